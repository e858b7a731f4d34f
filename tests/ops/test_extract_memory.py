"""An extract worker's per-GPU memory and assumed prefill rate, by hand for the tiny model (Qwen3: vocabulary
1,536, hidden 128, 6 layers, 2 query heads and 1 key/value head of 64, MLP 384, untied, float32)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig

from dflash_queue.ops.extract_memory import H200_PEAK_BF16_FLOP_S, extract_memory

EMBEDDING = 1536 * 128  # and as much again for the LM head
# q 128 x 128, k and v 128 x 64, o 128 x 128, q/k norms of 64; MLP 3 x 128 x 384; two norms of 128.
LAYER = (128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 64) + 3 * 128 * 384 + 2 * 128
TOTAL = 2 * EMBEDDING + 6 * LAYER + 128


def test_the_tiny_model_by_hand():
    assert LAYER == 196_992 and TOTAL == 1_575_296


def test_vllm_engine_weights_and_cache_per_gpu(make_config, tiny_model, tmp_path):
    # A checkpoint without an index: the parameters are counted from the config's shapes.
    unindexed = tmp_path / "unindexed"
    unindexed.mkdir()
    shutil.copy(tiny_model / "config.json", unindexed / "config.json")
    config = make_config(
        model={"path": str(unindexed)},
        extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5}}
    )
    memory = extract_memory(
        config.model, config.extract, AutoConfig.from_pretrained(unindexed), gpus_per_worker=2, gpu_memory_gib=1
    )
    # float32 (model.dtype): 4 bytes a parameter, half the weights on each of the 2 GPUs.
    assert memory.parameters == TOTAL and memory.parameters_source == "config shapes"
    assert memory.weight_bytes == TOTAL * 4 and memory.weight_bytes_per_gpu == TOTAL * 4 / 2 == 3_150_592
    # Keys and values: 2 x 6 layers x 1 head x 64 x 4 bytes; one key/value head over two GPUs is replicated.
    assert memory.kv_cache_bytes_per_token == 2 * 6 * 1 * 64 * 4 == 3072
    # Layers [1, 2, 3] are vLLM's aux layers 2, 3 and 4: 3 x 128 x 4 bytes on every GPU.
    assert memory.hidden_state_cache_bytes_per_token == 3 * 128 * 4 == 1536
    # Half of 1 GiB less the weights, over 4,608 bytes a token.
    assert memory.tokens_in_flight == (2**30 // 2 - 3_150_592) // 4608 == 115_824
    assert memory.max_model_len == 4096 and memory.warnings == []  # the model's own context
    # 50% of 790 TFLOP/s on each of the 2 GPUs over 2 FLOP per parameter of the 6 layers.
    assert memory.flop_per_token == 2 * 6 * LAYER
    assert memory.tokens_per_s == pytest.approx(0.5 * 790e12 * 2 / (2 * 6 * LAYER))
    assert "50% of 790 TFLOP/s bf16 per H200 x 2 GPU(s)" in memory.assumption
    assert H200_PEAK_BF16_FLOP_S == 790e12


def test_vllm_engine_cache_set_by_size_and_the_warnings(make_config, tiny_model):
    model_config = AutoConfig.from_pretrained(tiny_model)
    sized = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"kv_cache_memory_gib": 0.5}})
    memory = extract_memory(sized.model, sized.extract, model_config, gpus_per_worker=1, gpu_memory_gib=1)
    assert memory.tokens_in_flight == 2**29 // (3072 + 1536)  # kv_cache_memory_gib, whatever the weights
    short = make_config("short.toml", extract={"engine": "vllm"}, **{"extract.vllm": {"kv_cache_memory_gib": 0.01}})
    [warning] = extract_memory(short.model, short.extract, model_config, gpus_per_worker=1, gpu_memory_gib=1).warnings
    # 0.01 GiB (10,737,418 bytes) over 4,608 bytes a token: 2,330 tokens, fewer than the model's 4,096.
    assert "room for 2,330 tokens in flight, less than one sequence of max_model_len 4,096" in warning
    [warning] = extract_memory(
        sized.model, sized.extract, model_config, gpus_per_worker=1, gpu_memory_gib=0.001
    ).warnings
    assert "do not fit" in warning and "raise extract.vllm.tensor_parallel_size" in warning


def test_vllm_engine_weights_from_a_checkpoint_index(make_config, tiny_model, tmp_path):
    model = tmp_path / "indexed"
    model.mkdir()
    shutil.copy(tiny_model / "config.json", model / "config.json")
    # float32 in the checkpoint (its config's dtype): 8,000,000 bytes are 2,000,000 parameters, bf16 in the engine.
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 8_000_000}}))
    config = make_config(model={"path": str(model), "dtype": "bfloat16"}, extract={"engine": "vllm"})
    memory = extract_memory(
        config.model, config.extract, AutoConfig.from_pretrained(model), gpus_per_worker=1, gpu_memory_gib=1
    )
    assert memory.parameters == 2_000_000 and memory.weight_bytes == 4_000_000
    assert memory.parameters_source == "checkpoint index (metadata.total_size / 4 bytes)"


def test_the_tiny_models_own_index_counts_what_the_config_shapes_count(make_config, tiny_model):
    config = make_config(extract={"engine": "vllm"})
    memory = extract_memory(
        config.model, config.extract, AutoConfig.from_pretrained(tiny_model), gpus_per_worker=1, gpu_memory_gib=1
    )
    assert memory.parameters_source.startswith("checkpoint index") and memory.parameters == TOTAL


def test_transformers_engine_over_a_group_of_gpus(make_config, tiny_model):
    config = make_config()  # layers [1, 2, 3], token budget 2,048, float32
    memory = extract_memory(
        config.model, config.extract, AutoConfig.from_pretrained(tiny_model), gpus_per_worker=2, gpu_memory_gib=1
    )
    # The engine loads no LM head and no layer above 3: the embedding, 4 layers and the final norm.
    loaded = (EMBEDDING + 4 * LAYER + 128) * 4
    assert memory.weight_bytes == loaded == 3_938_816 and memory.weight_bytes_per_gpu == loaded / 2
    # A pass of 2,048 tokens: 2 K H + 3 H + max(2 (2 + 1) 64, 3 x 384) values of 4 bytes, and 4 H, per token.
    activations = 2048 * ((2 * 3 * 128 + 3 * 128 + 3 * 384) * 4 + 4 * 128)
    assert memory.activation_bytes == activations == 19_922_944
    assert memory.bytes_per_gpu == loaded / 2 + activations
    # Its layers run one GPU after another: one GPU's rate, over the 4 layers it runs.
    assert memory.compute_gpus == 1 and memory.flop_per_token == 2 * 4 * LAYER
    assert memory.tokens_per_s == pytest.approx(0.5 * 790e12 / (2 * 4 * LAYER))
    assert "x 1 GPU(s) (a group's layers run one GPU after another)" in memory.assumption
    [warning] = extract_memory(
        config.model, config.extract, AutoConfig.from_pretrained(tiny_model), gpus_per_worker=1,
                               gpu_memory_gib=0.01).warnings
    assert "GiB per GPU (weights and a pass of 2,048 tokens)" in warning and "lower extract.token_budget" in warning
