"""Turns and the quality gate in the generate lane, on the real Transformers engine and the tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.lanes.turns import split_turns
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage

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
    config = make_config(dataset={"regenerate": "all", "thinking": "never", "history": "as-generated"},
                         **{"generate.sampling": {"max_tokens": 12}})
    samples = example_samples("all", "never", 4, multi_turn_only=True)
    assert sum(s.num_turns for s in samples) > len(samples)
    storage, shard_id = stage(config, samples)
    lane = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
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

    extract = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
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
    summary = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
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
    summary = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
    records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    assert [r.id for r in records] == [s.id for s in samples]  # dropped ones are recorded too
    dropped = [r for r in records if not r.kept]
    assert len(dropped) >= 6  # `</think>` is one token in ~1,500: it almost never comes within 12 tokens
    for record in dropped:
        assert record.quality.decision == "drop" and "unclosed_thinking" in record.quality.flags
        assert record.quality.thinking == "unclosed" and record.quality.answer_tokens == 0
        assert "<think>" not in record.text  # the block was opened by the prompt, not the completion
    assert summary.gate["gate_drop"] == len(dropped) == summary.gate["gate_unclosed_thinking_drop"]

    ExtractLane(extract_lane_settings(config), build_extractor(config), storage).run(shard_id)
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
    from dfq_testing.templates import THINKING_ONLY_TEMPLATE

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
        GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
        records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
        assert {r.id: r.thinking for r in records} == expected, model.name


def test_a_generate_worker_refuses_a_policy_its_template_cannot_honour(make_config, tiny_model_with_template, start_worker):
    from dfq_testing.templates import THINKING_ONLY_TEMPLATE

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
    GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
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
        first_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        first_sequence = record.training_sequences()[0].input_ids  # the first turn's (served turn by turn or not)
        assert first_sequence[: len(first_ids)] == first_ids
        regenerated = sum(1 for m in sample.messages if m.is_slot) if regenerate == "all" else 1
        assert len(record.turn_finish_reasons()) == regenerated


def reply_as_message(tokenizer, ids: list[int], start: int, end: int) -> dict:
    """A generated reply as a client sends it back: the answer as content, the reasoning (up to </think>, also when
    the prompt opened the block) as reasoning_content. Written out here, independently of the code under test."""
    before = tokenizer.decode(ids[max(0, start - 8) : start])
    opened = before.rfind("<think>") > before.rfind("</think>")  # the prompt ends inside an open block
    text = tokenizer.decode(ids[start:end], skip_special_tokens=True)
    if opened:
        text = "<think>" + text
    if "</think>" in text:
        reasoning, answer = text.rsplit("</think>", 1)
        return {"role": "assistant", "content": answer.lstrip("\n"),
                "reasoning_content": reasoning.replace("<think>", "", 1).strip("\n")}
    if text.startswith("<think>"):
        return {"role": "assistant", "content": "", "reasoning_content": text[len("<think>"):].strip("\n")}
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("template", ["qwen3", "thinking-first"])
@pytest.mark.parametrize("thinking", ["always", "never"])
def test_as_served_history_is_the_templates_rendering_of_each_turn(
    make_config, tiny_model, thinking_template_model, template, thinking
):
    """Each later turn is generated from the chat template's rendering of the conversation so far, the earlier
    replies sent back as messages (a Qwen3-style template strips their reasoning): the stored ids of every turn are
    that rendering followed by the reply, and every reply is trained in the context it was generated in."""
    from transformers import AutoTokenizer

    model = tiny_model if template == "qwen3" else thinking_template_model
    config = make_config(model={"path": str(model)}, dataset={"regenerate": "all", "thinking": thinking},
                         **{"generate.sampling": {"max_tokens": 10}})
    samples = example_samples("all", thinking, 4, multi_turn_only=True)
    storage, shard_id = stage(config, samples)
    GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
    records = {r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)}
    tokenizer = AutoTokenizer.from_pretrained(model)
    enable = thinking == "always"
    separate = multi = 0
    for sample in samples:
        record = records[sample.id]
        first, between = split_turns(sample)
        # Every turn as (prompt ids, reply ids): from the separate sequences, or from the spans of one sequence.
        if record.served_turns:
            turns = [(t.prompt_ids, t.completion_ids) for t in record.served_turns]
            separate += 1
        else:
            turns = [(record.prompt_ids[: t.start], record.prompt_ids[t.start : t.end]) for t in record.earlier_turns]
        turns.append((record.prompt_ids, record.completion_ids))
        multi += len(turns) > 1
        history = [m.to_json() for m in first]
        for number, (prompt, reply) in enumerate(turns):
            rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False,
                                                     enable_thinking=enable)
            assert prompt == tokenizer(rendered, add_special_tokens=False)["input_ids"], (sample.id, number)
            if number < len(between):
                ids = prompt + reply
                history += [reply_as_message(tokenizer, ids, len(prompt), len(ids)),
                            *(m.to_json() for m in between[number])]
        # Whatever the layout, each reply is trained once, in the context it was generated in.
        sequences = record.training_sequences()
        trained = [s.input_ids[i] for s in sequences for i, bit in enumerate(s.loss_mask) if bit]
        assert trained == [t for _, reply in turns for t in reply]
        assert len(sequences) == (len(turns) if record.served_turns else 1)
    # The Qwen3-style template re-renders an earlier reply differently when it had a think block (an empty one
    # with thinking off, the reasoning a thinking-first prompt opened): those samples are one sequence per turn.
    assert multi >= 2
    if thinking == "never" or template == "thinking-first":
        assert separate == multi


class ScriptedEngine:
    """Replies whose ids are the canonical tokenization of fixed text, so a re-rendered history can match them."""

    name = "scripted"

    def __init__(self, tokenizer, text: str) -> None:
        self.reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, requests):
        from dflash_queue.engines.base import Generation

        return [Generation(r.sample_id, list(r.prompt_ids), list(self.reply), "stop", "") for r in requests]

    def close(self) -> None:
        pass


def test_as_served_replies_that_render_back_as_generated_stay_one_sequence(make_config, tiny_model_with_template):
    """With a template that renders an earlier reply exactly as it was generated, the sample is one training
    sequence, its loss mask on every reply."""
    from transformers import AutoTokenizer

    from dfq_testing.templates import PLAIN_TEMPLATE

    model = tiny_model_with_template(PLAIN_TEMPLATE, "tiny-plain")
    config = make_config(model={"path": str(model)}, dataset={"regenerate": "all", "thinking": "never"})
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = example_samples("all", "never", 3, multi_turn_only=True)
    storage, shard_id = stage(config, samples)
    GenerateLane(generate_lane_settings(config), ScriptedEngine(tokenizer, "Fine, thanks for asking."), storage).run(shard_id)
    for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id):
        sample = next(s for s in samples if s.id == record.id)
        assert not record.served_turns and len(record.earlier_turns) == sample.num_turns - 1
        [sequence] = record.training_sequences()
        trained = sum(sequence.loss_mask)
        reply = ScriptedEngine(tokenizer, "Fine, thanks for asking.").reply
        assert trained == len(reply) * sample.num_turns
        for turn in record.earlier_turns:
            assert record.prompt_ids[turn.start : turn.end] == reply


def test_a_sample_served_turn_by_turn_is_extracted_as_one_row_per_turn_and_counted_once(make_config):
    import json

    from dflash_queue.verify import shard_contents

    config = make_config(dataset={"regenerate": "all", "thinking": "never"}, extract={"layer_ids": [1, 3]},
                         **{"generate.sampling": {"max_tokens": 8}})
    samples = example_samples("all", "never", 3, multi_turn_only=True)
    storage, shard_id = stage(config, samples)
    GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage).run(shard_id)
    records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    expected = [(r.id, s) for r in records if r.kept for s in r.training_sequences()]
    assert any(r.served_turns for r in records) and len(expected) > len(records)
    summary = ExtractLane(extract_lane_settings(config), build_extractor(config), storage).run(shard_id)
    assert summary.num_samples == sum(1 for r in records if r.kept)
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        turns = json.loads(shard.metadata["sample_turns"])
        assert [(shard[i].id, turns[i]) for i in range(len(shard))] == [(i, s.turn) for i, s in expected]
        for index, (_, sequence) in enumerate(expected):
            row = shard[index]
            assert row.input_ids.tolist() == sequence.input_ids and row.loss_mask.tolist() == sequence.loss_mask
            assert row.finish_reason == sequence.finish_reason
    ids, _, _ = shard_contents(storage, shard_key(shard_id))
    assert sorted(ids) == sorted(r.id for r in records if r.kept)  # verify counts each sample once
