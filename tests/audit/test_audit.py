"""`dflash-queue audit` on real files: datasets with and without placeholder responses, and produced outputs."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import stage_samples

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDERS = ["OK.", "Sure.", "ok", "Got it.", "N/A", "...", "Done."]
TOPICS = ["tides", "volcanoes", "bread", "bridges", "comets", "honey", "glaciers", "violins", "maps", "owls"]


def answer(topic: str, index: int) -> str:
    return (f"Here is a careful explanation of {topic}, number {index}. It covers where the idea comes from, how it "
            f"works in practice, and two examples that make the difference clear for a newcomer.")


def dataset_rows(count: int, placeholder_share: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    placeholders = set(rng.sample(range(count), round(count * placeholder_share)))
    rows = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        reply = rng.choice(PLACEHOLDERS) if index in placeholders else answer(topic, index)
        rows.append({"conversations": [{"from": "human", "value": f"Explain {topic} (question {index})."},
                                       {"from": "gpt", "value": reply}]})
    return rows


def audit(*args: str) -> subprocess.CompletedProcess:
    return dflash_queue("audit", *args)


def test_dataset_with_87_percent_placeholders_fails_the_gate_and_names_the_share(tmp_path):
    path = tmp_path / "stubby.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in dataset_rows(1000, 0.87)))
    result = audit(str(path), "--plot", str(tmp_path / "audit.png"))
    assert result.returncode == 1, result.stderr
    assert "placeholder responses: 870 of 1000 (87.0%" in result.stdout
    assert "FAIL: 87.0% placeholder responses (max 5.0%)" in result.stdout
    assert (tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clean_dataset_passes_with_token_counts_from_the_config(tmp_path, make_config):
    config = make_config(dataset={"thinking": "auto", "max_model_len": 4096})
    rows = dataset_rows(300, 0.0)
    rows[7]["conversations"].insert(0, {"from": "system", "value": "Be kind."})
    path = tmp_path / "clean.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    result = audit(str(path), "-c", config.source, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    [part] = report["parts"]
    assert report["passed"] and report["stub_fraction"] == 0.0
    assert part["conversations"] == 300 and part["responses"]["placeholders"] == 0
    assert part["responses"]["length_unit"] == "tokens" and part["roles"] == {"user": 300, "assistant": 300, "system": 1}
    assert part["system_prompt_share"] == pytest.approx(1 / 300)
    assert part["turns_per_conversation"] == {"2": 299, "3": 1}
    assert part["prompt_tokens"]["count"] == 300 and part["prompt_tokens"]["min"] > 5
    assert part["thinking"]["policy"] == "auto" and sum(part["thinking"]["rules"].values()) == 300


def test_conversations_the_chat_template_refuses_are_bad_records(tmp_path, make_config, tiny_model_with_template):
    from dfq_testing.templates import ALTERNATING_TEMPLATE

    model = tiny_model_with_template(ALTERNATING_TEMPLATE)
    config = make_config(model={"path": str(model)}, dataset={"max_model_len": 4096})
    rows = dataset_rows(20, 0.0)
    rows[3]["conversations"].insert(0, {"from": "human", "value": "Hello?"})
    path = tmp_path / "roles.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = audit(str(path), "-c", config.source, "--json")
    assert result.returncode == 0, result.stderr
    [part] = json.loads(result.stdout)["parts"]
    assert part["bad_record_kinds"] == {"chat template refused the conversation": 1}
    assert part["bad_record_examples"] == [
        f"{path}:4: chat template refused the conversation: Conversation roles must alternate "
        "user/assistant/user/assistant/..."
    ]
    assert part["prompt_tokens"]["count"] == 19


def test_short_real_answers_are_reported_as_short_never_as_placeholders(tmp_path):
    """"4." and "Paris." are answers: short, counted as such, and the dataset passes; "OK." is filler."""
    rows = dataset_rows(20, 0.0)
    for index, reply in enumerate(["4.", "8.", "Paris.", "Yes."]):
        rows[index]["conversations"][1]["value"] = reply
    rows[4]["conversations"][1]["value"] = "OK."
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = audit(str(path))
    assert result.returncode == 0, result.stdout
    assert "placeholder responses: 1 of 20 (5.0%" in result.stdout
    assert "short responses: 4 (20.0%; real answers under 8 words: reported, not gated)" in result.stdout


def test_a_small_share_passes_and_the_threshold_is_honoured(tmp_path):
    path = tmp_path / "mostly.json"
    path.write_text(json.dumps(dataset_rows(200, 0.03)))
    assert audit(str(path)).returncode == 0
    strict = audit(str(path), "--max-stub-fraction", "0.01")
    assert strict.returncode == 1 and "FAIL: 3.0% placeholder responses (max 1.0%)" in strict.stdout


@pytest.fixture
def produced(make_config):
    """A storage root with completions and training shards made by the real lanes, with stubs in them."""
    config = make_config(
        dataset={"thinking": "never"},
        quality={"on_stub": "flag", "on_short": "flag", "on_truncated": "flag", "on_empty": "drop",
                 "on_repetition": "flag"},
        **{"generate.sampling": {"max_tokens": 6}},
    )
    storage = open_storage(config.storage.url)
    samples = [apply_thinking_policy(s, "never") for s in read_dataset(
        [REPO / "examples" / "sharegpt_sample.jsonl"], max_record_bytes=1 << 20) if isinstance(s, Sample)][:16]
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    extract = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    shard_ids = []
    for chunk in (samples[:8], samples[8:]):
        shard_id = stage_samples(storage, chunk)
        generate.run(shard_id)
        extract.run(shard_id)
        shard_ids.append(shard_id)
    return config, storage, shard_ids


def test_outputs_audit_reads_loss_masks_and_verdicts(produced, tmp_path):
    config, storage, shard_ids = produced
    records = [r for s in shard_ids for r in decode_completions(storage.read_bytes(completions_key(s)), what=s)]
    kept = [r for r in records if r.kept]
    sums = []
    for shard_id in shard_ids:
        with storage.local_copy(shard_key(shard_id)) as path:
            sums += TrainingShard(path).loss_mask_sums()

    result = audit(storage.url, "--json", "--plot", str(tmp_path / "out.png"))
    report = json.loads(result.stdout)
    parts = {p["kind"]: p for p in report["parts"]}
    assert set(parts) == {"completions", "training shards"} and report["gated_on"] == ["training shards"]
    shards, completions = parts["training shards"], parts["completions"]
    assert completions["samples"] == 16 and shards["samples"] == len(kept) == len(sums)
    assert shards["dropped_by_gate"] == completions["dropped_by_gate"] == 16 - len(kept)
    assert shards["loss_mask_sum"]["max"] == max(sums) <= 6 and shards["loss_mask_sum"]["count"] == len(kept)
    # Six tokens cannot make an eight-token answer: the gate flagged each kept sample as either a placeholder
    # (stub) or a short answer, and the audit counts them the same way: stubs are the gate's, short the rest.
    stubs = sum(1 for r in kept if {"stub", "empty"} & set(r.quality.flags))
    assert shards["stubs"] == stubs and shards["short"] == len(kept) - stubs
    assert shards["flags"].get("stub", 0) + shards["flags"].get("short", 0) == len(kept)
    assert shards["truncated_share"] == pytest.approx(sum(r.finish_reason == "length" for r in kept) / len(kept))
    assert shards["closed_thinking_share"] == 0.0 and set(shards["thinking"]) == {"off"}
    assert result.returncode == (1 if stubs / len(kept) > 0.05 else 0) and report["passed"] == (result.returncode == 0)
    assert (tmp_path / "out.png").stat().st_size > 10_000

    text = audit(str(Path(storage.url) / "shards"), "--min-answer-tokens", "1", "--max-stub-fraction", "1").stdout
    assert "training shards: " in text and "PASS: " in text and "stubs in training shards" in text
