"""The vLLM extract engine in the dtype users run, bfloat16, on vLLM's CPU build, for a dense target (Qwen3) and a
hybrid one (Qwen3-Next: linear attention and experts, whose batched states differ from its states alone): the
canary's tolerance calibrated at load lies between the batching noise and the error of a faulty request; with one
canary sample per shard, as shipped, a swapped, a one-token-shifted and a zeroed request are each caught, and so is
a fault on every sample whichever the canary picks; a one-off flake on either side of the comparison passes after
the re-check, with the states of the pass that was checked; and the engine's states agree with the checkpoint's own
Transformers forward at load. Faults are injected in the KV connector (inside vLLM's processes), named by sample
id, so that one engine per family serves every test."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dflash_queue import faults
from dflash_queue.config import load_config
from dflash_queue.doctor.extract_states import describe_engine
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.state_checks import (
    CALIBRATION_FACTOR,
    TOKEN_CEILINGS,
    TOLERANCE_CEILINGS,
    TOLERANCE_FLOORS,
    CanaryMismatch,
    compare_states,
)
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.errors import EngineStatesInvalid
from dflash_queue.lanes.canaries import CanaryPicker
from dflash_queue.lanes.extract import ExtractLane, extract_lane_settings, vllm_extract_settings
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.configs import tiny_config_tables, write_config

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

BF16 = torch.bfloat16
STEP_TOKENS = 64  # sequences longer than this are prefilled over several engine steps
EVERY = [f"every-{i}" for i in range(5)]
FAULTS = {
    "zero": ["zero"],
    "shift": ["shift", "measure-shift", *EVERY],
    "swap": [["swap-a", "swap-b"], ["measure-swap-a", "measure-swap-b"]],
    "flake": ["flake-pass"],
    "flake_canary": ["flake-alone"],
}
# Lengths of the shipped sample job's sequences (examples/sharegpt_sample.jsonl through worker_configs/local-cpu.toml),
# none a step and one token long (vLLM's CPU build kills a hybrid engine on a one-token step alone).
SHIPPED_LENGTHS = [29, 41, 44, 48, 53, 56, 59, 62, 67, 72, 76, 81, 85, 92, 99, 102, 112, 120, 124, 136, 170, 197, 320]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def engine(request, tiny_family, tmp_path_factory):
    """(config, engine) of one family in bfloat16; the connector breaks the states of the samples FAULTS names."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"bf16-{family}")
    tables = tiny_config_tables(tiny_family(family), tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    config = load_config(
        write_config(
            tmp / "config.toml",
            tables,
            model={"name": family, "dtype": "bfloat16"},
            extract={"engine": "vllm"},  # one canary sample per shard, bfloat16 shards: as shipped
            **{"extract.vllm": {"max_model_len": 512, "max_num_batched_tokens": STEP_TOKENS, "max_num_seqs": 16,
                                "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0,
                                "shutdown_timeout_s": 30}},
        )
    )
    assert config.extract.canary_samples == 1
    faults.install({"extract_vllm_states": FAULTS})
    try:
        extractor = VllmStateExtractor(vllm_extract_settings(config))
    finally:
        faults.uninstall()
    yield family, config, extractor
    extractor.close()


def random_ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000) for _ in range(length)]


def test_the_canary_tolerance_lies_between_the_batching_noise_and_a_faulty_requests_error(engine):
    family, _, extractor = engine
    tolerance = extractor.canary_tolerance()
    assert tolerance.head >= tolerance.whole
    assert tolerance.whole <= TOLERANCE_CEILINGS[BF16] and tolerance.head <= TOLERANCE_CEILINGS[BF16]
    assert tolerance.whole == max(CALIBRATION_FACTOR * extractor.calibrated_noise, TOLERANCE_FLOORS[BF16][0]) or (
        tolerance.whole == TOLERANCE_CEILINGS[BF16] < CALIBRATION_FACTOR * extractor.calibrated_noise
    )
    if family == "qwen3":  # a dense model: batched and alone agree to a rounding (bit-identical in most batches)
        assert extractor.calibrated_noise < 1e-3
    else:  # Qwen3-Next: linear attention and experts differ batched from alone
        assert extractor.calibrated_noise > 1e-3
    # A production-like batch: 16 sequences of the shipped job's lengths, three of them broken by the connector.
    rng = random.Random(7)
    normal = [ExtractionRequest(f"normal-{i}", random_ids(rng.choice(SHIPPED_LENGTHS), rng)) for i in range(13)]
    faulty = [ExtractionRequest("measure-shift", random_ids(90, rng)),
              ExtractionRequest("measure-swap-a", random_ids(76, rng)),
              ExtractionRequest("measure-swap-b", random_ids(76, rng))]
    batch = normal[:6] + faulty + normal[6:]
    errors = {
        request.sample_id: compare_states(captured.states, extractor.reference_states(request))
        for request, captured in zip(batch, extractor.capture(batch))
    }
    noise = max(errors[r.sample_id].worst for r in normal)
    noise_head = max(errors[r.sample_id].worst_head for r in normal)
    noise_token = max(errors[r.sample_id].worst_focus_token for r in normal)  # every token of these counts
    zeroed = compare_states(torch.zeros(5, 3, 8), torch.ones(5, 3, 8)).worst  # what a zeroed request's canary shows
    print(f"\n{family} bfloat16: calibrated noise {extractor.calibrated_noise:.2e}, tolerance {tolerance.whole:.2e} "
          f"(head {tolerance.head:.2e}); per token: noise {tolerance.noise_token:.2e}, bound {tolerance.token:.2e}; "
          f"production-like batch: largest {noise:.2e} (head {noise_head:.2e}, worst token {noise_token:.2e}); "
          f"shift {errors['measure-shift'].worst:.2e}, swap {errors['measure-swap-a'].worst:.2e}/"
          f"{errors['measure-swap-b'].worst:.2e} (worst token {errors['measure-swap-a'].worst_focus_token:.2e}/"
          f"{errors['measure-swap-b'].worst_focus_token:.2e}), zeroed {zeroed:.2e}")
    assert noise <= tolerance.whole and noise_head <= tolerance.head  # no false alarm
    assert noise_token <= tolerance.token <= TOKEN_CEILINGS[BF16]
    for name in ("measure-shift", "measure-swap-a", "measure-swap-b"):
        # Caught at every layer, with room: the smallest layer's error is several times the tolerance.
        assert min(errors[name].relative) > 3 * tolerance.whole, (name, errors[name])
        assert min(errors[name].focus_token) > 3 * tolerance.token, (name, errors[name])
    assert zeroed > 3 * tolerance.whole


# ---------------------------------------------------------------------------------------------------------------
# Through the extract lane, one canary sample per shard


def canary_of(config, shard_id: str, lengths: list[int]) -> int:
    """The sample the lane's canary picks in a shard of these lengths (drawn from the shard id; in the vLLM engine
    every sequence of a batch follows another)."""
    picker = CanaryPicker(shard_id, lengths, 1, config.extract.canary_longest_every)
    for index in range(len(lengths)):
        picker.offer(index, torch.zeros(1), 1)
    [(index, _, _)] = picker.chosen(range(len(lengths)))
    return index


def write_shard(config, shard_id: str, samples: list[tuple[str, int]], seed: int = 0) -> list[list[int]]:
    """A completions shard of these (sample id, length) samples, random ids; returns each sequence's ids."""
    rng = random.Random(seed)
    records, sequences = [], []
    for sample_id, length in samples:
        ids = random_ids(length, rng)
        sequences.append(ids)
        records.append(CompletionRecord(sample_id, ids[: length // 2], ids[length // 2 :], "stop", thinking=False,
                                        text=""))
    open_storage(config.storage).write_bytes(completions_key(shard_id), encode_completions(records))
    return sequences


def shard_faulting_its_canary(config, shard_id: str, lengths: list[int], name: str, partner: str = ""):
    """A shard whose canary sample is `name` (and whose other sample of the same length is `partner`)."""
    ids = [f"{shard_id}-{i}" for i in range(len(lengths))]
    canary = canary_of(config, shard_id, lengths)
    ids[canary] = name
    if partner:
        ids[next(i for i, n in enumerate(lengths) if n == lengths[canary] and i != canary)] = partner
    return ids, write_shard(config, shard_id, list(zip(ids, lengths)))


def run_lane(config, extractor, shard_id):
    storage = open_storage(config.storage)
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    try:
        return lane.run(shard_id), storage
    finally:
        lane.uploader.close()  # the engine is the module's


def stored(storage, shard_id):
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        info = shard.info()
        states = {shard[i].id: shard[i].hidden_states.clone() for i in range(len(shard))}
    return info, states


@pytest.mark.parametrize("fault", ["shift", "swap", "zero"])
def test_one_canary_per_shard_catches_a_faulty_request_it_picks(engine, fault):
    family, config, extractor = engine
    shard_id = f"{family}-{fault}"
    # The canary's sample is drawn from the shard id (canary_of finds it); a swap's partner has its length.
    lengths = [60, 140, 60, 140] if fault == "swap" else [50, 90, 70, 110, 40]
    if fault == "swap":
        ids, _ = shard_faulting_its_canary(config, shard_id, lengths, "swap-a", partner="swap-b")
    else:
        ids, _ = shard_faulting_its_canary(config, shard_id, lengths, fault)
    if fault == "zero":  # all-zero rows are the engine's unwritten states: refused before the canary runs
        with pytest.raises(EngineStatesInvalid, match=r"sample zero: the vLLM engine never wrote the states of \d+ of "
                                                      r"\d+ tokens"):
            run_lane(config, extractor, shard_id)
    else:
        canary = "swap-a" if fault == "swap" else fault
        with pytest.raises(CanaryMismatch, match=rf"canary sample {canary}: layer \d \(decoder_output\) differs from "
                                                 r"the sample run alone by relative error .* \(checked twice, both "
                                                 r"sides recomputed\)"):
            run_lane(config, extractor, shard_id)
    assert not open_storage(config.storage).exists(shard_key(shard_id))


def test_a_fault_on_every_sample_is_caught_whichever_sample_the_canary_picks(engine):
    family, config, extractor = engine
    shard_id = f"{family}-every"
    write_shard(config, shard_id, list(zip(EVERY, [50, 90, 70, 110, 40])))
    with pytest.raises(CanaryMismatch, match=r"canary sample every-\d: layer"):
        run_lane(config, extractor, shard_id)
    assert not open_storage(config.storage).exists(shard_key(shard_id))


@pytest.mark.parametrize(("flake", "side"), [("flake-pass", "the shard's pass"), ("flake-alone", "the rerun alone")])
def test_a_one_off_flake_passes_after_the_recheck_with_the_states_that_were_checked(engine, flake, side):
    """The connector shifts the canary sample's states once: the first time it is handed over in the shard's pass,
    or the first time the canary reruns it alone. The first comparison fails; both sides recomputed agree; the
    shard is stored, every row from the recomputed pass, the canary sample's as it is alone."""
    family, config, extractor = engine
    shard_id = f"{family}-{flake}"
    lengths = [50, 90, 70, 110, 40]
    ids, sequences = shard_faulting_its_canary(config, shard_id, lengths, flake)
    summary, storage = run_lane(config, extractor, shard_id)
    assert summary.num_samples == len(lengths) and summary.canary_samples == 1 + summary.canary_window
    info, states = stored(storage, shard_id)
    canary = json.loads(info["canary"])
    [recheck] = canary["rechecks"]
    assert recheck["first"].startswith(f"canary sample {flake}: layer") and recheck["again"] <= canary["tolerance"]
    assert canary["samples"] == [flake] and canary["relative_error"] <= canary["tolerance"]
    for sample_id, sequence in zip(ids, sequences):
        # No row holds a shifted state (1.2-1.5 from the sample alone; Qwen3-Next's batching noise stays below 0.2).
        alone = extractor.reference_states(ExtractionRequest(sample_id, sequence))
        assert compare_states(states[sample_id], alone).worst < 0.5, (side, sample_id)


def test_the_engines_states_agree_with_the_checkpoints_own_forward_at_load(engine):
    """Every captured entry, over a batch of several sequences that spans more than one prefill step."""
    family, _, extractor = engine
    reference = extractor.reference
    assert reference is not None and reference.agrees and reference.dtype == BF16
    assert [e.name for e in reference.entries] == [f"{layer} ({kind})" for layer, kind in extractor.captured]
    assert len(set(reference.lengths)) == 4 and sum(reference.lengths) > STEP_TOKENS
    assert all(0 < e.rounding < 0.2 and 0 < e.token_rounding for e in reference.entries)  # bfloat16 rounds
    print(f"\n{family} bfloat16 against the checkpoint's own forward: "
          + "; ".join(f"{e.name}: whole {e.error:.2e} (own {e.rounding:.2e}), worst token {e.token_error:.2e} (own "
                      f"{e.token_rounding:.2e})" for e in reference.entries))
    detail = describe_engine(extractor)  # what `doctor` prints for this engine
    assert detail.startswith(f"as the checkpoint's own: {len(reference.entries)} entries compared with the checkpoint")
    assert f"canary tolerance {extractor.canary_tolerance().whole:.2e}" in detail
