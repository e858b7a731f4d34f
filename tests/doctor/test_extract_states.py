"""`doctor`'s start of the vLLM extract engine: the comparison of its states with the checkpoint's own forward, and
when it is left out (no weights, the Transformers engine, `--skip-engine-start`). The passing engine's line is
checked on the engines of tests/engines/vllm/test_vllm_extract_bfloat16.py (`describe_engine`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.config import load_config
from dflash_queue.doctor.extract_states import NAME, check_extract_states
from dflash_queue.doctor.preflight import run_doctor
from dflash_queue.engines.state_checks import CanaryTolerance
from dflash_queue.errors import UnsupportedArchitecture
from dfq_testing.configs import local_copy

REPO = Path(__file__).resolve().parents[2]
NO_GPUS = ([], [], None)


def test_no_engine_starts_without_weights_on_the_transformers_engine_or_when_skipped(
    make_config, tiny_model, redis_url, tmp_path
):
    def refuse():
        raise AssertionError("no engine may start here")

    plain = make_config()
    assert check_extract_states(plain.extract, plain.model, start=refuse) is None  # extract.engine = "transformers"
    weightless = local_copy(REPO / "worker_configs" / "qwen3.6-27b-h200.toml", tmp_path,
                            model=REPO / "examples" / "qwen3.6-27b-class", tokenizer=tiny_model, broker_url=redis_url)
    weightless_config = load_config(weightless)
    assert check_extract_states(weightless_config.extract, weightless_config.model, start=refuse) is None
    vllm = make_config("vllm.toml", extract={"engine": "vllm"})
    assert NAME not in {c.name for c in run_doctor(vllm, gpu_reader=lambda: NO_GPUS, start_engine=False)}

    def unsupported():
        raise UnsupportedArchitecture("vLLM extract engine: layer 1 (decoder_output) differs")

    refused = check_extract_states(vllm.extract, vllm.model, start=unsupported)
    assert refused is not None and refused.verdict == "fail" and refused.detail.startswith("vLLM extract engine: layer 1")

    def broken():
        raise RuntimeError("Engine core initialization failed")

    failed = check_extract_states(vllm.extract, vllm.model, start=broken)
    assert failed is not None and failed.detail == (
        "the vLLM extract engine did not start: RuntimeError: Engine core initialization failed"
    )


def test_an_engine_whose_states_were_compared_with_nothing_is_a_warning_not_a_pass(make_config):
    """extract.vllm.reference_check = false: the engine starts, having compared nothing with the checkpoint."""

    class Unchecked:
        reference = None
        calibrated_noise = 0.0
        closed = False

        def canary_tolerance(self):
            return CanaryTolerance.fixed(1e-3)

        def close(self):
            self.closed = True

    config = make_config("unchecked.toml", extract={"engine": "vllm"}, **{"extract.vllm": {"reference_check": False}})
    engine = Unchecked()
    check = check_extract_states(config.extract, config.model, start=lambda: engine)
    assert check is not None and check.verdict == "warn" and engine.closed
    assert check.detail.startswith("its states were compared with nothing: extract.vllm.reference_check = false")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor")
def test_doctor_fails_an_engine_that_reads_every_request_one_slot_off(make_config, inject_faults):
    """The connector reads each token's state one cache slot on, for every request, the canary's reruns alone
    included: batched and alone agree (the canary cannot see it), the checkpoint's own forward does not. The engine
    refuses to start at load, and `doctor`, which starts it as a worker would, fails with its reason."""
    config = make_config(
        "slot-offset.toml",
        model={"dtype": "bfloat16"},
        extract={"engine": "vllm"},
        **{"extract.vllm": {"max_model_len": 512, "max_num_batched_tokens": 64, "max_num_seqs": 16,
                            "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0,
                            "shutdown_timeout_s": 30}},
    )
    inject_faults({"extract_vllm_states": {"slot_offset": 1}})
    checks = {c.name: c for c in run_doctor(config, gpu_reader=lambda: NO_GPUS)}
    states = checks[NAME]
    assert states.verdict == "fail", states.detail
    # ReferenceMismatch's message: the engine raised it while it loaded.
    assert states.detail.startswith("vLLM extract engine: layer ")
    assert "differs from the checkpoint's own forward: worst token" in states.detail
    assert "more than bfloat16 rounding explains" in states.detail and "refusing to start" in states.detail
