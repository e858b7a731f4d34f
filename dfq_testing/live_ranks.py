"""Two ranks of one consumer training on a live run, as threads of the calling process: what the suite's two-rank
test and tools/stress_live.py drive. A run that does not end by its deadline fails with the state of the window,
the epochs, the ranks and the queues (dfq_testing/live_state.py), not with a bare timeout."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.live import LiveShards
from dfq_testing.live_state import live_state


def stored_training_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.safetensors") if not p.name.startswith(".")]


@dataclass
class RanksResult:
    # epoch -> sample id -> times served (kept or dropped by the quality gate)
    seen: dict[int, Counter[str]] = field(default_factory=dict)
    # rank -> epoch -> shards served
    shards_per_rank: dict[int, Counter[int]] = field(default_factory=dict)
    # training files in storage, looked at around every acknowledgement
    fills: list[int] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def train_two_ranks(
    config: Config,
    *,
    epochs: int = 2,
    deadline_s: float = 300.0,
    delay_s: Callable[[], float] = lambda: 0.0,
    logs: Callable[[], str] = lambda: "",
) -> RanksResult:
    """Both ranks to their last epoch, each sleeping `delay_s()` per shard (a slow trainer); AssertionError with the
    run's state (and `logs()`) when they have not finished within `deadline_s`."""
    storage_root = Path(config.storage.url)
    result = RanksResult(seen={e: Counter() for e in range(epochs)}, shards_per_rank={0: Counter(), 1: Counter()})
    lock = threading.Lock()

    def train(rank: int) -> None:
        try:
            live = LiveShards(config, consumer="drafter", rank=rank, world_size=2, epochs=epochs, poll_s=0.2)
            for shard in live:
                with lock:
                    result.fills.append(len(stored_training_files(storage_root)))
                    result.seen[shard.epoch].update(shard[i]["sample_id"] for i in range(len(shard)))
                    # Samples the quality gate dropped are accounted for in the shard, never extracted.
                    result.seen[shard.epoch].update(entry["id"] for entry in shard.shards[0].dropped)
                    result.shards_per_rank[rank][shard.epoch] += 1
                time.sleep(delay_s())
                live.ack(shard)
                with lock:
                    result.fills.append(len(stored_training_files(storage_root)))
        except BaseException as exc:  # reported by the caller
            result.errors.append(exc)

    threads = [threading.Thread(target=train, args=(rank,), daemon=True, name=f"rank-{rank}") for rank in (0, 1)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise AssertionError(
            f"{', '.join(alive)} still training after {deadline_s:.0f} s (served per rank and epoch "
            f"{ {r: dict(c) for r, c in result.shards_per_rank.items()} }):\n{live_state(config, epochs)}\n{logs()}"
        )
    return result


def random_delay(low: float, high: float, rng: random.Random | None = None) -> Callable[[], float]:
    rng = rng or random.Random()
    return lambda: rng.uniform(low, high)
