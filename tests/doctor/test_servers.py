"""`doctor` checks the generate lane's inference servers as a worker would at start (fake SGLang servers)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.doctor.servers import check_servers
from dflash_queue.lanes.generate import build_generate_engine
from dfq_testing.fake_sglang import FakeSglang, ToyBackend


@pytest.fixture
def fake(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    server = FakeSglang(tiny_model, ToyBackend(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))).start()
    yield server
    server.close()


def server_config(make_config, *urls: str, model: str = "tiny-qwen3"):
    return make_config(
        generate={"engine": "server"},
        **{"generate.server": {"urls": list(urls), "kind": "sglang", "model": model},
           "dataset": {"shard_size": 8, "thinking": "always", "max_model_len": 1024}},
    )


def servers_of(config):
    return check_servers(config.generate, config.served_model_name, lambda: build_generate_engine(config))


def test_doctor_passes_a_server_that_serves_the_target_and_warns_of_one_that_is_down(make_config, fake):
    down = "http://127.0.0.1:9"  # discard port: nothing listens
    checks = servers_of(server_config(make_config, fake.url, down))
    assert [(c.name, c.verdict) for c in checks] == [("server", "pass"), ("server", "warn")]
    assert checks[0].detail == f"{fake.url}: serves tiny-qwen3, checked"
    assert checks[1].detail.startswith(f"{down}: not used: cannot connect")


def test_doctor_fails_when_no_server_serves_the_target(make_config, fake):
    (check,) = servers_of(server_config(make_config, fake.url, model="Qwen3-27B"))
    assert check.verdict == "fail" and "serves tiny-qwen3, not Qwen3-27B" in check.detail


def test_doctor_skips_the_servers_for_other_engines(make_config):
    assert servers_of(make_config()) == []
