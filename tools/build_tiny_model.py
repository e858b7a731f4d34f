#!/usr/bin/env python
"""Build the tiny random-weight Qwen3 test model (see ``dfq_testing.tiny_model``).

Usage: python tools/build_tiny_model.py OUT_DIR [--layers N] [--seed S] [--hidden-size H]
                                        [--eos-stop-probability P] [--overwrite]

Prints the model's directory on stdout (for scripts), and on stderr what was built there, or that the build was
already there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run from a checkout without installing the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dfq_testing.tiny_model import MARKER_FILE, build_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight Qwen3 model and tokenizer, offline.")
    parser.add_argument("out_dir", type=Path, help="directory to create (written atomically)")
    parser.add_argument("--layers", type=int, default=6, help="number of decoder layers (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--hidden-size", type=int, default=128, help="hidden size, a multiple of 64 (default 128)")
    parser.add_argument(
        "--eos-stop-probability",
        type=float,
        default=0.03,
        help="mean per-step probability of <|im_end|> when sampling at temperature 1 (default 0.03)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing build or directory")
    args = parser.parse_args(argv)
    already_built = not args.overwrite and (args.out_dir / MARKER_FILE).is_file()
    try:
        path = build_tiny_model(
            args.out_dir,
            num_layers=args.layers,
            hidden_size=args.hidden_size,
            seed=args.seed,
            eos_stop_probability=args.eos_stop_probability,
            overwrite=args.overwrite,
        )
    except (FileExistsError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    settings = (
        f"{args.layers} layer(s), hidden size {args.hidden_size}, seed {args.seed}, <|im_end|> probability "
        f"{args.eos_stop_probability}"
    )
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if already_built:
        print(f"{path} already holds this tiny model ({settings}): nothing built", file=sys.stderr)
    else:
        print(
            f"built a tiny random-weight Qwen3 model ({settings}; {weights / 1e6:.1f} MB of weights) and its "
            f"tokenizer in {path}: give it as model.path (worker_configs/local-cpu.toml reads .cache/tiny-qwen3)",
            file=sys.stderr,
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
