"""Build a tiny, random-weight Qwen3 model and tokenizer entirely offline.

``build_tiny_model(out_dir)`` writes a ``Qwen3ForCausalLM`` checkpoint (float32 safetensors, with the
``model.safetensors.index.json`` that tools reading a target's weights by name look for), a byte-level
BPE tokenizer trained on an embedded corpus, a Qwen3-style chat template and a generation config. Nothing is
downloaded.

The weights are random (transformers' default initialisation, seeded), with three changes:

* every token embedding shares a common random component (``_SHARED_EMBEDDING_SCALE`` times the mean
  embedding norm; trained models have such a component too). It gives the final hidden states a common
  direction, which acts as the bias the output head lacks and lets the EOS calibration below work even
  with one or two layers. It also makes next-token distributions depend less on the context;
* ordinary ``lm_head`` rows are drawn with a larger standard deviation than the rest of the network
  (logit std ``LOGIT_STD``), so next-token distributions are peaked (on-policy top-1 probability
  ~0.1-0.3 depending on the seed, rather than 1/vocab);
* the ``<|im_end|>`` (EOS) row is calibrated on the model's own temperature-1.0 samples: a least-squares
  fit whose logit tracks the log-sum-exp of the other logits plus a multiple of a fitted "bias" row
  (logit ~1 in every state), the multiple chosen so that the mean per-step EOS probability over the
  sampled states is ``eos_stop_probability``. The per-step probability then barely varies between states,
  so sampled completions have roughly geometric lengths with mean ~1/p (for p=0.03: mean ~34 tokens,
  ~14% longer than 64 tokens, well under 1% longer than 256). Greedy decoding seldom picks EOS (its
  probability is rarely the largest) and mostly runs to the length limit. ``<|endoftext|>`` and
  ``<|im_start|>`` rows get the same treatment with a per-step probability of 1e-6, so, as in a trained
  chat model, they are practically never generated.

Byte-identical output for the same arguments holds on the same machine and software versions; the
calibrated rows are rounded to a 2**-10 grid so that, in practice, the torch thread count does not matter.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "INDEX_FILE",
    "MARKER_FILE",
    "TINY_CORPUS",
    "build_tiny_model",
    "is_complete_build",
]

#: Bump when the produced files change for the same arguments; an existing build made by another version is
#: not reused (``build_tiny_model`` raises unless ``overwrite=True``).
BUILDER_VERSION = 1

#: Written last into a finished build; its presence (with matching parameters) marks the build complete.
MARKER_FILE = "tiny_model_build.json"

#: The checkpoint's index (tensor name -> file), as a sharded checkpoint has; added to a build made without it.
INDEX_FILE = "model.safetensors.index.json"

#: Total tokenizer size including the added tokens (a multiple of 64, so the model's vocab_size equals it).
TOKENIZER_VOCAB_SIZE = 1536

HEAD_DIM = 64
MAX_POSITION_EMBEDDINGS = 4096
ROPE_THETA = 1_000_000.0
#: Standard deviation of the output logits of ordinary tokens (before the EOS row is calibrated).
LOGIT_STD = 2.5

#: (content, special) in id order, appended after the BPE vocabulary the way Qwen3 does it. ``special``
#: follows Qwen3: ``<think>``/``</think>`` and the tool tags are added tokens that are *not* special, so
#: ``decode(..., skip_special_tokens=True)`` keeps them.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Same pre-tokenization regex as the Qwen2/Qwen3 tokenizers.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Training text for the tokenizer: chat, reasoning, math, code and prose (about 9 KB).
TINY_CORPUS = (Path(__file__).with_name("tiny_corpus.txt")).read_text(encoding="utf-8")

# A Qwen3-style chat template (same rendering rules as the official Qwen3 one):
# * ``<|im_start|>{role}\n{content}<|im_end|>\n`` per turn; a leading system message (or the tool list) first;
# * assistant turns before the last real user query lose their ``<think>...</think>`` reasoning; assistant
#   turns after it (the current turn) keep it, taken from ``reasoning_content`` or split out of ``content``,
#   and the final assistant turn always gets a (possibly empty) think block;
# * tool results are rendered as ``<tool_response>`` blocks inside a user turn, tool calls as ``<tool_call>``;
# * ``add_generation_prompt`` appends ``<|im_start|>assistant\n``, plus ``<think>\n\n</think>\n\n`` when
#   ``enable_thinking`` is false.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Files a finished build must contain besides the marker.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _build_params(num_layers: int, hidden_size: int, seed: int, eos_stop_probability: float) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "num_layers": int(num_layers),
        "hidden_size": int(hidden_size),
        "seed": int(seed),
        "eos_stop_probability": float(eos_stop_probability),
    }


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not all((path / name).is_file() for name in _REQUIRED_FILES):
        return None
    return marker


def is_complete_build(path: str | Path) -> bool:
    """Whether ``path`` holds a finished build (of any parameters)."""
    return _read_marker(Path(path)) is not None


def build_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 6,
    hidden_size: int = 128,
    seed: int = 0,
    eos_stop_probability: float = 0.03,
    overwrite: bool = False,
) -> Path:
    """Build a tiny random-weight Qwen3 model with its tokenizer into ``out_dir`` and return the path.

    If ``out_dir`` already holds a complete build with the same parameters, it is returned at once (unless
    ``overwrite``). A complete build with other parameters, or a non-empty directory that is not a build,
    raises ``FileExistsError`` unless ``overwrite`` is true. The files are written into a temporary directory
    next to ``out_dir`` and renamed into place, so readers never see a half-written build; concurrent builders
    of the same build are fine (the first rename wins).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if hidden_size < HEAD_DIM or hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}, got {hidden_size}")
    if not 0.0 < eos_stop_probability < 0.5:
        raise ValueError(f"eos_stop_probability must be in (0, 0.5), got {eos_stop_probability}")
    params = _build_params(num_layers, hidden_size, seed, eos_stop_probability)

    if not overwrite:
        _check_existing(out_dir, params)
        if _read_marker(out_dir) is not None:
            if not (out_dir / INDEX_FILE).is_file():  # a build from before the index was written
                _write_index(out_dir)
            return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _build_into(tmp, params)
        # The marker goes last: its presence means every other file is complete.
        (tmp / MARKER_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _move_into_place(tmp, out_dir, params, overwrite=overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _check_existing(out_dir: Path, params: dict[str, Any]) -> None:
    """Raise unless ``out_dir`` is absent, empty, or a complete build with ``params``."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    marker = _read_marker(out_dir)
    if marker is None:
        if any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} is not empty and holds no complete tiny-model build")
        return
    if marker != params:
        raise FileExistsError(
            f"{out_dir} holds a tiny-model build with other parameters ({marker}, wanted {params}); "
            "pass overwrite=True (--overwrite) to replace it"
        )


def _move_into_place(tmp: Path, out_dir: Path, params: dict[str, Any], *, overwrite: bool) -> None:
    if out_dir.exists() and (overwrite or not any(out_dir.iterdir())):
        if any(out_dir.iterdir()):
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process finished the same build first: keep theirs if it is what we wanted.
        if _read_marker(out_dir) == params:
            return
        raise


def _build_into(path: Path, params: dict[str, Any]) -> None:
    import torch

    tokenizer = _build_tokenizer()
    # Do not disturb the caller's global RNG state (model init draws from it).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = _build_model(tokenizer, params)
    from transformers.utils import logging as hf_logging

    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 6 MB file
    try:
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    _write_index(path)
    # transformers 5 records its new class name ("TokenizersBackend"); the old alias loads in 4.x and 5.x
    # alike and, unlike a model-specific class such as Qwen2Tokenizer, uses tokenizer.json as it is.
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")
    # mkdtemp makes a private directory, and some writers create private files: use the usual permissions.
    os.chmod(path, 0o755)
    for child in path.iterdir():
        os.chmod(child, 0o644)


def _write_index(path: Path) -> None:
    """The checkpoint's index, as sharded checkpoints have: every tensor -> its file. Tools that read a target's
    weights by name look it up there (SpecForge's EAGLE-3 trainer reads the LM head through it and finds no
    weights without it). Written beside the weights, atomically: readers never see half of it."""
    from safetensors import safe_open

    weights = path / "model.safetensors"
    with safe_open(str(weights), framework="pt") as checkpoint:
        names = sorted(checkpoint.keys())
        total = sum(_tensor_bytes(checkpoint, name) for name in names)
    index = {"metadata": {"total_size": total}, "weight_map": {name: weights.name for name in names}}
    temporary = path / f".{INDEX_FILE}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.chmod(temporary, 0o644)
    os.replace(temporary, path / INDEX_FILE)


def _tensor_bytes(checkpoint, name: str) -> int:
    tensor = checkpoint.get_tensor(name)
    return tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer():
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator([TINY_CORPUS], trainer=trainer)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    if backend.get_vocab_size() != TOKENIZER_VOCAB_SIZE:  # the embedded corpus is rich enough for this
        raise RuntimeError(f"tokenizer has {backend.get_vocab_size()} tokens, expected {TOKENIZER_VOCAB_SIZE}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        chat_template=CHAT_TEMPLATE,
    )
    for content, _ in ADDED_TOKENS:
        ids = tokenizer.encode(content, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"{content!r} encodes to {ids}, expected a single id")
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# Model

# Calibration sampling: this many sequences of this many sampled tokens after fixed-length chat prompts.
_CALIBRATION_SEQUENCES = 48
_CALIBRATION_STEPS = 192
_CALIBRATION_PROMPT_TOKENS = 16
# Mean per-step probability of <|endoftext|> and of <|im_start|> (never emitted by a trained chat model).
_SUPPRESSED_PROBABILITY = 1e-6
# Norm of the component added to every token embedding, relative to the mean norm of an embedding.
_SHARED_EMBEDDING_SCALE = 0.5


def _build_model(tokenizer, params: dict[str, Any]):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    hidden = params["hidden_size"]
    num_layers = params["num_layers"]
    num_heads = max(2, hidden // HEAD_DIM)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=num_layers,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=endoftext_id,
        dtype="float32",
    )
    model: Any = Qwen3ForCausalLM(config)
    model = model.to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eos_id, endoftext_id], pad_token_id=endoftext_id
    )

    with torch.no_grad():
        # A component shared by every token embedding (trained models have one too). It gives the final hidden
        # states a common direction even with very few layers, which the EOS calibration below relies on.
        embeddings = model.model.embed_tokens.weight  # [vocab, hidden]
        shared = torch.randn(hidden)
        shared *= _SHARED_EMBEDDING_SCALE * embeddings.norm(dim=1).mean() / shared.norm()
        embeddings += shared

        weight = model.lm_head.weight  # [vocab, hidden]
        # Peaked next-token distributions: the final RMSNorm makes |h| ~ sqrt(hidden).
        weight.normal_(0.0, LOGIT_STD / math.sqrt(hidden))

        # Sample from the model at temperature 1 with EOS, <|endoftext|> and <|im_start|> masked out.
        # Conditioned on not having stopped, a real generation follows exactly this distribution, so the
        # per-step EOS probability along these trajectories determines the length distribution.
        special_ids = [eos_id, endoftext_id, im_start_id]
        weight[special_ids] = 0.0
        corpus_ids = tokenizer.encode(TINY_CORPUS, add_special_tokens=False)
        prompts = _calibration_prompts(tokenizer, corpus_ids)
        generator = torch.Generator().manual_seed(params["seed"])
        states, rest_lse = _sampled_states(model, prompts, special_ids, generator)

        # Least squares gives a row whose logit tracks the log-sum-exp of the other logits, and a "bias" row
        # whose logit is as close to 1 as possible in every state (the head has no bias; the shared embedding
        # component makes a good one exist). A special token with row ``lse_row + offset * bias_row`` then
        # has roughly the same probability in every state, which gives roughly geometric lengths instead of
        # a few "sticky" states that never stop. The offset is solved by bisection so that the mean
        # probability over the sampled states is the requested one.
        fit = torch.linalg.lstsq(states, torch.stack([rest_lse, torch.ones_like(rest_lse)], dim=1)).solution
        lse_row, bias_row = fit[:, 0], fit[:, 1]
        residual = states @ lse_row - rest_lse
        slope = states @ bias_row
        for token_id, probability, strict in (
            (eos_id, params["eos_stop_probability"], True),
            (endoftext_id, _SUPPRESSED_PROBABILITY, False),
            (im_start_id, _SUPPRESSED_PROBABILITY, False),
        ):
            offset = _solve_offset(residual, slope, probability, strict=strict)
            weight[token_id] = _quantize(lse_row + offset * bias_row).to(weight.dtype)
    return model


def _quantize(values, step: float = 2.0**-10):
    """Round to a coarse grid, so the last-bit differences of reductions run with other thread counts (which
    change the summation order) almost never reach the saved bytes."""
    import torch

    return torch.round(values / step) * step


def _calibration_prompts(tokenizer, corpus_ids: list[int]):
    """Equal-length chat prompts (thinking off) around corpus snippets, as a [sequences, length] tensor."""
    import torch

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head = enc("<|im_start|>user\n")
    tail = enc("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    n = _CALIBRATION_PROMPT_TOKENS
    stride = max(1, (len(corpus_ids) - n) // _CALIBRATION_SEQUENCES)
    rows = [head + corpus_ids[i * stride : i * stride + n] + tail for i in range(_CALIBRATION_SEQUENCES)]
    return torch.tensor(rows, dtype=torch.long)


def _sampled_states(model, prompts, masked_ids: list[int], generator):
    """Sample continuations at temperature 1 with ``masked_ids`` never chosen.

    Returns the final hidden state at every sampled step ([sequences * steps, hidden], float64) and the
    log-sum-exp of the logits of every token except ``masked_ids`` at that step.
    """
    import torch

    hidden, cache = _step(model, prompts, None)
    states, lses = [], []
    for step in range(_CALIBRATION_STEPS):
        logits = model.lm_head(hidden).double()
        logits[:, masked_ids] = float("-inf")
        states.append(hidden.double())
        lses.append(torch.logsumexp(logits, dim=-1))
        if step + 1 < _CALIBRATION_STEPS:
            next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            hidden, cache = _step(model, next_ids, cache)
    return torch.cat(states), torch.cat(lses)


def _step(model, input_ids, cache):
    """Run ``input_ids`` through the decoder; return the last position's final hidden state and the cache."""
    out = model.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    return out.last_hidden_state[:, -1], out.past_key_values


def _solve_offset(base, slope, target: float, *, strict: bool, limit: float = 64.0) -> float:
    """Offset ``c`` in [-limit, limit] with mean(sigmoid(base + c * slope)) == target, to 4 significant digits.

    ``slope`` is close to 1 in most states, so the mean increases with ``c``. When the target cannot be reached
    inside the limits, return the nearest limit, or raise if ``strict``.
    """
    import torch

    def mean_prob(offset: float) -> float:
        return float(torch.sigmoid(base + offset * slope).mean())

    low, high = -limit, limit
    if mean_prob(low) > target or mean_prob(high) < target:
        if strict:
            raise RuntimeError(f"cannot calibrate a mean token probability of {target} for this model")
        return low if mean_prob(low) > target else high
    for _ in range(60):
        mid = 0.5 * (low + high)
        if mean_prob(mid) < target:
            low = mid
        else:
            high = mid
    return float(f"{0.5 * (low + high):.4g}")
