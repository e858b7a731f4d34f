"""Fault injection for fault tests and drills: faults named in the `DFQ_INJECT_FAULTS` environment variable.

A JSON object, read once per process:
  {"extract_poison": ["<sample id>", ...]}   the extract engine "crashes" on any batch holding one of these
  {"generate_poison": ["<sample id>", ...]}  the same for the generate engine
  {"task_delay_s": 2.0}                      every lane task sleeps this long before its work
  {"kill_on_shards": ["<shard id>", ...]}    the worker SIGKILLs itself when a task for one of these starts
  {"extract_break_packing": true}           the extract lane's packed sequences see each other (after the
                                            engine's load probe), so that the run-time canary must catch it
  {"extract_vllm_states": {"zero": [id], "constant": [id], "drop_tail": [id], "shift": [id],
                           "swap": [[id, id]], "other_tokens": [id]}}
                                            the vLLM engine's KV connector zeroes, makes constant, leaves the last
                                            half unwritten, shifts by one token or swaps these samples' states, or
                                            hands them over with other token ids (never in the canary's reruns
                                            alone), so that the checks that must catch such bugs are seen to

Unset (always, in production), every check is a no-op.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from functools import cache

from dflash_queue.errors import SampleDependentError

ENV = "DFQ_INJECT_FAULTS"


class InjectedFault(SampleDependentError):
    """A crash the fault-injection hook caused on purpose."""


@cache
def _faults() -> dict:
    text = os.environ.get(ENV, "")
    if not text:
        return {}
    faults = json.loads(text)
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV} must be a JSON object, got {text!r}")
    return faults


def check_poison(lane: str, sample_ids: Iterable[str]) -> None:
    poison = set(_faults().get(f"{lane}_poison", ()))
    if not poison:
        return
    hit = tuple(i for i in sample_ids if i in poison)
    if hit:
        raise InjectedFault(f"injected {lane} engine crash on sample(s) {', '.join(hit)}", sample_ids=hit)


def task_delay() -> None:
    delay = float(_faults().get("task_delay_s", 0))
    if delay > 0:
        time.sleep(delay)


def packing_broken() -> bool:
    return bool(_faults().get("extract_break_packing", False))


def vllm_states_faults() -> dict:
    """What the extract lane's vLLM connector alters (see engines/vllm_states_connector.py); {} normally."""
    faults = _faults().get("extract_vllm_states", {})
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV}: extract_vllm_states must be a JSON object, got {faults!r}")
    return faults


def maybe_kill(shard_id: str) -> None:
    if shard_id and shard_id in set(_faults().get("kill_on_shards", ())):
        os.kill(os.getpid(), signal.SIGKILL)
