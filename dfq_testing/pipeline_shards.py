"""Training shards made by the real lanes (generate, then extract) on the tiny model, for tests and benchmarks.

One generate pass; then the same completions are extracted once per requested `hidden_dtype`, each into its
own storage root, so that shards of different dtypes hold the very same samples.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_queue.config import Config, load_config
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.keys import COMPLETIONS, PROMPTS, prompts_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import LocalStorage
from dfq_testing.configs import tiny_config_tables, write_config

SAMPLE_DATASET = Path(__file__).resolve().parents[1] / "examples" / "sharegpt_sample.jsonl"


# Every check flags instead of dropping, so every sample reaches the training shards.
FLAG_EVERYTHING = {"on_empty": "flag", "on_repetition": "flag", "on_unclosed_thinking": "flag"}


def produce_training_shards(
    model_path: Path,
    root: Path,
    *,
    hidden_dtypes: Sequence[str] = ("bfloat16",),
    samples: int = 12,
    shard_size: int = 6,
    max_tokens: int = 32,
    dataset: Path = SAMPLE_DATASET,
    extract: dict[str, Any] | None = None,
) -> dict[str, Config]:
    """{hidden_dtype: config whose storage.url holds prompts/, completions/ and shards/ for those samples}.
    `extract`: more [extract] settings (layers, last-layer and final-norm entries)."""
    root.mkdir(parents=True, exist_ok=True)
    prompts = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)][:samples]
    if not prompts:
        raise ValueError(f"{dataset}: no samples to make shards of")
    configs = {
        dtype: load_config(
            write_config(
                root / f"{dtype}.toml",
                tiny_config_tables(model_path, root / dtype, "", root / "state"),
                **_overrides(shard_size, max_tokens, dtype, extract or {}),
            )
        )
        for dtype in hidden_dtypes
    }
    first = configs[hidden_dtypes[0]]
    storage = LocalStorage(first.storage.url)
    shard_ids = []
    for start in range(0, len(prompts), shard_size):
        chunk = prompts[start : start + shard_size]
        shard_ids.append(prompt_shard_id(chunk))
        storage.write_bytes(prompts_key(shard_ids[-1]), encode_prompts(chunk))
    generate = GenerateLane(generate_lane_settings(first), build_generate_engine(first), storage)
    for shard_id in shard_ids:
        generate.run(shard_id)
    generate.close()

    extractor = build_extractor(first)
    for config in configs.values():
        target = LocalStorage(config.storage.url)
        if target.root != storage.root:
            for folder in (PROMPTS, COMPLETIONS):
                shutil.copytree(storage.root / folder, target.root / folder, dirs_exist_ok=True)
        lane = ExtractLane(extract_lane_settings(config), extractor, target)
        for shard_id in shard_ids:
            lane.run(shard_id)
    extractor.close()
    return configs


def _overrides(shard_size: int, max_tokens: int, dtype: str, extract: dict[str, Any]) -> dict[str, Any]:
    return {"dataset": {"shard_size": shard_size}, "generate.sampling": {"max_tokens": max_tokens},
            "extract": {"hidden_dtype": dtype, **extract}, "quality": FLAG_EVERYTHING}
