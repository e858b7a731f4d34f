from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from dflash_queue.config import BROKER_URL_ENV, STORAGE_URL_ENV, load_config
from dflash_queue.engines.checkpoint_digest import weights_digest
from dflash_queue.errors import ConfigError
from dfq_testing.checkpoints import fine_tune
from dfq_testing.configs import to_toml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 4}')
    return path


def write(tmp_path: Path, tables: dict) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(to_toml(tables))
    return path


def base(model_dir: Path) -> dict:
    return {"storage": {"url": "out"}, "model": {"path": str(model_dir)}}


def test_minimal_config_gets_defaults_and_resolves_relative_paths(tmp_path, model_dir):
    config = load_config(write(tmp_path, base(model_dir)), env={})
    assert config.storage.url == str(tmp_path / "out")
    assert config.model.display_name == "model"
    assert config.broker.visibility_timeout_s > config.broker.task_timeout_s
    assert config.extract.hidden_dtype == "bfloat16"


def test_config_objects_are_frozen(tmp_path, model_dir):
    config = load_config(write(tmp_path, base(model_dir)), env={})
    with pytest.raises(ValidationError, match="frozen"):
        config.dataset.shard_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "tables, key, words",
    [
        ({"generate": {"bach_size": 4}}, "generate.bach_size", "unknown key"),
        ({"dataset": {"shard_size": "8"}}, "dataset.shard_size", "valid integer"),
        ({"dataset": {"shard_size": 0}}, "dataset.shard_size", "greater than 0"),
        ({"generate.sampling": {"temperature": -1.0}}, "generate.sampling.temperature", "greater than or equal"),
        ({"broker": {"visibility_timeout_s": 60, "task_timeout_s": 120}}, "broker", "must exceed task_timeout_s"),
        ({"extract": {"layer_ids": [1, 1]}}, "extract", "distinct"),
        ({"extract": {"max_shard_bytes": 0}}, "extract.max_shard_bytes", "greater than or equal to 1"),
        ({"extract": {"max_shard_bytes": "8GB"}}, "extract.max_shard_bytes", "valid integer"),
        ({"dataset": {"thinking": "sometimes"}}, "dataset.thinking", "'always', 'never' or 'auto'"),
        ({"dataset": {"regenerate": "first"}}, "dataset.regenerate", "'last' or 'all'"),
        ({"quality": {"on_stub": "ignore"}}, "quality.on_stub", "'off', 'flag', 'drop' or 'retry'"),
        ({"quality": {"min_answer_tokens": 0}}, "quality.min_answer_tokens", "greater than or equal to 1"),
        ({"quality": {"retry_max_tokens": 100}, "generate.sampling": {"max_tokens": 200}}, "quality.retry_max_tokens",
         "must exceed generate.sampling.max_tokens (200)"),
        ({"dataset": {"max_model_len": 1024}, "generate.sampling": {"max_tokens": 2048}}, "dataset.max_model_len",
         "leaves no room for a prompt"),
        ({"generate": {"engine": "sglang"}}, "generate.engine", "'transformers', 'vllm' or 'server'"),
        ({"generate.vllm": {"tensor_parallel": 2}}, "generate.vllm.tensor_parallel", "unknown key"),
        ({"generate.vllm": {"gpu_memory_utilization": 1.5}}, "generate.vllm.gpu_memory_utilization", "less than or equal"),
        ({"generate.vllm": {"inflight_tasks": 0}}, "generate.vllm.inflight_tasks", "greater than 0"),
        ({"generate.vllm": {"enforce_eager": "yes"}}, "generate.vllm.enforce_eager", "valid boolean"),
        ({"generate.vllm.env": {"vllm-cpu-threads": "1"}}, "generate.vllm.env.vllm-cpu-threads.[key]", "pattern"),
        ({"generate.vllm.env": {"VLLM_CPU_KVCACHE_SPACE": 4}}, "generate.vllm.env.VLLM_CPU_KVCACHE_SPACE", "string"),
        (
            {"generate": {"engine": "vllm"}, "generate.vllm": {"max_model_len": 2048}},
            "generate",
            "generate.sampling.max_tokens (4096) must be below generate.vllm.max_model_len (2048)",
        ),
    ],
)
def test_bad_values_name_file_and_key(tmp_path, model_dir, tables, key, words):
    path = write(tmp_path, {**base(model_dir), **tables})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message
    assert f"  {key}: " in message
    assert words in message


@pytest.mark.parametrize(
    "tables, line",
    [
        ({"generate": {"bach_size": 4}}, "generate.bach_size: unknown key; did you mean batch_size?"),
        ({"generate.sampling": {"max_token": 8}}, "generate.sampling.max_token: unknown key; did you mean max_tokens?"),
        ({"extract": {"num_draft_layer": 5}}, "extract.num_draft_layer: unknown key; did you mean num_draft_layers?"),
        ({"storage.uploader": {"max_pendng": 2}}, "storage.uploader.max_pendng: unknown key; did you mean max_pending?"),
        ({"brokr": {"url": ""}}, "brokr: unknown key; did you mean broker?"),
        ({"run": {"statedir": "s"}}, "run.statedir: unknown key; did you mean state_dir?"),
        ({"generate.vllm": {"tensor_parallel": 2}}, "generate.vllm.tensor_parallel: unknown key; did you mean "
                                                    "tensor_parallel_size?"),
        # Nothing close: no guess; and `source`, which is not a key, is never suggested.
        ({"dataset": {"colour": "blue"}}, "dataset.colour: unknown key\n"),
        ({"sourc": {}}, "sourc: unknown key\n"),
    ],
)
def test_a_misspelt_key_gets_the_nearest_one(tmp_path, model_dir, tables, line):
    path = write(tmp_path, {**base(model_dir), **tables})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert f"  {line}" in str(info.value) + "\n"


def test_vllm_section_loads_with_its_environment_table(tmp_path, model_dir):
    tables = {
        **base(model_dir),
        "generate": {"engine": "vllm"},
        "generate.vllm": {"tensor_parallel_size": 2, "max_model_len": 8192, "kv_cache_memory_gib": 2.5},
        "generate.vllm.env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    }
    settings = load_config(write(tmp_path, tables), env={}).generate.vllm
    assert (settings.tensor_parallel_size, settings.max_model_len, settings.kv_cache_memory_gib) == (2, 8192, 2.5)
    assert settings.env == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert settings.inflight_tasks == 3 and settings.dtype == "" and settings.enable_prefix_caching is True
    # The Transformers engine ignores the section, so its limits do not apply there.
    transformers = {**tables, "generate": {"engine": "transformers"}, "generate.vllm": {"max_model_len": 16}}
    assert load_config(write(tmp_path, transformers), env={}).generate.engine == "transformers"


def test_missing_model_path_fails_at_load(tmp_path):
    path = write(tmp_path, {"storage": {"url": "out"}, "model": {"path": "nowhere"}})
    with pytest.raises(ConfigError, match=r"model\.path: no such path: .*nowhere"):
        load_config(path, env={})


def test_missing_required_section_is_named(tmp_path, model_dir):
    path = write(tmp_path, {"model": {"path": str(model_dir)}})
    with pytest.raises(ConfigError, match=r"storage: required key is missing"):
        load_config(path, env={})


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[model\npath = 1")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(path, env={})


def test_environment_overrides_broker_and_storage(tmp_path, model_dir):
    env = {BROKER_URL_ENV: "redis://10.0.0.5:6379/2", STORAGE_URL_ENV: str(tmp_path / "elsewhere")}
    config = load_config(write(tmp_path, base(model_dir)), env=env)
    assert config.broker.url == "redis://10.0.0.5:6379/2"
    assert config.storage.url == str(tmp_path / "elsewhere")


def test_broker_url_must_be_redis(tmp_path, model_dir):
    path = write(tmp_path, {**base(model_dir), "broker": {"url": "amqp://guest@localhost//"}})
    with pytest.raises(ConfigError, match="redis://"):
        load_config(path, env={})


def test_fingerprint_tracks_output_settings_not_locations(tmp_path, model_dir):
    config = load_config(write(tmp_path, base(model_dir)), env={})
    original = config.fingerprint()
    moved = load_config(write(tmp_path, base(model_dir)), env={STORAGE_URL_ENV: "/elsewhere", BROKER_URL_ENV: "redis://x:1/0"})
    assert moved.fingerprint() == original
    hotter = config.with_overrides(generate={"sampling": {**config.generate.sampling.model_dump(), "temperature": 1.0}})
    assert hotter.fingerprint() != original
    # What staging tolerates and how it runs changes no sample a task writes.
    for key, value in (("max_bad_share", 0.9), ("max_record_bytes", 1 << 20), ("staging_processes", 3)):
        tolerant = config.with_overrides(dataset={**config.dataset.model_dump(), key: value})
        assert tolerant.fingerprint() == original, key
    (model_dir / "config.json").write_text('{"num_hidden_layers": 8}')
    assert load_config(write(tmp_path, base(model_dir)), env={}).fingerprint() != original


def test_the_weights_enter_the_output_settings_not_the_fingerprint(tmp_path, tiny_model):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    path = write(tmp_path, {**base(model), "model": {"path": str(model), "name": "tiny"}})
    before = load_config(path, env={})
    weights = before.output_settings()["model"]["weights"]
    assert weights == weights_digest(model)

    fine_tune(model)  # another checkpoint behind the same path, name and config.json
    after = load_config(path, env={})
    assert after.output_settings()["model"]["weights"] != weights
    # Nodes without the weights share the run's fingerprint: it is the same whatever the weights.
    assert after.fingerprint() == before.fingerprint()
    weightless = shutil.copytree(model, tmp_path / "weightless", ignore=shutil.ignore_patterns("*.safetensors"))
    without = load_config(write(tmp_path, {**base(weightless), "model": {"path": str(weightless), "name": "tiny"}}))
    assert "weights" not in without.output_settings()["model"] and without.fingerprint() == before.fingerprint()


def test_shipped_configs_parse(tmp_path):
    """Every config in worker_configs/ is valid apart from model paths that only exist on their machines."""
    paths = sorted((REPO / "worker_configs").glob("*.toml"))
    assert paths, f"no configs in {REPO / 'worker_configs'}"
    for path in paths:
        try:
            load_config(path, env={})
        except ConfigError as exc:
            lines = str(exc).splitlines()[1:]
            assert all("no such path" in line for line in lines), str(exc)


def test_flower_section_is_validated_and_its_db_resolved(tmp_path, model_dir):
    tables = {**base(model_dir), "flower": {"persistent": True, "db": "state/f.db"}}
    config = load_config(write(tmp_path, tables), env={})
    assert config.flower.db == str(tmp_path / "state" / "f.db")
    assert (config.flower.address, config.flower.port, config.flower.max_tasks) == ("127.0.0.1", 5555, 10000)
    for tables, key in (({"flower": {"port": 70000}}, "flower.port"), ({"flower": {"auth": "a:b"}}, "flower.auth")):
        with pytest.raises(ConfigError, match=rf"  {key}: "):
            load_config(write(tmp_path, {**base(model_dir), **tables}), env={})


def test_max_model_len_comes_from_the_model_unless_set(tmp_path, model_dir):
    config = load_config(write(tmp_path, base(model_dir)), env={})
    with pytest.raises(ConfigError, match="no max_position_embeddings; set dataset.max_model_len"):
        config.max_model_len()
    (model_dir / "config.json").write_text('{"num_hidden_layers": 4, "max_position_embeddings": 32768}')
    assert config.max_model_len() == 32768
    assert config.generation_budget == config.generate.sampling.max_tokens
    assert config.retry_max_tokens == 2 * config.generate.sampling.max_tokens
    explicit = load_config(write(tmp_path, {**base(model_dir), "dataset": {"max_model_len": 8192}}), env={})
    assert explicit.max_model_len() == 8192


def test_the_vllm_extract_engines_context_holds_the_longest_sequence_and_the_token_vllm_samples(tmp_path, model_dir):
    (model_dir / "config.json").write_text('{"num_hidden_layers": 4, "max_position_embeddings": 32768}')
    staged_up_to = {**base(model_dir), "dataset": {"max_model_len": 8192}}
    assert load_config(write(tmp_path, staged_up_to), env={}).extract_context_len() == 8193
    # The model's whole context: no room for one more token, within the model's own positions.
    assert load_config(write(tmp_path, base(model_dir)), env={}).extract_context_len() == 32768
    explicit = {**staged_up_to, "extract.vllm": {"max_model_len": 4096}}
    assert load_config(write(tmp_path, explicit), env={}).extract_context_len() == 4096


def test_extract_engine_settings_that_corrupt_states_are_refused_with_the_reason(tmp_path, model_dir):
    refused = [
        ({"pipeline_parallel_size": 2}, "extract.vllm.pipeline_parallel_size", "vLLM #36151"),
        ({"kv_cache_dtype": "fp8"}, "extract.vllm.kv_cache_dtype", "a quantized KV cache changes every hidden state"),
    ]
    for settings, key, words in refused:
        path = write(tmp_path, {**base(model_dir), "extract": {"engine": "vllm"}, "extract.vllm": settings})
        with pytest.raises(ConfigError) as info:
            load_config(path, env={})
        assert f"  {key}: " in str(info.value) and words in str(info.value)
    fine = {**base(model_dir), "extract": {"engine": "vllm"}, "extract.vllm": {"kv_cache_dtype": "bfloat16"}}
    assert load_config(write(tmp_path, fine), env={}).extract.vllm.kv_cache_dtype == "bfloat16"


# -- [storage], [storage.s3], [storage.uploader] --------------------------------------------------------------


def test_s3_storage_settings_load_with_defaults(tmp_path, model_dir):
    tables = {
        **base(model_dir),
        "storage": {"url": "s3://training-data/qwen3-27b/run-1"},
        "storage.s3": {"endpoint_url": "https://minio.internal:9000", "addressing_style": "path", "part_size_mb": 128},
        "storage.uploader": {"staging_dir": "staging", "max_pending": 4},
    }
    config = load_config(write(tmp_path, tables), env={})
    assert config.storage.url == "s3://training-data/qwen3-27b/run-1"  # URLs are not resolved as paths
    assert config.storage.s3.part_size_mb == 128 and config.storage.s3.checksum_algorithm == "CRC32"
    assert config.storage.s3.retry_mode == "standard" and config.storage.s3.max_attempts == 10
    assert config.staging_dir == tmp_path / "staging"  # relative to the config file
    assert config.storage.uploader.parallel_uploads == 2


def test_staging_defaults_to_the_state_directory(tmp_path, model_dir):
    config = load_config(write(tmp_path, {**base(model_dir), "run": {"state_dir": "state"}}), env={})
    assert config.staging_dir == tmp_path / "state" / "staging"


def test_storage_url_from_the_environment_may_be_s3(tmp_path, model_dir):
    config = load_config(write(tmp_path, base(model_dir)), env={STORAGE_URL_ENV: "s3://bucket-a/x"})
    assert config.storage.url == "s3://bucket-a/x"


@pytest.mark.parametrize(
    "tables, key, words",
    [
        ({"storage": {"url": "gs://bucket/x"}}, "storage.url", "unsupported scheme 'gs'"),
        ({"storage": {"url": "s3://Not_A_Bucket/x"}}, "storage.url", "invalid bucket name"),
        ({"storage": {"url": "s3://bucket-a/x?versionId=1"}}, "storage.url", "no query"),
        ({"storage.s3": {"part_size_mb": 4}}, "storage.s3.part_size_mb", "greater than or equal to 5"),
        ({"storage.s3": {"addressing_style": "dns"}}, "storage.s3.addressing_style", "'auto', 'path' or 'virtual'"),
        ({"storage.s3": {"endpoint_url": "minio:9000"}}, "storage.s3.endpoint_url", "http:// or https://"),
        ({"storage.s3": {"checksum_algorithm": "MD5"}}, "storage.s3.checksum_algorithm", "CRC32"),
        ({"storage.s3": {"retry_mode": "legacy"}}, "storage.s3.retry_mode", "'standard' or 'adaptive'"),
        ({"storage.s3": {"max_attempts": 0}}, "storage.s3.max_attempts", "greater than or equal to 1"),
        ({"storage.s3": {"bucket": "x"}}, "storage.s3.bucket", "unknown key"),
        ({"storage.uploader": {"max_pending": 1, "parallel_uploads": 2}}, "storage.uploader", "cannot exceed"),
        ({"storage.uploader": {"max_pending": 0}}, "storage.uploader.max_pending", "greater than or equal to 1"),
    ],
)
def test_bad_storage_settings_name_file_and_key(tmp_path, model_dir, tables, key, words):
    merged = {**base(model_dir), **tables}
    merged["storage"] = {**base(model_dir)["storage"], **tables.get("storage", {})}
    path = write(tmp_path, merged)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message and f"  {key}: " in message and words in message, message


@pytest.mark.parametrize(
    "table, key",
    [
        ("storage.s3", "aws_secret_access_key"),
        ("storage.s3", "aws_access_key_id"),
        ("storage.s3", "session_token"),
        ("storage", "secret_key"),
        ("storage.s3", "credentials"),
    ],
)
def test_credentials_in_the_config_file_are_refused(tmp_path, model_dir, table, key):
    tables = {**base(model_dir), table: {**(base(model_dir)["storage"] if table == "storage" else {}), key: "x"}}
    path = write(tmp_path, tables)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message and f"  {table}.{key}: credentials are never read from the config file" in message
    assert "AWS_ACCESS_KEY_ID" in message and "profile" in message
