"""Turns and the quality gate in the generate lane, on the real Transformers engine and the tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.lanes.extract import ExtractLane, build_extractor
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine
from dflash_queue.lanes.turns import split_turns
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dflash_queue.storage.keys import completions_key, prompts_key, shard_key

REPO = Path(__file__).resolve().parents[2]
MULTI_TURN = REPO / "examples" / "sharegpt_sample.jsonl"


def stage(config, samples: list[Sample]):
    storage = open_storage(config.storage.url)
    shard_id = prompt_shard_id(samples)
    storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
    return storage, shard_id


def example_samples(regenerate: str, thinking: str, count: int, *, multi_turn_only: bool = False) -> list[Sample]:
    samples = [s for s in read_dataset([MULTI_TURN], max_record_bytes=1 << 20, regenerate=regenerate)
               if isinstance(s, Sample)]
    if multi_turn_only:
        samples = [s for s in samples if s.num_turns > 1]
    return [apply_thinking_policy(s, thinking) for s in samples[:count]]


def test_every_assistant_turn_regenerated_on_the_exact_ids(make_config):
    config = make_config(dataset={"regenerate": "all", "thinking": "never"}, **{"generate.sampling": {"max_tokens": 12}})
    samples = example_samples("all", "never", 4, multi_turn_only=True)
    assert sum(s.num_turns for s in samples) > len(samples)
    storage, shard_id = stage(config, samples)
    lane = GenerateLane(config, build_generate_engine(config), storage)
    summary = lane.run(shard_id)
    records = {r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)}
    formatter = lane.formatter

    for sample in samples:
        record = records[sample.id]
        assert record.quality is not None
        if not record.kept:
            continue
        first, between = split_turns(sample)
        assert len(record.earlier_turns) == sample.num_turns - 1
        # Rebuild the sequence from its parts: the first prompt, then each generated turn followed by the
        # template's continuation. Nothing was re-tokenised on the way.
        expected = formatter.prompt_ids(first, enable_thinking=False)
        for span, messages in zip(record.earlier_turns, between):
            assert span.start == len(expected)
            generated = record.prompt_ids[span.start : span.end]
            assert 0 < len(generated) <= 12
            expected += generated
            last = generated[-1] if span.finish_reason == "stop" else None
            expected += formatter.continuation_ids(messages, enable_thinking=False, last_token=last)
        assert record.prompt_ids == expected
        mask = record.loss_mask()
        assert sum(mask) == len(record.completion_ids) + sum(t.end - t.start for t in record.earlier_turns)
        assert mask[-len(record.completion_ids):] == [1] * len(record.completion_ids)
        text = formatter.tokenizer.decode(record.input_ids)
        for message in sample.messages:
            assert message.content in text  # every user turn is in the sequence, in order
    assert summary.completion_tokens == sum(r.generated_tokens for r in records.values())
    # Finish reasons are counted per generated turn, not per sample's last turn.
    counters = summary.counters()
    turns = sum(1 + len(r.earlier_turns) for r in records.values())
    assert counters.get("finish_stop", 0) + counters.get("finish_length", 0) == turns > len(records)

    extract = ExtractLane(config, build_extractor(config), storage)
    extract.run(shard_id)
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        for index in range(len(shard)):
            item = shard[index]
            record = records[item.id]
            assert item.input_ids.tolist() == record.input_ids
            assert item.loss_mask.tolist() == record.loss_mask()


def test_truncations_are_retried_once_with_the_larger_budget(make_config):
    config = make_config(
        dataset={"thinking": "never"},
        quality={"on_truncated": "retry", "retry_max_tokens": 40, "on_stub": "flag", "on_repetition": "flag",
                 "on_empty": "flag", "on_retry_failure": "flag"},
        **{"generate.sampling": {"max_tokens": 4}},
    )
    samples = example_samples("last", "never", 16)
    storage, shard_id = stage(config, samples)
    summary = GenerateLane(config, build_generate_engine(config), storage).run(shard_id)
    records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    retried = [r for r in records if "truncated" in r.quality.retried]
    # The tiny model stops with ~3% probability per token: four tokens truncate most replies.
    assert len(retried) >= 8
    assert summary.gate["gate_truncated_retry"] == len(retried) == summary.gate["gate_retried"]
    for record in records:
        if record in retried:
            assert len(record.completion_ids) <= 40
            still = record.finish_reason == "length"
            assert ("truncated" in record.quality.flags) == still
            assert record.quality.decision == ("flag" if record.quality.flags else "keep")
        else:
            assert len(record.completion_ids) <= 4 and record.finish_reason == "stop"
    assert any(len(r.completion_ids) > 4 for r in retried)  # only a retry can be longer than the budget
    assert summary.kept == len(records)


@pytest.fixture
def thinking_template_model(tiny_model, tmp_path) -> Path:
    """The tiny model with a template that opens `<think>` in the generation prompt (as some reasoning models'
    templates do): the completion then holds only the closing tag, if any."""
    model = tmp_path / "tiny-open-think"
    shutil.copytree(tiny_model, model)
    template = (model / "chat_template.jinja").read_text()
    marker = "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking"
    assert marker in template
    opened = "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- if enable_thinking"
    (model / "chat_template.jinja").write_text(template.replace(marker, opened))
    return model


def test_thinking_that_never_closes_is_dropped_and_still_accounted_for(make_config, thinking_template_model):
    config = make_config(
        model={"path": str(thinking_template_model)},
        dataset={"thinking": "always"},
        quality={"on_unclosed_thinking": "drop", "on_truncated": "flag", "on_stub": "flag"},
        **{"generate.sampling": {"max_tokens": 12}},
    )
    samples = example_samples("last", "always", 8)
    storage, shard_id = stage(config, samples)
    summary = GenerateLane(config, build_generate_engine(config), storage).run(shard_id)
    records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    assert [r.id for r in records] == [s.id for s in samples]  # dropped ones are recorded too
    dropped = [r for r in records if not r.kept]
    assert len(dropped) >= 6  # `</think>` is one token in ~1,500: it almost never comes within 12 tokens
    for record in dropped:
        assert record.quality.decision == "drop" and "unclosed_thinking" in record.quality.flags
        assert record.quality.thinking == "unclosed" and record.quality.answer_tokens == 0
        assert "<think>" not in record.text  # the block was opened by the prompt, not the completion
    assert summary.gate["gate_drop"] == len(dropped) == summary.gate["gate_unclosed_thinking_drop"]

    ExtractLane(config, build_extractor(config), storage).run(shard_id)
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        assert len(shard) == len(records) - len(dropped)
        assert {d["id"] for d in shard.dropped} == {r.id for r in dropped}
        assert all(d["flags"] and "unclosed_thinking" in d["flags"] for d in shard.dropped)


def test_thinking_is_recorded_as_the_prompt_did_it(
    make_config, tiny_model_with_template, thinking_template_model, tmp_path
):
    """With `auto`, some samples ask for thinking off; a thinking-only template opens <think> anyway, so every
    reply starts inside a thinking block and is recorded `thinking = true`. A template with a switch records
    what was asked."""
    from dflash_queue.testing.templates import THINKING_ONLY_TEMPLATE

    every = example_samples("last", "auto", 50)
    samples = [s for s in every if s.thinking][:3] + [s for s in every if not s.thinking][:3]
    assert {s.thinking for s in samples} == {True, False}
    for model, expected in (
        (tiny_model_with_template(THINKING_ONLY_TEMPLATE), {s.id: True for s in samples}),
        (thinking_template_model, {s.id: s.thinking for s in samples}),
    ):
        config = make_config(
            f"{model.name}.toml", model={"path": str(model)}, dataset={"thinking": "auto"},
            storage={"url": str(tmp_path / f"storage-{model.name}")}, **{"generate.sampling": {"max_tokens": 6}},
        )
        storage, shard_id = stage(config, samples)
        GenerateLane(config, build_generate_engine(config), storage).run(shard_id)
        records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
        assert {r.id: r.thinking for r in records} == expected, model.name


def test_a_generate_worker_refuses_a_policy_its_template_cannot_honour(make_config, tiny_model_with_template, start_worker):
    from dflash_queue.testing.templates import THINKING_ONLY_TEMPLATE

    config = make_config(model={"path": str(tiny_model_with_template(THINKING_ONLY_TEMPLATE))},
                         dataset={"thinking": "never"})
    with pytest.raises(RuntimeError, match="generate worker exited") as failed:
        start_worker(config, "generate")
    assert "dataset.thinking = 'never' cannot be honoured" in str(failed.value)


TOOL_USE = REPO / "examples" / "tool_use_sample.jsonl"


@pytest.mark.parametrize("regenerate", ["last", "all"])
def test_tool_conversations_keep_their_calls_results_and_tool_schemas(make_config, tiny_model, regenerate):
    """The records' `tools` reach the template (its tools block is in every prompt); assistant turns that call
    tools stay verbatim with their results, and only the answers are regenerated."""
    from transformers import AutoTokenizer

    config = make_config(dataset={"regenerate": regenerate, "thinking": "never"},
                         **{"generate.sampling": {"max_tokens": 8}})
    samples = [apply_thinking_policy(s, "never") for s in read_dataset([TOOL_USE], max_record_bytes=1 << 20,
                                                                      regenerate=regenerate)]
    assert len(samples) == 2 and all(isinstance(s, Sample) and s.tools for s in samples)
    storage, shard_id = stage(config, samples)
    GenerateLane(config, build_generate_engine(config), storage).run(shard_id)
    records = {r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for sample in samples:
        record = records[sample.id]
        text = tokenizer.decode(record.input_ids)
        assert "# Tools" in text and "<tools>" in text  # the template's tools block
        for tool in sample.tool_list():
            name = tool.get("function", tool)["name"]
            assert f'"name": "{name}"' in text  # the schema, and the call below, name the tool
        assert text.count("<tool_call>") >= 2 and "<tool_response>" in text  # the call kept, with its result
        first = split_turns(sample)[0]
        rendered = tokenizer.apply_chat_template(
            [m.to_json() for m in first], tools=sample.tool_list(), add_generation_prompt=True, tokenize=False,
            enable_thinking=False,
        )
        assert record.input_ids[: len(tokenizer(rendered, add_special_tokens=False)["input_ids"])] == \
            tokenizer(rendered, add_special_tokens=False)["input_ids"]
        regenerated = sum(1 for m in sample.messages if m.is_slot) if regenerate == "all" else 1
        assert len(record.earlier_turns) + 1 == regenerated
