"""The whole job with S3 storage for prompts, completions and shards: real workers, real Redis, the tiny model
and an S3-compatible HTTP endpoint on loopback (moto's threaded server)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.lanes.registry import EXTRACT
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.tasks import LANE_TASKS
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger
from dflash_queue.runstate.run_identity import MANIFEST_KEY
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dflash_queue.storage.s3 import SHA256_METADATA
from dfq_testing.jobs import first_lines
from dfq_testing.polling import wait_for_states
from dfq_testing.s3 import LoopbackS3

REPO = Path(__file__).resolve().parent
SAMPLE = REPO.parent / "examples" / "sharegpt_sample.jsonl"
MiB = 1024 * 1024
pytestmark = pytest.mark.slow


def test_job_on_s3_stores_verified_multipart_shards(
    make_config, s3_server, s3_bucket, redis_url, start_worker, tmp_path, tiny_model
):
    config = make_config(
        storage={"url": f"s3://{s3_bucket}/e2e"},
        **{
            # Float32 states of all six layers: the 24-sample shard exceeds the 5 MiB part size, the 8-sample
            # remainder does not, so both upload paths run.
            "storage.s3": {"endpoint_url": s3_server.endpoint_url, "multipart_threshold_mb": 5, "part_size_mb": 5},
            "dataset": {"shard_size": 24, "thinking": "always"},
            "generate.sampling": {"max_tokens": 96},
            "extract": {"layer_ids": [0, 1, 2, 3, 4, 5], "hidden_dtype": "float32", "token_budget": 2048},
        },
    )
    configure_app(config)
    dataset = first_lines(SAMPLE, 32, tmp_path / "prompts.jsonl")
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.enqueued == 2
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=600, workers=workers)

    storage = open_storage(config.storage)
    raw = s3_server.client()
    samples = {s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)}
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    seen = set()
    sizes = {}
    for shard_id in report.shard_ids:
        head = raw.head_object(Bucket=s3_bucket, Key=f"e2e/{shard_key(shard_id)}")
        multipart = "-" in head["ETag"]  # a multipart upload's ETag ends in -{number of parts}
        assert multipart == (head["ContentLength"] >= 5 * MiB), head
        sizes[head["ContentLength"]] = multipart
        stored = storage.read_bytes(completions_key(shard_id))
        completions = {c.id: c for c in decode_completions(stored, what=shard_id)}
        with storage.local_copy(shard_key(shard_id)) as path:
            shard = TrainingShard(path)
            assert len(shard) in (24, 8)
            for index in range(len(shard)):
                item = shard[index]
                record = completions[item.id]
                assert item.input_ids.tolist() == record.prompt_ids + record.completion_ids
                assert item.loss_mask.tolist() == [0] * len(record.prompt_ids) + [1] * len(record.completion_ids)
                assert item.hidden_states.shape == (len(item.input_ids), 6, 128)
                if index % 5 == 0:
                    with torch.inference_mode():
                        out = reference(item.input_ids.long()[None], output_hidden_states=True)
                    # Transformers' last tuple entry has the final norm applied; layers 0-4 compare directly.
                    expected = torch.stack([out.hidden_states[i + 1][0] for i in range(5)], dim=1)
                    torch.testing.assert_close(item.hidden_states[:, :5], expected, rtol=1e-4, atol=1e-4)
                seen.add(item.id)
    assert seen == samples
    assert sorted(sizes.values()) == [False, True], sizes

    # Every object the job wrote carries the sha256 of its content and an S3 checksum.
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    # The run's outputs, and what they were made with (dflash_queue.runstate.run_identity) in the storage root.
    assert {k.split("/")[1] for k in keys} == {"prompts", "completions", "shards", MANIFEST_KEY}
    for key in keys:
        head = raw.head_object(Bucket=s3_bucket, Key=key, ChecksumMode="ENABLED")
        body = raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert head["Metadata"][SHA256_METADATA] == hashlib.sha256(body).hexdigest(), key
        assert "ChecksumCRC32" in head, key
    assert raw.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert list(config.staging_dir.glob("*/*")) == []


def test_job_survives_the_endpoint_going_away_mid_run(make_config, s3_env, redis_url, start_worker, tmp_path):
    """The store disappears after the first shard is done and comes back once the workers have noticed; the
    job finishes with every shard stored and none failed."""
    with LoopbackS3() as server:
        bucket = server.create_bucket("outage-run")
        config = make_config(
            storage={"url": f"s3://{bucket}/job", "unavailable_task_retries": 50},
            **{
                "storage.s3": {"endpoint_url": server.endpoint_url, "max_attempts": 2, "connect_timeout_s": 1.0},
                "dataset": {"shard_size": 4, "thinking": "always"},
                "generate.sampling": {"max_tokens": 24},
            },
        )
        configure_app(config)
        dataset = first_lines(SAMPLE, 40, tmp_path / "prompts.jsonl")
        workers = [start_worker(config, "generate"), start_worker(config, "extract")]
        ledger = Ledger.from_url(redis_url, config.run.name)
        report = Producer(config, ledger).enqueue([dataset])
        assert report.enqueued == 10

        deadline = time.monotonic() + 600
        while DONE not in ledger.states(report.shard_ids).values():
            assert all(w.alive() for w in workers) and time.monotonic() < deadline
            time.sleep(0.05)
        server.stop()
        # A duplicate delivery of a finished shard gives the extract worker work that needs the store too.
        finished = next(s for s, state in ledger.states(report.shard_ids).items() if state == DONE)
        LANE_TASKS["extract"].apply_async(args=(finished, 4, config.fingerprint()), queue=EXTRACT.queue)
        # Keep the store down until both workers have hit the outage and scheduled a retry.
        while not all("storage unavailable (retry" in w.log_tail(200_000) for w in workers):
            assert all(w.alive() for w in workers) and time.monotonic() < deadline, workers[0].log_tail()
            time.sleep(0.2)
        server.start()

        states = wait_for_states(ledger, report.shard_ids, {DONE, FAILED}, timeout=900, workers=workers)
        assert FAILED not in states.values(), {s: ledger.failure(s) for s, v in states.items() if v == FAILED}
        assert ledger.counters()["storage_retries"] >= 2

        storage = open_storage(config.storage)
        samples = {s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)}
        seen = set()
        for shard_id in report.shard_ids:
            with storage.local_copy(shard_key(shard_id)) as path:
                shard = TrainingShard(path)
                seen.update(shard[i].id for i in range(len(shard)))
                seen.update(d["id"] for d in shard.dropped)  # left out by the quality gate, accounted for
        assert seen == samples
        assert storage.incomplete_uploads() == []
        assert list(config.staging_dir.glob("*/*")) == []
