"""The vLLM engine on vLLM's CPU build and the tiny model: exact outputs, budgets, threads, shutdown."""

from __future__ import annotations

import os
import threading

import pytest
from transformers import AutoTokenizer

from dflash_queue.config import load_config
from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Message
from dflash_queue.engines.base import GenerationRequest, request_seed
from dflash_queue.engines.vllm.generate import (
    VllmGenerateEngine,
    check_platform,
    engine_args,
    sampling_kwargs,
)
from dflash_queue.errors import ConfigError, EngineUnavailable, GenerationRejected
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config
from dfq_testing.processes import descendants, describe, survivors

pytestmark = pytest.mark.vllm

MAX_TOKENS = 40
TOPICS = [
    "rivers", "code", "the moon", "tea", "graphs", "rain", "salt", "maps", "ice", "wind", "trains", "clocks",
    "bees", "glass", "paper", "stars", "bread", "chess", "wolves", "copper", "tides", "ink", "owls", "sand",
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_config(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    tables = tiny_config_tables(tiny_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    # Temperature 1 without truncation: the tiny model then ends a reply with probability ~3% per token, so a
    # batch has replies that stop and replies that run out of budget.
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_TOKENS, "seed": 7}
    overrides = {**tiny_vllm_overrides(), "generate.sampling": sampling}
    return load_config(write_config(tmp / "vllm.toml", tables, **overrides))


@pytest.fixture(scope="module")
def started(vllm_config):
    """The module's engine and the processes it started (multiprocessing's resource tracker aside: it is shared by
    the whole test process and ends when its parent does)."""
    before = {p.pid for p in descendants(os.getpid())}
    engine = VllmGenerateEngine(vllm_config.model, vllm_config.generate.vllm, vllm_config.generate.sampling)
    processes = [p for p in descendants(os.getpid())
                 if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    yield engine, processes
    engine.close()


@pytest.fixture(scope="module")
def engine(started):
    return started[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def eos_ids(tokenizer):
    return {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}


@pytest.fixture(scope="module")
def requests(tokenizer):
    formatter = ChatFormatter(tokenizer)
    return [
        GenerationRequest(
            f"sample-{index}",
            formatter.prompt_ids((Message("user", f"Tell me about {topic}."),), enable_thinking=index % 2 == 0),
        )
        for index, topic in enumerate(TOPICS)
    ]


@pytest.fixture(scope="module")
def generations(engine, requests):
    return engine.generate(requests)


def test_sampling_follows_the_config_with_a_seed_per_sample(vllm_config):
    from vllm import SamplingParams

    sampling = vllm_config.generate.sampling
    first = sampling_kwargs(sampling, GenerationRequest("a", [1, 2]))
    again = sampling_kwargs(sampling, GenerationRequest("a", [3]))
    other = sampling_kwargs(sampling, GenerationRequest("b", [1, 2], max_tokens=99))
    assert first["seed"] == again["seed"] == request_seed(7, "a") != other["seed"]
    assert request_seed(8, "a") != request_seed(7, "a")
    retry = sampling_kwargs(sampling, GenerationRequest("a", [1, 2], attempt=1))
    assert retry["seed"] == request_seed(7, "a", 1) != first["seed"]
    assert (first["max_tokens"], other["max_tokens"]) == (MAX_TOKENS, 99)
    assert (first["temperature"], first["top_p"], first["top_k"], first["stop"]) == (1.0, 1.0, 0, None)
    strict = sampling.model_copy(update={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop": ("\n\n",)})
    params = SamplingParams(**sampling_kwargs(strict, GenerationRequest("a", [1])))  # vLLM accepts them
    assert (params.top_k, params.min_p, params.repetition_penalty, params.stop) == (20, 0.05, 1.1, ["\n\n"])


def test_engine_arguments_pass_the_settings_through(vllm_config):
    args = engine_args(vllm_config.model, vllm_config.generate.vllm)
    assert args["model"] == vllm_config.model.path
    assert args["dtype"] == "float32" and args["max_model_len"] == 1024 and args["max_num_seqs"] == 32
    assert args["kv_cache_memory_bytes"] == 2**30 and args["enforce_eager"] is True
    assert "max_num_batched_tokens" not in args  # 0 leaves vLLM's default
    settings = vllm_config.generate.vllm.model_dump()
    follows_model = vllm_config.with_overrides(model={"dtype": "bfloat16"}, generate={"vllm": {**settings, "dtype": ""}})
    assert engine_args(follows_model.model, follows_model.generate.vllm)["dtype"] == "bfloat16"
    assert "language_model_only" not in args


def test_a_multimodal_checkpoint_runs_its_language_model_only(vllm_config, tiny_family):
    multimodal = vllm_config.with_overrides(model={"path": str(tiny_family("qwen3_5"))})
    assert engine_args(multimodal.model, multimodal.generate.vllm)["language_model_only"] is True
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert AsyncEngineArgs(**engine_args(multimodal.model, multimodal.generate.vllm)).language_model_only  # vLLM takes the argument


def test_cpu_build_refuses_chunked_prefill_before_starting(vllm_config):
    settings = vllm_config.generate.vllm.model_dump()
    chunked = vllm_config.with_overrides(generate={"vllm": {**settings, "enable_chunked_prefill": True}})
    with pytest.raises(ConfigError, match=r"generate\.vllm\.enable_chunked_prefill must be false"):
        check_platform(chunked.generate.vllm, chunked.generate.sampling, chunked.source)
    check_platform(vllm_config.generate.vllm, vllm_config.generate.sampling, vllm_config.source)


def test_generations_keep_vllms_ids_and_finish_reasons(generations, requests, eos_ids):
    assert [g.sample_id for g in generations] == [r.sample_id for r in requests]
    reasons = set()
    for request, generation in zip(requests, generations):
        assert generation.prompt_ids == request.prompt_ids
        assert not eos_ids & set(generation.completion_ids[:-1])
        if generation.finish_reason == "stop":
            # The end-of-sequence token is part of what was generated, so the extract lane prefills it too.
            assert generation.completion_ids[-1] in eos_ids
            assert len(generation.completion_ids) <= MAX_TOKENS
        else:
            assert generation.finish_reason == "length"
            assert len(generation.completion_ids) == MAX_TOKENS
        reasons.add(generation.finish_reason)
    assert reasons == {"stop", "length"}


def test_a_reply_does_not_depend_on_what_shared_the_engine(engine, requests, generations):
    # Four threads at once, each with an interleaved quarter of the requests, as concurrent tasks would.
    parts = [requests[start::4] for start in range(4)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(parts))

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = engine.generate(parts[index])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    expected = {g.sample_id: g for g in generations}
    for index, part in enumerate(parts):
        assert results[index] == [expected[r.sample_id] for r in part]
    # One at a time gives the same replies again.
    assert engine.generate(requests[:2]) == generations[:2]
    assert engine.generate([requests[5]]) == [generations[5]]


def test_per_request_budgets_are_honoured(engine, requests, generations):
    truncated = [i for i, g in enumerate(generations) if g.finish_reason == "length"]
    index = truncated[0]
    short, longer = engine.generate(
        [
            GenerationRequest(requests[index].sample_id, requests[index].prompt_ids, max_tokens=5),
            # Above the configured budget, as a retry with a larger budget asks.
            GenerationRequest(requests[index].sample_id, requests[index].prompt_ids, max_tokens=3 * MAX_TOKENS),
        ]
    )
    first = generations[index].completion_ids
    assert short.finish_reason == "length" and short.completion_ids == first[:5]
    assert len(longer.completion_ids) > MAX_TOKENS
    assert longer.completion_ids[:MAX_TOKENS] == first  # the same seed replays the same start


def test_prompts_longer_than_one_step_budget_are_served(engine):
    # More prompt tokens than one engine step takes: with chunked prefill a prompt would be split across
    # steps, which vLLM's CPU build cannot do for seeded requests.
    requests = [GenerationRequest(f"long-{i}", [(7 * i + j) % 1400 + 10 for j in range(700)]) for i in range(8)]
    generations = engine.generate(requests)
    assert [g.prompt_ids for g in generations] == [r.prompt_ids for r in requests]
    assert all(0 < len(g.completion_ids) <= MAX_TOKENS for g in generations)


def test_a_refused_request_names_its_sample_and_spares_the_engine(engine, requests, generations):
    too_long = GenerationRequest("sample-too-long", [100] * 1100)  # max_model_len is 1024
    with pytest.raises(GenerationRejected, match="sample-too-long"):
        engine.generate([requests[0], too_long])
    assert engine.generate([requests[0]]) == [generations[0]]


def test_close_stops_vllms_processes(started, requests, generations):
    """Last in the module: it closes the module's engine."""
    engine, processes = started
    assert any("EngineCore" in p.name() for p in processes), describe(processes)
    engine.close()
    left = survivors(processes, timeout=60)
    assert not left, f"engine processes outlived close(): {describe(left)}"
    with pytest.raises(EngineUnavailable):
        engine.generate(requests[:1])
    engine.close()  # closing twice is harmless
