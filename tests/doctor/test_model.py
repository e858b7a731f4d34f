"""Model, tokenizer and chat-template checks on the real tiny model and on real tokenizers with other templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.doctor.model import check_model, check_thinking_template
from dfq_testing.templates import PLAIN_TEMPLATE, THINKING_ONLY_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_qwen3_style_template_switches_thinking(tokenizer, policy):
    check = check_thinking_template(tokenizer, policy)
    assert check.verdict == "pass" and "switches" in check.detail


@pytest.mark.parametrize(
    ("template", "policy", "verdict"),
    [
        (PLAIN_TEMPLATE, "always", "fail"),
        (PLAIN_TEMPLATE, "auto", "fail"),
        (PLAIN_TEMPLATE, "never", "pass"),
        (THINKING_ONLY_TEMPLATE, "never", "fail"),
        (THINKING_ONLY_TEMPLATE, "always", "pass"),
    ],
)
def test_templates_without_a_switch(tiny_model, template, policy, verdict):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = template
    check = check_thinking_template(tokenizer, policy)
    assert check.verdict == verdict, check.detail


def test_model_and_tokenizer_load_and_layers_exist(make_config):
    config = make_config()
    checks, tokenizer = check_model(config.model, config.extract)
    assert [(c.name, c.verdict) for c in checks] == [("model", "pass"), ("architecture", "pass"), ("tokenizer", "pass")]
    assert "6 layers, hidden 128; extracting layers [1, 2, 3]" in checks[0].detail
    assert checks[1].detail == "qwen3: 6 layers (6 full_attention), hidden 128; extraction packed"
    assert tokenizer is not None

    too_many = make_config("k5.toml", extract={"num_draft_layers": 5})
    checks, _ = check_model(too_many.model, too_many.extract)
    assert checks[0].verdict == "fail" and "cannot spread 5 layers over a 6-layer model" in checks[0].detail


def test_a_model_directory_without_a_model(make_config, tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    config = make_config("empty.toml", model={"path": str(empty)})
    checks, tokenizer = check_model(config.model, config.extract)
    assert [(c.name, c.verdict) for c in checks] == [("model", "fail"), ("tokenizer", "fail")]
    assert tokenizer is None
