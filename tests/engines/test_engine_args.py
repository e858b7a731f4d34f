"""`[generate.vllm.engine_args]` / `[extract.vllm.engine_args]`: checked against the installed vLLM when the config
loads, refused where the project sets the key, passed to the engine, and fingerprinted when they change outputs."""

from __future__ import annotations

import json
import re

import pytest

from dflash_queue.config import load_config
from dflash_queue.engines import engine_args as vllm_args
from dflash_queue.engines.vllm.extract_args import extract_engine_args
from dflash_queue.engines.vllm.generate import engine_args
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.extract import vllm_extract_settings
from dflash_queue.runstate.run_identity import RunIdentity
from dflash_queue.shards.training import ShardInfo
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config
from dfq_testing.imports import imported_by

pytestmark = pytest.mark.vllm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture
def load(tiny_model, tmp_path):
    tables = tiny_config_tables(tiny_model, tmp_path / "storage", "redis://127.0.0.1:1/0", tmp_path / "state")
    base = {**tiny_vllm_overrides(), "extract": {"engine": "vllm"}}

    def load_with(generate_args=None, extract_args=None, **overrides):
        tables_ = {**base, **overrides}
        if generate_args is not None:
            tables_["generate.vllm.engine_args"] = generate_args
        if extract_args is not None:
            tables_["extract.vllm.engine_args"] = extract_args
        return load_config(write_config(tmp_path / "engine-args.toml", tables, **tables_))

    return load_with


def refusal(load, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        load(**kwargs)
    return str(caught.value)


def test_any_engine_argument_reaches_the_engines_of_both_lanes(load):
    config = load(
        generate_args={"speculative_config": NGRAM, "kv_cache_dtype": "fp8", "block_size": 16},
        extract_args={"quantization": "fp8", "max_num_scheduled_tokens": 512},
    )
    generate = engine_args(config.model, config.generate.vllm)
    assert generate["speculative_config"] == NGRAM and generate["kv_cache_dtype"] == "fp8"
    assert generate["block_size"] == 16 and generate["seed"] == config.generate.vllm.seed
    extract = extract_engine_args(vllm_extract_settings(config), [1, 2], "/dev/shm/x")
    assert extract["quantization"] == "fp8" and extract["max_num_scheduled_tokens"] == 512
    assert extract["speculative_config"]["method"] == "extract_hidden_states"
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs(**generate)  # vLLM takes them as they are


@pytest.mark.parametrize(
    ("lane", "args", "expected"),
    [
        ("generate", {"speculative_confg": NGRAM},
         "generate.vllm.engine_args.speculative_confg: not an engine argument of vLLM .*did you mean speculative_config"),
        ("extract", {"kv_cache_dtyp": "auto"},
         "extract.vllm.engine_args.kv_cache_dtyp: not an engine argument .*did you mean kv_cache_dtype"),
        ("generate", {"block_size": "16"}, r"generate.vllm.engine_args.block_size: expected int, got '16'"),
        ("generate", {"kv_cache_dtype": "fp9"},
         r"generate.vllm.engine_args.kv_cache_dtype: expected one of 'auto', .*got 'fp9'; did you mean fp8\?"),
        ("generate", {"speculative_config": "ngram"}, r"generate.vllm.engine_args.speculative_config: expected dict"),
        ("generate", {"speculative_config": {**NGRAM, "num_speculative_token": 2}},
         r"generate.vllm.engine_args.speculative_config.num_speculative_token: not a field of vLLM's "
         r"SpeculativeConfig; did you mean num_speculative_tokens\?"),
        ("generate", {"speculative_config": {**NGRAM, "rejection_sample_method": "synthetic"}},
         r"generate.vllm.engine_args.speculative_config.rejection_sample_method: 'synthetic' accepts drafts at "
         r"fixed rates"),
        ("extract", {"quantization": "fp88"},
         r"extract.vllm.engine_args.quantization: 'fp88' is not a quantization method .*did you mean fp8\?"),
    ],
)  # fmt: skip
def test_unknown_keys_and_wrong_types_name_the_file_the_dotted_key_and_the_nearest_name(load, lane, args, expected):
    message = refusal(load, **{f"{lane}_args": args})
    assert message.split("\n")[0].endswith("engine-args.toml: invalid configuration"), message
    assert re.search(expected, message), message


@pytest.mark.parametrize(
    ("lane", "key", "reason"),
    [
        ("generate", "model", "from model.path"),
        ("generate", "tokenizer", "from model.tokenizer"),
        ("generate", "seed", "set generate.vllm.seed"),
        ("generate", "max_num_batched_tokens", "set generate.vllm.max_num_batched_tokens"),
        ("extract", "seed", "greedy prefills"),
        ("extract", "speculative_config", "extract_hidden_states"),
        ("extract", "kv_transfer_config", "KV connector"),
        ("extract", "enable_prefix_caching", "vLLM #44485"),
        ("extract", "kv_cache_dtype", "set extract.vllm.kv_cache_dtype"),
    ],
)
def test_keys_the_project_sets_are_refused_with_the_reason(load, lane, key, reason):
    values = {"model": "x", "tokenizer": "x", "seed": 1, "max_num_batched_tokens": 8, "speculative_config": NGRAM,
              "kv_transfer_config": {}, "enable_prefix_caching": True, "kv_cache_dtype": "auto"}  # fmt: skip
    message = refusal(load, **{f"{lane}_args": {key: values[key]}})
    assert f"{lane}.vllm.engine_args.{key}: not settable here: " in message and reason in message, message


def test_min_p_is_refused_under_speculative_decoding(load):
    message = refusal(load, generate_args={"speculative_config": NGRAM}, **{"generate.sampling": {"min_p": 0.05}})
    assert "generate.sampling.min_p (0.05) is ignored by vLLM under speculative decoding" in message
    load(generate_args={"speculative_config": NGRAM})  # min_p 0 is fine


def test_settings_that_change_outputs_change_the_fingerprint_and_are_recorded(load):
    plain = load()
    speculative = load(generate_args={"speculative_config": NGRAM})
    quantized = load(extract_args={"quantization": "fp8"})
    tuned = load(generate_args={"block_size": 32}, extract_args={"max_num_scheduled_tokens": 512})
    fingerprints = {c.fingerprint() for c in (plain, speculative, quantized)}
    assert len(fingerprints) == 3
    assert tuned.fingerprint() == plain.fingerprint()  # speed and memory only
    assert plain.output_settings() == load(generate_args={}).output_settings()
    other_draft = load(generate_args={"speculative_config": {**NGRAM, "num_speculative_tokens": 5}})
    assert other_draft.fingerprint() != speculative.fingerprint()
    # On the Transformers engine the vLLM section's arguments change nothing.
    on_transformers = load(generate_args={"speculative_config": NGRAM}, generate={"engine": "transformers"})
    assert on_transformers.fingerprint() == load(generate={"engine": "transformers"}).fingerprint()

    differences = RunIdentity.of(plain, "s").differences(RunIdentity.of(speculative, "s"))
    assert differences == [f"generate.vllm.engine_args.speculative_config: (unset); yours: {json.dumps(NGRAM)}"]

    both = load(generate_args={"speculative_config": NGRAM, "block_size": 32}, extract_args={"quantization": "fp8"})
    assert both.engine_output_args() == {"generate": {"speculative_config": NGRAM}, "extract": {"quantization": "fp8"}}
    info = ShardInfo("m", (1,), 2, 8, "bfloat16", both.fingerprint(), {}, engine_args=both.engine_output_args())
    assert json.loads(info.to_metadata()["engine_args"]) == both.engine_output_args()
    assert "engine_args" not in ShardInfo("m", (1,), 2, 8, "bfloat16", plain.fingerprint(), {}).to_metadata()


def test_without_vllm_only_the_refusals_are_checked(monkeypatch):
    monkeypatch.setattr(vllm_args, "engine_arg_types", lambda: None)
    vllm_args.check_engine_args({"anything": 1}, vllm_args.GENERATE_REFUSED)
    with pytest.raises(Exception, match="not settable here"):
        vllm_args.check_engine_args({"model": "x"}, vllm_args.GENERATE_REFUSED)


def test_a_config_without_engine_args_loads_without_importing_vllm(tiny_model, tmp_path):
    """vLLM takes seconds to import: a command or worker that never starts it (`run`, `status`, a Transformers
    worker) does not import it to check engine arguments it was not given, even when the config is validated again
    with overrides (what `run` does with its private broker's URL)."""
    tables = tiny_config_tables(tiny_model, tmp_path / "storage", "", tmp_path / "state")
    path = write_config(tmp_path / "plain.toml", tables)
    code = (
        "from dflash_queue.config import load_config\n"
        f"config = load_config({str(path)!r}, env={{}})\n"
        "config.with_overrides(broker={'url': 'redis://127.0.0.1:1/0'})\n"
    )
    assert imported_by(code, ["vllm"]) == set()
