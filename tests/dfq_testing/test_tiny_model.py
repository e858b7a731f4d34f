"""The locally built tiny Qwen3 test model: determinism, tokenizer, chat template, stopping, caching."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dfq_testing.tiny_model import INDEX_FILE, MARKER_FILE, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same place and arguments as the session-wide `tiny_model` fixture in tests/conftest.py, so when that one
    # already ran this is a no-op (and the other way round).
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _files(path: Path) -> dict[str, bytes]:
    return {child.name: child.read_bytes() for child in sorted(path.iterdir())}


def test_same_seed_gives_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    first, second = _files(model_dir), _files(again)
    assert sorted(first) == sorted(second)
    assert {"model.safetensors", "tokenizer.json", "config.json", "generation_config.json"} <= set(first)
    for name in first:
        assert first[name] == second[name], name

    other = _files(build_tiny_model(tmp_path / "other-seed", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_special_tokens_are_single_ids(model_dir: Path, tokenizer) -> None:
    import json

    ids = {}
    for token in SPECIAL_TOKENS:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        assert len(encoded) == 1, (token, encoded)
        ids[token] = encoded[0]
        assert tokenizer.convert_tokens_to_ids(token) == encoded[0]
    assert len(set(ids.values())) == len(ids)
    # Inside text too, not only on their own.
    assert tokenizer.encode("a<think>b</think>c", add_special_tokens=False).count(ids["<think>"]) == 1

    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hello world", add_special_tokens=True) == tokenizer.encode("hello world", add_special_tokens=False)
    text = "Let me think: 17 * 24 = 408, so the answer is 408. Ünïcödé ¿qué? 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    # Like Qwen3: the think tags survive skip_special_tokens, the chat markers do not.
    assert tokenizer.decode([ids["<|im_start|>"], ids["<think>"], ids["<|im_end|>"]], skip_special_tokens=True) == "<think>"

    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["head_dim"] == 64
    assert config["eos_token_id"] == ids["<|im_end|>"]
    assert config["pad_token_id"] == ids["<|endoftext|>"]
    assert config["bos_token_id"] is None
    assert config["tie_word_embeddings"] is False
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert generation["pad_token_id"] == ids["<|endoftext|>"]


def test_chat_template_thinking_switch(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    default = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert on == default
    assert on == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + EMPTY_THINK

    # tokenize=True returns a BatchEncoding in transformers 5; return_dict=False gives the plain ids.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert list(ids) == tokenizer.encode(off, add_special_tokens=False)


def test_chat_template_history_reasoning(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "new reasoning"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nA2<|im_end|>\n"
    )
    # A final answer without reasoning gets the empty think block that enable_thinking=False prompts with.
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    full = tokenizer.apply_chat_template(messages[:1] + [{"role": "assistant", "content": "A1"}], tokenize=False)
    assert full == prompt + "A1<|im_end|>\n"


def test_sampling_mixes_eos_stops_and_truncation(model_dir: Path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=bool(i % 2),
        )
        for i in range(40)
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64)
    generated = out[:, batch["input_ids"].shape[1] :].tolist()
    stopped = sum(eos in row for row in generated)
    truncated = len(generated) - stopped
    # With p=0.03 per step about 86% stop within 64 tokens.
    assert stopped > 0 and truncated > 0, (stopped, truncated)
    assert stopped >= len(generated) // 2, (stopped, truncated)


def test_second_call_reuses_the_build(model_dir: Path, tmp_path: Path) -> None:
    before = {child.name: child.stat().st_mtime_ns for child in model_dir.iterdir()}
    start = time.perf_counter()
    assert build_tiny_model(model_dir) == model_dir
    assert build_tiny_model(str(model_dir)) == model_dir
    assert time.perf_counter() - start < 0.5
    assert {child.name: child.stat().st_mtime_ns for child in model_dir.iterdir()} == before
    assert (model_dir / MARKER_FILE).is_file()
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(f".{model_dir.name}.")]

    # Other parameters on an existing build, or a foreign non-empty directory, are refused.
    with pytest.raises(FileExistsError):
        build_tiny_model(model_dir, seed=7)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_build(tmp_path: Path) -> None:
    target = tmp_path / "small"
    build_tiny_model(target, num_layers=1)
    old = (target / "model.safetensors").read_bytes()
    build_tiny_model(target, num_layers=1, seed=5, overwrite=True)
    assert (target / "model.safetensors").read_bytes() != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]


def test_cli_on_an_existing_build(model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_tiny_model.py"), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=model_dir.parent,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(model_dir)


def test_the_index_names_every_tensor_and_the_peers_loaders_read_the_weights_through_it(model_dir: Path) -> None:
    """SpecForge's EAGLE-3 trainer reads the target's LM head through its index file, and its draft's embedding the
    same way when there is one."""
    import json

    import torch
    from safetensors import safe_open
    from specforge.modeling.target.target_head import TargetHead

    index = json.loads((model_dir / INDEX_FILE).read_text())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as checkpoint:
        names = set(checkpoint.keys())
        lm_head = checkpoint.get_tensor("lm_head.weight")
        total = sum(checkpoint.get_tensor(n).numel() * checkpoint.get_tensor(n).element_size() for n in names)
    assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == total == (model_dir / "model.safetensors").stat().st_size - \
        (8 + int.from_bytes((model_dir / "model.safetensors").read_bytes()[:8], "little"))
    head = TargetHead.from_pretrained(str(model_dir))
    assert torch.equal(head.fc.weight, lm_head.to(torch.bfloat16))


def test_a_build_made_without_the_index_gets_it_on_reuse(model_dir: Path, tmp_path: Path) -> None:
    import shutil

    old = tmp_path / "old-build"
    shutil.copytree(model_dir, old)
    (old / INDEX_FILE).unlink()
    assert build_tiny_model(old) == old
    assert (old / INDEX_FILE).read_bytes() == (model_dir / INDEX_FILE).read_bytes()
