"""The canary of a shard: which samples it recomputes (picked while the shard's states stream past), and the
check itself.

Drawn from the shard id, so a re-delivered task checks the same ones; preferably from the samples that followed
another in their forward pass (the first sequence of a pass sees nothing before it, so a leak between sequences
could not show in it) and are no longer than the shard's median, which keeps one canary below an average
sample's cost (a sample alone computes a little less efficiently than in a pack). Whether a sample followed
another is known only once its pass ran, so the picker ranks every offered sample and keeps copies of the states
of the best `count` seen so far: never more than `count` samples' states, whatever the shard size.

A mismatch is checked again before it fails the shard, both sides recomputed: the shard's samples run through the
engine again as the task ran them (`recompute`; their states replace the first pass's as they arrive), and the
canary samples alone again. The second comparison decides: a fault of the engine, or of the batch (two requests'
states swapped), recurs and fails the shard; a one-off flake on either side does not, and the shard is stored with
the states of the pass that was checked.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_queue import faults
from dflash_queue.engines.base import ExtractEngine, ExtractionRequest
from dflash_queue.engines.state_checks import CanaryMismatch, CanaryTolerance, StateDifference, check_canary

log = logging.getLogger(__name__)

# Verdicts: every canary sample matched, and at least one of them followed another sequence in its pass (where a
# leak would show); or they matched but none did, so a leak between sequences could not have shown.
PASSED = "pass"
UNTESTABLE = "untestable"


class CanaryPicker:
    def __init__(self, shard_id: str, lengths: Sequence[int], count: int) -> None:
        self.count = count
        self.lengths = list(lengths)
        self.median = sorted(self.lengths)[(len(self.lengths) - 1) // 2] if self.lengths else 0
        order = list(range(len(self.lengths)))
        random.Random(shard_id).shuffle(order)
        self._rank = {index: rank for rank, index in enumerate(order)}
        self._kept: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self._positions: dict[int, int] = {}

    def offer(self, index: int, states: torch.Tensor, pass_position: int) -> None:
        """Keep a copy of `states` if the sample is among the best `count` candidates offered so far."""
        if self.count <= 0:
            return
        follower = pass_position > 0
        tier = 0 if follower and self.lengths[index] <= self.median else 1 if follower else 2
        key = (tier, self._rank[index])
        if len(self._kept) >= self.count:
            worst = max(self._kept, key=lambda i: self._kept[i][0])
            if key >= self._kept[worst][0]:
                return
            del self._kept[worst]
        # A copy: a view would keep its whole forward pass's states alive.
        self._kept[index] = (key, states.clone())
        self._positions[index] = pass_position

    def chosen(self, ok: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(index, states, position in its pass) of the kept samples still in the shard, in shard order."""
        allowed = set(ok)
        return [(i, states, self._positions[i]) for i, (_, states) in sorted(self._kept.items()) if i in allowed]


@dataclass(frozen=True)
class CanaryOutcome:
    record: dict[str, Any]  # the shard's `canary` metadata
    samples: int  # samples recomputed alone (the window canary's sequence included)
    worst: float  # the largest relative error over the whole sample, any layer
    untestable: bool
    window: bool  # a sequence longer than the model's window or chunk was checked


# Runs the shard's samples through the engine again as its task ran them, handing each one's states (shard index,
# [T, K, H]) to the callback once the lane has stored them in place of the first pass's.
Recompute = Callable[[Callable[[int, torch.Tensor], None]], None]


def window_canary_due(shard_id: str, every: int) -> bool:
    """Whether this shard's canary also checks a sequence longer than the model's window (one shard in `every`,
    drawn from the shard id, so a re-delivery does the same)."""
    if every <= 0:
        return False
    return int.from_bytes(hashlib.sha256(shard_id.encode()).digest()[:8], "little") % every == 0


def run_canary(
    engine: ExtractEngine,
    shard_id: str,
    requests: Sequence[ExtractionRequest],
    chosen: Sequence[tuple[int, torch.Tensor, int]],
    ok: Sequence[int],
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
    window_every: int,
    recompute: Recompute | None = None,
) -> CanaryOutcome | None:
    """Recompute the chosen samples alone and compare (raises CanaryMismatch above the tolerance; after a re-check
    through `recompute` when given); on the shards `window_canary_due` picks, also a sequence longer than the
    model's window, after another one in one pass."""
    if not chosen:
        return None
    rechecks: list[dict[str, Any]] = []
    compared = _compare_alone(engine, requests, chosen, layer_names, tolerance)
    if isinstance(compared, CanaryMismatch):
        if recompute is None:
            raise compared
        compared, recheck = _recheck(engine, requests, chosen, layer_names, tolerance, recompute, compared)
        rechecks.append(recheck)
    checked = [
        (requests[index].sample_id, difference, position) for (index, _, position), difference in zip(chosen, compared)
    ]
    window = None
    if engine.coverage_length() and window_canary_due(shard_id, window_every):
        window = _window_canary(engine, shard_id, [requests[i] for i in ok], layer_names, tolerance)
        checked.append((window["sample"], window.pop("difference"), window["position"]))
        if "recheck" in window:
            rechecks.append(window["recheck"])
    differences = [d for _, d, _ in checked]
    per_layer = [max(d.relative[k] for d in differences) for k in range(len(layer_names))]
    followers = sum(1 for _, _, position in checked if position > 0)
    record = {
        "samples": [sample for sample, _, _ in checked[: len(chosen)]],
        "relative_error": max(per_layer),
        "relative_error_per_layer": per_layer,
        "head_error": max(d.worst_head for d in differences),
        "worst_token_error": max(max(d.worst_token) for d in differences),
        **tolerance.to_metadata(),
        "followers": followers,
        "verdict": PASSED if followers else UNTESTABLE,
    }
    if window is not None:
        record["window"] = window
    if rechecks:
        record["rechecks"] = rechecks
    return CanaryOutcome(record, len(checked), max(per_layer), not followers, window is not None)


def _compare_alone(
    engine: ExtractEngine,
    requests: Sequence[ExtractionRequest],
    chosen: Sequence[tuple[int, torch.Tensor, int]],
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
) -> list[StateDifference] | CanaryMismatch:
    """Each chosen sample's states against it alone, up to the first mismatch (returned, not raised)."""
    differences = []
    for index, states, _ in chosen:
        try:
            differences.append(_check_alone(engine, requests[index], states, layer_names, tolerance))
        except CanaryMismatch as mismatch:
            return mismatch
    return differences


def _recheck(
    engine: ExtractEngine,
    requests: Sequence[ExtractionRequest],
    chosen: Sequence[tuple[int, torch.Tensor, int]],
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
    recompute: Recompute,
    first: CanaryMismatch,
) -> tuple[list[StateDifference], dict[str, Any]]:
    """Both sides again after `first`: the shard's pass (whose states the lane stores in place of the first
    pass's) and each chosen sample alone. Raises CanaryMismatch when a mismatch recurs."""
    wanted = {index for index, _, _ in chosen}
    again: dict[int, torch.Tensor] = {}

    def keep(index: int, states: torch.Tensor) -> None:
        if index in wanted:
            again[index] = states.clone()  # a copy: a view would keep its whole pass's states alive

    recompute(keep)
    missing = [requests[i].sample_id for i in sorted(wanted - set(again))]
    if missing:
        raise CanaryMismatch(f"{first}; its recomputation handed back no states for {', '.join(missing)}")
    rechecked = [(index, again[index], position) for index, _, position in chosen]
    compared = _compare_alone(engine, requests, rechecked, layer_names, tolerance)
    if isinstance(compared, CanaryMismatch):
        raise CanaryMismatch(f"{compared} (checked twice, both sides recomputed)") from first
    worst = max(d.worst for d in compared)
    log.warning("%s; not again with the shard's pass and the sample alone recomputed (worst %.2e): a one-off, the "
                "shard is stored with the recomputed pass's states", first, worst)
    return compared, {"first": str(first), "again": worst}


def _check_alone(
    engine: ExtractEngine,
    request: ExtractionRequest,
    states: torch.Tensor,
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
) -> StateDifference:
    """`states` against the request run alone (raises CanaryMismatch above the tolerance), compared on the device:
    the states of a long sample are large for the host."""
    alone = engine.reference_states(request, on_device=True)
    return check_canary(request.sample_id, states.to(engine.device), alone, layer_names, tolerance)


def _window_canary(
    engine: ExtractEngine,
    shard_id: str,
    requests: Sequence[ExtractionRequest],
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
) -> dict[str, Any]:
    """A sequence longer than the model's window or chunk: the shortest of the shard's that is, else the shard's
    sequences joined until one is; run after the shard's shortest sequence in one pass, then alone (both again
    after a mismatch)."""
    reach = engine.coverage_length()
    long_enough = sorted((r for r in requests if len(r.input_ids) > reach), key=lambda r: len(r.input_ids))
    if long_enough:
        ids = list(long_enough[0].input_ids)
    else:
        ids = []
        for request in requests:
            ids += request.input_ids
            if len(ids) > reach:
                break
        ids = (ids * (reach // max(len(ids), 1) + 1))[: reach + 1] if len(ids) <= reach else ids
    target = ExtractionRequest(f"{shard_id}:window", ids)
    before = min(requests, key=lambda r: len(r.input_ids))
    together = [before, target] if len(before.input_ids) + len(ids) <= engine.pass_tokens else [target]
    position = len(together) - 1

    def in_a_pass() -> torch.Tensor:
        with faults.extract_faults_applied(faults.extract_faults()):
            return engine.run_together(together)[position].states

    recheck = None
    try:
        difference = _check_alone(engine, target, in_a_pass(), layer_names, tolerance)
    except CanaryMismatch as first:
        try:
            difference = _check_alone(engine, target, in_a_pass(), layer_names, tolerance)
        except CanaryMismatch as again:
            raise CanaryMismatch(f"{again} (checked twice, both sides recomputed)") from first
        recheck = {"first": str(first), "again": difference.worst}
    window: dict[str, Any] = {
        "sample": target.sample_id,
        "tokens": len(ids),
        "reach": reach,
        "position": position,
        "relative_error": difference.worst,
        "head_error": difference.worst_head,
        "difference": difference,
    }
    if recheck is not None:
        window["recheck"] = recheck
    return window
