"""The target's causal LM, for the Transformers generate engine (`load_causal_lm`): a text-only checkpoint loads as
its causal LM class; a multimodal one as its text decoder under its LM head, since Transformers has no text-only
causal LM class for some text decoders (Qwen3-VL's).

The decoder is loaded as the extract lane loads it (`decoder.load_text_decoder`: the text config's base model, the
language model's prefix mapped away, no vision tower, every weight checked), so every checkpoint whose states can
be extracted can also be generated from, whether or not Transformers has a text-only causal LM class for its text
config (Qwen3.5 and Gemma 3 have one, Qwen3-VL has none). The head is the checkpoint's `lm_head.weight` (where the
checkpoint keeps it, e.g. under `language_model.`), or the input embeddings where the checkpoint's config ties them
and stores no head; a checkpoint with neither is refused, as a missing decoder weight is.

Prompts are text: through the multimodal class, a text-only prompt runs through the text decoder and the head
alone (its positions are plain positions, in every section of an interleaved multimodal rope), which is what
this model computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from dflash_queue.engines.decoder import (
    HEAD,
    CheckpointLayout,
    checkpoint_keys,
    checkpoint_tensors,
    load_kwargs,
    load_text_decoder,
    read_layout,
    require_complete,
)
from dflash_queue.errors import UnsupportedArchitecture

# What the decoder's class declares about itself, which Transformers reads on the model that generates (which
# attention kernels it takes, whether its cache holds a recurrent state).
_DECLARED = (
    "_is_stateful",
    "_supports_sdpa",
    "_supports_flash_attn",
    "_supports_flex_attn",
    "_supports_attention_backend",
    "_can_compile_fullgraph",
)
# Text config settings by which a family's causal LM transforms the head's logits (their neutral values): a plain
# head would ignore them.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


class TextCausalLM(PreTrainedModel, GenerationMixin):
    """A text decoder (`model`) under an LM head (`lm_head`), generating as Transformers' causal LMs do."""

    base_model_prefix = "model"

    def __init__(self, decoder: nn.Module, head: nn.Linear) -> None:
        super().__init__(decoder.config)  # type: ignore[arg-type]
        self.model = decoder
        self.lm_head = head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> nn.Module:
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, kept])
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)


def load_causal_lm(path: str, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The text decoder with its LM head, for generation: a text-only checkpoint's causal LM class; for a
    multimodal checkpoint, its text decoder (as `load_text_decoder` loads it) under its LM head
    (`load_text_causal_lm`). Attention is eager where SDPA would drop a feature of the model
    (soft-capping, sinks), SDPA otherwise."""
    from dflash_queue.engines.architecture import profile_config

    layout = read_layout(path)
    # SDPA drops attention soft-capping (Gemma 2): generate with the attention that applies every feature.
    attention = profile_config(layout.config).reference_attention
    if layout.multimodal:
        return load_text_causal_lm(path, layout, dtype=dtype, device=device, attn_implementation=attention)
    from transformers import AutoModelForCausalLM

    kwargs = load_kwargs(layout, dtype, device, attention)
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    model, info = loaded
    require_complete(model, info, path, layout)
    return model.to(device)


def load_text_causal_lm(
    path: str, layout: CheckpointLayout, *, dtype: torch.dtype, device: torch.device, attn_implementation: str
) -> TextCausalLM:
    """The text causal LM of the multimodal checkpoint at `path` (whose `layout` the caller has read)."""
    _refuse_logit_transforms(path, layout)
    decoder = load_text_decoder(
        path, dtype=dtype, device=device, attn_implementation=attn_implementation, layout=layout
    )
    head = _lm_head(Path(path), layout, decoder, dtype, device)
    kind: Any = type(decoder)
    declared = {name: getattr(kind, name) for name in _DECLARED if hasattr(kind, name)}
    # Whether the attention and experts kernels can be chosen, which Transformers finds in the model's own module.
    declared["_can_set_attn_implementation_cached_value"] = kind._can_set_attn_implementation()
    declared["_can_set_experts_implementation_cached_value"] = kind._can_set_experts_implementation()
    # Named as Transformers names its causal LMs (Qwen3VLTextModel -> Qwen3VLTextForCausalLM).
    name = kind.__name__.removesuffix("Model") + "ForCausalLM"
    model = type(name, (TextCausalLM,), declared)(decoder, head)
    model.generation_config = _generation_config(path, layout)
    return model.eval()


def _lm_head(
    directory: Path, layout: CheckpointLayout, decoder: nn.Module, dtype: torch.dtype, device: torch.device
) -> nn.Linear:
    text: Any = layout.text_config
    shape = (int(text.vocab_size), int(text.hidden_size))
    keys = checkpoint_keys(directory)
    heads = [key for key in keys if key.endswith(HEAD)]
    key = f"{layout.head_prefix}{HEAD}"
    head = nn.Linear(shape[1], shape[0], bias=False, device="meta")
    if key in heads and len(heads) == 1:
        bias_key = key.removesuffix("weight") + "bias"
        tensors = checkpoint_tensors(directory, [key, bias_key])
        weight = tensors[key]
        if tuple(weight.shape) != shape:
            raise UnsupportedArchitecture(
                f"{directory}: the LM head {key} has shape {tuple(weight.shape)}, the text decoder needs {shape} "
                "(vocabulary x hidden size)"
            )
        head.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
        if bias_key in tensors:
            head.bias = nn.Parameter(tensors[bias_key].to(device=device, dtype=dtype), requires_grad=False)
        return head
    if not heads and getattr(layout.config, "tie_word_embeddings", False):
        head.weight = decoder.get_input_embeddings().weight  # type: ignore[operator]
        return head
    found = ", ".join(heads) if heads else "none"
    raise UnsupportedArchitecture(
        f"{directory}: {layout.model_type} needs one LM head weight ('*{HEAD}'; found: {found}) or a config that "
        "ties the head to the embeddings; generation would run a random head"
    )


def _refuse_logit_transforms(path: str, layout: CheckpointLayout) -> None:
    for setting, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(layout.text_config, setting, neutral)
        if value != neutral:
            raise UnsupportedArchitecture(
                f"{path}: {layout.text_model_type} sets {setting} = {value}, a transform of the head's logits that "
                "the text causal LM built from the decoder and the head does not apply"
            )


def _generation_config(path: str, layout: CheckpointLayout) -> GenerationConfig:
    """The checkpoint's generation config (its end-of-sequence tokens), as Transformers' `from_pretrained` reads
    it: generation_config.json, else the model config."""
    if (Path(path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(layout.config)  # type: ignore[arg-type]
