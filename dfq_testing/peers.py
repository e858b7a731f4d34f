"""Running the peer trainers' own code on CPU in tests: speculators' train command, its Trainer (which needs an
accelerator) replaced by one that keeps what the command built and runs one training forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# What a CPU needs: no dataloader worker processes, the attention and loss that run without a GPU, float32.
CPU_ARGUMENTS = (
    "--num-workers", "0", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
    "--hidden-states-dtype", "float32", "--total-seq-len", "512", "--train-data-ratio", "0.75",
)


class RecordingTrainer:
    """Stands in for speculators' Trainer: keeps the draft, the trainer config and the data loaders the command
    built, and runs one training forward on the first batch, as the trainer's first step does."""

    built: dict[str, Any] = {}

    def __init__(self, model, config, train_loader, val_loader) -> None:
        RecordingTrainer.built = {"model": model, "config": config, "train": train_loader, "val": val_loader}

    def run_training(self) -> None:
        built = RecordingTrainer.built
        batch = next(iter(built["train"]))
        built["batch"] = batch
        tensors = {key: value for key, value in batch.items() if torch.is_tensor(value)}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = built["model"](**tensors, **built["config"].train_call_kwargs)[1]
        built["loss"] = float(loss.detach())


def run_speculators_train(arguments: Sequence[str], monkeypatch) -> dict[str, Any]:
    """`speculators train ARGUMENTS` (its config resolution and `main`), on CPU; returns what it built."""
    import speculators.train.cli as speculators_cli
    from speculators.train.config import TrainConfig

    monkeypatch.setattr(speculators_cli, "Trainer", RecordingTrainer)
    speculators_cli.main(TrainConfig.resolve([*arguments, *CPU_ARGUMENTS]))
    return RecordingTrainer.built
