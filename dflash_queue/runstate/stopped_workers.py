"""Workers that stopped themselves because their engine cannot be trusted, and why: a record per worker node in
the run's broker, `dfq:{run}:stopped_workers` (node -> JSON), for `status` to show.

A worker whose extract engine fails its state checks (canary, plausibility, what the engine handed over) on
`extract.stop_after_failed_checks` of its last `extract.failed_checks_window` shards, whose engine's states differ
from the checkpoint's own forward at load, or that a reference audit halted (lanes/audit.py) stops taking tasks
and exits with `EXIT_FAILING_CHECKS`, which the shipped systemd units do not restart on
(`RestartPreventExitStatus=`): a systematic fault (a broken GPU, a wrong kernel, a bad setting) would otherwise
send the rest of the queue to the dead letters shard by shard, or into storage as suspect shards. The
record stays until a worker of the same node name starts again (after the operator fixed the cause), which
clears it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_queue.runstate.keys import RunKeys

# sysexits' EX_CONFIG: the worker cannot run as it is until someone looks. systemd's Restart=on-failure would
# restart it into the same failures; the worker units name it in RestartPreventExitStatus=.
EXIT_FAILING_CHECKS = 78


@dataclass(frozen=True)
class StoppedWorker:
    node: str
    lane: str
    engine: str  # "transformers" or "vllm"
    reason: str
    # (shard id, "ExceptionType: message") of each failure in the streak, oldest first.
    failures: list[tuple[str, str]] = field(default_factory=list)
    exit_status: int = EXIT_FAILING_CHECKS
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StoppedWorker:
        raw = json.loads(text)
        raw["failures"] = [tuple(pair) for pair in raw.get("failures", [])]
        return cls(**raw)


class StoppedWorkers:
    """The stop records of a run's workers, in Redis."""

    def __init__(self, client: Any, run_name: str) -> None:
        self.client = client  # decode_responses=True
        self.key = RunKeys(run_name).stopped_workers

    def record(self, stopped: StoppedWorker) -> None:
        if not stopped.time:
            stopped = StoppedWorker(**{**asdict(stopped), "time": time.time()})
        self.client.hset(self.key, stopped.node, stopped.to_json())

    def clear(self, node: str) -> StoppedWorker | None:
        """Forget the node's record (a worker of that name starts again); returns what it said."""
        pipe = self.client.pipeline()
        pipe.hget(self.key, node)
        pipe.hdel(self.key, node)
        text, _ = pipe.execute()
        return StoppedWorker.from_json(text) if text else None

    def all(self) -> list[StoppedWorker]:
        """Every record, oldest first; an unreadable one is shown as such rather than hidden."""
        records = []
        for node, text in (self.client.hgetall(self.key) or {}).items():
            try:
                records.append(StoppedWorker.from_json(text))
            except (ValueError, TypeError):
                records.append(StoppedWorker(node, "?", "?", f"unreadable stop record: {text[:200]!r}"))
        return sorted(records, key=lambda r: r.time)
