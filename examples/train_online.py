"""Train a toy DFlash-style drafter on a run while it extracts (dflash_queue.live).

Beside the job's `dflash-queue run` (with an empty broker.url the trainer finds the run's private broker, and the
run stays up, extracting the later epochs, until the trainer has consumed its last one) or against workers on a
broker.url; one process, or one per rank under torchrun (gloo on CPU, NCCL on GPUs):

    dflash-queue run examples/sharegpt_sample.jsonl -c worker_configs/local-cpu-live.toml &
    python examples/train_online.py -c worker_configs/local-cpu-live.toml --epochs 2
    torchrun --nproc-per-node 2 examples/train_online.py -c worker_configs/local-cpu-live.toml --epochs 2

The drafter is a toy: from the target's hidden states at the K extracted layers of token t (concatenated) and the
embedding of token t, it predicts token t + 1, with the loss on completion tokens only. A real DFlash drafter
predicts a block of tokens from the same inputs; what this shows is the data path: samples of shards as they are
stored, split over ranks and DataLoader workers, each shard acknowledged once every one of its samples went
through an optimizer step, so the window (extract.max_unconsumed_shards) frees and storage.retention =
"until-consumed" deletes what was consumed. Killed and started again, it resumes where it was: shards it had not
acknowledged are served again, the others never.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dflash_queue.live import LiveShards
from dflash_queue.training import collate_padded


class ToyDrafter(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, vocab_size: int, width: int = 64) -> None:
        super().__init__()
        self.states = nn.Linear(num_layers * hidden_size, width)
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        b, t, k, h = hidden_states.shape
        mixed = torch.tanh(self.states(hidden_states.reshape(b, t, k * h).float()) + self.embed(input_ids))
        return self.head(mixed)


def next_token_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Cross-entropy of token t + 1 where it is a completion token (loss_mask) of a real (unpadded) position."""
    targets = batch["input_ids"][:, 1:]
    mask = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()
    losses = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", required=True, type=Path)
    parser.add_argument("--consumer", default="toy-drafter")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ack-log", type=Path, default=None,
                        help="Append one JSON line per acknowledged shard: rank, epoch, shard, sample ids")
    parser.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (a slow trainer)")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    live = LiveShards(args.config, consumer=args.consumer, epochs=args.epochs)
    # Batches come whole from the live dataset (a part batch when it would otherwise wait for the next shard), and
    # from whichever loader worker has one ready (in_order=False): a batch held back keeps its shard unconsumed.
    loader = DataLoader(
        live.samples(args.batch_size, collate_padded),
        batch_size=None,
        num_workers=args.num_workers,
        in_order=False,
    )
    model: nn.Module = ToyDrafter(*_target_sizes(live))
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pending: dict[tuple[int, str], list[str]] = defaultdict(list)
    steps = 0
    # Ranks may get one shard more than others: Join lets the ones that finish first shadow the gradient
    # all-reduce of the others instead of waiting for ever.
    with Join([model]) if distributed else nullcontext():
        for batch in loader:
            loss = next_token_loss(model(batch["hidden_states"], batch["input_ids"]), batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            time.sleep(args.step_delay)
            for epoch, shard_id, sample_id in zip(batch["epoch"], batch["shard_id"], batch["sample_id"], strict=True):
                pending[(int(epoch), shard_id)].append(sample_id)
            for key in live.consumed(batch):
                samples = pending.pop(key)
                if args.ack_log is not None:
                    with args.ack_log.open("a") as log:
                        log.write(json.dumps({"rank": live.rank, "epoch": key[0], "shard": key[1], "samples": samples}) + "\n")
            if steps % 10 == 0:
                print(f"rank {live.rank} step {steps} loss {loss.item():.4f}", flush=True)
    print(f"rank {live.rank}: {steps} steps over {args.epochs} epoch(s)", flush=True)
    if distributed:
        dist.destroy_process_group()


def _target_sizes(live: LiveShards) -> tuple[int, int, int]:
    """(entries stored per token, hidden size, vocabulary) of the run's target, from its config.json."""
    text = json.loads((Path(live.config.model.path) / "config.json").read_text())
    text = text.get("text_config", text)
    entries = live.config.extract.captured_entries(text["num_hidden_layers"])
    return len(entries), text["hidden_size"], text["vocab_size"]


if __name__ == "__main__":
    main()
