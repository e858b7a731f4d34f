#!/usr/bin/env python
"""S3 storage throughput against a loopback S3-compatible endpoint (moto, in its own process), in one run:

1. uploads: (a) raw boto3 `upload_file` (TransferManager) of N shard-sized files, (b) the storage layer's
   `write_file` of the same files (sha256 metadata + S3 checksum + multipart), interleaved file by file.
   Prints MB/s of both and b/a (target >= 0.9).
2. the extract lane: the same completions extracted by a real `dflash-queue worker extract` storing into a
   local directory and into S3 (default task slots, so uploads overlap the next shard's compute), plus S3 with
   a single task slot for reference. Prints samples/s and s3/local (target >= 0.9).

    .venv/bin/python tools/bench_s3.py [--files 8 --file-mb 64 --part-mb 16] [--samples 64 --rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_pipeline import make_dataset  # noqa: E402

from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import Config, S3Config, load_config  # noqa: E402
from dflash_queue.data.readers import read_dataset  # noqa: E402
from dflash_queue.data.samples import Sample  # noqa: E402
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings  # noqa: E402
from dflash_queue.lanes.registry import EXTRACT  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.runstate.ledger import DONE, Ledger  # noqa: E402
from dflash_queue.shards.keys import COMPLETIONS, SHARDS, completions_key, prompts_key  # noqa: E402
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id  # noqa: E402
from dflash_queue.storage import open_storage  # noqa: E402
from dflash_queue.storage.s3 import S3Storage, file_sha256  # noqa: E402
from dfq_testing.configs import tiny_config_tables, write_config  # noqa: E402
from dfq_testing.polling import wait_for_states  # noqa: E402
from dfq_testing.s3 import TEST_CREDENTIALS, LoopbackS3Process  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

MiB = 1024 * 1024


def bench_uploads(server: LoopbackS3Process, args: argparse.Namespace, tmp: Path) -> tuple[float, float, float, float]:
    from boto3.s3.transfer import TransferConfig

    bucket = server.create_bucket("bench-uploads")
    files = []
    for index in range(args.files):
        path = tmp / f"shard-{index}.safetensors"
        path.write_bytes(os.urandom(args.file_mb * MiB))
        files.append(path)
    settings = S3Config(
        endpoint_url=server.endpoint_url,
        multipart_threshold_mb=args.part_mb,
        part_size_mb=args.part_mb,
        max_concurrency=args.concurrency,
    )
    storage = S3Storage(f"s3://{bucket}/layer", settings)
    raw = server.client()
    raw_config = TransferConfig(
        multipart_threshold=args.part_mb * MiB, multipart_chunksize=args.part_mb * MiB, max_concurrency=args.concurrency
    )

    def raw_upload(path: Path) -> None:
        raw.upload_file(str(path), bucket, f"raw/{path.name}", Config=raw_config)

    def layer_upload(path: Path) -> None:
        storage.write_file(f"shards/{path.name}", path)

    def clear() -> None:
        for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                raw.delete_object(Bucket=bucket, Key=item["Key"])

    for path in files[:2]:  # warm-up: connections, page cache
        raw_upload(path), layer_upload(path)
    clear()
    # Interleaved file by file, order alternating, so that load changes on a shared machine hit both alike.
    times = {"raw": 0.0, "layer": 0.0}
    pair_ratios = []  # raw time / layer time of the same file uploaded back to back: robust to load bursts
    for round_index in range(args.upload_rounds):
        for file_index, path in enumerate(files):
            order = (("raw", raw_upload), ("layer", layer_upload))
            pair = {}
            for name, upload in order if (round_index + file_index) % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                upload(path)
                pair[name] = time.perf_counter() - started
                times[name] += pair[name]
            pair_ratios.append(pair["raw"] / pair["layer"])
        clear()
    total_mb = args.files * args.file_mb * args.upload_rounds * MiB / 1e6
    started = time.perf_counter()
    for path in files:
        file_sha256(path)
    hash_mbps = args.files * args.file_mb * MiB / 1e6 / (time.perf_counter() - started)
    storage.close()
    for path in files:
        path.unlink()
    return total_mb / times["raw"], total_mb / times["layer"], hash_mbps, statistics.median(pair_ratios)


def generate_completions(config: Config, samples: list[Sample], shard_size: int) -> list[tuple[str, int]]:
    storage = open_storage(config.storage)
    lane = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    shards = []
    for begin in range(0, len(samples), shard_size):
        shard = samples[begin : begin + shard_size]
        shard_id = prompt_shard_id(shard)
        storage.write_bytes(prompts_key(shard_id), encode_prompts(shard))
        lane.run(shard_id)
        shards.append((shard_id, len(shard)))
    lane.close()
    return shards


def time_extraction(
    config: Config, shards: list[tuple[str, int]], tmp: Path, concurrency: int | None, tag: str, passes: int
) -> float:
    """Seconds an extract worker (engine loaded and warmed up on one shard) takes to extract and store every
    shard `passes` times; outputs are removed between passes while the worker idles."""
    from dflash_queue.queue.tasks import LANE_TASKS

    storage = open_storage(config.storage)
    app = configure_app(config)
    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)

    def one_pass(selected: list[tuple[str, int]]) -> float:
        for key in list(storage.list(SHARDS + "/")):
            storage.delete(key)
        ledger.reset()
        started = time.perf_counter()
        for shard_id, count in selected:
            LANE_TASKS["extract"].apply_async(args=(shard_id, count, config.fingerprint()), queue=EXTRACT.queue)
        wait_for_states(ledger, [s for s, _ in selected], {DONE}, timeout=3600, workers=[worker])
        return time.perf_counter() - started

    extra = ("--concurrency", str(concurrency)) if concurrency else ()
    worker = WorkerProcess(
        "extract", Path(config.source), dict(os.environ), tmp / "logs" / f"{tag}.log", hostname=f"{tag}@bench",
        extra_args=extra,
    )
    try:
        worker.wait_ready(app, timeout=300)
        one_pass(shards[:1])  # first forward passes are slow (allocations, kernel selection): not timed
        return sum(one_pass(shards) for _ in range(passes))
    finally:
        worker.stop()


def bench_extract_lane(server: LoopbackS3Process, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    model_dir = args.model or REPO / ".cache" / f"tiny-qwen3-h{args.hidden_size}"
    model = build_tiny_model(model_dir, hidden_size=args.hidden_size)
    bucket = server.create_bucket("bench-extract")
    with RedisServer(tmp / "redis") as redis:
        tables = tiny_config_tables(model, tmp / "local", redis.url, tmp / "state")
        overrides = {
            "dataset": {"shard_size": args.shard_size, "thinking": "always"},
            "generate.sampling": {"max_tokens": args.max_tokens},
            "extract": {"layer_ids": list(range(6)), "hidden_dtype": args.hidden_dtype, "token_budget": 4096},
        }
        local = load_config(write_config(tmp / "local.toml", tables, **overrides))
        s3 = load_config(
            write_config(
                tmp / "s3.toml",
                tables,
                **overrides,
                storage={"url": f"s3://{bucket}/run"},
                **{"storage.s3": {"endpoint_url": server.endpoint_url}},
            )
        )
        dataset = make_dataset(args.samples, tmp / "prompts.jsonl")
        samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
        print(f"generating completions for {len(samples)} samples (not timed) ...", flush=True)
        shards = generate_completions(local, samples, args.shard_size)
        s3_storage = open_storage(s3.storage)
        local_storage = open_storage(local.storage)
        for key in local_storage.list(COMPLETIONS + "/"):
            s3_storage.write_bytes(key, local_storage.read_bytes(key))
        assert all(s3_storage.exists(completions_key(s)) for s, _ in shards)

        variants = [("local", local, None), ("s3", s3, None), ("s3-one-slot", s3, 1)]
        times = {name: 0.0 for name, _, _ in variants}
        for round_index in range(args.rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for name, config, concurrency in order:
                elapsed = time_extraction(config, shards, tmp, concurrency, f"{name}-{round_index}", args.passes)
                times[name] += elapsed
                rate = len(samples) * args.passes / elapsed
                print(f"  round {round_index + 1} {name:<12} {rate:7.2f} samples/s", flush=True)
        sizes = [local_storage.size(k) for k in local_storage.list(SHARDS + "/")]
        print(f"shards: {len(shards)} x ~{sum(sizes) / max(len(sizes), 1) / 1e6:.1f} MB")
        return {name: len(samples) * args.passes * args.rounds / elapsed for name, elapsed in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--file-mb", type=int, default=64)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=10, help="parallel part uploads")
    parser.add_argument("--upload-rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden-dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=2, help="worker starts per variant, alternating order")
    parser.add_argument("--passes", type=int, default=3, help="extractions of every shard per worker start")
    parser.add_argument("--hidden-size", type=int, default=512, help="of the tiny model built for the extract lane")
    parser.add_argument("--model", type=Path, default=None, help="default .cache/tiny-qwen3-h{hidden size}")
    parser.add_argument("--skip-extract", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name, value in TEST_CREDENTIALS.items():  # the loopback endpoint accepts any credentials
        os.environ[name] = value
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="dfq-bench-s3-"))
    try:
        with LoopbackS3Process() as server:
            raw_mbps, layer_mbps, hash_mbps, median_ratio = bench_uploads(server, args, tmp)
            print(f"uploads: {args.files} files x {args.file_mb} MiB, parts {args.part_mb} MiB, "
                  f"{args.concurrency} in flight, {args.upload_rounds} rounds")
            print(f"  (a) boto3 upload_file (TransferManager): {raw_mbps:8.1f} MB/s")
            print(f"  (b) storage layer write_file:            {layer_mbps:8.1f} MB/s")
            print(f"  b / a = {layer_mbps / raw_mbps:.3f}  (target >= 0.9); median over back-to-back pairs of the "
                  f"same file: {median_ratio:.3f}")
            print(f"  (b) also hashes every file once for its sha256 metadata; sha256 alone: {hash_mbps:.0f} MB/s",
                  flush=True)
            if args.skip_extract:
                return
            rates = bench_extract_lane(server, args, tmp)
        print(f"extract lane: tiny model (hidden {args.hidden_size}), {args.samples} samples in shards of "
              f"{args.shard_size}, {args.hidden_dtype} states of 6 layers, {args.rounds} rounds x {args.passes} passes")
        print(f"  local storage:                     {rates['local']:7.2f} samples/s")
        print(f"  S3 storage (default task slots):   {rates['s3']:7.2f} samples/s")
        print(f"  S3 storage (one task slot):        {rates['s3-one-slot']:7.2f} samples/s")
        print(f"  s3 / local = {rates['s3'] / rates['local']:.3f}  (target >= 0.9)")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
