"""The inference-server engine on real `vllm serve` processes of vLLM's CPU build (the `vllm_servers` session
fixture) and on the fake SGLang server relaying to one: replies token for token the in-process vLLM engine's,
the start-up checks, two servers sharing a worker's load, and whole jobs through real workers (states exact to
the model's own forward, a server killed and restarted mid-job)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dflash_queue import faults
from dflash_queue.config import Config, load_config
from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Message, Sample
from dflash_queue.engines.base import Generation, GenerationRequest
from dflash_queue.engines.config import SamplingConfig
from dflash_queue.engines.server.generate import ServedTarget, ServerGenerateEngine, ServerRejectedSample
from dflash_queue.engines.vllm.generate import VllmGenerateEngine
from dflash_queue.errors import ConfigError
from dflash_queue.ops.status import WorkerView, collect_status
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config
from dfq_testing.fake_sglang import FakeSglang, VllmBackend
from dfq_testing.jobs import exactly_once_problems, first_lines
from dfq_testing.polling import wait_for_states, wait_until
from dfq_testing.processes import descendants, describe
from dfq_testing.references import reference_model, reference_states
from dfq_testing.servers import MAX_MODEL_LEN, SERVED_NAME
from dfq_testing.vllm_forkserver import forked_engine_cores
from dfq_testing.vllm_uniproc import model_workers, uniproc_executor
from dfq_testing.vocabularies import swapped_vocabulary

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.vllm

MAX_TOKENS = 40
# Temperature 1 without truncation: replies that stop and replies that run out of budget.
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_TOKENS, "seed": 7}
GREEDY = {**SAMPLED, "temperature": 0.0}
TOPICS = ["rivers", "code", "the moon", "tea", "graphs", "rain", "salt", "maps", "ice", "wind", "trains", "clocks"]
JOB_SAMPLES = 24


@pytest.fixture(scope="module")
def formatter(tiny_model):
    return ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))


@pytest.fixture(scope="module")
def topic_requests(formatter):
    return [
        GenerationRequest(
            f"topic-{index}",
            formatter.prompt_ids((Message("user", f"Tell me about {topic}."),), enable_thinking=index % 2 == 0),
        )
        for index, topic in enumerate(TOPICS)
    ]


@pytest.fixture(scope="module")
def job_samples() -> list[Sample]:
    return [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:JOB_SAMPLES]


@pytest.fixture(scope="module")
def job_requests(job_samples, formatter):
    """The job's prompts as the generate lane renders them (thinking on: the tiny config's policy is "always")."""
    return [GenerationRequest(s.id, formatter.prompt_ids(s.messages, enable_thinking=True)) for s in job_samples]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory, topic_requests, job_requests) -> dict[str, dict[str, Generation]]:
    """What the in-process vLLM engine generates, by sampling ("sampled", "greedy") and sample id: the topics in
    both, the job's samples sampled. The engine is closed before the servers are used. Its model runs in its engine
    core's process (dfq_testing/vllm_uniproc.py), as the servers' do."""
    tmp = tmp_path_factory.mktemp("reference")
    tables = tiny_config_tables(tiny_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    config = load_config(write_config(tmp / "vllm.toml", tables, **tiny_vllm_overrides(), **{"generate.sampling": SAMPLED}))
    with forked_engine_cores(), uniproc_executor():
        engine = VllmGenerateEngine(config.model, config.generate.vllm, config.generate.sampling)
    try:
        sampled = engine.generate(topic_requests + job_requests)
        # The engine reads its sampling settings per request: the same engine, greedy.
        engine.sampling = SamplingConfig.model_validate(GREEDY)
        greedy = engine.generate(topic_requests)
    finally:
        engine.close()
    return {"sampled": {g.sample_id: g for g in sampled}, "greedy": {g.sample_id: g for g in greedy}}


@pytest.fixture(scope="module")
def server(vllm_servers):
    return vllm_servers.get(0)


def server_engine(tiny_model, urls, sampling=SAMPLED, *, kind="vllm", model=SERVED_NAME, tokenizer=None,
                  context_len=MAX_MODEL_LEN, **server) -> ServerGenerateEngine:
    from dflash_queue.engines.config import GenerateConfig

    settings = GenerateConfig.model_validate({
        "engine": "server",
        "server": {"urls": list(urls), "kind": kind, "model": model, "backoff_initial_s": 0.2, **server},
        "sampling": sampling,
    })
    target = ServedTarget(model, str(tokenizer or tiny_model), context_len)
    return ServerGenerateEngine(settings.server, settings.sampling, target)


def assert_same(generations: list[Generation], expected: dict[str, Generation], *, text: bool = True) -> None:
    reasons = set()
    for generation in generations:
        want = expected[generation.sample_id]
        assert generation.prompt_ids == want.prompt_ids
        assert generation.completion_ids == want.completion_ids, generation.sample_id
        assert generation.finish_reason == want.finish_reason, generation.sample_id
        if text:
            assert generation.text == want.text
        reasons.add(generation.finish_reason)
    assert reasons == {"stop", "length"} or all(g.finish_reason == "length" for g in generations)


@pytest.mark.parametrize("sampling", ["sampled", "greedy"])
def test_vllm_server_replies_are_the_in_process_engines_token_for_token(
    tiny_model, server, reference, topic_requests, sampling
):
    engine = server_engine(tiny_model, [server.url], SAMPLED if sampling == "sampled" else GREEDY)
    try:
        assert_same(engine.generate(topic_requests), reference[sampling])
    finally:
        engine.close()


@pytest.mark.parametrize("sampling", ["sampled", "greedy"])
def test_sglang_protocol_replies_are_the_in_process_engines_token_for_token(
    tiny_model, server, reference, topic_requests, sampling
):
    # The fake SGLang server relays each /generate to the vLLM server (sampling_seed as vLLM's seed).
    fake = FakeSglang(tiny_model, VllmBackend(server.url, SERVED_NAME)).start()
    try:
        engine = server_engine(tiny_model, [fake.url], SAMPLED if sampling == "sampled" else GREEDY, kind="sglang")
        try:
            # SGLang's text keeps the stop token (no_stop_trim); the ids are what must agree.
            assert_same(engine.generate(topic_requests), reference[sampling], text=False)
        finally:
            engine.close()
    finally:
        fake.close()


def test_the_openai_kind_sends_only_openai_keys_and_gets_the_same_ids(tiny_model, server, reference, topic_requests):
    engine = server_engine(tiny_model, [server.url], kind="openai")
    try:
        assert_same(engine.generate(topic_requests), reference["sampled"], text=False)
    finally:
        engine.close()


def test_the_server_runs_its_model_in_its_engine_cores_process(server):
    """As vLLM serves a model from one GPU (dfq_testing/servers.py): no model worker process beside the core."""
    processes = descendants(server.process.pid)
    assert any("EngineCore" in p.name() for p in processes), describe(processes)
    assert not model_workers(processes), describe(processes)


def test_a_reply_does_not_depend_on_what_shared_the_servers(tiny_model, server, reference, topic_requests):
    engine = server_engine(tiny_model, [server.url])
    parts = [topic_requests[start::3] for start in range(3)]
    results: dict[int, list[Generation]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(parts))

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = engine.generate(parts[index])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(parts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        for index, part in enumerate(parts):
            assert results[index] == [reference["sampled"][r.sample_id] for r in part]
        # Per-request budgets: a shorter one is the same reply cut, as the same seed replays the same start.
        truncated = next(r for r in topic_requests if reference["sampled"][r.sample_id].finish_reason == "length")
        (short,) = engine.generate([GenerationRequest(truncated.sample_id, truncated.prompt_ids, max_tokens=5)])
        assert short.finish_reason == "length"
        assert short.completion_ids == reference["sampled"][truncated.sample_id].completion_ids[:5]
    finally:
        engine.close()


def test_a_request_over_the_servers_context_is_rejected_alone_with_its_words(
    tiny_model, server, reference, topic_requests
):
    engine = server_engine(tiny_model, [server.url])
    try:
        too_long = GenerationRequest("too-long", [100] * (MAX_MODEL_LEN + 76))
        with pytest.raises(ServerRejectedSample, match=r"too-long.*maximum context length is 1024") as rejected:
            engine.generate([topic_requests[0], too_long])
        assert rejected.value.sample_ids == ("too-long",)
        assert engine.generate([topic_requests[0]]) == [reference["sampled"][topic_requests[0].sample_id]]
    finally:
        engine.close()


def test_two_servers_share_one_workers_load(tiny_model, vllm_servers, reference, topic_requests):
    first, second = vllm_servers.get(0), vllm_servers.get(1)
    before = first.requests_finished(), second.requests_finished()
    engine = server_engine(tiny_model, [first.url, second.url])
    try:
        assert_same(engine.generate(topic_requests), reference["sampled"])
        sent = {s.url: s.sent for s in engine.servers()}
    finally:
        engine.close()
    served = first.requests_finished() - before[0], second.requests_finished() - before[1]
    # Each server saw a share, besides the start-up check's two probes (one token; the weights probe).
    assert min(served) >= 2 + 3, served
    assert sum(served) == 2 * 2 + len(topic_requests)
    assert sent == {first.url: served[0] - 2, second.url: served[1] - 2}


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("name", "serves tiny-qwen3, not tiny-qwen3-27b"),
        ("vocabulary", "its tokenizer gives other token ids than the local one"),
        ("context", "its context is 1024 tokens, shorter than the 4096"),
    ],
)
def test_a_server_of_another_model_is_refused(tiny_model, server, tmp_path_factory, case, refusal):
    settings = {
        "name": {"model": "tiny-qwen3-27b"},
        "vocabulary": {"tokenizer": swapped_vocabulary(tiny_model, tmp_path_factory.getbasetemp() / "swapped")},
        "context": {"context_len": 4096},
    }[case]
    with pytest.raises(ConfigError, match="no inference server can serve") as refused:
        server_engine(tiny_model, [server.url], **settings)
    assert f"{server.url}: " in str(refused.value) and refusal in str(refused.value)


# -- whole jobs through real workers ---------------------------------------------------------------------------


def server_job_config(make_config, urls, **server) -> Config:
    return make_config(
        generate={"engine": "server"},
        **{
            "generate.server": {"urls": list(urls), "model": SERVED_NAME, "inflight_tasks": 2,
                                "backoff_initial_s": 0.5, "backoff_max_s": 2.0, **server},
            "generate.sampling": SAMPLED,
            "dataset": {"shard_size": 8, "thinking": "always", "max_model_len": MAX_MODEL_LEN},
            "extract": {"hidden_dtype": "float32"},
            "quality": {"on_empty": "flag", "on_repetition": "flag", "on_unclosed_thinking": "flag",
                        "on_truncated": "flag", "on_stub": "flag", "on_short": "flag"},
        },
    )


def stored_records(config: Config, shard_ids: list[str]) -> dict:
    storage = open_storage(config.storage)
    return {
        record.id: record
        for shard_id in shard_ids
        for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    }


@pytest.mark.slow
def test_a_job_on_a_vllm_server_stores_the_in_process_replies_and_exact_states(
    make_config, server, reference, job_requests, start_worker, redis_url, tmp_path, tiny_model
):
    config = server_job_config(make_config, [server.url])
    dataset = first_lines(SAMPLE, 16, tmp_path / "prompts.jsonl")
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=600, workers=workers)

    expected = {r.sample_id: r for r in job_requests}
    records = stored_records(config, report.shard_ids)
    assert len(records) == 16
    for sample_id, record in records.items():
        want = reference["sampled"][sample_id]
        assert record.prompt_ids == expected[sample_id].prompt_ids == want.prompt_ids
        assert record.completion_ids == want.completion_ids, sample_id
        assert record.finish_reason == want.finish_reason
    assert {r.finish_reason for r in records.values()} == {"stop", "length"}

    model = reference_model(tiny_model)
    storage = open_storage(config.storage)
    for shard_id in report.shard_ids:
        with storage.local_copy(shard_key(shard_id)) as path:
            shard = TrainingShard(path)
            captured = list(zip(shard.layer_ids, shard.index.layer_states))
            for index in range(len(shard)):
                item = shard[index]
                record = records[item.id]
                assert item.input_ids.tolist() == record.prompt_ids + record.completion_ids
                want = reference_states(model, item.input_ids, captured)
                got = item.hidden_states.float()
                assert got.shape == want.shape
                for k in range(got.shape[1]):
                    scale = float(want[:, k].abs().max())
                    torch.testing.assert_close(got[:, k], want[:, k], rtol=1e-5, atol=1e-4 * scale)
    assert exactly_once_problems(config, dataset) == []


@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_job_loses_and_duplicates_nothing(
    make_config, server, reference, start_worker, redis_url, tmp_path
):
    config = server_job_config(make_config, [server.url])
    dataset = first_lines(SAMPLE, JOB_SAMPLES, tmp_path / "prompts.jsonl")
    # Each task waits 3 s before it generates (two at a time): once a shard is generated, the third one's requests
    # are seconds away, so the kill lands mid-job even when the test process is slow to see the first shard.
    generate = start_worker(config, "generate", env={faults.ENV: json.dumps({"task_delay_s": 3})})
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.enqueued == 3
    wait_until(
        lambda: any(s == GENERATED for s in ledger.states(report.shard_ids).values()), 300, "a shard generated",
        [generate], poll_s=0.05,
    )
    server.kill()  # mid-job: the third shard's requests are on their way
    status = wait_until(
        lambda: (s := collect_status(config, workers=WorkerView())).servers_down and s, 60,
        "status showing the worker waiting for its server", [generate],
    )
    (waiting,) = status.servers_down
    assert list(waiting.servers) == [server.url] and "cannot connect" in waiting.servers[server.url]
    time.sleep(3)
    assert generate.alive()  # waiting, not failing its tasks
    assert ledger.counters().get("generate_shards", 0) < 3
    server.start()
    extract = start_worker(config, "extract")
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=600, workers=[generate, extract])
    assert exactly_once_problems(config, dataset) == []
    assert ledger.counters()["generate_shards"] == 3  # no shard generated twice, none dead-lettered
    records = stored_records(config, report.shard_ids)
    for sample_id, record in records.items():
        assert record.completion_ids == reference["sampled"][sample_id].completion_ids, sample_id
    # The worker's record goes within a refresh interval of the server coming back.
    wait_until(lambda: collect_status(config, workers=WorkerView()).servers_down == [], 30, "the wait's record gone")
