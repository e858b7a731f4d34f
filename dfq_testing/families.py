"""Tiny random-weight checkpoints of every model family drafters are trained for, built offline.

Each family is one of Transformers' own config classes at toy size, saved with the tiny tokenizer (the same
vocabulary and chat template as `tiny_model`), the way Transformers' own tests build models: hybrid linear
attention (Qwen3.5 text-only and multimodal, its multimodal MoE variant, Qwen3-Next), sliding windows (Mistral,
Gemma 2/3), attention sinks (gpt-oss), logit soft-capping (Gemma 2), mixtures of experts (Qwen3-MoE, Qwen3-Next,
gpt-oss, DeepSeek-V3, Qwen3.5-MoE), multi-head latent attention (DeepSeek-V3), interleaved multimodal rope
(Qwen3-VL), dense (Qwen3, Llama), and a short-convolution hybrid (LFM2) and a Mamba-2 hybrid (Bamba) that only
run unpacked.

Weights are drawn at a standard deviation of `INIT_STD` instead of the usual 0.02: at init scale the states are
nearly zero and a wrong answer (a window ignored, a recurrent state leaking into the next sequence) hides below
any tolerance. Norm weights, which every family initialises to a constant, are drawn too (`NORM_STD`), so that a
norm applied twice, or with another family's formula, shows.

Sizes also suit vLLM's CPU build, which runs some families through the extract lane's vLLM engine: attention
head size 32 (its CPU attention kernels take no smaller), linear-attention heads of 128 (its CPU Gated DeltaNet
kernel's size), and gpt-oss's sliding window on every other layer (vLLM's gpt-oss assumes it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INIT_STD = 0.2
NORM_STD = 0.3
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
NUM_LAYERS = 6
# A deeper build (build_family's `num_layers`), for faults at one layer among many: only the families whose layers
# are all alike, since the others' layer patterns are written for NUM_LAYERS.
DEEP_LAYERS = 16
UNIFORM_LAYERS = frozenset({"qwen3", "llama", "qwen3_moe", "mistral"})
_num_layers: ContextVar[int] = ContextVar("num_layers", default=NUM_LAYERS)
WINDOW = 16  # sliding window: far below the test sequences' lengths
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[int], Any]  # vocab size -> a model with random weights
    # What the extraction engine is expected to do with it.
    mode: str = "packed"
    # The model's own attention that applies all its features (SDPA drops soft-capping).
    reference_attention: str = "sdpa"
    multimodal: bool = False
    # Whether its decoder's final norm is a module named `norm` (extract.final_norm_state needs one).
    final_norm: bool = True


def _common(vocab: int, **extra) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": _num_layers.get(),
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        **extra,
    }


_HYBRID = ["linear_attention", "linear_attention", "full_attention"] * (NUM_LAYERS // 3)
_LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
_INTERLEAVED = ["sliding_attention", "sliding_attention", "full_attention"] * (NUM_LAYERS // 3)
_ALTERNATING = ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2)


def _qwen3(vocab):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_common(vocab)))


def _llama(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_common(vocab)))


def _qwen3_moe(vocab):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**_common(vocab, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    )


def _qwen3_5_text(vocab):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_common(vocab, layer_types=_HYBRID, **_LINEAR)))


def _qwen3_5(vocab):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2}
    text = _common(vocab, layer_types=_HYBRID, **_LINEAR)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.initializer_range = INIT_STD
    return Qwen3_5ForConditionalGeneration(config)


def _qwen3_next(vocab):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(
        Qwen3NextConfig(
            **_common(vocab, layer_types=_HYBRID, **_LINEAR),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    )


def _mistral(vocab):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_common(vocab), sliding_window=WINDOW))


def _gemma3_text(vocab):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_common(vocab), sliding_window=WINDOW, layer_types=_INTERLEAVED))


def _gemma3(vocab):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    text = _common(vocab, sliding_window=WINDOW, layer_types=_INTERLEAVED)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=False)
    config.initializer_range = INIT_STD
    return Gemma3ForConditionalGeneration(config)


def _gemma2(vocab):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(**_common(vocab), sliding_window=WINDOW, layer_types=_INTERLEAVED, attn_logit_softcapping=5.0)
    )


def _gpt_oss(vocab):
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(
        GptOssConfig(
            **_common(vocab), num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=_ALTERNATING,
        )
    )


def _lfm2(vocab):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    kinds = ["conv", "conv", "full_attention"] * (NUM_LAYERS // 3)
    config = _common(vocab, layer_types=kinds)
    del config["head_dim"]
    return Lfm2ForCausalLM(Lfm2Config(**config, conv_L_cache=3, block_auto_adjust_ff_dim=False))


def _deepseek_v3(vocab):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # Multi-head latent attention: keys and values from a compressed latent, query/key heads of a no-position
    # part and a rotary part (32 + 16) wider than the value heads (32), as DeepSeek-V3's 128 + 64 and 128; every
    # head reads its own keys (num_key_value_heads = heads). Yarn rope (its mscale changes the softmax scale),
    # a dense first layer, then group-limited sigmoid routing over 8 experts in 4 groups and a shared expert.
    config = _common(vocab, num_key_value_heads=HEADS)
    del config["head_dim"]
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **config, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=HEAD_DIM // 2,
            v_head_dim=HEAD_DIM, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, rope_parameters=rope,
        )
    )


def _bamba(vocab):
    from transformers import BambaConfig, BambaForCausalLM

    # Mamba-2 layers (a causal conv1d and a state space scan in chunks of 16 tokens, so the test sequences cross
    # chunks) with attention on layers 2 and 5; attention heads of 32 (hidden / heads: Bamba has no head_dim).
    config = _common(vocab, num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=1)
    del config["head_dim"]
    return BambaForCausalLM(
        BambaConfig(
            **config, attn_layer_indices=[2, 5], mamba_n_heads=4, mamba_d_head=HEAD_DIM, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        )
    )


def _qwen3_5_moe(vocab):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2}
    text = _common(vocab, layer_types=_HYBRID, **_LINEAR, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32)
    del text["intermediate_size"]  # every layer's MLP is the mixture of experts
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.initializer_range = INIT_STD
    return Qwen3_5MoeForConditionalGeneration(config)


def _qwen3_vl(vocab):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0]}
    # Interleaved multimodal rope: the 16 rotary frequencies of a 32-wide head shared among time, height and
    # width (6, 5, 5, as Qwen3-VL's 24, 20, 20 of 64), interleaved.
    rope = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    text = _common(vocab, rope_parameters=rope)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.initializer_range = INIT_STD
    return Qwen3VLForConditionalGeneration(config)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3", _qwen3),
        Family("llama", _llama),
        Family("qwen3_moe", _qwen3_moe),
        Family("qwen3_5_text", _qwen3_5_text),
        Family("qwen3_5", _qwen3_5, multimodal=True),
        Family("qwen3_next", _qwen3_next),
        Family("mistral", _mistral),
        Family("gemma3_text", _gemma3_text),
        Family("gemma3", _gemma3, multimodal=True),
        Family("gemma2", _gemma2, reference_attention="eager"),
        Family("gpt_oss", _gpt_oss, reference_attention="eager"),
        Family("lfm2", _lfm2, mode="padded", final_norm=False),
        Family("deepseek_v3", _deepseek_v3),
        Family("bamba", _bamba, mode="padded", final_norm=False),
        Family("qwen3_5_moe", _qwen3_5_moe, multimodal=True),
        Family("qwen3_vl", _qwen3_vl, multimodal=True),
    )
}


def build_family(
    name: str, out_dir: str | Path, tokenizer_dir: str | Path, *, seed: int = 0, num_layers: int = NUM_LAYERS
) -> Path:
    """Write family `name` as a checkpoint (float32 safetensors, the tiny tokenizer, a generation config) into
    `out_dir` and return it; an existing build is reused. `num_layers` other than NUM_LAYERS (families in
    UNIFORM_LAYERS only) builds a deeper (or shallower) checkpoint, its depth recorded in the marker: give it a
    directory of its own (a build of another depth there is refused)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    if num_layers != NUM_LAYERS and name not in UNIFORM_LAYERS:
        raise ValueError(f"family {name} is built with {NUM_LAYERS} layers only (its layer pattern is fixed)")
    out_dir = Path(out_dir)
    marker = out_dir / "family.json"
    if marker.is_file():
        built = json.loads(marker.read_text()).get("num_layers", NUM_LAYERS)
        if built != num_layers:
            raise ValueError(f"{out_dir} holds a {built}-layer build of {name}, not {num_layers}")
        return out_dir
    family = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    depth = _num_layers.set(num_layers)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = family.build(len(tokenizer)).to(torch.float32).eval()
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "norm" in name and parameter.dim() == 1:
                        parameter.add_(torch.randn_like(parameter) * NORM_STD)
    finally:
        _num_layers.reset(depth)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[eos, pad], pad_token_id=pad)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for file in _TOKENIZER_FILES:
        if (Path(tokenizer_dir) / file).is_file():
            shutil.copy(Path(tokenizer_dir) / file, tmp / file)
    recorded = {"family": name, "seed": seed} | ({"num_layers": num_layers} if num_layers != NUM_LAYERS else {})
    (tmp / "family.json").write_text(json.dumps(recorded) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)  # an unfinished build (no marker)
    tmp.rename(out_dir)
    return out_dir
