"""Faults put into the vLLM extract engine's KV connector from outside the package (dfq_testing/connector_faults.py):
one engine of the 16-layer Qwen3 family (float32, every kind of entry captured) whose engine core is spawned with
every rule installed, each restricted to the samples that test it, so that the engine's load-time checks (probe
requests) see none. Each faulted request's states are held, entry by entry and token by token, to the checkpoint's
own forward with the rule applied: the entry and rows the rule names are the truth's shifted, normed or swapped
rows, everything else the truth. And a subprocess given `environment()` has the class wrapped; without the variable
nothing is installed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.lanes.extract import vllm_extract_settings
from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER
from dfq_testing import connector_faults
from dfq_testing.references import reference_model, reference_states

# Not vllm_forked_engine_cores: a forked engine core would not run the site directory's hook.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_LAYERS = 16
LAYER_IDS = [8, 1, 13]  # vLLM's aux ids 9, 2, 14; the last layer (before and after the final norm) is aux id 16
CAPTURED = [(8, DECODER_OUTPUT), (1, DECODER_OUTPUT), (13, DECODER_OUTPUT), (15, LAST_LAYER), (15, FINAL_NORM)]
DEEPEST = CAPTURED.index((13, DECODER_OUTPUT))  # aux 14: the highest aux id below N
LAST, NORMED = CAPTURED.index((15, LAST_LAYER)), CAPTURED.index((15, FINAL_NORM))  # both made from aux 16
STEP_TOKENS = 64  # sequences longer than this are prefilled in chunks
SLOT_POSITION = STEP_TOKENS  # a chunk's boundary for a sequence prefilled alone
RULES = [
    {"kind": "deepest_layer_offset", "samples": "outside-offset"},
    {"kind": "last_layer_after_norm", "samples": "outside-norm"},
    {"kind": "slot_offset_after", "position": SLOT_POSITION, "samples": "outside-slot"},
    {"kind": "swap", "pairs": [["outside-swap-a", "outside-swap-b"]]},
]
LENGTHS = {"outside-offset": 90, "outside-norm": 70, "outside-slot": 150, "outside-swap-a": 76,
           "outside-swap-b": 76, "outside-clean": 150}
# Per token and entry, relative L2 error: float32 rounding against a fault's error of order 1.
ROUNDING = 1e-4
VISIBLE = 0.1


@pytest.fixture(scope="module")
def family(tiny_deep_family):
    return tiny_deep_family("qwen3", NUM_LAYERS)


@pytest.fixture(scope="module")
def extractor(family, tmp_path_factory, vllm_uniproc_executor):
    from dflash_queue.config import load_config
    from dfq_testing.configs import tiny_config_tables, write_config

    tmp = tmp_path_factory.mktemp("outside-faults")
    tables = tiny_config_tables(family, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    config = load_config(
        write_config(
            tmp / "config.toml",
            tables,
            model={"name": "qwen3", "dtype": "float32"},
            extract={"engine": "vllm", "layer_ids": LAYER_IDS, "last_layer_state": True, "final_norm_state": True,
                     "hidden_dtype": "float32"},
            **{"extract.vllm": {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": STEP_TOKENS,
                                "max_num_seqs": 16, "enforce_eager": True, "kv_cache_memory_gib": 0.5,
                                "log_stats_interval_s": 0, "shutdown_timeout_s": 30}},
        )
    )
    with connector_faults.installed(RULES):  # the engine core, spawned inside, wraps its connector
        engine = VllmStateExtractor(vllm_extract_settings(config))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def model(family):
    return reference_model(family)


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(11)
    return {name: ExtractionRequest(name, [rng.randrange(1000) for _ in range(n)]) for name, n in LENGTHS.items()}


@pytest.fixture(scope="module")
def handed_over(extractor, requests):
    """Every request in one batch: what the engine handed over for each."""
    batch = list(requests.values())
    return {request.sample_id: captured.states for request, captured in zip(batch, extractor.capture(batch))}


@pytest.fixture(scope="module")
def truth(model, requests):
    return {name: reference_states(model, torch.tensor(r.input_ids), CAPTURED) for name, r in requests.items()}


def token_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[T, K]: each token's relative L2 error at each entry."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def assert_states(got: torch.Tensor, want: torch.Tensor, sample: str) -> None:
    assert got.shape == want.shape == (LENGTHS[sample], len(CAPTURED), want.shape[-1]), sample
    errors = token_errors(got, want)
    worst = int(errors.argmax())
    token, entry = divmod(worst, len(CAPTURED))
    assert float(errors.max()) <= ROUNDING, (
        f"{sample}: entry {CAPTURED[entry]}, token {token}: relative error {float(errors.max()):.2e}"
    )


def assert_visible(got: torch.Tensor, truth: torch.Tensor, rows: slice, entries: list[int]) -> None:
    """The fault shows at every row and entry it touched: far from the truth there."""
    assert float(token_errors(got, truth)[rows][:, entries].min()) > VISIBLE


def test_the_load_time_checks_saw_no_fault_and_untouched_requests_are_the_truth(extractor, handed_over, truth):
    assert extractor.captured == CAPTURED and extractor.aux_ids == [2, 9, 14, 16]
    assert connector_faults.deepest_column(extractor.aux_ids, NUM_LAYERS) == extractor.aux_ids.index(14)
    assert extractor.reference is not None and extractor.reference.agrees
    assert extractor.calibrated_noise <= 1e-6
    assert_states(handed_over["outside-clean"], truth["outside-clean"], "outside-clean")


def test_deepest_layer_offset_puts_the_previous_tokens_state_in_the_deepest_layer_below_the_last(
    extractor, requests, handed_over, truth
):
    name = "outside-offset"
    want = truth[name].clone()
    want[1:, DEEPEST] = truth[name][:-1, DEEPEST]
    assert_states(handed_over[name], want, name)
    assert_visible(handed_over[name], truth[name], slice(1, None), [DEEPEST])
    # The same alone (the canary's rerun): a batch of one does not tell it.
    assert torch.equal(extractor.reference_states(requests[name]), handed_over[name])


def test_last_layer_after_norm_hands_over_the_normed_state_as_the_last_layers(model, handed_over, truth):
    name = "outside-norm"
    with torch.inference_mode():
        normed_twice = model.get_decoder().norm(truth[name][:, NORMED])
    want = truth[name].clone()
    want[:, LAST] = truth[name][:, NORMED]  # the last layer's state is the final norm's
    want[:, NORMED] = normed_twice  # and the worker's final norm is applied to it again
    assert_states(handed_over[name], want, name)
    assert_visible(handed_over[name], truth[name], slice(None), [LAST, NORMED])


def test_slot_offset_after_reads_one_slot_on_from_the_position(handed_over, truth):
    name = "outside-slot"
    want = truth[name].clone()
    want[SLOT_POSITION:-1] = truth[name][SLOT_POSITION + 1 :]
    assert_states(handed_over[name], want, name)
    assert_visible(handed_over[name], truth[name], slice(SLOT_POSITION, -1), list(range(len(CAPTURED))))


def test_swap_exchanges_the_two_requests_states(handed_over, truth):
    a, b = "outside-swap-a", "outside-swap-b"
    assert_states(handed_over[a], truth[b], a)
    assert_states(handed_over[b], truth[a], b)
    assert_visible(handed_over[a], truth[a], slice(1, None), list(range(len(CAPTURED))))


def test_environment_gives_a_subprocess_the_patch_and_without_the_variable_nothing_is_installed(tmp_path):
    other = tmp_path / "other-site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = '1'\n")
    base = {**os.environ, "PYTHONPATH": str(other)}
    env = connector_faults.environment(RULES, base=base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(connector_faults.SITE_DIR), str(other)]
    assert json.loads(env[connector_faults.RULES_ENV]) == RULES
    script = (
        "import json, os, sys\n"
        "hooked = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == 'dfq_testing.connector_faults']\n"
        "print(json.dumps({'hooked': hooked, 'other_site': os.environ.get('OTHER_SITE_RAN'),\n"
        "                  'faults_module': 'dfq_testing.connector_faults' in sys.modules}))\n"
        "if hooked:\n"
        "    from dflash_queue.engines.vllm.states_connector import HiddenStatesConnector as C\n"
        "    print(json.dumps({'rules': getattr(C, sys.argv[1], None),\n"
        "                      'wrapped': C._gather.__wrapped__.__module__ == C.__module__}))\n"
    )

    def run(environment):
        done = subprocess.run([sys.executable, "-c", script, connector_faults.PATCHED_ATTR], env=environment,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    seen, patched = run(env)
    assert seen == {"hooked": ["_Hook"], "other_site": "1", "faults_module": True}
    assert patched == {"rules": RULES, "wrapped": True}
    without = run({k: v for k, v in env.items() if k != connector_faults.RULES_ENV})
    assert without == [{"hooked": [], "other_site": "1", "faults_module": False}]
    # The test process's own environment is put back after `installed`.
    before = {name: os.environ.get(name) for name in ("PYTHONPATH", connector_faults.RULES_ENV)}
    with connector_faults.installed(RULES):
        assert os.environ["PYTHONPATH"].startswith(str(connector_faults.SITE_DIR))
    assert {name: os.environ.get(name) for name in before} == before
    with pytest.raises(ValueError, match="kind 'nope'"):
        connector_faults.environment([{"kind": "nope"}])


@pytest.mark.parametrize(
    ("faulted", "beyond"),
    [
        (["outside-offset"], [DEEPEST]),  # the deepest decoder layer alone
        (["outside-norm"], [LAST, NORMED]),  # the last state after the final norm (and the norm applied again)
        (["outside-slot"], list(range(len(CAPTURED)))),  # rows one slot off past a chunk's boundary
        (["outside-swap-a", "outside-swap-b"], list(range(len(CAPTURED)))),  # two requests' states exchanged
    ],
)
def test_the_checkpoint_comparison_of_the_load_check_refuses_each_fault_naming_its_entries(
    extractor, requests, faulted, beyond
):
    """What the engine's load check runs (`compare_with_checkpoint` over a batch, then `require_agreement`), on
    batches holding a faulted request: the entries the fault touched are beyond their bounds, the others are not."""
    from dflash_queue.engines.reference.check import require_agreement
    from dflash_queue.errors import ReferenceMismatch

    clean = extractor.compare_with_checkpoint([requests["outside-clean"]])
    assert clean.agrees and clean.dtype == torch.float32
    comparison = extractor.compare_with_checkpoint([requests["outside-clean"], *(requests[n] for n in faulted)])
    assert [k for k, entry in enumerate(comparison.entries) if not entry.agrees] == beyond
    assert all(comparison.entries[k].excess > 10 for k in beyond), comparison.describe()
    with pytest.raises(ReferenceMismatch, match="more than float32 rounding explains") as refused:
        require_agreement(comparison, "vLLM extract engine")
    assert refused.value.comparison is comparison
    assert comparison.worst.name in str(refused.value)
