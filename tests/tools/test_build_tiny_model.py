"""tools/build_tiny_model.py as a user runs it: the directory on stdout for scripts, and on stderr what it built
where, or that the build was already there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "build_tiny_model.py"


def build(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_it_says_what_it_built_and_where(tmp_path):
    target = tmp_path / "one-layer"
    built = build(target, "--layers", "1", "--hidden-size", "64", "--seed", "3")
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(target)
    said = built.stderr.strip().splitlines()[-1]
    assert said.startswith("built a tiny random-weight Qwen3 model (1 layer(s), hidden size 64, seed 3"), said
    assert f"and its tokenizer in {target}" in said and "MB of weights" in said, said
    assert (target / "model.safetensors").is_file()

    again = build(target, "--layers", "1", "--hidden-size", "64", "--seed", "3")
    assert again.returncode == 0 and again.stdout.strip() == str(target), again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"{target} already holds this tiny model (1 layer(s), hidden size 64, seed 3, <|im_end|> probability 0.03): "
        "nothing built"
    )
