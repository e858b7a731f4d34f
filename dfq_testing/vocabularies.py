"""A model directory whose tokenizer differs from the tiny model's: what a server or a worker of another
vocabulary looks like to the inference-server engine's start-up check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def swapped_vocabulary(model: Path, out: Path, pair: tuple[str, str] = ("Ġthe", "Ġa")) -> Path:
    """A copy of `model` (config, weights, chat template) whose tokenizer gives the two tokens of `pair` each
    other's ids: every text holding one of them tokenises to other ids. Built once per `out`."""
    if (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    tokenizer = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    first, second = pair
    if first not in vocab or second not in vocab:
        raise ValueError(f"{model}: the vocabulary lacks {pair}")
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    tmp.rename(out)
    return out
