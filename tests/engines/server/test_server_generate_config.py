"""`[generate.server]`: what the config accepts and refuses, where the API key comes from, and the run
fingerprint holding the served model."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.config import load_config
from dflash_queue.errors import ConfigError
from dfq_testing.configs import to_toml


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 4, "max_position_embeddings": 4096}')
    return path


def load(tmp_path: Path, model_dir: Path, name: str = "deploy.toml", **tables: dict):
    base = {"storage": {"url": "out"}, "model": {"path": str(model_dir), "name": "tiny"}}
    path = tmp_path / name
    path.write_text(to_toml({**base, **{key.replace("__", "."): value for key, value in tables.items()}}))
    return load_config(path, env={})


SERVER = {"engine": "server"}


def test_a_server_config_loads_with_its_urls_normalised_and_a_key_file_resolved(tmp_path, model_dir):
    config = load(
        tmp_path, model_dir, generate=SERVER,
        generate__server={"urls": ["http://10.0.0.5:8000/", "https://gpu-7.example:443/serve"],
                          "kind": "sglang", "api_key_file": "secrets/key"},
    )
    server = config.generate.server
    assert server.urls == ("http://10.0.0.5:8000", "https://gpu-7.example:443/serve")
    assert server.api_key_file == str(tmp_path / "secrets" / "key")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("k-123\nignored\n")
    assert server.api_key() == "k-123"
    assert config.served_model_name == "tiny"


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ({"generate": SERVER}, "generate.server.urls is empty"),
        ({"generate": SERVER, "generate__server": {"urls": ["10.0.0.5:8000"]}}, "a server's base URL is http://"),
        ({"generate": SERVER, "generate__server": {"urls": ["http://user:pw@10.0.0.5:8000"]}},
         "a server URL holds credentials"),
        ({"generate": SERVER, "generate__server": {"urls": ["http://a:1", "http://a:1/"]}}, "urls must be distinct"),
        ({"generate": SERVER, "generate__server": {"urls": ["http://a:1"], "api_key_env": "K", "api_key_file": "f"}},
         "set api_key_file or api_key_env, not both"),
        ({"generate": SERVER, "generate__server": {"urls": ["http://a:1"], "kind": "tgi"}},
         "'vllm', 'sglang' or 'openai'"),
        ({"generate": SERVER, "generate__server": {"urls": ["http://a:1"], "kind": "openai"}},
         'generate.sampling.top_k = 20 is not part of the OpenAI completions API'),
        ({"generate": SERVER, "generate__server": {"urls": ["http://a:1"], "kind": "openai"},
          "generate__sampling": {"top_k": -1, "repetition_penalty": 1.1}},
         "generate.sampling.repetition_penalty = 1.1 is not part of the OpenAI completions API"),
    ],
)
def test_bad_server_settings_fail_at_load_naming_the_key(tmp_path, model_dir, tables, words):
    with pytest.raises(ConfigError, match="invalid configuration") as refused:
        load(tmp_path, model_dir, **tables)
    assert words in str(refused.value)


def test_an_api_key_in_the_config_file_is_refused_without_showing_it(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"generate.server.api_key: the servers' API key is never read") as refused:
        load(tmp_path, model_dir, generate=SERVER,
             generate__server={"urls": ["http://a:1"], "api_key": "sk-very-secret"})
    assert "sk-very-secret" not in str(refused.value)


def test_a_missing_key_file_or_variable_is_named(tmp_path, model_dir):
    config = load(tmp_path, model_dir, generate=SERVER,
                  generate__server={"urls": ["http://a:1"], "api_key_file": "nowhere"})
    with pytest.raises(ConfigError, match=r"generate.server.api_key_file: cannot read .*nowhere"):
        config.generate.server.api_key()
    variable = config.generate.server.model_copy(update={"api_key_file": "", "api_key_env": "DFQ_KEY"})
    with pytest.raises(ConfigError, match="the environment variable DFQ_KEY is not set"):
        variable.api_key(env={})
    assert variable.api_key(env={"DFQ_KEY": "k"}) == "k"


def test_the_fingerprint_holds_the_served_model_so_a_worker_of_another_refuses_the_tasks(tmp_path, model_dir):
    server = {"urls": ["http://a:1"]}
    plain = load(tmp_path, model_dir, "plain.toml")
    served = load(tmp_path, model_dir, "served.toml", generate=SERVER, generate__server=server)
    renamed = load(tmp_path, model_dir, "renamed.toml", generate=SERVER,
                   generate__server={**server, "model": "other-model"})
    elsewhere = load(tmp_path, model_dir, "elsewhere.toml", generate=SERVER,
                     generate__server={"urls": ["http://b:2", "http://c:3"], "requests_in_flight": 64})
    assert served.output_settings()["generate.server.model"] == "tiny"
    assert "generate.server.model" not in plain.output_settings()  # other engines keep the fingerprint they had
    assert renamed.fingerprint() != served.fingerprint()
    assert elsewhere.fingerprint() == served.fingerprint()  # where the servers are does not change outputs


def test_worker_slots_and_warnings_follow_the_server_section(tmp_path, model_dir):
    from dflash_queue.lanes.registry import GENERATE

    config = load(tmp_path, model_dir, generate=SERVER, dataset={"shard_size": 32},
                  generate__server={"urls": ["http://a:1"], "inflight_tasks": 3, "requests_in_flight": 128})
    assert GENERATE.default_slots(config) == 3
    (warning,) = GENERATE.startup_warnings(config, 3)
    assert "fewer than generate.server.requests_in_flight (128)" in warning
    assert GENERATE.startup_warnings(config, 5) == []
