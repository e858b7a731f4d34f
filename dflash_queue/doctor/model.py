"""The target model: config and tokenizer load, the configured layers exist, the extraction engine can run the
architecture exactly (and how: packed or padded), and the chat template can do what the thinking policy asks of
it."""

from __future__ import annotations

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.doctor.result import Check
from dflash_queue.engines.architecture import profile_config
from dflash_queue.engines.config import ModelConfig
from dflash_queue.engines.layers import resolve_layer_ids
from dflash_queue.lanes.config import ExtractConfig


def check_model(model: ModelConfig, extract: ExtractConfig) -> tuple[list[Check], object | None]:
    """Checks, and the tokenizer when it loaded (for the chat-template check)."""
    from transformers import AutoConfig, AutoTokenizer

    checks = []
    try:
        model_config = AutoConfig.from_pretrained(model.path)
    except Exception as exc:
        checks.append(Check.failed("model", f"{model.path}: config does not load: {type(exc).__name__}: {exc}"))
    else:
        text = getattr(model_config, "text_config", None) or model_config
        layers, hidden = getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)
        arch = ",".join(getattr(model_config, "architectures", None) or [model_config.model_type])
        detail = f"{model.path}: {arch}, {layers} layers, hidden {hidden}"
        try:
            ids = resolve_layer_ids(extract.layer_ids, int(layers), extract.num_draft_layers)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            checks.append(Check.failed("model", f"{detail}; extract layers: {exc}"))
        else:
            checks.append(Check.passed("model", f"{detail}; extracting layers {ids}"))
        checks.append(check_architecture(model_config, extract))

    try:
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path)
    except Exception as exc:
        checks.append(
            Check.failed("tokenizer", f"{model.tokenizer_path}: does not load: {type(exc).__name__}: {exc}")
        )
        return checks, None
    if not getattr(tokenizer, "chat_template", None):
        checks.append(Check.failed("tokenizer", f"{model.tokenizer_path}: loads, but has no chat template"))
        return checks, None
    checks.append(Check.passed("tokenizer", f"{model.tokenizer_path}: {len(tokenizer)} tokens, chat template"))
    return checks, tokenizer


def check_architecture(model_config, extract: ExtractConfig) -> Check:
    """Whether hidden states of this architecture can be extracted exactly, from its config alone; the worker
    confirms the choice with a probe when it loads the weights."""
    profile = profile_config(
        model_config, attn_implementation=extract.attn_implementation, packing=extract.packing
    )
    if profile.refusal:
        return Check.failed("architecture", profile.describe())
    return Check.passed("architecture", profile.describe())


def check_thinking_template(tokenizer, policy: str) -> Check:
    """Whether the chat template can do what the thinking policy asks (see ChatFormatter.check_thinking_policy);
    `run`, `enqueue` and the generate workers refuse the same configurations with the same message."""
    check = ChatFormatter(tokenizer).check_thinking_policy(policy)
    return (Check.passed if check.ok else Check.failed)("chat template thinking", check.message)
