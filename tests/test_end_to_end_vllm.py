"""The generate lane on vLLM (CPU build) through Redis and real workers: exact ids, warm stop, a dying engine.

The workers' engines run their model in the engine core's process, the layout vLLM gives one GPU
(`VLLM_ENABLE_V1_MULTIPROCESSING=0` in generate.vllm.env; on a CPU vLLM otherwise adds a model worker process,
whose reader spins beside the engine core's on a machine with few cores). The CPU build's own layout is under test
in tests/engines/vllm/test_vllm_generate.py, the tensor-parallel tests and `run` on the vLLM extract engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.engines.base import request_seed
from dflash_queue.lanes.registry import EXTRACT, GENERATE
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.worker import EXIT_ENGINE_LOST
from dflash_queue.runstate.ledger import DONE, GENERATED, QUEUED, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.configs import tiny_vllm_overrides
from dfq_testing.jobs import first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states
from dfq_testing.processes import descendants, describe, survivors
from dfq_testing.vllm_uniproc import MULTIPROCESSING_ENV, model_workers

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": 48, "seed": 3}
ONE_PROCESS = {"env": {MULTIPROCESSING_ENV: "0"}}


def queued_messages(redis_url: str, queue: str) -> int:
    """Messages waiting in a Celery queue on Redis (kombu keeps each queue as a list under its name)."""
    return redis.Redis.from_url(redis_url).llen(queue)


def wait_until_one(ledger: Ledger, shard_ids: list[str], state: str, worker) -> None:
    deadline = time.monotonic() + 600
    while not any(s == state for s in ledger.states(shard_ids).values()):
        assert worker.alive(), worker.log_tail()
        assert time.monotonic() < deadline, f"no shard reached {state}:\n{worker.log_tail()}"
        time.sleep(0.1)


REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt

def main():
    requests = json.load(sys.stdin)
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=2**30,
              enable_chunked_prefill=False, disable_log_stats=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests],
                           [SamplingParams(**r["sampling"]) for r in requests], use_tqdm=False)
    print(json.dumps([{"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                       "finish_reason": o.outputs[0].finish_reason} for o in outputs]))

if __name__ == "__main__":
    main()
"""


def reference_generations(tiny_model: Path, samples: list[Sample]) -> dict[str, dict]:
    """The same requests through a separate, plain vLLM `LLM` with the same sampling, in a process of its own with
    its engine core inside (one process importing vLLM, not three): this test's process may hold proxies of modules
    (Flask's, via the S3 test server) that vLLM's CPU build trips over when it registers its kernels."""
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))
    requests = [
        {
            "prompt_ids": formatter.prompt_ids(s.messages, enable_thinking=s.thinking),
            "sampling": {
                "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"], "top_k": SAMPLING["top_k"],
                "max_tokens": SAMPLING["max_tokens"], "seed": request_seed(SAMPLING["seed"], s.id),
            },
        }
        for s in samples
    ]
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(tiny_model)], input=json.dumps(requests), capture_output=True,
        text=True, timeout=600, env={**os.environ, MULTIPROCESSING_ENV: "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = json.loads(done.stdout.strip().splitlines()[-1])
    return {sample.id: output for sample, output in zip(samples, outputs, strict=True)}


def test_shards_hold_exactly_what_vllm_generated_across_a_warm_stop(
    make_config, redis_url, start_worker, tmp_path, tiny_model
):
    # The quality gate flags but neither drops nor retries: every reply stays exactly what vLLM first generated.
    config = make_config(
        **tiny_vllm_overrides(inflight_tasks=2, **ONE_PROCESS), **{"generate.sampling": SAMPLING},
        quality=FLAG_EVERYTHING,
    )
    app = configure_app(config)
    dataset = first_lines(SAMPLE, 48, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    storage = open_storage(config.storage.url)

    # A first vLLM worker takes part of the job, then gets SIGTERM (what systemd sends) while tasks run.
    first = start_worker(config, "generate")
    report = Producer(config, ledger).enqueue([dataset])
    assert report.samples == 48 and report.enqueued == 6
    wait_until_one(ledger, report.shard_ids, GENERATED, first)
    tree = descendants(first.pid)
    assert any("EngineCore" in p.name() for p in tree), describe(tree)
    assert not model_workers(tree), describe(tree)  # the model in the engine core's process
    first.terminate()
    assert first.process.wait(timeout=300) == 0, first.log_tail()
    left = survivors(tree, timeout=60)
    assert not left, f"processes outlived the worker: {describe(left)}"

    # Tasks in flight finished (stored, chained to extraction); the others went back to the queue untouched.
    states = ledger.states(report.shard_ids)
    generated = [s for s in report.shard_ids if states[s] == GENERATED]
    waiting = [s for s in report.shard_ids if states[s] == QUEUED]
    assert len(generated) + len(waiting) == 6
    assert all(storage.exists(completions_key(s)) for s in generated)
    assert not any(storage.exists(completions_key(s)) for s in waiting)
    assert queued_messages(redis_url, GENERATE.queue) == len(waiting)
    assert queued_messages(redis_url, EXTRACT.queue) == len(generated)

    # A second vLLM worker and an extract worker finish the job.
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=900, workers=workers)
    assert ledger.counters()["generate_shards"] == 6  # no shard generated twice

    samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))
    template_ids = {s.id: formatter.prompt_ids(s.messages, enable_thinking=s.thinking) for s in samples}
    expected = reference_generations(tiny_model, samples)
    finish_reasons = set()
    for shard_id in report.shard_ids:
        records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
        with storage.local_copy(shard_key(shard_id)) as path:
            shard = TrainingShard(path)
            assert [shard[i].id for i in range(len(shard))] == [r.id for r in records]
            for index, record in enumerate(records):
                reference = expected[record.id]
                assert record.prompt_ids == template_ids[record.id] == reference["prompt_token_ids"]
                assert record.completion_ids == reference["token_ids"], record.id
                assert record.finish_reason == reference["finish_reason"]
                item = shard[index]
                assert item.input_ids.tolist() == record.prompt_ids + record.completion_ids
                assert item.loss_mask.tolist() == [0] * len(record.prompt_ids) + [1] * len(record.completion_ids)
                finish_reasons.add(record.finish_reason)
    assert finish_reasons == {"stop", "length"}
    assert app.conf.worker_prefetch_multiplier == 1


def test_a_worker_whose_engine_dies_hands_its_tasks_back_and_exits(
    make_config, redis_url, start_worker, tmp_path, tiny_model
):
    config = make_config(**tiny_vllm_overrides(inflight_tasks=2, **ONE_PROCESS))
    configure_app(config)
    worker = start_worker(config, "generate")
    tree = descendants(worker.pid)
    (engine_core,) = [p for p in tree if "EngineCore" in p.name()]
    os.kill(engine_core.pid, signal.SIGKILL)  # as the OOM killer would

    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([first_lines(SAMPLE, 16, tmp_path / "prompts.jsonl")])
    assert report.enqueued == 2
    assert worker.process.wait(timeout=300) == EXIT_ENGINE_LOST, worker.log_tail()
    left = survivors(tree, timeout=60)
    assert not left, f"processes outlived the worker: {describe(left)}"
    # Not marked failed, nothing written: both messages are back in the queue for a healthy worker.
    assert set(ledger.states(report.shard_ids).values()) == {QUEUED}
    assert queued_messages(redis_url, GENERATE.queue) == 2
    storage = open_storage(config.storage.url)
    assert not any(storage.exists(completions_key(s)) for s in report.shard_ids)
