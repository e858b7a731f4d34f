"""The Transformers extract engine's activation estimate, by hand."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from dflash_queue.engines.activation_memory import pass_activation_bytes

REPO = Path(__file__).resolve().parents[2]


def test_a_pass_of_a_qwen3_235b_class_decoder():
    config = AutoConfig.from_pretrained(REPO / "examples" / "qwen3-235b-a22b-class")
    # Per token, in bf16: capture buffers 2 x 5 x 4096, residual, norm and output 3 x 4096, and the larger of
    # attention's 2 x (64 + 4) x 128 = 17,408 and the MLP's 3 x 12,288 = 36,864; then 4 x 4096 bytes of float32
    # statistics. 16,384 tokens x (90,112 x 2 + 16,384) bytes = 3 GiB.
    assert pass_activation_bytes(config, 16_384, 5, 2) == 16_384 * (90_112 * 2 + 16_384) == 3 * 1024**3
    assert pass_activation_bytes(config, 1, 5, 2) * 1000 == pass_activation_bytes(config, 1000, 5, 2)
