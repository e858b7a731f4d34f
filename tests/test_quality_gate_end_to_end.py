"""The quality gate through real workers: Redis, `dflash-queue worker` processes, the tiny model.

Small token budgets make the tiny model (random weights, ~3% chance per token to stop) truncate most replies:
the gate retries them once with a larger budget, flags what is still truncated or too short, drops empty
ones, and every decision lands in the ledger, the completions shards and the training shards' metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_queue.producer import Producer
from dflash_queue.quality.gate import gate_summary
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parent
SAMPLE = REPO.parent / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_gate_decisions_through_real_workers(make_config, redis_url, start_worker, tmp_path, tiny_model):
    config = make_config(
        dataset={"shard_size": 8, "thinking": "auto", "regenerate": "all"},
        quality={"on_truncated": "retry", "retry_max_tokens": 20, "on_stub": "flag", "on_empty": "drop",
                 "on_repetition": "flag", "on_unclosed_thinking": "retry", "on_retry_failure": "flag"},
        **{"generate.sampling": {"max_tokens": 5}},
    )
    configure_app(config)
    lines = SAMPLE.read_text().splitlines()
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(lines[:10] + lines[-6:]) + "\n")  # single-turn and multi-turn conversations
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.staged == 16 and report.enqueued == 2
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=600, workers=workers)

    storage = open_storage(config.storage.url)
    records = {}
    shards = {}
    dropped_in_shards: set[str] = set()
    for shard_id in report.shard_ids:
        for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id):
            records[record.id] = record
        with storage.local_copy(shard_key(shard_id)) as path:
            shard = TrainingShard(path)
            shards.update({shard[i].id: shard[i] for i in range(len(shard))})
            dropped_in_shards |= {d["id"] for d in shard.dropped}
    assert len(records) == 16  # every staged sample is accounted for, dropped ones included
    kept = {i for i, r in records.items() if r.kept}
    assert set(shards) == kept and dropped_in_shards == set(records) - kept

    counters = ledger.counters()
    decisions = {d: sum(r.quality.decision == d for r in records.values()) for d in ("keep", "flag", "drop")}
    assert {d: counters.get(f"gate_{d}", 0) for d in decisions} == decisions
    retried = [r for r in records.values() if r.quality.retried]
    assert len(retried) >= 8 and counters["gate_retried"] == len(retried)
    assert counters.get("gate_empty_drop", 0) == sum("empty" in r.quality.flags for r in records.values() if not r.kept)
    assert any(len(r.completion_ids) > 5 or any(t.end - t.start > 5 for t in r.earlier_turns) for r in retried)
    for record in records.values():
        if record.id in shards:
            item = shards[record.id]
            assert item.flags == record.quality.flags
            assert item.input_ids.tolist() == record.input_ids
            assert item.loss_mask.tolist() == record.loss_mask()
    assert any(records[i].earlier_turns for i in kept), "a multi-turn conversation made it to a shard"
    summary = gate_summary(counters)
    assert summary[0] == f"{decisions['keep']} kept, {decisions['flag']} flagged, {decisions['drop']} dropped, {len(retried)} retried"

    # Multi-turn sequences are prefilled exactly as generated: hidden states match an independent forward pass.
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    multi = next(shards[i] for i in kept if records[i].earlier_turns)
    with torch.inference_mode():
        out = reference(multi.input_ids.long()[None], output_hidden_states=True)
    expected = torch.stack([out.hidden_states[i + 1][0] for i in (1, 2, 3)], dim=1)
    torch.testing.assert_close(multi.hidden_states.float(), expected.to(torch.bfloat16).float(), rtol=1.6e-2, atol=1e-3)
