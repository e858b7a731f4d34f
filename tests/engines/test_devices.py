"""Where the Transformers engines put the model: one device, or a decoder's layers spread over a GPU group."""

from __future__ import annotations

import pytest
import torch

from dflash_queue.engines.devices import decoder_device_map, spread_gpu_count


def layers_on(mapping: dict[str, int], gpu: int) -> list[int]:
    return [int(name.split(".")[1]) for name, where in mapping.items() if name.startswith("layers.") and where == gpu]


def test_layers_in_contiguous_runs_embeddings_first_final_norm_last():
    # 94 layers over 8 GPUs: 11 each and 6 left over, one more on each of the first six GPUs.
    mapping = decoder_device_map(94, 8)
    assert [len(layers_on(mapping, gpu)) for gpu in range(8)] == [12, 12, 12, 12, 12, 12, 11, 11]
    assert layers_on(mapping, 0) == list(range(0, 12)) and layers_on(mapping, 6) == list(range(72, 83))
    assert layers_on(mapping, 7) == list(range(83, 94))
    assert (mapping["embed_tokens"], mapping["rotary_emb"], mapping["norm"]) == (0, 0, 7)
    assert sorted(int(name.split(".")[1]) for name in mapping if name.startswith("layers.")) == list(range(94))
    assert decoder_device_map(6, 1) == {"embed_tokens": 0, "rotary_emb": 0, **{f"layers.{i}": 0 for i in range(6)},
                                        "norm": 0}
    # More GPUs than layers: the last ones hold no layer; the final norm still goes to the last.
    assert [layers_on(decoder_device_map(2, 3), gpu) for gpu in range(3)] == [[0], [1], []]
    with pytest.raises(ValueError, match="cannot place 4 layers on 0 GPUs"):
        decoder_device_map(4, 0)


def test_one_device_unless_auto_sees_several_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a worker's group of four
    assert spread_gpu_count("auto") == 4
    assert spread_gpu_count("cuda") == 1 and spread_gpu_count("cpu") == 1  # model.device names one device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spread_gpu_count("auto") == 1
