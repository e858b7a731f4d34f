"""The vLLM extract engine on vLLM's CPU build (tiny Qwen3 family, float32): states exact against the
checkpoint's own forward and the Transformers engine, layer conventions, chunked prefill, the canary as a batch
of one with its tolerance calibrated at load, and the checks that refuse states the engine got wrong (faults
injected in the KV connector, inside vLLM's processes)."""

from __future__ import annotations

import json
import os
import random
import threading

import pytest
import torch

from dflash_queue import faults
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.hf.extract import HiddenStateExtractor
from dflash_queue.engines.state_checks import (
    CALIBRATION_FACTOR,
    TOLERANCE_FLOORS,
    CanaryMismatch,
    ImplausibleHiddenStates,
    compare_states,
)
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.errors import EngineStatesInvalid
from dflash_queue.lanes.extract import ExtractLane, extract_lane_settings, vllm_extract_settings
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER, TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.references import reference_model, reference_states
from dfq_testing.vllm_uniproc import model_workers

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

# Not in ascending order, and the last layer both as itself and through the final norm: vLLM caches its aux
# layers in ascending order, and the last layer's output before the norm is its aux id N.
LAYER_IDS = [4, 0, 5, 2]
CAPTURED = [
    (4, DECODER_OUTPUT), (0, DECODER_OUTPUT), (5, DECODER_OUTPUT), (2, DECODER_OUTPUT), (5, LAST_LAYER), (5, FINAL_NORM)
]
# A step prefills at most this many tokens: longer sequences are prefilled in chunks over several steps.
STEP_TOKENS = 64
MAX_MODEL_LEN = 1024
FAULTS = {
    "zero": ["fault-zero"],
    "constant": ["fault-constant"],
    "drop_tail": ["fault-tail"],
    "shift": ["fault-shift"],
    "swap": [["fault-swap-a", "fault-swap-b"]],
    "other_tokens": ["fault-tokens"],
    "no_space": ["fault-nospace"],
}


@pytest.fixture(scope="module")
def family(tiny_family):
    return tiny_family("qwen3")


@pytest.fixture(scope="module")
def config(family, tmp_path_factory):
    from dflash_queue.config import load_config
    from dfq_testing.configs import tiny_config_tables, write_config

    tmp = tmp_path_factory.mktemp("vllm-extract")
    tables = tiny_config_tables(family, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    return load_config(
        write_config(
            tmp / "config.toml",
            tables,
            model={"name": "qwen3", "dtype": "float32"},
            extract={"engine": "vllm", "layer_ids": LAYER_IDS, "last_layer_state": True, "final_norm_state": True,
                     "hidden_dtype": "float32"},
            **{
                "extract.vllm": {
                    "dtype": "float32",
                    "max_model_len": MAX_MODEL_LEN,
                    "max_num_batched_tokens": STEP_TOKENS,
                    "max_num_seqs": 16,
                    "enforce_eager": True,
                    "kv_cache_memory_gib": 0.5,
                    "log_stats_interval_s": 0,
                    "shutdown_timeout_s": 30,
                },
            },
        )
    )


@pytest.fixture(scope="module")
def extractor(config):
    """One engine for the module, its connector told to break the states of the `fault-*` samples only."""
    faults.install({"extract_vllm_states": FAULTS})
    try:
        engine = VllmStateExtractor(vllm_extract_settings(config))
    finally:
        faults.uninstall()
    yield engine
    transfer_dir = engine.transfer_dir
    engine.close()
    assert not transfer_dir.exists()


@pytest.fixture(scope="module")
def model(family):
    return reference_model(family)


def random_requests(lengths, prefix="s", seed=0):
    rng = random.Random(seed)
    return [ExtractionRequest(f"{prefix}-{i}", [rng.randrange(1000) for _ in range(n)]) for i, n in enumerate(lengths)]


# Lengths around the step size (chunked over 2 to 6 steps) and short ones sharing steps.
LENGTHS = [3, 17, STEP_TOKENS, STEP_TOKENS + 1, 150, 333]


def test_the_engine_caches_the_aux_layers_vllm_numbers_and_puts_them_back_in_the_configs_order(extractor):
    assert extractor.captured == CAPTURED
    # Layer i's output is vLLM's aux id i + 1; the final norm is computed from aux id N (the same as layer N - 1).
    assert extractor.aux_ids == [1, 3, 5, 6]
    assert extractor.mode == "vllm" and extractor.name == "vllm" and extractor.dtype == torch.float32
    scheduler = extractor._resident.engine.vllm_config.scheduler_config
    # Sequences longer than a step are prefilled in chunks; prefix caching is off whatever the settings.
    assert scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == STEP_TOKENS
    assert not extractor._resident.engine.vllm_config.cache_config.enable_prefix_caching


def test_states_equal_the_checkpoints_own_forward_of_each_sequence_alone(extractor, model):
    requests = random_requests(LENGTHS)
    captured = extractor.capture(requests)
    for request, result in zip(requests, captured):
        want = reference_states(model, torch.tensor(request.input_ids), CAPTURED)
        assert result.states.shape == want.shape == (len(request.input_ids), len(CAPTURED), model.config.hidden_size)
        for k in range(len(CAPTURED)):
            scale = float(want[:, k].abs().max())
            assert scale > 1.0  # scaled weights: an error would show
            torch.testing.assert_close(result.states[:, k], want[:, k], rtol=1e-5, atol=1e-5 * scale)
        # The final norm is the checkpoint's own (its weights are not all 1): not the state before it.
        assert compare_states(result.states[:, 2:3], result.states[:, 5:6]).worst > 0.1
        assert torch.equal(result.states[:, 2], result.states[:, 4])  # the last layer, as itself and as last_layer


def test_states_equal_the_transformers_engines(extractor, family):
    requests = random_requests(LENGTHS, seed=1)
    transformers_engine = HiddenStateExtractor(
        str(family), layer_ids=LAYER_IDS, last_layer_state=True, final_norm_state=True, device="cpu", dtype="float32",
        token_budget=256,
    )
    try:
        expected = transformers_engine.capture(requests)
    finally:
        transformers_engine.close()
    assert transformers_engine.captured == extractor.captured
    for mine, theirs in zip(extractor.capture(requests), expected):
        assert compare_states(mine.states, theirs.states).worst <= 1e-5
        torch.testing.assert_close(mine.summary, theirs.summary, rtol=1e-4, atol=1e-5)


def test_results_are_delivered_as_each_sequence_finishes_and_concurrent_tasks_share_the_engine(extractor):
    first, second = random_requests([200, 9, 120, 40], "a", seed=2), random_requests([31, 250, 7], "b", seed=3)
    alone = {r.sample_id: extractor.reference_states(r) for r in first + second}
    delivered: dict[str, dict[int, torch.Tensor]] = {"a": {}, "b": {}}

    def run(name, requests):
        extractor.capture(requests, deliver=lambda i, c: delivered[name].__setitem__(i, c.states))

    threads = [threading.Thread(target=run, args=("a", first)), threading.Thread(target=run, args=("b", second))]
    for thread in threads:
        thread.start()
    # A canary rerun meanwhile waits for the engine to be free of the others' requests, then runs alone.
    canary = extractor.reference_states(first[0])
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(delivered["a"]) == [0, 1, 2, 3] and sorted(delivered["b"]) == [0, 1, 2]
    for name, requests in (("a", first), ("b", second)):
        for index, request in enumerate(requests):
            assert compare_states(delivered[name][index], alone[request.sample_id]).worst <= 1e-5
    assert compare_states(canary, alone[first[0].sample_id]).worst == 0.0


def test_the_canary_tolerance_is_calibrated_at_load(extractor):
    # float32 on the CPU: batched and alone agree to rounding, so the tolerance is the dtype's floor.
    assert 0.0 <= extractor.calibrated_noise <= 1e-6
    tolerance = extractor.canary_tolerance()
    assert tolerance.noise_whole == extractor.calibrated_noise
    assert tolerance.whole == max(CALIBRATION_FACTOR * extractor.calibrated_noise, TOLERANCE_FLOORS[torch.float32][0])
    assert tolerance.head == max(CALIBRATION_FACTOR * tolerance.noise_head, TOLERANCE_FLOORS[torch.float32][1])


# ---------------------------------------------------------------------------------------------------------------
# Through the extract lane, with states broken in the connector


def write_completions(config, shard_id: str, lengths: dict[str, int], seed: int = 0):
    """A completions shard of one sample per entry: random prompt and completion ids of the given total length."""
    rng = random.Random(seed)
    records = []
    for sample_id, length in lengths.items():
        ids = [rng.randrange(1000) for _ in range(length)]
        split = length // 2
        records.append(CompletionRecord(sample_id, ids[:split], ids[split:], "stop", thinking=False, text=""))
    storage = open_storage(config.storage)
    storage.write_bytes(completions_key(shard_id), encode_completions(records))
    return storage


def run_lane(config, extractor, shard_id, **extract):
    lane_config = config.with_overrides(extract=extract) if extract else config
    storage = open_storage(config.storage)
    lane = ExtractLane(extract_lane_settings(lane_config), extractor, storage)
    try:
        return lane.run(shard_id), storage
    finally:
        lane.uploader.close()  # the engine is the module's: not closed with the lane


NORMAL = {"ok-1": 40, "ok-2": 90, "ok-3": 25}


def test_a_shard_records_the_engine_and_its_calibrated_canary(config, extractor):
    write_completions(config, "vllm-normal", NORMAL)
    summary, storage = run_lane(config, extractor, "vllm-normal", canary_samples=2)
    assert summary.num_samples == 3 and summary.canary_samples == 2
    with storage.local_copy(shard_key("vllm-normal")) as path:
        info = TrainingShard(path).info()
    assert info["extraction"] == "vllm"
    assert json.loads(info["layer_ids"]) == [layer for layer, _ in CAPTURED]
    assert json.loads(info["layer_states"]) == [kind for _, kind in CAPTURED]
    assert "vllm" in json.loads(info["versions"])
    canary = json.loads(info["canary"])
    tolerance = extractor.canary_tolerance()
    assert canary["tolerance"] == tolerance.whole and canary["head_tolerance"] == tolerance.head
    assert canary["relative_error"] <= 1e-5 and canary["verdict"] == "pass"


def test_states_left_all_zero_fail_the_task_and_store_nothing(config, extractor):
    write_completions(config, "vllm-zero", {**NORMAL, "fault-zero": 60})
    with pytest.raises(EngineStatesInvalid, match=r"sample fault-zero: the vLLM engine never wrote the states of 60 "
                                                   r"of 60 tokens \(first token 0, aux layer 1\)"):
        run_lane(config, extractor, "vllm-zero")
    assert not open_storage(config.storage).exists(shard_key("vllm-zero"))


def test_states_half_unwritten_fail_the_task(config, extractor):
    write_completions(config, "vllm-tail", {**NORMAL, "fault-tail": 150})
    with pytest.raises(EngineStatesInvalid, match=r"sample fault-tail: the vLLM engine never wrote the states of 75 "
                                                   r"of 150 tokens \(first token 75,"):
        run_lane(config, extractor, "vllm-tail")


def test_states_handed_over_for_other_tokens_fail_the_task(config, extractor):
    write_completions(config, "vllm-tokens", {**NORMAL, "fault-tokens": 50})
    with pytest.raises(EngineStatesInvalid, match=r"sample fault-tokens: the vLLM engine returned the states of 50 "
                                                   r"other tokens for this sequence of 50"):
        run_lane(config, extractor, "vllm-tokens")


def test_a_full_transfer_directory_fails_the_task_for_a_retry_and_the_retry_stores_the_shard(config, extractor):
    """The connector's write of one sample's states fails as on a full tmpfs (ENOSPC, first write only): the task
    fails with a transient error (the queue retries it and counts the retry, queue/steps/retries.py), nothing is stored,
    and the next run of the task stores the whole shard."""
    from dflash_queue.errors import StatesHandOverFailed, TransientIOError
    from dflash_queue.queue.steps.retries import TRANSIENT_ERRORS

    write_completions(config, "vllm-nospace", {**NORMAL, "fault-nospace": 80})
    with pytest.raises(StatesHandOverFailed, match=r"could not write states into \S+: writing \S+ failed: OSError: "
                                                   r"\[Errno 28\] No space left on device") as failed:
        run_lane(config, extractor, "vllm-nospace")
    assert isinstance(failed.value, TransientIOError) and isinstance(failed.value, TRANSIENT_ERRORS)
    assert not open_storage(config.storage).exists(shard_key("vllm-nospace"))
    summary, storage = run_lane(config, extractor, "vllm-nospace")
    assert summary.num_samples == 4 and not summary.poisoned
    with storage.local_copy(shard_key("vllm-nospace")) as path:
        assert sorted(TrainingShard(path).sample_ids) == sorted([*NORMAL, "fault-nospace"])
    assert not list(extractor.transfer_dir.iterdir())  # no file or error left behind


def test_the_connector_zeroes_the_blocks_the_scheduler_hands_out_before_the_step_writes_them():
    """What makes an unwritten state show as an all-zero row (see the tests above): blocks reused from earlier
    requests are zeroed when a request is given them, before the forward pass that first writes them."""
    from dflash_queue.engines.vllm.states_connector import HiddenStatesConnector, HiddenStatesMetadata

    connector = object.__new__(HiddenStatesConnector)  # the worker side alone, without a vLLM config
    connector._connector_metadata = None
    connector._writer = True
    connector._cache = torch.ones(6, 3, 4, 8)  # [blocks, aux layers, block size, hidden]: stale states
    connector.bind_connector_metadata(HiddenStatesMetadata(new_blocks=[1, 4]))
    assert connector._cache[[1, 4]].eq(0).all() and connector._cache[[0, 2, 3, 5]].eq(1).all()
    connector._writer = False  # another tensor-parallel rank: its cache is never read
    connector.bind_connector_metadata(HiddenStatesMetadata(new_blocks=[0]))
    assert connector._cache[0].eq(1).all()


def test_constant_states_fail_the_plausibility_check(config, extractor):
    write_completions(config, "vllm-constant", {**NORMAL, "fault-constant": 60})
    with pytest.raises(ImplausibleHiddenStates, match=r"sample fault-constant, layer 4 \(decoder_output\): constant "
                                                      r"\(0\.5\)"):
        run_lane(config, extractor, "vllm-constant")


@pytest.mark.parametrize(
    ("shard_id", "faulty"),
    [("vllm-shift", {"fault-shift": 70}), ("vllm-swap", {"fault-swap-a": 70, "fault-swap-b": 70})],
)
def test_states_shifted_or_swapped_between_requests_fail_the_canary(config, extractor, shard_id, faulty):
    """States that are another token's or another sequence's are plausible: only the canary's rerun of the sample
    alone shows them (every sample is a canary here, so that the faulty ones are among them)."""
    write_completions(config, shard_id, {**NORMAL, **faulty})
    with pytest.raises(CanaryMismatch, match=r"canary sample fault-(shift|swap-a|swap-b): layer \S+ \(\w+\) differs "
                                             r"from the sample run alone by relative error"):
        run_lane(config, extractor, shard_id, canary_samples=5)
    assert not open_storage(config.storage).exists(shard_key(shard_id))


def test_without_the_canary_shifted_states_would_be_stored(config, extractor):
    """The failure above is the canary's doing: with it off, the same wrong states pass every other check."""
    write_completions(config, "vllm-shift-unchecked", {**NORMAL, "fault-shift": 70})
    summary, storage = run_lane(config, extractor, "vllm-shift-unchecked", canary_samples=0)
    assert summary.num_samples == 4 and storage.exists(shard_key("vllm-shift-unchecked"))


def test_a_sequence_longer_than_the_engines_context_is_dead_lettered_alone(config, extractor):
    write_completions(config, "vllm-long", {**NORMAL, "too-long": MAX_MODEL_LEN + 10})
    summary, storage = run_lane(config, extractor, "vllm-long")
    assert [sample for sample, _ in summary.poisoned] == ["too-long"]
    assert "vLLM refused the sequence" in str(summary.poisoned[0][1])
    with storage.local_copy(shard_key("vllm-long")) as path:
        assert sorted(TrainingShard(path).sample_ids) == sorted(NORMAL)


def test_an_engine_that_died_fails_the_capture_as_unavailable(extractor):
    """Last in the module: it kills the module's engine. The worker then stops and hands its tasks back (see
    queue/worker.py); a capture must not wait for states that will never come."""
    import psutil

    from dflash_queue.errors import EngineUnavailable

    engine_processes = psutil.Process().children(recursive=True)
    cores = [p for p in engine_processes if "EngineCore" in p.name()]
    assert cores
    # Forked from this process's fork server (the module's vllm_forked_engine_cores), not spawned from it.
    assert all(core.ppid() != os.getpid() for core in cores)
    # The model runs in the engine core's process (the module's vllm_uniproc_executor): no worker of its own.
    assert not model_workers(engine_processes)
    for process in cores:
        process.kill()
    with pytest.raises(EngineUnavailable):
        extractor.capture(random_requests([300, 200, 100], "dying"))
