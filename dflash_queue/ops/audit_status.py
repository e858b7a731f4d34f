"""What `status` shows of the reference audit, a side lane (no progress or ETA of its own: it audits a sample of the
stored shards): its queue, workers and figures, and the suspect shards a failed audit left, with the consumers any
of them was served to as good."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_queue.lanes.registry import LANES
from dflash_queue.runstate.ledger import WindowTotals
from dflash_queue.suspects import SuspectShard

if TYPE_CHECKING:
    from dflash_queue.config import Config

# Suspect shards `status` names one by one (with --json: all of them).
NAMED_SUSPECTS = 5


@dataclass
class AuditStatus:
    queued: int  # audit messages waiting
    reserved: int  # delivered to a worker, not yet acknowledged
    running: int | None  # audits running, as the workers said; None when no audit worker answered
    workers: list[str]
    shards: int  # shards audited
    samples: int
    tokens: int
    tokens_per_s: float  # over the status window
    failed: int  # audits that failed
    busy_s: float  # time the audit workers spent auditing
    # Every suspect shard, oldest first (dflash_queue/suspects.py): not served as good until extracted again.
    suspects: list[SuspectShard] = field(default_factory=list)

    @property
    def consumed_suspects(self) -> list[SuspectShard]:
        """Suspect shards a consumer had been served (as good) before they turned suspect."""
        return [s for s in self.suspects if s.consumed_by]


def audit_in_use(config: Config, counters: dict[str, int]) -> bool:
    """Whether `status` shows the audit: the config turns it on, or it has audited something."""
    spec = LANES["audit"]
    counted = [counter for counter, _ in spec.counters] + [spec.shards_counter, spec.busy_counter]
    return spec.in_use(config) or any(counters.get(counter, 0) for counter in counted)


def collect_audit(
    suspects: list[SuspectShard],
    *,
    counters: dict[str, int],
    window: WindowTotals,
    queued: int,
    reserved: int,
    workers: list[str],
    running: int | None,
    in_use: bool,
) -> AuditStatus | None:
    """The audit's section of the status (None when the audit is not in use and no shard is suspect)."""
    if not in_use and not suspects:
        return None
    spec = LANES["audit"]
    return AuditStatus(
        queued=queued,
        reserved=reserved,
        running=running,
        workers=workers,
        shards=counters.get(spec.shards_counter, 0),
        samples=counters.get(spec.samples_counter, 0),
        tokens=counters.get("audit_tokens", 0),
        tokens_per_s=window.rate("audit_tokens"),
        failed=counters.get("audit_failed", 0),
        busy_s=counters.get(spec.busy_counter, 0) / 1000.0,
        suspects=suspects,
    )
