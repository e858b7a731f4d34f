"""The vLLM extract engine's canary tolerance, calibrated when the engine loads on probe sequences batched the way
production batches them.

The canary compares a sample's states from a production batch with the same sample rerun alone. vLLM is not batch
invariant: its kernels tile and reduce differently for other batch shapes, and in bfloat16 a token's expert choice
in a mixture of experts can flip, so the two differ by a noise that depends on the batch the sample shared: how many
sequences, how long, where its prefill was cut into steps of `max_num_batched_tokens`. On vLLM's CPU build in
bfloat16 the dense Qwen3 gives bit-identical states batched and alone; Qwen3-Next (linear attention, experts), in
batches of 16 sequences of the shipped sample job's lengths, differs by a median of 1e-2 and at most 0.13 (160
sequences), where a swapped or one-token-shifted request differs by 1.2-1.5.

So the probes meet what production meets: `PROBES` sequences (at most the engine's `max_num_seqs`) of lengths spread
from short to the engine's context (at most `LONGEST_PROBE` tokens, or one step when a step is longer), so that
together they fill more than two steps and the longer ones are prefilled over several; batched twice: once as one group of requests, and once as several
groups submitted at the same time from different threads, as the lane's concurrent tasks submit them. Each
difference from the sequence alone is one draw of the noise. The tolerance is state_checks.CALIBRATION_FACTOR
times the largest draw, between the dtype's floor and ceiling (TOLERANCE_FLOORS, TOLERANCE_CEILINGS: below what a
swap or a shift gives, whatever the noise); over the first tokens the same noise lands on fewer tokens, so the
head's tolerance is at least the whole sample's. The per-token bound is state_checks.TOKEN_CALIBRATION_FACTOR times
the largest error of any one probe token in any draw (every probe token counts: probes share no prefix and have no
completion), between TOKEN_FLOORS and TOKEN_CEILINGS. Whether the engine computes the model at all is judged on the
median draw, which a systematic batching error moves and the noise's rare large draws do not.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dflash_queue.engines.base import CapturedStates, ExtractionRequest
from dflash_queue.engines.state_checks import NOISE_CEILINGS, CanaryTolerance, StateDifference, compare_states

PROBES = 16
SHORTEST_PROBE = 16
LONGEST_PROBE = 4096


@dataclass(frozen=True)
class Calibration:
    tolerance: CanaryTolerance
    lengths: tuple[int, ...]
    differences: tuple[StateDifference, ...]  # every probe in every round, batched against alone
    seconds: float

    @property
    def typical(self) -> float:
        """The median draw (whole sample)."""
        draws = sorted(d.worst for d in self.differences)
        return draws[(len(draws) - 1) // 2] if draws else 0.0

    def beyond_rounding(self, dtype: torch.dtype) -> bool:
        """A typical probe differs batched from alone by more than the dtype's rounding (NOISE_CEILINGS): the
        batched engine computes something else."""
        return self.typical > NOISE_CEILINGS.get(dtype, 5e-2)


def avoid_single_token_tail(length: int, step_tokens: int) -> int:
    """`length`, or one more when its last prefill step would hold a single token: vLLM's CPU build (0.32) kills the
    engine on such a step of a hybrid target run alone ("tensor must be contiguous", its Gated DeltaNet kernel)."""
    return length + 1 if step_tokens and length > step_tokens and length % step_tokens == 1 else length


def probe_lengths(context: int, step_tokens: int, coverage: int, count: int) -> list[int]:
    """`count` lengths spread geometrically from SHORTEST_PROBE to the longest sequence the engine takes (at most
    LONGEST_PROBE, or one step when a step is longer: together they fill more than two steps, so that some are
    prefilled over several as production's are), and one just past the model's window or chunk (`coverage`) when it
    has one."""
    longest = max(1, min(context - 1, max(LONGEST_PROBE, step_tokens)))
    if step_tokens and longest > step_tokens and longest % step_tokens == 1:
        longest -= 1
    shortest = min(SHORTEST_PROBE, longest)
    count = max(1, count)
    ratio = (longest / shortest) ** (1 / (count - 1)) if count > 1 else 1.0
    lengths = [int(round(shortest * ratio**i)) for i in range(count)]
    if coverage:
        lengths.append(min(coverage + 6, longest))
    return [min(avoid_single_token_tail(length, step_tokens), longest) for length in lengths]


def probe_requests(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[ExtractionRequest]:
    rng = random.Random(seed)
    return [
        ExtractionRequest(f"probe-{i}", [rng.randrange(vocab_size) for _ in range(length)])
        for i, length in enumerate(lengths)
    ]


def calibrate_batched(
    capture: Callable[..., list[CapturedStates]],
    alone: Callable[[ExtractionRequest], torch.Tensor],
    probes: Sequence[ExtractionRequest],
    dtype: torch.dtype,
    *,
    groups: int,
) -> Calibration:
    """The canary's tolerance from `probes` batched (by `capture(requests, deliver=...)`, safe from several threads
    at once) against the same probes `alone`. At most one round of the probes' states is held at a time: the
    first round's until each probe has run alone, then the probes alone while the second round's arrive."""
    started = time.perf_counter()
    first = {p.sample_id: c.states for p, c in zip(probes, capture(probes))}
    differences: list[StateDifference] = []
    references: dict[str, torch.Tensor] = {}
    for probe in probes:
        references[probe.sample_id] = alone(probe)
        differences.append(compare_states(first.pop(probe.sample_id), references[probe.sample_id]))
    reversed_probes = list(reversed(probes))
    size = math.ceil(len(reversed_probes) / max(groups, 1))
    slices = [reversed_probes[i : i + size] for i in range(0, len(reversed_probes), size)]
    lock = threading.Lock()

    def compare_group(group: list[ExtractionRequest]) -> None:
        def arrived(index: int, captured: CapturedStates) -> None:
            difference = compare_states(captured.states, references[group[index].sample_id])
            with lock:
                differences.append(difference)

        capture(group, deliver=arrived)

    with ThreadPoolExecutor(max_workers=len(slices), thread_name_prefix="dfq-calibration") as pool:
        list(pool.map(compare_group, slices))  # as the lane's concurrent tasks submit them
    noise_whole = max((d.worst for d in differences), default=0.0)
    noise_head = max([noise_whole] + [d.worst_head for d in differences])
    noise_token = max((d.worst_focus_token for d in differences), default=0.0)  # every probe token matters
    tolerance = CanaryTolerance.calibrated(dtype, noise_whole, noise_head, noise_token)
    lengths = tuple(len(p.input_ids) for p in probes)
    return Calibration(tolerance, lengths, tuple(differences), time.perf_counter() - started)
