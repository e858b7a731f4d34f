"""`doctor` checks the generate lane's inference servers as a worker would at start (fake SGLang servers)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.doctor.servers import check_servers
from dflash_queue.lanes.generate import build_generate_engine
from dfq_testing.fake_sglang import FakeSglang, ToyBackend


@pytest.fixture
def fakes(tiny_model):
    """Make fake SGLang servers on a ToyBackend of the given weights; all closed when the test ends."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    made: list[FakeSglang] = []

    def make(weights: str = "", **settings) -> FakeSglang:
        backend = ToyBackend(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"), weights=weights)
        made.append(FakeSglang(tiny_model, backend, **settings).start())
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def fake(fakes):
    return fakes()


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
    assert checks[0].detail == f"{fake.url}: serves tiny-qwen3, checked, weights within 0 nats of the first's"
    assert checks[1].detail.startswith(f"{down}: not used: cannot connect")


def test_doctor_fails_when_no_server_serves_the_target(make_config, fake):
    (check,) = servers_of(server_config(make_config, fake.url, model="Qwen3-27B"))
    assert check.verdict == "fail" and "serves tiny-qwen3, not Qwen3-27B" in check.detail


def test_doctor_skips_the_servers_for_other_engines(make_config):
    assert servers_of(make_config()) == []


def test_doctor_warns_of_a_server_whose_tokenizer_it_cannot_check(make_config, fakes):
    server = fakes(tokenize=False)
    (check,) = servers_of(server_config(make_config, server.url))
    assert check.verdict == "warn"
    assert check.detail == (
        f"{server.url}: serves tiny-qwen3, checked, weights within 0 nats of the first's; but its tokenizer is not "
        "checked: it has no tokenize endpoint (/tokenize)"
    )


def test_doctor_warns_of_a_server_that_runs_other_weights_than_the_first(make_config, fakes):
    first, other = fakes("w1"), fakes("w2")
    checks = servers_of(server_config(make_config, first.url, other.url))
    assert [c.verdict for c in checks] == ["pass", "warn"]
    assert checks[1].detail.startswith(f"{other.url}: not used: it runs other weights than the run's (the weights "
                                       f"probe's fingerprint recorded from {first.url}): at greedy token 0")
