"""What a target architecture needs for exact hidden states, and how the extraction engine runs it.

Decided from the config alone (so `doctor` can say it without loading weights), per model:

* "packed": sequences concatenated in one row (no padding). Exact because every token mixer is confined to its
  sequence: attention by `packed_attention` (per sequence, with the layer's sliding window, logit soft-capping
  and attention sinks), linear-attention layers (Gated DeltaNet: a causal conv1d and a recurrent state) by
  running them on each sequence of the row in turn, so neither state runs on into the next sequence;
* "padded": right-padded batches with an attention mask, through the model's own attention. Every causal
  model is exact this way (a token never sees the padding after it); used for token mixers the packed path
  does not know (Mamba, short convolutions, chunked attention);
* refused: encoder-decoder or bidirectional models, which have no causal decoder states to condition a drafter.

The engine confirms the choice at load with a probe (packed against one sequence at a time) and falls back to
"padded" if packing is not exact after all; see `hf/extract.py`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from dflash_queue.errors import UnsupportedArchitecture

Mode = Literal["packed", "padded"]

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
LINEAR_ATTENTION = "linear_attention"
# Text models whose linear-attention layers are a `linear_attn` module taking (hidden_states, ...) of one
# sequence, which the packed path runs sequence by sequence.
SEGMENTABLE_LINEAR_ATTENTION = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
# Text decoders the conformance suite proves packed (tests/test_conformance.py). Another model type is packed only
# when its config declares no token mixer beyond those the packed path applies (`undeclared_mixers`) and the load
# probe reaches past every mixer's span (hf/probe.py).
PROVEN_PACKED = frozenset({
    "qwen3", "llama", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "mistral", "gemma2",
    "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_vl_text",
})
# Config settings that declare a token mixer other than attention (state spaces, short convolutions): in a model
# type not proven packed, one of them sends it to padded batches whatever its layer types say.
MIXER_SETTINGS = ("mamba_", "ssm_", "conv_L_cache", "short_conv", "linear_conv_kernel_dim", "attention_chunk_size")
# Attention extras the native SDPA kernel ignores: the reference (and padded) path must use eager attention.
EAGER_ONLY_FEATURES = frozenset({"softcap", "sinks"})
# The chunk Qwen3.5's and Qwen3-Next's linear attention works in: the reach `coverage_length` gives it.
LINEAR_ATTENTION_CHUNK = 64


@dataclass(frozen=True)
class ArchitectureProfile:
    model_type: str  # the checkpoint's (e.g. qwen3_5 for a multimodal Qwen3.5)
    text_model_type: str  # its text decoder's (qwen3_5_text)
    multimodal: bool
    num_layers: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mode: Mode
    why_padded: str = ""
    refusal: str = ""
    features: dict[str, str] = field(default_factory=dict)

    @property
    def reference_attention(self) -> str:
        """The model's own attention for one sequence: eager where SDPA would drop soft-capping or sinks."""
        return "eager" if EAGER_ONLY_FEATURES & self.features.keys() else "sdpa"

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in Counter(self.layer_types).items())
        extras = "; ".join(f"{k} {v}".strip() for k, v in self.features.items())
        where = f"{self.model_type} (text decoder {self.text_model_type})" if self.multimodal else self.model_type
        head = f"{where}: {self.num_layers} layers ({kinds}), hidden {self.hidden_size}"
        if extras:
            head += f"; {extras}"
        if self.refusal:
            return f"{head}; refused: {self.refusal}"
        how = "packed" if self.mode == "packed" else f"padded ({self.why_padded})"
        return f"{head}; extraction {how}"


def profile_config(config, *, attn_implementation: str = "sdpa", packing: str = "auto") -> ArchitectureProfile:
    """The profile of a Transformers config (a checkpoint's `AutoConfig`, multimodal or text-only)."""
    text = config.get_text_config()
    num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    layer_types = tuple(getattr(text, "layer_types", None) or _implicit_layer_types(text, num_layers))
    features = _features(text, layer_types)
    refusal = _refusal(config, text, num_layers, features, attn_implementation)
    unknown = sorted({t for t in layer_types if t not in ATTENTION_LAYERS | {LINEAR_ATTENTION}})
    text_type = str(getattr(text, "model_type", "?"))
    why_padded = ""
    if unknown:
        why_padded = f"layer types {unknown} have no packed implementation"
    elif LINEAR_ATTENTION in layer_types and text_type not in SEGMENTABLE_LINEAR_ATTENTION:
        why_padded = f"the linear-attention layers of {text_type} have no per-sequence packed implementation"
    elif getattr(text, "attention_chunk_size", None):
        why_padded = "chunked attention has no packed implementation"
    elif text_type not in PROVEN_PACKED and (declared := undeclared_mixers(text)):
        why_padded = f"{text_type} is not proven packed and its config declares other token mixers ({declared})"
    elif packing == "padded":
        why_padded = "extract.packing = 'padded'"
    if packing == "packed" and why_padded and not refusal:
        refusal = f"extract.packing = 'packed' but {why_padded}"
    return ArchitectureProfile(
        model_type=str(getattr(config, "model_type", "?")),
        text_model_type=text_type,
        multimodal=text is not config,
        num_layers=num_layers,
        hidden_size=int(getattr(text, "hidden_size", 0) or 0),
        layer_types=layer_types,
        mode="padded" if why_padded else "packed",
        why_padded=why_padded,
        refusal=refusal,
        features=features,
    )


def require_supported(config, attn_implementation: str, packing: str) -> ArchitectureProfile:
    """The profile, or UnsupportedArchitecture saying what the engine cannot do for this model."""
    profile = profile_config(config, attn_implementation=attn_implementation, packing=packing)
    if profile.refusal:
        raise UnsupportedArchitecture(f"cannot extract exact hidden states of {profile.describe()}")
    return profile


def native_attention(profile: ArchitectureProfile, attn_implementation: str) -> str:
    """The model's own attention for padded passes and reference runs: eager where SDPA would drop a feature."""
    return profile.reference_attention if attn_implementation == "sdpa" else attn_implementation


def _implicit_layer_types(text, num_layers: int) -> list[str]:
    # Configs without `layer_types` (Mistral, Llama): a sliding window, when set, applies to every layer.
    kind = "sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"
    return [kind] * num_layers


def _features(text, layer_types: tuple[str, ...]) -> dict[str, str]:
    features: dict[str, str] = {}
    if "sliding_attention" in layer_types and getattr(text, "sliding_window", None):
        features["sliding window"] = str(text.sliding_window)
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap:
        features["softcap"] = f"{softcap:g}"
    if getattr(text, "model_type", "") == "gpt_oss":
        features["sinks"] = "per head"
    if LINEAR_ATTENTION in layer_types:
        features["linear attention"] = f"{layer_types.count(LINEAR_ATTENTION)} layers"
    if getattr(text, "attention_chunk_size", None):
        features["attention chunk"] = str(text.attention_chunk_size)
    if getattr(text, "mamba_chunk_size", None):
        features["state-space chunk"] = str(text.mamba_chunk_size)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if experts:
        features["MoE"] = f"{experts} experts"
    return features


def undeclared_mixers(text) -> str:
    """The settings of `text` (a text config) that declare token mixers other than attention, comma-separated."""
    keys = [k for k, v in text.to_dict().items() if v not in (None, False, 0) and k.startswith(MIXER_SETTINGS)]
    return ", ".join(sorted(keys))


def _refusal(config, text, num_layers: int, features: dict[str, str], attn_implementation: str) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model has no causal decoder states to extract"
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return "its attention is bidirectional, not causal: states would depend on later tokens"
    architectures = getattr(config, "architectures", None) or []
    generative = any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures)
    if getattr(text, "is_decoder", None) is False and not generative:
        return f"an encoder ({', '.join(architectures) or 'is_decoder = false'}), not a causal decoder"
    if num_layers < 1:
        return "its config names no decoder layers (num_hidden_layers)"
    if attn_implementation == "flash_attention_2" and "sinks" in features:
        return "flash_attention_2 has no attention sinks; use extract.attn_implementation = 'sdpa'"
    return ""


def coverage_length(profile: ArchitectureProfile) -> int:
    """How far the model's token mixers reach before they behave as plain causal attention: its sliding window, its
    attention chunk, a linear-attention chunk (0: nothing beyond full attention)."""
    reaches = [
        int(profile.features.get("sliding window", "0") or 0),
        int(profile.features.get("attention chunk", "0") or 0),
        int(profile.features.get("state-space chunk", "0") or 0),
        LINEAR_ATTENTION_CHUNK if "linear attention" in profile.features else 0,
    ]
    return max(reaches)
