"""Epochs of a live run: every shard extracted again from its stored completions (no generation), in an order of
its own, into `epochs/{epoch}/shards/`.

An epoch starts once the previous one's extraction is over (every shard stored, consumed or failed): its tasks
then never wait in the window behind shards a consumer is still waiting for. It is sealed (its shards recorded)
before its messages are sent, so a consumer splits it at once; sending again (`dflash-queue epoch --resend`) sends
the shards not yet done, which the extract lane skips if they are stored after all.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_queue.config import Config
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import DONE, FAILED, GENERATED
from dflash_queue.runstate.window import ShardWindow, epoch_states, settled

# send(shard id, samples, fingerprint, epoch)
SendExtract = Callable[[str, int, str, int], None]


def epoch_order(shard_ids: Sequence[str], seed: int, epoch: int) -> list[str]:
    """The epoch's shards in a seeded order of their own (the same in every process)."""
    order = sorted(shard_ids)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


@dataclass
class EpochStart:
    epoch: int
    started: bool = False
    sent: int = 0
    shards: int = 0
    samples: int = 0
    # Shards of the previous epoch that failed: not in this one.
    left_out: list[str] = field(default_factory=list)
    why_not: str = ""

    def lines(self) -> list[str]:
        if not self.started:
            return [f"epoch {self.epoch} not started: {self.why_not}"]
        lines = [f"epoch {self.epoch}: {self.shards} shards ({self.samples} samples), {self.sent} sent to extract"]
        if self.left_out:
            lines.append(f"left out: {len(self.left_out)} shards that failed in epoch {self.epoch - 1}")
        return lines


def start_epoch(
    config: Config,
    epoch: int,
    *,
    seed: int = 0,
    consumption: ShardWindow,
    ledger: Ledger,
    send: SendExtract | None = None,
    resend: bool = False,
) -> EpochStart:
    """Seal epoch `epoch` (>= 1) and send its extraction, once the previous epoch's extraction is over.

    Started once: a second caller finds it claimed and does nothing, unless `resend` (its shards not done are sent
    again). Takes the whole Config: the epoch's tasks carry its fingerprint, and without `send` the Celery app is
    configured from it."""
    report = EpochStart(epoch)
    if epoch < 1:
        raise ValueError(f"epoch 0 is the run itself (enqueue); epochs to start are 1 and later, not {epoch}")
    previous = consumption.epoch_shards(epoch - 1)
    if previous is None:
        report.why_not = f"epoch {epoch - 1} has not started"
        return report
    states = epoch_states(consumption, ledger, epoch - 1, list(previous))
    unsettled = [s for s in previous if not settled(states.get(s))]
    if unsettled and not resend:
        report.why_not = f"{len(unsettled)} of epoch {epoch - 1}'s {len(previous)} shards are not extracted yet"
        return report
    claimed = consumption.claim_epoch(epoch)
    if not claimed and not resend:
        report.why_not = "already started"
        return report
    sizes = {s: n for s, n in previous.items() if states.get(s) == DONE}
    report.left_out = sorted(s for s in previous if states.get(s) == FAILED)
    recorded = consumption.epoch_shards(epoch)
    if recorded is None:
        consumption.seal_epoch(epoch, sizes)
    else:
        sizes = recorded
    send = send or _send_extract(config)
    fingerprint = config.fingerprint()
    done = consumption.epoch_states(epoch)
    try:
        for shard_id in epoch_order(list(sizes), seed, epoch):
            if done.get(shard_id) == DONE:
                continue
            consumption.set_epoch_state(epoch, shard_id, GENERATED)
            send(shard_id, sizes[shard_id], fingerprint, epoch)
            report.sent += 1
    except BaseException:
        if claimed and report.sent == 0:
            consumption.unclaim_epoch(epoch)
        raise
    report.started = True
    report.shards = len(sizes)
    report.samples = sum(sizes.values())
    return report


def _send_extract(config: Config) -> SendExtract:
    from dflash_queue.lanes.registry import FINAL_LANE
    from dflash_queue.queue.app import configure_app
    from dflash_queue.queue.tasks import send_to_lane

    configure_app(config)

    def send(shard_id: str, num_samples: int, fingerprint: str, epoch: int) -> None:
        send_to_lane(FINAL_LANE.name, shard_id, num_samples, fingerprint, epoch=epoch)

    return send
