"""Other checkpoints made from a built one, as they turn up behind a model path: a fine-tune (the same files,
`config.json`, tensor names, dtypes, shapes and file sizes, every tensor's values changed) and the same weights
sharded over several safetensors files with their `model.safetensors.index.json`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def fine_tune(checkpoint: Path, out: Path | None = None, *, files: list[str] | None = None) -> Path:
    """A fine-tune of `checkpoint` in `out` (a copy; in place when None): in each safetensors file (or those named in
    `files`), every floating-point tensor scaled by 1.01 and shifted by 1e-3, the bytes of any other flipped in their
    lowest bit. The header is kept byte for byte; each file is written anew and renamed over the old one."""
    import torch

    if out is not None:
        shutil.copytree(checkpoint, out)
        checkpoint = out
    targets = [checkpoint / name for name in files] if files else sorted(checkpoint.glob("*.safetensors"))
    for path in targets:
        data = bytearray(path.read_bytes())
        header_length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_length])
        base = 8 + header_length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = (base + offset for offset in entry["data_offsets"])
            if start == end:
                continue
            if entry["dtype"] in _FLOAT_DTYPES:
                values = torch.frombuffer(data[start:end], dtype=getattr(torch, _FLOAT_DTYPES[entry["dtype"]]))
                changed = (values.double() * 1.01 + 1e-3).to(values.dtype)
                data[start:end] = changed.view(torch.uint8).numpy().tobytes()
            else:
                data[start:end] = bytes(byte ^ 1 for byte in data[start:end])
        written = path.with_name(path.name + ".tmp")
        written.write_bytes(data)
        os.replace(written, path)
    return checkpoint


def sharded(checkpoint: Path, out: Path, parts: int) -> Path:
    """`checkpoint`'s weights in `parts` safetensors files (`model-0000i-of-0000n.safetensors`, tensors in name order)
    with the index naming them, beside its other files, in `out`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            tensors.update({name: weights.get_tensor(name) for name in weights.keys()})
    out.mkdir(parents=True)
    for path in checkpoint.iterdir():
        if path.suffix != ".safetensors" and path.name != INDEX and path.is_file():
            shutil.copy(path, out / path.name)
    names = sorted(tensors)
    weight_map = {}
    for part in range(parts):
        file = f"model-{part + 1:05d}-of-{parts:05d}.safetensors"
        chosen = names[part * len(names) // parts : (part + 1) * len(names) // parts]
        save_file({name: tensors[name].contiguous() for name in chosen}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chosen, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
