"""Fault injection for the test suite: the faults a test installs, and the hooks in the lanes that obey them.

Faults are never read from the environment of a worker: the test harness installs them, in the test process
(`install`) or in a worker it starts through `dfq_testing.faulty_worker`, which reads them from
`DFQ_INJECT_FAULTS` and installs them before the worker starts. A production worker, or `dflash-queue run`, finding
`DFQ_INJECT_FAULTS` set refuses to start (`refuse_uninstalled`), and every training shard made while a fault was
installed says so in its metadata (`injected_faults`). The faults, a JSON object:

  {"extract_poison": ["<sample id>", ...]}   the extract engine "crashes" on any batch holding one of these
  {"generate_poison": ["<sample id>", ...]}  the same for the generate engine
  {"task_delay_s": 2.0}                      every lane task sleeps this long before its work
  {"task_delay_s": [0.0, 1.5]}               ... a random time between these
  {"kill_on_shards": ["<shard id>", ...]}    the worker SIGKILLs itself when a task for one of these starts
  {"extract_break_packing": true}           the extract lane's packed sequences see each other (after the
                                            engine's load probe), so that the run-time canary must catch it;
  {"extract_break_packing": ["<shard id>", ...]}   the same on these shards only
  {"extract_ignore_window": true}           the extract lane's packed attention ignores sliding windows (after the
                                            load probe): only a sequence longer than the window shows it
  {"extract_leak_head": {"relative": 1e-3, "tokens": 8}}
                                            a state carried across a pack boundary: the first tokens of every
                                            sequence that follows another in its pass get this share of the
                                            previous sequence's last state (after the load probe)
  {"extract_vllm_states": {"zero": [id], "constant": [id], "drop_tail": [id], "shift": [id],
                           "swap": [[id, id]], "other_tokens": [id], "nonfinite": {id: "nan" | "inf" | "-inf"}}}
                                            the vLLM engine's KV connector zeroes, makes constant, leaves the last
                                            half unwritten, shifts by one token or swaps these samples' states, or
                                            hands them over with other token ids, or puts a NaN or an infinity in
                                            one of their values before it computes their statistics (never in the
                                            canary's reruns alone), so that the checks that must catch such bugs
                                            are seen to
  {"extract_vllm_states": {"slot_offset": 1}}
                                            the connector reads every request's rows one slot on (canary reruns
                                            included): an error the same batched and alone, for the load-time
                                            comparison with the checkpoint's own Transformers forward to refuse
  {"extract_vllm_states": {"flake": [id], "flake_canary": [id]}}
                                            these samples' states shifted by one token once: the first time they
                                            are handed over in a batch (`flake`), or rerun alone by the canary
                                            (`flake_canary`); never again while the engine runs

With nothing installed (always, in production), every hook is a no-op.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from dflash_queue.errors import ConfigError, SampleDependentError

ENV = "DFQ_INJECT_FAULTS"

_installed: dict[str, Any] = {}


def install(faults: dict[str, Any]) -> None:
    """Make `faults` active in this process (the test harness's call; see the module docstring)."""
    if not isinstance(faults, dict):
        raise ValueError(f"faults must be a JSON object, got {faults!r}")
    _installed.clear()
    _installed.update(faults)


def uninstall() -> None:
    _installed.clear()


def installed() -> dict[str, Any]:
    """The faults active in this process ({} in production)."""
    return dict(_installed)


def install_from_environment() -> None:
    """The test harness's worker wrapper: install what `DFQ_INJECT_FAULTS` names."""
    text = os.environ.get(ENV, "")
    install(json.loads(text) if text else {})


def refuse_uninstalled() -> None:
    """A worker or run started with `DFQ_INJECT_FAULTS` in its environment, outside the test harness: refused."""
    if os.environ.get(ENV) and not _installed:
        raise ConfigError(
            f"{ENV} is set: fault injection exists for the test suite only (its workers install the faults "
            f"through dfq_testing.faulty_worker); unset {ENV} to run this worker"
        )


def _faults() -> dict[str, Any]:
    return _installed


class InjectedFault(SampleDependentError):
    """A crash the fault-injection hook caused on purpose."""


def check_poison(lane: str, sample_ids: Iterable[str]) -> None:
    poison = set(_faults().get(f"{lane}_poison", ()))
    if not poison:
        return
    hit = tuple(i for i in sample_ids if i in poison)
    if hit:
        raise InjectedFault(f"injected {lane} engine crash on sample(s) {', '.join(hit)}", sample_ids=hit)


def task_delay() -> None:
    configured = _faults().get("task_delay_s", 0)
    if isinstance(configured, (list, tuple)):  # [low, high]: a random delay between them
        delay = random.uniform(float(configured[0]), float(configured[1]))
    else:
        delay = float(configured)
    if delay > 0:
        time.sleep(delay)


@dataclass(frozen=True)
class ExtractFaults:
    """What the Transformers extract engine does wrong on purpose in its shared passes (never in a sequence run
    alone, the canary's reference)."""

    break_packing: bool = False  # the sequences of a pack see each other
    # (share of the previous sequence's last state, tokens) added to the first tokens of every follower
    head_leak: tuple[float, int] | None = None
    ignore_window: bool = False  # packed attention ignores the layers' sliding window

    def __bool__(self) -> bool:
        return self.break_packing or self.head_leak is not None or self.ignore_window


def extract_faults(shard_id: str = "") -> ExtractFaults:
    """The Transformers engine's faults for a capture of `shard_id` ("": not a shard's own capture)."""
    found = _faults()
    leak = found.get("extract_leak_head")
    breaking = found.get("extract_break_packing", False)
    return ExtractFaults(
        break_packing=shard_id in breaking if isinstance(breaking, list) else bool(breaking),
        head_leak=(float(leak.get("relative", 1e-3)), int(leak.get("tokens", 8))) if leak else None,
        ignore_window=bool(found.get("extract_ignore_window", False)),
    )


_APPLIED_EXTRACT_FAULTS: ContextVar[ExtractFaults | None] = ContextVar("dfq_extract_faults", default=None)


@contextmanager
def extract_faults_applied(injected: ExtractFaults | None) -> Iterator[None]:
    """The Transformers extract engine's passes do `injected` wrong within this block, in this thread (the lane
    wraps a shard's capture and the canary's shared pass in it); the engine's calls take no faults of their own."""
    token = _APPLIED_EXTRACT_FAULTS.set(injected or None)
    try:
        yield
    finally:
        _APPLIED_EXTRACT_FAULTS.reset(token)


def applied_extract_faults() -> ExtractFaults | None:
    """What the Transformers extract engine's shared passes do wrong now (`extract_faults_applied`); None normally."""
    return _APPLIED_EXTRACT_FAULTS.get()


def vllm_states_faults() -> dict:
    """What the extract lane's vLLM connector alters (see engines/vllm/states_connector.py); {} normally."""
    faults = _faults().get("extract_vllm_states", {})
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV}: extract_vllm_states must be a JSON object, got {faults!r}")
    return faults


def maybe_kill(shard_id: str) -> None:
    if shard_id and shard_id in set(_faults().get("kill_on_shards", ())):
        os.kill(os.getpid(), signal.SIGKILL)
