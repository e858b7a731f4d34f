from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Message
from dflash_queue.engines.base import GenerationRequest
from dflash_queue.engines.hf.generate import TransformersGenerateEngine


@pytest.fixture(scope="module")
def engine_config(tiny_model, tmp_path_factory):
    from dflash_queue.config import load_config
    from dfq_testing.configs import tiny_config_tables, write_config

    tmp = tmp_path_factory.mktemp("gen")
    tables = tiny_config_tables(tiny_model, tmp / "s", "redis://127.0.0.1:1/0", tmp / "state")
    return load_config(write_config(tmp / "c.toml", tables, **{"generate.sampling": {"max_tokens": 24}}))


@pytest.fixture(scope="module")
def engine(engine_config):
    return TransformersGenerateEngine(engine_config.model, engine_config.generate.sampling, batch_size=engine_config.generate.batch_size)


@pytest.fixture(scope="module")
def formatter(tiny_model):
    return ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))


def test_thinking_off_prompt_ends_with_an_empty_think_block(formatter):
    messages = (Message("user", "What is a prime number?"),)
    on = formatter.prompt_ids(messages, enable_thinking=True)
    off = formatter.prompt_ids(messages, enable_thinking=False)
    assert off[: len(on)] == on
    tail = formatter.tokenizer.decode(off[len(on) :])
    assert tail == "<think>\n\n</think>\n\n"


def test_generations_keep_exact_ids_and_finish_reasons(engine, formatter):
    prompts = [formatter.prompt_ids((Message("user", f"Tell me about {w}."),), enable_thinking=True)
               for w in ["rivers", "code", "the moon", "tea", "graphs", "rain", "salt", "maps", "ice", "wind",
                         "trains", "clocks", "bees", "glass", "paper", "stars"]]
    requests = [GenerationRequest(str(i), ids) for i, ids in enumerate(prompts)]
    generations = engine.generate(requests)
    assert [g.sample_id for g in generations] == [r.sample_id for r in requests]
    reasons = set()
    for request, generation in zip(requests, generations):
        assert generation.prompt_ids == request.prompt_ids
        assert engine.pad_id not in generation.completion_ids[:-1]
        if generation.finish_reason == "stop":
            assert generation.completion_ids[-1] in engine.eos_ids
            assert len(generation.completion_ids) <= 24
        else:
            assert generation.finish_reason == "length"
            assert len(generation.completion_ids) == 24
        reasons.add(generation.finish_reason)
    assert reasons == {"stop", "length"}


def test_generation_is_reproducible_for_the_same_samples(engine, formatter):
    ids = formatter.prompt_ids((Message("user", "Count to five."),), enable_thinking=True)
    requests = [GenerationRequest("x", ids), GenerationRequest("y", ids)]
    assert engine.generate(requests) == engine.generate(requests)


def test_per_request_budget(engine, formatter):
    ids = formatter.prompt_ids((Message("user", "Write a long story."),), enable_thinking=True)
    short, long = engine.generate([GenerationRequest("s", ids, max_tokens=3), GenerationRequest("l", ids, max_tokens=30)])
    assert len(short.completion_ids) <= 3 and len(long.completion_ids) <= 30
