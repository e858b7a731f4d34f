"""The inference-server engine against small fake SGLang servers (dfq_testing/fake_sglang.py, replies made up
without a model): SGLang's protocol, the start-up checks, and what each kind of failure costs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.samples import Message, Sample
from dflash_queue.engines.base import GenerationRequest, request_seed
from dflash_queue.engines.config import GenerateConfig
from dflash_queue.engines.server.generate import ServedTarget, ServerGenerateEngine, ServerRejectedSample
from dflash_queue.errors import ConfigError, SampleDependentError, WorkerShuttingDown
from dflash_queue.lanes.generate import build_generate_lane
from dflash_queue.runstate.ledger import resilient_client
from dflash_queue.runstate.server_waits import OutageReporter, ServerWaits
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key
from dflash_queue.storage import open_storage
from dfq_testing.fake_sglang import FakeSglang, ToyBackend
from dfq_testing.jobs import stage_samples
from dfq_testing.polling import wait_until
from dfq_testing.vocabularies import swapped_vocabulary

SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 30, "min_p": 0.05, "max_tokens": 24, "seed": 11}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def toy(tokenizer):
    return ToyBackend(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture
def fakes(tiny_model, toy):
    """Make fake SGLang servers (each listening); all closed when the test ends."""
    made: list[FakeSglang] = []

    def make(**settings) -> FakeSglang:
        fake = FakeSglang(settings.pop("tokenizer_path", tiny_model), settings.pop("backend", toy), **settings).start()
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.close()


def engine_for(tiny_model, *fakes: FakeSglang, context_len: int = 1024, **server) -> ServerGenerateEngine:
    settings = GenerateConfig.model_validate({
        "engine": "server",
        "server": {"urls": [f.url for f in fakes], "kind": "sglang", "backoff_initial_s": 0.05,
                   "backoff_max_s": 0.2, "model": "tiny-qwen3", **server},
        "sampling": SAMPLING,
    })
    return ServerGenerateEngine(
        settings.server, settings.sampling, ServedTarget("tiny-qwen3", str(tiny_model), context_len)
    )


def requests(count: int, start: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(f"s{i}", [100 + i, 200 + i, 300, 400]) for i in range(start, start + count)]


def test_sglang_gets_the_prompt_ids_and_every_sampling_setting_and_its_ids_come_back(tiny_model, fakes, toy):
    fake = fakes()
    engine = engine_for(tiny_model, fake)
    try:
        batch = [*requests(6), GenerationRequest("s-budget", [7, 8, 9], max_tokens=5),
                 GenerationRequest("s0", [100, 200, 300, 400], attempt=1)]
        generations = engine.generate(batch)
    finally:
        engine.close()
    sent = {(tuple(b["input_ids"]), b["sampling_params"]["sampling_seed"]): b for b in fake.bodies}
    reasons = set()
    for request, generation in zip(batch, generations):
        seed = request_seed(11, request.sample_id, request.attempt)
        params = sent[tuple(request.prompt_ids), seed]["sampling_params"]
        assert params == {
            "max_new_tokens": request.max_tokens or 24, "temperature": 1.0, "top_p": 0.9, "top_k": 30, "min_p": 0.05,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": seed, "n": 1,
        }
        expected = _run(toy(request.prompt_ids, params, params["max_new_tokens"]))
        assert generation.prompt_ids == request.prompt_ids
        assert generation.completion_ids == expected.ids  # the stop token included
        assert generation.finish_reason == expected.finish
        finish = expected.finish
        reasons.add(finish)
    assert reasons == {"stop", "length"}
    assert generations[0].completion_ids != generations[-1].completion_ids  # a retry is sampled afresh


def _run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


@pytest.mark.parametrize(
    ("fake_settings", "target", "sampling", "refusal"),
    [
        ({"model_path": "other-model"}, {}, {}, "serves other-model, not tiny-qwen3"),
        ({"context_length": 512}, {}, {}, "its context is 512 tokens, shorter than the 1024"),
        ({"deterministic": False}, {}, {}, "ignores per-request seeds"),
        ({"tokenizer_path": "other"}, {}, {}, "its tokenizer gives other token ids than the local one"),
    ],
)
def test_a_server_that_cannot_serve_the_target_is_refused_saying_why(
    tiny_model, fakes, tmp_path, fake_settings, target, sampling, refusal
):
    if fake_settings.get("tokenizer_path") == "other":
        fake_settings["tokenizer_path"] = other_vocabulary(tiny_model, tmp_path)
    fake = fakes(**fake_settings)
    with pytest.raises(ConfigError, match="no inference server can serve tiny-qwen3") as refused:
        engine_for(tiny_model, fake)
    assert fake.url in str(refused.value) and refusal in str(refused.value)


def test_greedy_sampling_needs_no_seeds(tiny_model, fakes):
    fake = fakes(deterministic=False)
    settings = GenerateConfig.model_validate({
        "engine": "server", "server": {"urls": [fake.url], "kind": "sglang", "model": "tiny-qwen3"},
        "sampling": {**SAMPLING, "temperature": 0.0},
    })
    engine = ServerGenerateEngine(settings.server, settings.sampling, ServedTarget("tiny-qwen3", str(tiny_model), 1024))
    try:
        assert len(engine.generate(requests(2))) == 2
    finally:
        engine.close()


def test_a_server_whose_replies_lack_token_ids_is_refused(tiny_model, fakes):
    fake = fakes()
    fake.faults.omit_output_ids = True
    with pytest.raises(ConfigError, match="cannot serve this job: the reply has no token ids in output_ids"):
        engine_for(tiny_model, fake)


def other_vocabulary(tiny_model: Path, root: Path) -> Path:
    """A copy of the tiny model's tokenizer whose vocabulary swaps the ids of two common tokens."""
    return swapped_vocabulary(tiny_model, root / "other-vocabulary")


def test_a_sample_the_server_refuses_is_rejected_alone_with_its_words(tiny_model, fakes):
    fake = fakes()
    engine = engine_for(tiny_model, fake)
    try:
        batch = requests(5)
        fake.faults.refused_token = batch[2].prompt_ids[0]
        with pytest.raises(ServerRejectedSample, match=r"sample s2: .*400: Token id 102 is not allowed here") as rejected:
            engine.generate(batch)
        assert rejected.value.sample_ids == ("s2",)
        served = fake.generate_requests
        # The lane runs the others again: their replies were kept, the servers are not asked twice.
        again = engine.generate(batch[:2] + batch[3:])
        assert fake.generate_requests == served
        fake.faults.refused_token = None
        assert again == engine.generate(batch[:2] + batch[3:])  # the same replies, asked anew
        assert fake.generate_requests == served + 4
    finally:
        engine.close()


def test_5xx_answers_are_retried_with_backoff_then_the_sample_is_given_up(tiny_model, fakes):
    fake = fakes()
    engine = engine_for(tiny_model, fake, max_tries=3)
    try:
        expected = engine.generate(requests(1, start=40))
        fake.faults.fail_next = 2
        assert engine.generate(requests(1, start=40)) == expected
        fake.faults.fail_next = 3
        with pytest.raises(SampleDependentError, match=r"s40: .*3 tries failed.*500: Internal server error") as failed:
            engine.generate(requests(1, start=40))
        assert failed.value.sample_ids == ("s40",)
        fake.faults.drop_next = 1  # the connection dropped while the server stays healthy: one more try
        assert engine.generate(requests(1, start=40)) == expected
    finally:
        engine.close()


def test_a_down_servers_share_goes_to_the_others_and_it_is_used_again_once_back(tiny_model, fakes):
    first, second = fakes(), fakes()
    engine = engine_for(tiny_model, first, second)
    try:
        expected = engine.generate(requests(8))
        assert first.generate_requests > 1 and second.generate_requests > 1  # both share the load
        second.stop()
        before = first.generate_requests
        assert engine.generate(requests(8)) == expected
        assert first.generate_requests - before >= 8
        (down,) = [s for s in engine.servers() if not s.up]
        assert down.url == second.url and "cannot connect" in down.reason
        second.start()
        wait_until(lambda: all(s.up for s in engine.servers()), 10, "the server back in use")
        served = second.generate_requests
        assert engine.generate(requests(8)) == expected
        assert second.generate_requests > served
    finally:
        engine.close()


def test_a_server_restarted_mid_request_loses_nothing(tiny_model, fakes):
    fake = fakes()
    engine = engine_for(tiny_model, fake)
    try:
        expected = engine.generate(requests(4, start=10))
        fake.faults.delay_s = 1.0
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(requests(4, start=10))))
        thread.start()
        wait_until(lambda: fake.generate_requests >= 8, 10, "the requests at the server")
        fake.stop()  # in-flight connections drop; the server is down for a while
        fake.faults.delay_s = 0.0
        time.sleep(0.5)
        fake.start()
        thread.join(30)
        assert result["out"] == expected
    finally:
        engine.close()


def test_when_every_server_is_down_the_worker_waits_and_status_says_so(tiny_model, fakes, redis_url):
    first, second = fakes(), fakes()
    engine = engine_for(tiny_model, first, second)
    waits = ServerWaits(resilient_client(redis_url), "fleet")
    reporter = OutageReporter(engine.outage, waits, worker="host:1", interval_s=0.1)
    try:
        expected = engine.generate(requests(3, start=20))
        assert engine.outage() is None and waits.all() == []
        first.stop()
        second.stop()
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(requests(3, start=20))))
        thread.start()
        (waiting,) = wait_until(lambda: waits.all() or None, 10, "the outage recorded")
        assert waiting.worker == "host:1" and set(waiting.servers) == {first.url, second.url}
        assert all("cannot connect" in why for why in waiting.servers.values())
        assert "every inference server has been down" in waiting.describe(time.time())
        time.sleep(1.0)
        assert thread.is_alive() and "out" not in result  # waiting, nothing failed
        second.start()
        thread.join(30)
        assert result["out"] == expected
        wait_until(lambda: waits.all() == [], 10, "the outage record cleared")
    finally:
        reporter.stop()
        engine.close()


def test_a_warm_stop_hands_back_tasks_waiting_for_a_server(tiny_model, fakes):
    fake = fakes()
    engine = engine_for(tiny_model, fake)
    try:
        fake.stop()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                engine.generate(requests(2))
            except BaseException as exc:  # checked below
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: engine.outage(), 10, "every server down")
        engine.begin_shutdown()
        thread.join(10)
        assert len(errors) == 1 and isinstance(errors[0], WorkerShuttingDown)
    finally:
        engine.close()


def test_the_api_key_comes_from_the_environment_and_is_sent(tiny_model, fakes, monkeypatch):
    fake = fakes(api_key="s3cret")
    with pytest.raises(ConfigError, match="the environment variable DFQ_TEST_KEY is not set"):
        engine_for(tiny_model, fake, api_key_env="DFQ_TEST_KEY")
    monkeypatch.setenv("DFQ_TEST_KEY", "wrong")
    with pytest.raises(ConfigError, match="answered 401") as refused:
        engine_for(tiny_model, fake, api_key_env="DFQ_TEST_KEY")
    assert "wrong" not in str(refused.value)
    monkeypatch.setenv("DFQ_TEST_KEY", "s3cret")
    engine = engine_for(tiny_model, fake, api_key_env="DFQ_TEST_KEY")
    try:
        assert len(engine.generate(requests(2))) == 2
    finally:
        engine.close()


def test_the_lane_dead_letters_a_refused_sample_alone_and_stores_the_rest(make_config, fakes):
    fake = fakes()
    config = make_config(
        generate={"engine": "server"},
        **{"generate.server": {"urls": [fake.url], "kind": "sglang", "model": "tiny-qwen3"},
           "generate.sampling": SAMPLING, "dataset": {"shard_size": 8, "thinking": "always", "max_model_len": 1024}},
    )
    samples = [Sample(f"lane-{i}", (Message("user", f"Tell me about topic {i}."),), "test") for i in range(6)]
    storage = open_storage(config.storage)
    shard_id = stage_samples(storage, samples)
    lane = build_generate_lane(config, storage)
    prompts = [lane.formatter.prompt_ids(s.messages, enable_thinking=True) for s in samples]
    (poison,) = set(prompts[3]) - {token for i, ids in enumerate(prompts) if i != 3 for token in ids}
    fake.faults.refused_token = poison
    try:
        summary = lane.run(shard_id)
    finally:
        lane.close()
    poisoned = dict(summary.poisoned)
    assert list(poisoned) == ["lane-3"]
    assert f"Token id {poison} is not allowed here" in str(poisoned["lane-3"])
    stored = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    assert [r.id for r in stored] == [s.id for s in samples if s.id != "lane-3"]
    assert lane.outage_reporter is not None  # status hears of this worker when its servers are all down
