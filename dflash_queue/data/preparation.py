"""Records prepared for staging, chunk by chunk: decoded, parsed into samples, their thinking decided and, for the
length filter, their prompt tokens counted with the target's chat template and tokenizer.

The chat template (Jinja, once per prompt) and the parsing are most of staging's CPU time, and both hold the
GIL: in one process, staging runs at the speed of one core (and a second one tokenizing). With `processes` > 1
a pool of processes prepares the chunks (each process loads the tokenizer once) while this process reads the
files and takes the results in file order. Results are the same either way, in the same order; only where the
work runs differs. With `encoded`, each sample comes back as an `EncodedSample` (its prompt-shard record already
written): rebuilding a tree of dataclasses from a pickle would cost the producer's process more than the rest of
its work per sample.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

from dflash_queue.data.containers import RawLine, RawRecord, decode_line, read_raw_records
from dflash_queue.data.length import Refused, Rendered, count_rendered, render_prompts
from dflash_queue.data.problems import BadRecord
from dflash_queue.data.readers import sample_of
from dflash_queue.data.samples import EncodedSample, Regenerate, Sample
from dflash_queue.data.thinking import apply_thinking_policy

# Records per chunk: one template call and one tokenizer call per thinking setting in it.
CHUNK = 1024

Item = Sample | EncodedSample | BadRecord
# A chunk's samples and bad records in file order, with each sample's prompt tokens (None: not counted; Refused:
# the template raised) and None for each bad record.
Prepared = tuple[list[Item], list[int | Refused | None]]


@dataclass(frozen=True)
class Preparation:
    thinking: str
    regenerate: Regenerate
    # Makes the chat formatter (the target's tokenizer and template) to count prompt tokens with, once per pool
    # process; picklable (a module-level function, or a functools.partial of one). None: no counting.
    load_formatter: Callable[[], Any] | None = None
    # Samples come back as `EncodedSample`s.
    encoded: bool = False


def prepared_chunks(
    paths: Iterable[str | Path],
    preparation: Preparation,
    *,
    max_record_bytes: int,
    formatter: Any = None,
    processes: int = 1,
) -> Iterator[Prepared]:
    """Every record of the files, prepared, in file order. Prompt tokens are counted with `formatter` in this
    process (`processes` = 1), with what `preparation.load_formatter` makes in pool processes; not at all
    without them."""
    chunks = _raw_chunks(paths, max_record_bytes)
    if processes > 1:
        yield from _in_processes(chunks, preparation, processes)
    else:
        yield from _here(chunks, preparation, formatter)


def _raw_chunks(paths: Iterable[str | Path], max_record_bytes: int) -> Iterator[list[RawLine | RawRecord | BadRecord]]:
    records = chain.from_iterable(read_raw_records(path, max_record_bytes=max_record_bytes) for path in paths)
    return batched(records, CHUNK)


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` items in order, the last one shorter."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _items(chunk: list[RawLine | RawRecord | BadRecord], preparation: Preparation) -> list[Sample | BadRecord]:
    items: list[Sample | BadRecord] = []
    for raw in chunk:
        record = decode_line(raw) if isinstance(raw, RawLine) else raw
        if record is None:  # a blank line
            continue
        item = record if isinstance(record, BadRecord) else sample_of(record, preparation.regenerate)
        items.append(apply_thinking_policy(item, preparation.thinking) if isinstance(item, Sample) else item)
    return items


def _prepared(
    items: list[Sample | BadRecord], counts: list[int | Refused] | None, preparation: Preparation
) -> Prepared:
    """The items (encoded if asked) with, per item, its sample's count, None for a bad record (or for every item
    when nothing was counted)."""
    out: list[Item]
    if preparation.encoded:
        out = [EncodedSample.of(item) if isinstance(item, Sample) else item for item in items]
    else:
        out = list(items)
    if counts is None:
        return out, [None] * len(items)
    aligned: list[int | Refused | None] = []
    taken = iter(counts)
    for item in items:
        aligned.append(next(taken) if isinstance(item, Sample) else None)
    return out, aligned


def _render(formatter: Any, items: list[Sample | BadRecord]) -> Rendered:
    return render_prompts(formatter, [item for item in items if isinstance(item, Sample)])


def prepare_chunk(chunk: list[RawLine | RawRecord | BadRecord], preparation: Preparation, formatter: Any) -> Prepared:
    """One chunk, start to end, in the calling thread (a pool process)."""
    items = _items(chunk, preparation)
    if formatter is None:
        return _prepared(items, None, preparation)
    return _prepared(items, count_rendered(formatter, _render(formatter, items)), preparation)


def _here(chunks: Iterator[list], preparation: Preparation, formatter: Any) -> Iterator[Prepared]:
    """In this process; the fast tokenizer releases the GIL, so a chunk is tokenized on a second thread while the
    next one is parsed and rendered."""
    if formatter is None:
        for chunk in chunks:
            yield _prepared(_items(chunk, preparation), None, preparation)
        return
    in_flight: deque[tuple[list[Sample | BadRecord], Future[list[int | Refused]]]] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dfq-count") as pool:
        for chunk in chunks:
            items = _items(chunk, preparation)
            in_flight.append((items, pool.submit(count_rendered, formatter, _render(formatter, items))))
            if len(in_flight) > 2:
                done, counted = in_flight.popleft()
                yield _prepared(done, counted.result(), preparation)
        while in_flight:
            done, counted = in_flight.popleft()
            yield _prepared(done, counted.result(), preparation)


# The preparation and formatter of a pool process, set once by _start_process.
_process_state: tuple[Preparation, Any] | None = None


def _start_process(preparation: Preparation) -> None:
    global _process_state
    # Ctrl-C reaches the whole process group: the producer stops the pool itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no tokenizer threads on top
    formatter = preparation.load_formatter() if preparation.load_formatter is not None else None
    _process_state = (preparation, formatter)


def _prepare_in_process(chunk: list[RawLine | RawRecord | BadRecord]) -> Prepared:
    assert _process_state is not None, "pool process not started"
    return prepare_chunk(chunk, *_process_state)


def _in_processes(
    chunks: Iterator[list], preparation: Preparation, processes: int
) -> Iterator[Prepared]:
    # Spawned, not forked: the producer holds threads, sockets and the tokenizer's thread pool.
    context = multiprocessing.get_context("spawn")
    pending: deque[Future[Prepared]] = deque()
    pool = ProcessPoolExecutor(processes, mp_context=context, initializer=_start_process, initargs=(preparation,))
    try:
        for chunk in chunks:
            if len(pending) >= 2 * processes:
                yield pending.popleft().result()
            pending.append(pool.submit(_prepare_in_process, chunk))
        while pending:
            yield pending.popleft().result()
    finally:
        # Stopped early (an error, Ctrl-C, the consumer gone): chunks not started are dropped, not prepared.
        pool.shutdown(wait=True, cancel_futures=True)
