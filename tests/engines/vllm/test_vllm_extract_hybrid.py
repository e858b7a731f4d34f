"""A hybrid linear-attention target (Qwen3-Next: Gated DeltaNet layers between attention layers, mixture of
experts) through the vLLM extract engine. vLLM's CPU build runs Gated DeltaNet in bfloat16 only, so the states are
held to bfloat16's precision: as close to the checkpoint's own float32 forward as the checkpoint's own class is in
bfloat16, and never all zero (the states vLLM returned for hybrid targets until #46301)."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_queue.config import load_config
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.state_checks import compare_states
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.lanes.extract import vllm_extract_settings
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.references import reference_model, reference_states

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

CAPTURED = [(0, "decoder_output"), (2, "decoder_output"), (4, "decoder_output"), (5, "final_norm")]


def test_a_hybrid_target_extracts_as_exactly_as_bfloat16_allows(tiny_family, tmp_path):
    path = tiny_family("qwen3_next")
    tables = tiny_config_tables(path, tmp_path / "storage", "redis://127.0.0.1:1/0", tmp_path / "state")
    config = load_config(
        write_config(
            tmp_path / "config.toml",
            tables,
            model={"name": "qwen3_next", "dtype": "bfloat16"},
            extract={"engine": "vllm", "layer_ids": [0, 2, 4], "final_norm_state": True},
            **{"extract.vllm": {"max_model_len": 512, "max_num_batched_tokens": 64, "max_num_seqs": 8,
                                "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0}},
        )
    )
    rng = random.Random(0)
    requests = [
        ExtractionRequest(f"s-{i}", [rng.randrange(1000) for _ in range(n)]) for i, n in enumerate([11, 64, 90, 200])
    ]
    engine = VllmStateExtractor(vllm_extract_settings(config))
    try:
        assert engine.dtype == torch.bfloat16
        captured = engine.capture(requests)
    finally:
        engine.close()
    exact = reference_model(path, dtype=torch.float32)
    rounded = reference_model(path, dtype=torch.bfloat16)
    for request, result in zip(requests, captured):
        ids = torch.tensor(request.input_ids)
        truth = reference_states(exact, ids, CAPTURED)
        own_bf16 = compare_states(reference_states(rounded, ids, CAPTURED), truth).relative
        vllm_bf16 = compare_states(result.states, truth).relative
        for k, (ours, theirs) in enumerate(zip(vllm_bf16, own_bf16)):
            # Within a few bfloat16 roundings of the truth, as the model's own class in bfloat16 is.
            assert ours <= max(2 * theirs, 2e-2), (request.sample_id, CAPTURED[k], ours, theirs)
        assert bool((result.summary[:, 2] > 0).all())  # a median token RMS above zero at every layer
