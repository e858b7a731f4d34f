"""Staging's preparation in a pool of processes gives what it gives in one: the same samples, counts and bad
records, in file order, from every container format."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_queue.data import preparation
from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.length import source_position
from dflash_queue.data.samples import EncodedSample
from dflash_queue.producer import Producer
from dflash_queue.prompt_staging import (
    AUTO_MIN_BYTES,
    EnqueueReport,
    build_length_filter,
    iter_encoded,
    iter_samples,
    staging_processes,
)
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.shards.prompts import decode_prompts, encode_prompts
from dfq_testing.templates import ALTERNATING_TEMPLATE

SUBJECTS = ["tides", "owls", "bread", "maps", "a binary search", "def f(x): return x", "what is 17 * 23?"]


def conversation(index: int, rng: random.Random) -> dict:
    turns = [{"from": "human", "value": f"Tell me about {rng.choice(SUBJECTS)} ({index})."}]
    if index % 5 == 0:
        turns = [{"from": "system", "value": "Be brief."}, *turns]
    if index % 7 == 0:
        turns.insert(-1, {"from": "human", "value": "Hello?"})  # two user turns in a row: the template refuses
    if index % 11 == 0:
        turns[-1]["value"] += " please explain at length" * 60  # too long for the context below
    return {"conversations": [*turns, {"from": "gpt", "value": "An answer."}]}


@pytest.fixture
def dataset(tmp_path: Path) -> list[Path]:
    """Three files in three containers, with bad lines, duplicates, refusals and prompts too long."""
    rng = random.Random(0)
    rows = [conversation(i, rng) for i in range(900)]
    lines = [json.dumps(r) for r in rows[:500]]
    lines[10], lines[200] = "{broken", json.dumps({"conversations": []})
    lines[300:300] = lines[20:40]  # exact duplicates
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    zipped = tmp_path / "b.json.gz"
    zipped.write_bytes(gzip.compress(json.dumps(rows[500:700] + rows[:5]).encode()))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows[700:]), parquet)
    return [jsonl, zipped, parquet]


def staged(config, paths, processes: int, formatter, *, encoded: bool = False) -> tuple[list, EnqueueReport]:
    report = EnqueueReport()
    read = iter_encoded if encoded else iter_samples
    length_filter = build_length_filter(config, formatter)
    samples = list(read(config.dataset, config.model, paths, report, length_filter, processes=processes))
    return samples, report


def summary(report: EnqueueReport) -> dict:
    return {
        "lines": report.lines(),
        "problems": [str(r) for kind in report.problems.examples.values() for r in kind],
        "too_long": [str(r) for kind in report.too_long.examples.values() for r in kind],
        "counts": (report.samples, report.duplicates, report.staged, report.refused, report.thinking_on,
                   report.prompt_tokens, report.max_prompt_tokens, report.problems.total, report.too_long.total),
    }


def test_a_pool_of_processes_stages_what_one_process_stages(dataset, make_config, tiny_model_with_template, monkeypatch):
    model = tiny_model_with_template(ALTERNATING_TEMPLATE)
    config = make_config(model={"path": str(model)},
                         dataset={"thinking": "auto", "max_model_len": 600, "generation_budget": 200})
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(model))
    monkeypatch.setattr(preparation, "CHUNK", 64)  # many chunks in flight at once, out of order if anything
    one, one_report = staged(config, dataset, 1, formatter)
    pooled, pooled_report = staged(config, dataset, 2, formatter)

    counts = summary(one_report)["counts"]
    assert counts[1] == 25 and counts[3] > 50 and one_report.too_long.total > 20 and one_report.problems.total > 50
    assert 0 < one_report.thinking_on < counts[2] and len(one) == counts[2] > 600
    assert pooled == one
    assert [s.thinking for s in pooled] == [s.thinking for s in one]
    assert summary(pooled_report) == summary(one_report)
    assert {Path(source_position(s.source)[0]).name for s in pooled} == {"a.jsonl", "b.json.gz", "c.parquet"}

    # As the producer takes them: each sample's prompt-shard record written in the pool's processes.
    encoded, encoded_report = staged(config, dataset, 2, formatter, encoded=True)
    assert summary(encoded_report) == summary(one_report)
    assert all(isinstance(e, EncodedSample) for e in encoded)
    assert [(e.id, e.source, e.thinking) for e in encoded] == [(s.id, s.source, s.thinking) for s in one]
    assert decode_prompts(encode_prompts(encoded), what="p") == one
    assert encode_prompts(encoded) == encode_prompts(one)


def test_enqueue_through_the_command_line_with_staging_processes(dataset, make_config, redis_url, tmp_path):
    pooled = make_config("pooled.toml", dataset={"staging_processes": 2}, run={"name": "pooled"})
    command = [sys.executable, "-m", "dflash_queue", "enqueue", *map(str, dataset), "-c", str(pooled.source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    single = make_config("single.toml", dataset={"staging_processes": 1}, run={"name": "single"},
                         storage={"url": str(tmp_path / "single-storage")})
    configure_app(single)
    report = Producer(single, Ledger.from_url(redis_url, "single")).enqueue(dataset)
    assert f"samples: {report.samples} ({report.duplicates} exact duplicates dropped" in result.stdout
    assert f"shards: {report.shards} ({report.shards} enqueued" in result.stdout
    pooled_files = {p.name: p.read_bytes() for p in (tmp_path / "storage").rglob("*.jsonl")}
    single_files = {p.name: p.read_bytes() for p in (tmp_path / "single-storage").rglob("*.jsonl")}
    assert len(pooled_files) == report.shards > 1
    assert pooled_files == single_files


def test_automatic_staging_processes(make_config, tmp_path):
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("{}\n")
    with open(large, "wb") as handle:
        handle.truncate(AUTO_MIN_BYTES)
    auto = make_config()
    assert staging_processes(auto.dataset, [large], cores=16) == 15
    assert staging_processes(auto.dataset, [large], cores=64) == 32
    assert staging_processes(auto.dataset, [large], cores=2) == 1
    assert staging_processes(auto.dataset, [small, tmp_path / "missing.jsonl"], cores=16) == 1
    assert staging_processes(make_config("fixed.toml", dataset={"staging_processes": 3}).dataset, [small], cores=2) == 3


def test_staging_stopped_early_stops_its_pool(dataset, make_config, monkeypatch):
    monkeypatch.setattr(preparation, "CHUNK", 16)
    config = make_config(dataset={"thinking": "auto"})
    samples = iter_encoded(config.dataset, config.model, dataset, EnqueueReport(), processes=2)
    first = [next(samples) for _ in range(3)]
    pool = multiprocessing.active_children()
    assert len(first) == 3 and len(pool) >= 2
    samples.close()  # what an error or Ctrl-C in the producer does to the generator
    assert not [p for p in pool if p.is_alive()]
    assert multiprocessing.active_children() == []
