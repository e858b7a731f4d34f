"""What a live run looks like from its broker, for a test or a stress run that waited too long: the window's places,
the epochs (sealed, stored order, states), each consumer's ranks and acknowledgements, the queues and what the
workers hold."""

from __future__ import annotations

import time

from dflash_queue.config import Config
from dflash_queue.lanes.registry import LANES
from dflash_queue.ops.status import queue_depth, unacked_by_queue
from dflash_queue.queue.liveness import Liveness
from dflash_queue.runstate.ledger import Ledger, resilient_client
from dflash_queue.runstate.window import ShardWindow, epoch_states


def live_state(config: Config, epochs: int = 2) -> str:
    client = resilient_client(config.broker.connection_url())
    consumption = ShardWindow(client, config.run.name)
    ledger = Ledger(client, config.run.name)
    now = time.time()
    lines = [
        f"window ({config.extract.max_unconsumed_shards}): {consumption.places()}",
        f"extract waiting: {consumption.waiting()}",
    ]
    for epoch in range(epochs):
        shards = consumption.epoch_shards(epoch)
        if shards is None:
            lines.append(f"epoch {epoch}: not sealed")
            continue
        stored = consumption.stored_since(epoch, 0)
        states = epoch_states(consumption, ledger, epoch, list(shards))
        lines.append(f"epoch {epoch}: {len(shards)} shards, stored in order {stored}, states {states}")
    for name, fields in consumption.consumers().items():
        seen = {rank: f"epoch {r['epoch']} {now - r['at']:.0f} s ago" for rank, r in consumption.ranks_seen(name).items()}
        acked = {epoch: sorted(consumption.acknowledged(name, epoch)) for epoch in range(epochs)}
        lines.append(f"consumer {name} {fields}: ranks seen {seen}, acknowledged {acked}, "
                     f"finished ranks {sorted(consumption.ranks_finished(name))}")
    lines.append(f"queues: {({lane.queue: queue_depth(client, lane.queue) for lane in LANES.values()})}, "
                 f"unacked {unacked_by_queue(client)}")
    liveness = Liveness(client, config.run.name, config.broker.worker_liveness_s)
    lines.append(f"held: {[(m.node, m.queue, m.shard_id) for m in liveness.held()]}")
    return "\n".join(lines)
