"""Faults a broken connector or model runner would have, put into vLLM's processes from outside the package
(dfq_testing/connector_faults.py), against the checks that hold stored states to the checkpoint's own forward, on
the trained checkpoint (SmolLM2-135M-Instruct, 30 layers) in bfloat16, the dtype users run: each fault is refused by
the load check's comparison, and the reference audit catches on a stored shard what no canary was there to see. The
same faults through `dflash-queue run` on the 16-layer family: tests/test_end_to_end_suspects.py."""

from __future__ import annotations

import pytest
import redis
import torch
from transformers import AutoTokenizer

from dflash_queue.config import load_config
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.reference.check import require_agreement
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.errors import ReferenceMismatch
from dflash_queue.lanes.audit import AuditLane, audit_lane_settings
from dflash_queue.lanes.extract import ExtractLane, extract_lane_settings, vllm_extract_settings
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, suspect_shard_ids
from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER
from dflash_queue.storage import open_storage
from dfq_testing import connector_faults
from dfq_testing.chat_texts import chat, conversations
from dfq_testing.configs import tiny_config_tables, write_config

# Not vllm_forked_engine_cores: a forked engine core would not run the outside faults' site hook.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# SmolLM2's 30 layers: DFlash's five, then the last layer before and after the final norm.
CAPTURED = [(1, DECODER_OUTPUT), (8, DECODER_OUTPUT), (14, DECODER_OUTPUT), (20, DECODER_OUTPUT),
            (27, DECODER_OUTPUT), (29, LAST_LAYER), (29, FINAL_NORM)]
DEEPEST, LAST, NORMED = 4, 5, 6  # aux 28 is the highest below N; aux 30 (N) carries both last entries
STEP_TOKENS = 256
SLOT_POSITION = 300  # a few hundred tokens in, past a prefill step's boundary
RULES = [
    {"kind": "deepest_layer_offset", "samples": "offset"},
    {"kind": "last_layer_after_norm", "samples": "norm"},
    {"kind": "slot_offset_after", "position": SLOT_POSITION, "samples": "slot|audit-slot"},
    {"kind": "swap", "pairs": [["swap-a", "swap-b"], ["audit-swap-a", "audit-swap-b"]]},
]


@pytest.fixture(scope="module")
def texts(trained_model):
    """Real chat sequences: {name: (prompt ids, completion ids)}; the swap pairs are as long as each other and share
    a system prompt of several hundred tokens; the slot ones run past SLOT_POSITION."""
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    pairs = conversations()
    notes = "\n\n".join(answer for _, answer in pairs[:4])
    system = f"You are a careful assistant. Notes from earlier answers; use them where they apply.\n\n{notes}"
    texts = {f"clean-{i}": chat(tokenizer, q, a) for i, (q, a) in enumerate(pairs[8:11])}
    texts |= {"offset": chat(tokenizer, *pairs[11]), "norm": chat(tokenizer, *pairs[12])}
    for prefix in ("", "audit-"):
        first, second = (chat(tokenizer, q, a, system) for q, a in pairs[5:7])
        length = min(len(first[0]) + len(first[1]), len(second[0]) + len(second[1]))
        texts[f"{prefix}swap-a"], texts[f"{prefix}swap-b"] = (
            (prompt, completion[: length - len(prompt)]) for prompt, completion in (first, second)
        )
        texts[f"{prefix}slot"] = chat(tokenizer, *pairs[13], system)
    shared = next(i for i, (a, b) in enumerate(zip(*(sum(texts[n], []) for n in ("swap-a", "swap-b")))) if a != b)
    assert 300 < shared < len(sum(texts["swap-a"], [])) - 20 and len(sum(texts["slot"], [])) > SLOT_POSITION + 50
    return texts


@pytest.fixture(scope="module")
def engine(trained_model, tmp_path_factory, vllm_uniproc_executor):
    """(config, engine): SmolLM2 in bfloat16 on vLLM's CPU build, prefilled in 256-token steps, every kind of entry
    captured, the outside faults installed (each on the requests it names: the load check's probes pass)."""
    tmp = tmp_path_factory.mktemp("outside-faults-trained")
    tables = tiny_config_tables(trained_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    config = load_config(write_config(
        tmp / "config.toml",
        tables,
        model={"name": "smollm2", "dtype": "bfloat16"},
        extract={"engine": "vllm", "num_draft_layers": 5, "last_layer_state": True, "final_norm_state": True,
                 "canary_samples": 0},
        **{"extract.vllm": {"max_model_len": 768, "max_num_batched_tokens": STEP_TOKENS, "max_num_seqs": 8,
                            "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0,
                            "shutdown_timeout_s": 30}},
    ))
    with connector_faults.installed(RULES):  # the engine core, spawned inside, wraps its connector
        extractor = VllmStateExtractor(vllm_extract_settings(config))
    assert extractor.captured == CAPTURED and extractor.reference is not None and extractor.reference.agrees
    yield config, extractor
    extractor.close()


def request(texts, name: str) -> ExtractionRequest:
    prompt, completion = texts[name]
    return ExtractionRequest(name, prompt + completion)


@pytest.mark.parametrize(
    ("faulted", "beyond"),
    [
        (["offset"], [DEEPEST]),  # the deepest decoder layer one token off, every request alike
        (["norm"], [LAST, NORMED]),  # the last state taken after the final norm
        (["slot"], list(range(len(CAPTURED)))),  # rows one slot off past a few hundred tokens
        (["swap-a", "swap-b"], list(range(len(CAPTURED)))),  # two requests behind one system prompt exchanged
    ],
)
def test_on_the_trained_checkpoint_in_bfloat16_the_load_checks_comparison_refuses_each_fault(
    engine, texts, faulted, beyond
):
    _, extractor = engine
    comparison = extractor.compare_with_checkpoint([request(texts, "clean-0"), *(request(texts, n) for n in faulted)])
    assert [k for k, entry in enumerate(comparison.entries) if not entry.agrees] == beyond, comparison.describe()
    assert all(comparison.entries[k].excess > 2 for k in beyond), comparison.describe()
    with pytest.raises(ReferenceMismatch, match="more than bfloat16 rounding explains"):
        require_agreement(comparison, "vLLM extract engine")


def test_on_the_trained_checkpoint_in_bfloat16_real_chat_agrees_with_the_checkpoints_forward(engine, texts):
    _, extractor = engine
    agreed = extractor.compare_with_checkpoint([request(texts, f"clean-{i}") for i in range(3)])
    assert agreed.agrees and agreed.dtype == torch.bfloat16, agreed.describe()
    assert all(entry.excess < 0.5 for entry in agreed.entries), agreed.describe()  # a margin of 2 at least


def test_the_audit_catches_on_a_stored_shard_what_no_canary_looked_at(engine, texts, redis_url, tmp_path):
    """A shard stored with the canary off (extract.canary_samples = 0): its swapped pair and its sequence read one
    slot off past SLOT_POSITION are found by the audit, the storing worker halted and the shard marked suspect."""
    config, extractor = engine
    lane_config = config.with_overrides(storage={"url": str(tmp_path / "storage")}, broker={"url": redis_url},
                                        audit={"enabled": True, "samples_per_shard": 8})
    storage = open_storage(lane_config.storage)
    names = ["clean-0", "audit-swap-a", "audit-swap-b", "audit-slot", "clean-1"]
    records = [
        CompletionRecord(id=name, prompt_ids=texts[name][0], completion_ids=texts[name][1], finish_reason="stop",
                         thinking=False, text="")
        for name in names
    ]
    storage.write_bytes(completions_key("faulted"), encode_completions(records))
    lane = ExtractLane(extract_lane_settings(lane_config), extractor, storage)
    summary = lane.run("faulted")
    assert summary.num_samples == len(names) and summary.canary_samples == 0  # stored, unchecked by any canary
    audits = AuditRecords(redis.Redis.from_url(redis_url, decode_responses=True), lane_config.run.name)
    audits.record_stored("faulted", 0, "inc-extract", "extract@a", every_shards=1, every_s=0.0, dtype="bfloat16")
    verdict = AuditLane(audit_lane_settings(lane_config), storage).run("faulted")
    assert not verdict.passed and verdict.suspects == ("faulted",), verdict.detail
    assert any(f"sample {n}, layer " in verdict.detail for n in names[1:4]), verdict.detail
    assert audits.halted("inc-extract") and suspect_shard_ids(storage, 0) == {"faulted"}
