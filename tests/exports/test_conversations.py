"""The regenerated dataset as an output: conversations exported as OpenAI-messages JSONL and Parquet, read back
with `datasets`, against the prompts and the exact ids the real generate lane stored."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import split_reply
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import stage_samples

REPO = Path(__file__).resolve().parents[2]
DATASETS = [REPO / "examples" / "sharegpt_sample.jsonl", REPO / "examples" / "tool_use_sample.jsonl"]


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nadd\n</think>\n\nFour.", False, ("add", "Four.")),
        ("add them\n</think>\n\nFour.", True, ("add them", "Four.")),
        ("Four.", False, (None, "Four.")),
        ("still thinking", True, ("still thinking", "")),
    ],
)
def test_a_reply_splits_into_reasoning_and_answer(text, opened, expected):
    assert split_reply(text, opened=opened) == expected


def cli(*args: str) -> subprocess.CompletedProcess:
    return dflash_queue(*args)


def letters(text: str) -> str:
    return re.sub(r"\s+|<think>|</think>", "", text)


@pytest.mark.parametrize("regenerate", ["last", "all"])
def test_conversations_export_as_messages_and_parquet(make_config, tiny_model, tmp_path, regenerate):
    import datasets

    config = make_config(dataset={"regenerate": regenerate, "thinking": "auto"},
                         **{"generate.sampling": {"max_tokens": 16}})
    storage = open_storage(config.storage)
    every = [s for s in read_dataset(DATASETS, max_record_bytes=1 << 20, regenerate=regenerate) if isinstance(s, Sample)]
    samples = [apply_thinking_policy(s, "auto") for s in every[:10] + every[-2:]]
    lane = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    shard_ids = []
    for chunk in (samples[:6], samples[6:]):
        shard_id = stage_samples(storage, chunk)
        lane.run(shard_id)
        shard_ids.append(shard_id)
    records = {r.id: r for s in shard_ids for r in decode_completions(storage.read_bytes(completions_key(s)), what=s)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    jsonl = cli("export", storage.url, "--format", "messages", str(tmp_path / "m"), "-c", str(config.source))
    assert jsonl.returncode == 0, jsonl.stderr[-3000:]
    assert "exported:    12 conversations from 2 shards as messages in" in jsonl.stdout
    parquet = cli("export", storage.url, "--format", "parquet", str(tmp_path / "p"), "--tokenizer", str(tiny_model))
    assert parquet.returncode == 0, parquet.stderr[-3000:]

    rows = datasets.load_dataset("json", data_files=str(tmp_path / "m" / "conversations.jsonl"), split="train")
    table = datasets.load_dataset("parquet", data_files=str(tmp_path / "p" / "conversations.parquet"), split="train")
    assert len(rows) == len(table) == 12
    by_id = {s.id: s for s in samples}
    for row, flat in zip(rows, table):
        sample, record = by_id[row["id"]], records[row["id"]]
        assert flat["id"] == row["id"] and flat["finish_reasons"] == row["finish_reasons"]
        assert row["thinking"] == record.thinking and row["quality"]["decision"] == record.quality.decision
        # Every generated turn as (ids, start, end): served turn by turn, or spans of the one sequence.
        spans = [(t.prompt_ids + t.completion_ids, len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids))
                 for t in record.served_turns]
        spans += [(record.input_ids, t.start, t.end) for t in record.earlier_turns]
        spans.append((record.input_ids, len(record.prompt_ids), len(record.input_ids)))
        assert row["finish_reasons"] == record.turn_finish_reasons()
        if regenerate == "last":  # the prompt as it was, then the reply
            exported_given, replies = row["messages"][:-1], row["messages"][-1:]
        else:  # the turns given, with a reply where each slot was
            slots = [i for i, m in enumerate(sample.messages) if m.is_slot][: len(spans)]
            exported_given = [m for i, m in enumerate(row["messages"]) if i not in slots]
            replies = [row["messages"][i] for i in slots]
        given = [m for m in sample.messages if not m.is_slot][: len(exported_given)]
        assert [(m["role"], m["content"]) for m in exported_given] == [(m.role, m.content) for m in given]
        if sample.tools:
            assert json.loads(flat["tools"]) == sample.tool_list()
            assert any(m["tool_calls"] for m in flat["messages"])  # the call kept, as JSON text
        assert all(r["role"] == "assistant" for r in replies)
        for reply, (ids, start, end) in zip(replies, spans, strict=True):
            generated = tokenizer.decode(ids[start:end], skip_special_tokens=True)
            joined = (reply.get("reasoning_content") or "") + reply["content"]
            assert letters(joined) == letters(generated)
        assert [m["content"] for m in flat["messages"]] == [m["content"] for m in row["messages"]]
