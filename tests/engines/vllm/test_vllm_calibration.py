"""The vLLM extract engine's calibration probes and rounds (engines/vllm/calibration.py), without vLLM: which
lengths it probes for a given engine, and the rounds run through a real engine that captures from several threads
at once (the Transformers engine, whose capture takes the same arguments). The calibration on vLLM itself, in
bfloat16, is in tests/engines/vllm/test_vllm_extract_bfloat16.py."""

from __future__ import annotations

import threading

import torch

from dflash_queue.engines.hf.extract import HiddenStateExtractor
from dflash_queue.engines.state_checks import (
    CALIBRATION_FACTOR,
    TOKEN_CALIBRATION_FACTOR,
    TOKEN_FLOORS,
    TOLERANCE_FLOORS,
)
from dflash_queue.engines.vllm.calibration import (
    LONGEST_PROBE,
    SHORTEST_PROBE,
    avoid_single_token_tail,
    calibrate_batched,
    probe_lengths,
    probe_requests,
)


def test_probes_spread_from_short_to_the_engines_context_and_fill_several_steps():
    lengths = probe_lengths(512, 64, 0, 16)
    assert len(lengths) == 16 and lengths[0] == SHORTEST_PROBE and lengths[-1] == 511
    assert lengths == sorted(lengths) and sum(lengths) > 2 * 64
    assert not any(n > 64 and n % 64 == 1 for n in lengths)  # no one-token last step
    # A long context: at most LONGEST_PROBE, or a step when the step is longer; and one past the window.
    assert max(probe_lengths(32_769, 2048, 0, 16)) == LONGEST_PROBE
    wide = probe_lengths(32_769, 16_384, 1024, 16)
    assert max(wide) == 16_384 and wide[-1] == 1030 and sum(wide) > 2 * 16_384
    assert probe_lengths(40, 64, 0, 4)[-1] == 39  # a short context bounds them all
    assert avoid_single_token_tail(129, 64) == 130 and avoid_single_token_tail(65, 0) == 65


def test_two_rounds_of_probes_batched_against_alone_give_the_tolerance(tiny_family):
    """Every probe is drawn twice (once in one group, once in groups captured from a pool of threads: one group
    here, the Transformers engine takes one capture at a time), each compared with the probe alone; an exact engine
    (the Transformers engine in float32 on the CPU) calibrates to the floor."""
    engine = HiddenStateExtractor(str(tiny_family("qwen3")), layer_ids=[1, 3], device="cpu", dtype="float32",
                                  token_budget=256)
    threads: set[str] = set()
    capture = engine.capture

    def recorded(requests, **kwargs):
        threads.add(threading.current_thread().name)
        return capture(requests, **kwargs)

    try:
        probes = probe_requests([16, 40, 90, 200], vocab_size=1000)
        calibration = calibrate_batched(recorded, engine.reference_states, probes, torch.float32, groups=1)
    finally:
        engine.close()
    assert len(calibration.differences) == 8 and calibration.lengths == (16, 40, 90, 200)
    assert len(threads) == 2  # the caller's, then the pool's
    tolerance = calibration.tolerance
    assert calibration.typical <= 1e-6 and not calibration.beyond_rounding(torch.float32)
    assert tolerance.noise_whole == max(d.worst for d in calibration.differences) <= 1e-6
    assert tolerance.whole == max(CALIBRATION_FACTOR * tolerance.noise_whole, TOLERANCE_FLOORS[torch.float32][0])
    assert tolerance.noise_head >= tolerance.noise_whole and tolerance.head >= tolerance.whole
    # The per-token bound from the worst token of any draw (every probe token counts): the floor on an exact engine.
    assert tolerance.noise_token == max(max(d.worst_token) for d in calibration.differences) <= 1e-5
    assert tolerance.token == max(TOKEN_CALIBRATION_FACTOR * tolerance.noise_token, TOKEN_FLOORS[torch.float32])
