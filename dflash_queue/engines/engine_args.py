"""`[generate.vllm.engine_args]` and `[extract.vllm.engine_args]`: any of vLLM's engine arguments, checked against
the installed vLLM's `AsyncEngineArgs` when the config loads, and which of them change what the engine outputs.

A key must be a field of `AsyncEngineArgs` (else the nearest field is named) and its TOML value must have the
field's type, read the way vLLM's own command line reads a JSON value (strict: no "4096" for an integer). Two
values get a closer look because a mistake there would only surface when the engine starts: the keys of
`speculative_config` (fields of vLLM's `SpeculativeConfig`) and `quantization` (one of vLLM's methods). Keys the
project sets itself are refused, each lane with its reasons (`GENERATE_REFUSED`, `EXTRACT_REFUSED`). Without
vLLM installed (a node that never runs a vLLM lane) only the refusals are checked.

vLLM is imported here only when a table is not empty.
"""

from __future__ import annotations

import difflib
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

# Error type of a problem with one key of a table: `ctx["key"]` extends the dotted key the config error names.
NESTED_KEY_ERROR = "nested_key"

# Set from the section's own keys or by the project, in both lanes.
_COMMON_REFUSED = {
    "model": "the project sets it from model.path",
    "tokenizer": "the project sets it from model.tokenizer",
    "served_model_name": "the project sets it from model.name",
    "tensor_parallel_size": "set {lane}.vllm.tensor_parallel_size (the worker's GPU group follows it)",
    "dtype": "set {lane}.vllm.dtype",
    "max_model_len": "set {lane}.vllm.max_model_len",
    "gpu_memory_utilization": "set {lane}.vllm.gpu_memory_utilization",
    "max_num_seqs": "set {lane}.vllm.max_num_seqs",
    "max_num_batched_tokens": "set {lane}.vllm.max_num_batched_tokens",
    "enforce_eager": "set {lane}.vllm.enforce_eager",
    "kv_cache_memory_bytes": "set {lane}.vllm.kv_cache_memory_gib",
    "disable_log_stats": "set {lane}.vllm.log_stats_interval_s (0 turns vLLM's statistics off)",
    "enable_chunked_prefill": "set {lane}.vllm.enable_chunked_prefill",
    "language_model_only": "the project sets it for multimodal checkpoints: prompts are text",
    "spec_method": "a shorthand of speculative_config: write speculative_config = {{ method = ... }}",
    "spec_model": "a shorthand of speculative_config: write speculative_config = {{ model = ... }}",
    "spec_tokens": "a shorthand of speculative_config: write speculative_config = {{ num_speculative_tokens = ... }}",
}
GENERATE_REFUSED = {
    **{key: reason.format(lane="generate") for key, reason in _COMMON_REFUSED.items()},
    "seed": "set generate.vllm.seed (every request also carries its own seed, from generate.sampling.seed)",
    "enable_prefix_caching": "set generate.vllm.enable_prefix_caching",
}
EXTRACT_REFUSED = {
    **{key: reason.format(lane="extract") for key, reason in _COMMON_REFUSED.items()},
    "seed": "the extract lane's requests are greedy prefills: no seed changes them",
    "enable_prefix_caching": "always off in the extract lane: a cached prefix is not recomputed, and its states "
    "would be missing (vLLM #44485)",
    "speculative_config": "the extract lane runs vLLM's extract_hidden_states method, set by the project",
    "kv_transfer_config": "the extract lane hands states over through its own KV connector, set by the project",
    "kv_cache_dtype": "set extract.vllm.kv_cache_dtype (quantized caches are refused there)",
    "pipeline_parallel_size": "set extract.vllm.pipeline_parallel_size (which must be 1)",
}

# Engine arguments that change how fast the engine runs, the memory it takes, where it runs and what it logs, but
# not which tokens it generates or which states it computes. Every other key of engine_args enters the run's
# fingerprint (Config.output_settings) and the training shards' metadata.
OPERATIONAL = frozenset({
    "async_scheduling", "block_size", "collect_detailed_traces", "compilation_config", "cpu_offload_gb",
    "cudagraph_capture_sizes", "data_parallel_size", "disable_custom_all_reduce", "distributed_executor_backend",
    "download_dir", "enable_log_requests", "kv_cache_metrics", "load_format", "log_level",
    "long_prefill_token_threshold", "max_cudagraph_capture_size", "max_num_scheduled_tokens",
    "max_parallel_loading_workers", "num_gpu_blocks_override", "numa_bind", "otlp_traces_endpoint",
    "performance_mode", "safetensors_load_strategy", "scheduling_policy", "stream_interval", "use_tqdm_on_load",
})  # fmt: skip


def output_args(engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments that may change what the engine outputs (all but `OPERATIONAL`), sorted by name."""
    return {key: engine_args[key] for key in sorted(engine_args) if key not in OPERATIONAL}


def speculative_method(engine_args: Mapping[str, Any]) -> str:
    """The speculative decoding method engine_args asks for ("" when none)."""
    spec = engine_args.get("speculative_config")
    return str(spec.get("method") or "") if isinstance(spec, Mapping) else ""


def key_error(key: str, message: str) -> PydanticCustomError:
    """A problem with one key of a table, reported under the table's dotted key extended by `key`."""
    return PydanticCustomError(NESTED_KEY_ERROR, "{message}", {"key": key, "message": message})


def check_engine_args(engine_args: Mapping[str, Any], refused: Mapping[str, str]) -> None:
    """Raise `key_error` for the first key the project sets itself, that vLLM does not know, or whose value does
    not have the argument's type."""
    if not engine_args:
        return  # nothing to check: vLLM, slow to import, stays unimported in processes that never start it
    for key in engine_args:
        if key in refused:
            raise key_error(key, f"not settable here: {refused[key]}")
    fields = engine_arg_types()
    if fields is None:
        return
    for key, value in engine_args.items():
        if key not in fields:
            raise key_error(key, f"not an engine argument of vLLM {_vllm_version()}{_nearest(key, fields)}")
        problem = type_problem(fields[key], value)
        if problem:
            raise key_error(key, problem)
    spec = engine_args.get("speculative_config")
    if isinstance(spec, Mapping):
        spec_fields = _speculative_fields()
        for name in spec:
            if name not in spec_fields:
                raise key_error(
                    f"speculative_config.{name}",
                    f"not a field of vLLM's SpeculativeConfig{_nearest(name, spec_fields)}",
                )
        if spec.get("rejection_sample_method") == "synthetic":
            raise key_error(
                "speculative_config.rejection_sample_method",
                "'synthetic' accepts drafts at fixed rates, not by the target's probabilities: the replies would "
                "not be the target's",
            )
    quantization = engine_args.get("quantization")
    if isinstance(quantization, str):
        methods = _quantization_methods()
        if methods and quantization not in methods:
            raise key_error("quantization", f"{quantization!r} is not a quantization method of vLLM "
                            f"{_vllm_version()}{_nearest(quantization, methods)}")


@functools.cache
def engine_arg_types() -> dict[str, Any] | None:
    """`AsyncEngineArgs`' fields and their types (None without vLLM)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return None
    return {field.name: field.type for field in dataclasses.fields(AsyncEngineArgs) if not field.name.startswith("_")}


@functools.cache
def _speculative_fields() -> tuple[str, ...]:
    import dataclasses

    from vllm.config import SpeculativeConfig

    return tuple(field.name for field in dataclasses.fields(SpeculativeConfig))


@functools.cache
def _quantization_methods() -> tuple[str, ...]:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return ()
    return tuple(QUANTIZATION_METHODS)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _nearest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def type_problem(annotation: Any, value: Any) -> str | None:
    """Why `value` (as TOML gives it) is not of the type `annotation`, read as vLLM reads a JSON argument; None when
    it is, or when the type is one pydantic cannot check (a class, a callable, a name vLLM leaves unresolved)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return f"{value!r} is not a plain value (a string, number, boolean, array or table)"
    members = _union_members(annotation)
    for member in members:
        if _accepts(member, value, text):
            return None
    options = [str(a) for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
    hint = _nearest(value, options) if isinstance(value, str) else ""
    return f"expected {' or '.join(_type_name(m) for m in members)}, got {value!r}{hint}"


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for m in typing.get_args(annotation) if m is not type(None))
    return (annotation,)


def _accepts(member: Any, value: Any, text: str) -> bool:
    if isinstance(member, type) and issubclass(member, enum.Enum):
        return any(value in (item.name, item.value) for item in member)
    adapter = _adapter(member)
    if adapter is None:
        return True  # a type pydantic cannot check: vLLM checks it when the engine starts
    try:
        adapter.validate_json(text, strict=True)
    except ValidationError:
        return False
    except Exception:  # a type pydantic could not resolve (a forward reference vLLM leaves)
        return True
    return True


@functools.cache
def _adapter(member: Any) -> TypeAdapter | None:
    for config in (None, ConfigDict(arbitrary_types_allowed=True)):
        try:
            return TypeAdapter(member, config=config)
        except Exception:  # pydantic cannot build a schema for an arbitrary or unresolved type
            continue
    return None


def _type_name(member: Any) -> str:
    if typing.get_origin(member) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(member))
    if typing.get_args(member) or not isinstance(member, type):
        return str(member).replace("typing.", "")
    return member.__name__
