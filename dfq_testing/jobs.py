"""Running whole jobs in fault tests and drills: datasets, broker switching, workers that obey directory
permissions, and the exactly-once accounting of a job's output."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from celery import Celery
from kombu import pools

from dflash_queue.config import Config
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.shards.keys import SHARDS, prompts_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import Storage, open_storage
from dflash_queue.verify import VerifyReport, verify
from dfq_testing.polling import wait_until


def stage_samples(storage: Storage, samples: list[Sample]) -> str:
    """Write `samples` as one prompt shard, as the producer stages it, and return its shard id."""
    shard_id = prompt_shard_id(samples)
    storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
    return shard_id


def first_lines(path: Path, count: int, out: Path) -> Path:
    out.write_text("\n".join(path.read_text().splitlines()[:count]) + "\n")
    return out


def dataset_ids(dataset: Path) -> set[str]:
    return {s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)}


def connect(config: Config) -> Celery:
    """Point the Celery app at `config`'s broker, dropping connections pooled for another broker."""
    return drop_pooled_connections(configure_app(config))


def drop_pooled_connections(app: Celery) -> Celery:
    """Forget the connections `app` pooled: the next use connects to the broker its settings name now."""
    pools.reset()  # closes every pooled connection and empties kombu's pool registry
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    control = app.__dict__.get("control")
    if control is not None:
        control.mailbox.__dict__.pop("producer_pool", None)
    return app


def channels_in_poll(app: Celery) -> list:
    """The channels of `app`'s pooled connections caught in the middle of a blocking read (kombu marks them
    `_in_poll`): what kombu's after-fork clean-up in a forked child (a DataLoader's workers) hangs closing."""
    pooled = [c() if type(c).__name__ == "lazy" else c for c in list(app.pool._resource.queue) if c is not None]
    return [ch for c in pooled if c._connection is not None for ch in c._connection.channels
            if getattr(ch, "_in_poll", False)]


def forked_child_exits(timeout: float = 20.0) -> bool:
    """Fork a child that does nothing: True when it exits cleanly within `timeout` (it runs the after-fork
    clean-ups of everything this process imported, kombu's pools included)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join(timeout=timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return False
    return child.exitcode == 0


def root_bypass_dropped() -> list[str]:
    """A command prefix under which directory permissions bind the process: empty for a normal user; for root,
    `setpriv` without the capabilities that let root write into a read-only (0o555) directory."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("running as root: need setpriv (util-linux) to start processes that obey permissions")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Make `directory` read-only (0o555) for the duration, then writable again."""
    mode = directory.stat().st_mode & 0o7777
    directory.chmod(0o555)
    try:
        yield
    finally:
        directory.chmod(mode)


def done_count(ledger: Ledger, shard_ids: Iterable[str], done: str = "done") -> int:
    states = ledger.states(list(shard_ids))
    return sum(1 for state in states.values() if state == done)


def stored_sample_ids(config: Config) -> Counter[str]:
    """How often each sample id occurs across the stored training shards, kept or dropped by the quality gate."""
    storage = open_storage(config.storage)
    seen: Counter[str] = Counter()
    for key in storage.list(SHARDS + "/"):
        if not key.endswith(".safetensors"):
            continue
        with storage.local_copy(key) as path:
            shard = TrainingShard(path)
            seen.update(shard.sample_ids)
            seen.update(entry["id"] for entry in shard.dropped)
    return seen


def exactly_once_problems(config: Config, dataset: Path) -> list[str]:
    """Empty when every sample of `dataset` is in exactly one stored shard and nothing else is; otherwise what
    is wrong. Checked twice: from the shards themselves, and by `dflash_queue.verify`."""
    expected = dataset_ids(dataset)
    seen = stored_sample_ids(config)
    problems = []
    missing = expected - set(seen)
    duplicated = {i: n for i, n in seen.items() if n > 1}
    strangers = set(seen) - expected
    if missing:
        problems.append(f"{len(missing)} samples in no shard: {sorted(missing)[:10]}")
    if duplicated:
        problems.append(f"{len(duplicated)} samples in several shards: {dict(list(duplicated.items())[:10])}")
    if strangers:
        problems.append(f"{len(strangers)} stored samples not in the dataset: {sorted(strangers)[:10]}")
    report = verify(config, [dataset])
    if not report.ok:
        problems.append("verify: " + "; ".join(report.lines()))
    return problems


def assert_accounted(config: Config, dataset: Path, *, done: int, dead: int = 0) -> VerifyReport:
    """`verify` finds every sample exactly once, with `done` in shards (kept or dropped) and `dead` in dead
    letters."""
    report = verify(config, [dataset])
    assert report.ok, "\n".join(report.lines())
    assert (report.done + report.dropped, report.dead) == (done, dead), "\n".join(report.lines())
    return report


def wait_accounted(
    config: Config, dataset: Path, *, done: int, dead: int = 0, timeout: float = 300, workers=()
) -> VerifyReport:
    """Poll `verify` until the job reaches that outcome (or fail, naming the wait)."""

    def reached() -> VerifyReport | None:
        report = verify(config, [dataset])
        return report if report.ok and (report.done + report.dropped, report.dead) == (done, dead) else None

    return wait_until(reached, timeout, f"{done} samples done and {dead} dead letters", workers, poll_s=1.0)
