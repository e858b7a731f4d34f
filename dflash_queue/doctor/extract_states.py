"""The vLLM extract engine started as a worker starts it, for `doctor`: its canary calibrated, and its states of a
probe batch compared at every captured entry with the checkpoint's own Transformers forward (engines/reference/check.py),
which it refuses to start beyond the dtype's rounding; with that comparison turned off, the check warns. Only when extract.engine = "vllm" and the checkpoint's weights are on this
node; it takes what a worker's engine takes (its GPUs, its memory), so `doctor --skip-engine-start` leaves it out
on a node whose workers already hold them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_queue.doctor.result import Check
from dflash_queue.engines.config import ModelConfig
from dflash_queue.lanes.config import ExtractConfig

NAME = "extract engine states"


def has_weights(model_path: str) -> bool:
    path = Path(model_path)
    return path.is_dir() and any(path.glob("*.safetensors"))


def check_extract_states(extract: ExtractConfig, model: ModelConfig, start: Callable[[], Any]) -> Check | None:
    """The engine started (`start`: the vLLM extract engine, as a worker builds it) and closed again; None without
    weights."""
    if extract.engine != "vllm" or not has_weights(model.path):
        return None
    from dflash_queue.errors import UnsupportedArchitecture

    try:
        engine = start()
    except UnsupportedArchitecture as exc:
        return Check.failed(NAME, str(exc))
    except Exception as exc:
        return Check.failed(NAME, f"the vLLM extract engine did not start: {type(exc).__name__}: {exc}")
    try:
        if engine.reference is None:  # compared nothing: not a pass
            return Check.warned(NAME, describe_engine(engine))
        return Check.passed(NAME, describe_engine(engine))
    finally:
        engine.close()


def describe_engine(engine: Any) -> str:
    """What a started vLLM extract engine found at load: its states against the checkpoint's own forward, and the
    canary's calibrated tolerance."""
    tolerance = engine.canary_tolerance()
    reference = engine.reference
    compared = (
        f"as the checkpoint's own: {reference.describe()}" if reference is not None
        else "its states were compared with nothing: extract.vllm.reference_check = false leaves an error the same "
        "batched and alone (a layer or token off by one, rows from the wrong cache slots) to the run-time audit"
    )
    return (
        f"{compared}; canary tolerance {tolerance.whole:.2e} (probe sequences batched vs alone: "
        f"{engine.calibrated_noise:.2e} at most)"
    )
