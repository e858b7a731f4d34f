"""The canary of a shard: which samples it recomputes (picked while the shard's states stream past), and the
check itself.

Drawn from the shard id, so a re-delivered task checks the same ones; preferably from the samples that followed
another in their forward pass (the first sequence of a pass sees nothing before it, so a leak between sequences
could not show in it), across the shard's lengths: each shard draws one of `STRATA` length strata (its samples
ranked by length, in equal shares) from its id and prefers followers of that stratum, and one shard in
`longest_every` gives one of its places to its longest sample that followed another (long sequences are prefilled
over several engine steps and meet what short ones never do): on the vLLM engine, where every sequence of a batch
follows another, the shard's longest; on the Transformers engine, which packs the longest sequences first in their
passes, the longest that was packed after another (the longest, where none was). Whether a sample followed another
is known only once its pass ran, so the picker ranks every offered sample and keeps copies of the states of the
best seen so far: never more than `count` samples' states, whatever the shard size.

Each canary sample is compared on the tokens that matter as well as on the whole sample (state_checks.TokenFocus):
its completion tokens (the loss mask, which the lane hands over) and every token past the longest prefix of token
ids it shares with another request of the shard (`shared_prefix`), since up to there two requests compute the same
states and a swap between them cannot show, and a long shared system prompt would dilute one.

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

import numpy as np
import torch

from dflash_queue import faults
from dflash_queue.engines.base import ExtractEngine, ExtractionRequest
from dflash_queue.engines.state_checks import (
    CanaryMismatch,
    CanaryTolerance,
    StateDifference,
    TokenFocus,
    check_canary,
)

log = logging.getLogger(__name__)

# Verdicts: every canary sample matched, and at least one of them followed another sequence in its pass (where a
# leak would show); or they matched but none did, so a leak between sequences could not have shown.
PASSED = "pass"
UNTESTABLE = "untestable"
# The shard's samples ranked by length in this many equal shares; each shard draws one from its id.
STRATA = 4
LONGEST = "longest"


def _drawn(shard_id: str, what: str) -> int:
    """A number drawn from the shard id for one decision (`what`), independent of the other decisions'."""
    return int.from_bytes(hashlib.sha256(f"{what}:{shard_id}".encode()).digest()[:8], "little")


def longest_due(shard_id: str, every: int) -> bool:
    """Whether this shard's canary checks its longest sample (one shard in `every`, drawn from the shard id, so a
    re-delivery does the same)."""
    return every > 0 and _drawn(shard_id, LONGEST) % every == 0


def length_strata(lengths: Sequence[int]) -> list[int]:
    """Each sample's length stratum: 0 for the shortest share of the shard, STRATA - 1 (or fewer strata in a shard
    of fewer samples) for the longest; ties in shard order."""
    strata = min(STRATA, len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    found = [0] * len(lengths)
    for rank, index in enumerate(order):
        found[index] = rank * strata // len(lengths)
    return found


class CanaryPicker:
    def __init__(self, shard_id: str, lengths: Sequence[int], count: int, longest_every: int = 0) -> None:
        self.count = count
        self.lengths = list(lengths)
        order = list(range(len(self.lengths)))
        random.Random(shard_id).shuffle(order)
        self._rank = {index: rank for rank, index in enumerate(order)}
        self._strata = length_strata(self.lengths)
        self.stratum = _drawn(shard_id, "stratum") % max(1, min(STRATA, len(self.lengths)))
        # One place, when due, for the longest sample that followed another (the longest, where none did).
        self.longest_due = count > 0 and bool(self.lengths) and longest_due(shard_id, longest_every)
        self._long: tuple[tuple[int, int, int], int, torch.Tensor] | None = None  # (key, index, states)
        self._kept: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}  # the other places
        self._positions: dict[int, int] = {}

    def offer(self, index: int, states: torch.Tensor, pass_position: int) -> None:
        """Keep a copy of `states` if the sample is among the best candidates offered so far: for the long place
        (when due) followers first, the longest first; for the others followers first, those of the drawn stratum
        before the others. A sample the long place lets go competes for the others with the states already held."""
        if self.count <= 0:
            return
        follower = pass_position > 0
        self._positions[index] = pass_position
        if self.longest_due:
            long_key = (0 if follower else 1, -self.lengths[index], self._rank[index])
            if self._long is None or long_key < self._long[0]:
                let_go, self._long = self._long, (long_key, index, states.clone())  # a copy: see below
                if let_go is None:
                    return
                index, states = let_go[1], let_go[2]
                follower = self._positions[index] > 0
                self._keep(index, states, follower, copied=True)
                return
        self._keep(index, states, follower, copied=False)

    def _keep(self, index: int, states: torch.Tensor, follower: bool, *, copied: bool) -> None:
        places = self.count - (1 if self.longest_due else 0)
        if places <= 0:
            return
        within = self._strata[index] == self.stratum
        key = ((0 if within else 1) + (0 if follower else 2), self._rank[index])
        if len(self._kept) >= places:
            worst = max(self._kept, key=lambda i: self._kept[i][0])
            if key >= self._kept[worst][0]:
                return
            del self._kept[worst]
        # A copy: a view would keep its whole forward pass's states alive.
        self._kept[index] = (key, states if copied else states.clone())

    def chosen(self, ok: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(index, states, position in its pass) of the kept samples still in the shard, in shard order."""
        allowed = set(ok)
        kept = {i: states for i, (_, states) in self._kept.items()}
        if self._long is not None:
            kept[self._long[1]] = self._long[2]
        return [(i, kept[i], self._positions[i]) for i in sorted(kept) if i in allowed]

    @property
    def held(self) -> int:
        """Samples whose states the picker holds."""
        return len(self._kept) + (self._long is not None)

    def describe(self, ok: Sequence[int]) -> dict[str, Any]:
        """How the samples were picked, for the shard's `canary` metadata: the drawn length stratum (0: the
        shortest share) of how many; on a shard due for its longest, the length of the sample in that place and of
        the shard's longest (equal where the longest followed another sequence, or none did)."""
        found: dict[str, Any] = {"stratum": self.stratum, "strata": min(STRATA, len(self.lengths))}
        if self.longest_due and self._long is not None and self._long[1] in ok:
            found["long"] = {"tokens": self.lengths[self._long[1]], "shard_longest": max(self.lengths)}
        return found


def shared_prefix(requests: Sequence[ExtractionRequest], index: int) -> int:
    """The longest prefix of request `index`'s token ids that another request of the shard starts with."""
    ids = np.asarray(requests[index].input_ids, dtype=np.int64)
    longest = 0
    for other, request in enumerate(requests):
        if other == index:
            continue
        n = min(len(ids), len(request.input_ids))
        if n <= longest:
            continue
        differs = np.flatnonzero(ids[:n] != np.asarray(request.input_ids[:n], dtype=np.int64))
        longest = max(longest, int(differs[0]) if differs.size else n)
    return longest


def token_focus(
    requests: Sequence[ExtractionRequest], index: int, loss_masks: Sequence[Any] | None
) -> TokenFocus:
    """The tokens of request `index` that matter: its completion (its loss mask, when the lane gave them) and every
    token past the prefix it shares with another request of the shard."""
    mask = loss_masks[index] if loss_masks is not None else None
    return TokenFocus.of(len(requests[index].input_ids), mask, shared_prefix(requests, index))


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
    *,
    loss_masks: Sequence[Any] | None = None,
    picked: dict[str, Any] | None = None,
) -> CanaryOutcome | None:
    """Recompute the chosen samples alone and compare (raises CanaryMismatch above the tolerance; after a re-check
    through `recompute` when given), on the whole sample, its first tokens and its tokens that matter (`loss_masks`:
    each request's, in request order; `token_focus`); on the shards `window_canary_due` picks, also a sequence
    longer than the model's window, after another one in one pass. `picked`: how the picker chose, recorded."""
    if not chosen:
        return None
    focus = {index: token_focus(requests, index, loss_masks) for index, _, _ in chosen}
    rechecks: list[dict[str, Any]] = []
    compared = _compare_alone(engine, requests, chosen, layer_names, tolerance, focus)
    if isinstance(compared, CanaryMismatch):
        if recompute is None:
            raise compared
        compared, recheck = _recheck(engine, requests, chosen, layer_names, tolerance, recompute, compared, focus)
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
    layers = range(len(layer_names))
    per_layer = [max(d.relative[k] for d in differences) for k in layers]
    token_per_layer = [max(d.focus_token[k] for d in differences) for k in layers]
    followers = sum(1 for _, _, position in checked if position > 0)
    record = {
        "samples": [sample for sample, _, _ in checked[: len(chosen)]],
        "relative_error": max(per_layer),
        "relative_error_per_layer": per_layer,
        "head_error": max(d.worst_head for d in differences),
        "worst_token_error": max(max(d.worst_token) for d in differences),
        # Over each sample's tokens that matter (its completion, and past the prefix it shares with another):
        # the worst single token's relative error, and the relative L2 over them, per layer.
        "token_error": max(token_per_layer),
        "token_error_per_layer": token_per_layer,
        "focus_error_per_layer": [max(d.focus[k] for d in differences) for k in layers],
        "focus_tokens": [d.focus_tokens for d in compared],
        "shared_prefix_tokens": [d.shared_prefix for d in compared],
        **tolerance.to_metadata(),
        "followers": followers,
        "verdict": PASSED if followers else UNTESTABLE,
        **(picked or {}),
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
    focus: dict[int, TokenFocus],
) -> list[StateDifference] | CanaryMismatch:
    """Each chosen sample's states against it alone, up to the first mismatch (returned, not raised)."""
    differences = []
    for index, states, _ in chosen:
        try:
            differences.append(_check_alone(engine, requests[index], states, layer_names, tolerance, focus[index]))
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
    focus: dict[int, TokenFocus],
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
    compared = _compare_alone(engine, requests, rechecked, layer_names, tolerance, focus)
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
    focus: TokenFocus | None = None,
) -> StateDifference:
    """`states` against the request run alone (raises CanaryMismatch above the tolerance), compared on the device:
    the states of a long sample are large for the host."""
    alone = engine.reference_states(request, on_device=True)
    return check_canary(request.sample_id, states.to(engine.device), alone, layer_names, tolerance, focus)


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
        "token_error": difference.worst_focus_token,
        "difference": difference,
    }
    if recheck is not None:
        window["recheck"] = recheck
    return window
