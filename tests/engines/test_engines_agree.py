"""The Transformers and vLLM engines end replies the same way: at the model's end-of-sequence token, right after
the token that completes a stop string, or at the budget; neither keeps a token the model did not produce (the
pad id that `generate` fills a finished row with is often an end-of-sequence id too). And vLLM with n-gram
speculative decoding generates the same greedy replies as without it, through the generate lane."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_queue.config import load_config
from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Message, Sample
from dflash_queue.engines.base import GenerationRequest
from dflash_queue.engines.hf.generate import TransformersGenerateEngine
from dflash_queue.lanes.generate import GenerateLane, generate_lane_settings
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, prompts_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import open_storage
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"

TOPICS = ["rivers", "code", "the moon", "tea", "graphs", "rain", "salt", "maps", "ice", "wind", "trains", "clocks",
          "bees", "glass", "paper"]
STOPS = [" the", "."]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    tables = tiny_config_tables(tiny_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "stop": STOPS}
    return load_config(write_config(tmp / "agree.toml", tables, **tiny_vllm_overrides(),
                                    **{"generate.sampling": sampling}))


@pytest.fixture(scope="module")
def requests_(tiny_model):
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))
    return [
        GenerationRequest(str(i), formatter.prompt_ids((Message("user", f"Tell me about {t}."),), enable_thinking=True))
        for i, t in enumerate(TOPICS)
    ]


def check_ends(generations, engine_name, tokenizer, eos_ids, pad_id):
    reasons = set()
    for g in generations:
        text = tokenizer.decode(g.completion_ids, skip_special_tokens=False)
        before = tokenizer.decode(g.completion_ids[:-1], skip_special_tokens=False)
        stopped_on_string = any(s in text for s in STOPS) and not any(s in before for s in STOPS)
        if g.finish_reason == "length":
            assert len(g.completion_ids) == MAX_TOKENS and not any(s in text for s in STOPS), (engine_name, g)
            reasons.add("length")
        elif g.completion_ids[-1] in eos_ids and not any(s in before for s in STOPS):
            reasons.add("eos")
        else:
            assert stopped_on_string, (engine_name, g.sample_id, text)
            reasons.add("stop string")
        assert pad_id not in g.completion_ids[:-1], (engine_name, g)
    return reasons


@pytest.mark.parametrize("pad_is_eos", [True, False])
def test_the_transformers_engine_keeps_only_what_the_model_produced(config, requests_, tiny_model, pad_is_eos):
    engine = TransformersGenerateEngine(config.model, config.generate.sampling, batch_size=16)
    assert engine.pad_id in engine.eos_ids
    if not pad_is_eos:
        engine.pad_id = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")  # never generated, not an EOS
    generations = engine.generate(requests_)
    reasons = check_ends(generations, "transformers", engine.tokenizer, set(engine.eos_ids), engine.pad_id)
    assert "stop string" in reasons
    assert all(g.completion_ids[-1] != engine.pad_id or g.completion_ids[-1] in engine.eos_ids for g in generations)


@pytest.fixture(scope="module")
def vllm_engine(config, vllm_forked_engine_cores, vllm_uniproc_executor):
    from dflash_queue.engines.vllm.generate import VllmGenerateEngine

    engine = VllmGenerateEngine(config.model, config.generate.vllm, config.generate.sampling)
    yield engine
    engine.close()


@pytest.mark.vllm
def test_vllm_and_transformers_end_greedy_replies_alike(config, requests_, vllm_engine):
    hf = TransformersGenerateEngine(config.model, config.generate.sampling, batch_size=16)
    expected = hf.generate(requests_)
    hf.close()
    got = vllm_engine.generate(requests_)
    check_ends(got, "vllm", hf.tokenizer, set(hf.eos_ids), hf.pad_id)
    assert [(g.completion_ids, g.finish_reason) for g in got] == [(e.completion_ids, e.finish_reason) for e in expected]


ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def spec_decode_counts() -> dict[str, float]:
    """vLLM's speculative-decoding counters in this process (drafts, draft tokens, accepted tokens)."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    return {m.name: m.value for m in get_metrics_snapshot() if isinstance(m, Counter) and "spec_decode" in m.name}


@pytest.mark.vllm
def test_ngram_speculative_decoding_leaves_greedy_replies_unchanged_through_the_lane(config, vllm_engine, tmp_path):
    from dflash_queue.engines.vllm.generate import VllmGenerateEngine

    storage = open_storage(str(tmp_path / "storage"))
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:16]
    shard_id = prompt_shard_id(samples)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # Statistics on: vLLM counts drafts and accepted tokens only then.
    settings = {**config.generate.vllm.model_dump(), "engine_args": {"speculative_config": ngram},
                "log_stats_interval_s": 3600}  # fmt: skip
    speculative = config.with_overrides(generate={"vllm": settings})
    assert speculative.fingerprint() != config.fingerprint()

    replies, accepted = {}, {}
    for name in ("plain", "ngram"):
        storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
        engine = vllm_engine if name == "plain" else VllmGenerateEngine(speculative.model, speculative.generate.vllm, speculative.generate.sampling)
        try:
            before = spec_decode_counts()
            settings = generate_lane_settings(speculative if engine is not vllm_engine else config)
            assert not GenerateLane(settings, engine, storage).run(shard_id).skipped
            accepted[name] = spec_decode_counts().get(ACCEPTED, 0) - before.get(ACCEPTED, 0)
        finally:
            if engine is not vllm_engine:
                engine.close()
        records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=name)
        replies[name] = [(r.id, r.prompt_ids, r.completion_ids, r.finish_reason) for r in records]
        storage.delete(completions_key(shard_id))
    # Drafts were proposed and accepted, so the comparison compares something.
    assert accepted["ngram"] > 0 and accepted["plain"] == 0, accepted
    assert replies["ngram"] == replies["plain"]
    assert len({tuple(r[2]) for r in replies["plain"]}) > len(samples) // 2  # distinct replies, not one repeated
