#!/usr/bin/env python
"""Write a random-weight checkpoint of a real model's shape, with few layers, to a directory; nothing downloaded.

The shape comes from a config.json (`--like examples/qwen3.6-27b-class/config.json`, or a checkpoint directory)
or a named shape (`--like qwen3-32b`: dense, hidden 5120, 64 heads x 128 / 8 kv heads, intermediate 25600).
`--layers N` keeps the first N decoder layers (and the first N entries of the layer-type list of a hybrid
model, so a Qwen3.5 cut to 4 layers has its 3 linear-attention layers and 1 full-attention layer); `--set
key=value` changes any other field (dotted keys for nested configs: `text_config.hidden_size=64`,
`vision_config.depth=1`; values are JSON, else strings). The model is built from the config directly on
`--device` (CUDA when available: a few seconds for billions of parameters) with Transformers' own initialisation,
in `--dtype`, and saved with `save_pretrained`; the tokenizer is the tiny test tokenizer (`dfq_testing`, built
into .cache/tiny-qwen3) or `--tokenizer DIR`. Token ids up to the config's vocab size are valid for vLLM, which
accepts ids below the larger of the tokenizer's and the model's vocabulary.

An existing build with the same parameters is reused; the directory is written beside itself and renamed into
place when complete.

    python tools/build_random_checkpoint.py --like examples/qwen3.6-27b-class/config.json --layers 6 --out DIR
    python tools/build_random_checkpoint.py --like qwen3-32b --layers 6 --vocab-size 32768 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MARKER = "random_checkpoint.json"
GIB = 2**30
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-32B's shape (a dense target with the 27B-32B class's width).
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
}


def read_shape(like: str) -> dict[str, Any]:
    if like in SHAPES:
        return json.loads(json.dumps(SHAPES[like]))
    path = Path(like)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(f"--like {like}: neither a config.json, a checkpoint directory nor one of {sorted(SHAPES)}")
    return json.loads(path.read_text())


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_settings(raw: dict[str, Any], settings: list[str]) -> None:
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {setting}: expected key=value")
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = parse_value(value)


def keep_layers(text: dict[str, Any], layers: int) -> None:
    """The first `layers` decoder layers of a (text) config, with its per-layer lists cut to match."""
    total = int(text["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers {layers}: the shape has {total} layers")
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    if isinstance(text.get("mlp_only_layers"), list):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < layers]
    if isinstance(text.get("max_window_layers"), int):
        text["max_window_layers"] = min(text["max_window_layers"], layers)


def shape_config(args: argparse.Namespace) -> dict[str, Any]:
    raw = read_shape(args.like)
    apply_settings(raw, args.set or [])
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    if args.text_only and text is not raw:
        text = raw = dict(text)
        raw.pop("architectures", None)
    if args.layers:
        keep_layers(text, args.layers)
    if args.vocab_size:
        text["vocab_size"] = args.vocab_size
    for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        raw.pop(key, None)
    return raw


def model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def build(args: argparse.Namespace) -> Path:
    import torch
    import transformers

    out = Path(args.out).resolve()
    raw = shape_config(args)
    params = {"config": raw, "dtype": args.dtype, "seed": args.seed, "tokenizer": str(args.tokenizer or "tiny")}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == params:
        print(f"reused {out}")
        return out
    if args.tokenizer:
        tokenizer_dir = Path(args.tokenizer)
    else:
        from dfq_testing.tiny_model import build_tiny_model

        tokenizer_dir = build_tiny_model(REPO / ".cache" / "tiny-qwen3")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="dfq-shape-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        config = transformers.AutoConfig.from_pretrained(tmp)
    cls = model_class(config)
    config.architectures = [cls.__name__]
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype).eval()
    built = time.perf_counter() - started
    count = sum(p.numel() for p in model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    model.save_pretrained(tmp_out)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_out)
    (tmp_out / MARKER).write_text(json.dumps(params, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    text = config.get_text_config()
    print(
        f"built {out}: {cls.__name__}, {text.num_hidden_layers} layers, hidden {text.hidden_size}, vocab "
        f"{text.vocab_size}, {count:,} parameters, {size / GIB:.2f} GiB {args.dtype} (built on {device} "
        f"in {built:.1f} s, saved in {time.perf_counter() - started - built:.1f} s)"
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", required=True, help=f"config.json, checkpoint directory or {sorted(SHAPES)}")
    parser.add_argument("--layers", type=int, help="decoder layers to keep (default: all)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the embedding and LM head (default: the shape's)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="another config field (repeatable)")
    parser.add_argument("--text-only", action="store_true", help="of a multimodal shape, its text model alone")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="where the weights are drawn (default: CUDA if any)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the tiny test tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    build(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
