"""Tensor parallelism in the extract lane: the shipped CPU config (worker_configs/local-cpu.toml) with
`extract.engine = "vllm"` and `extract.vllm.tensor_parallel_size = 2` on vLLM's CPU build, through real workers,
a redis-server and local storage; one engine start and one job for the whole module.

Nothing is set by hand that the worker must choose on a CPU: no KV cache size (vLLM alone would reserve 90 % of
the host's memory) and no thread binding (vLLM's own needs a NUMA node per rank). The connector's first write of
one sample's states fails as on a full tmpfs, so the job also shows that failure retried and counted.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import tomli_w
import torch

from dflash_queue.config import Config, load_config
from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.launcher import WorkerProcess
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.training import ShardDataset
from dfq_testing.configs import local_copy
from dfq_testing.jobs import first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states
from dfq_testing.references import assert_each_sample_exact, reference_model

REPO = Path(__file__).resolve().parent.parent
CPU_CONFIG = REPO / "worker_configs" / "local-cpu.toml"
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
SAMPLES = 16
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@dataclass
class Job:
    config: Config
    samples: list[str]
    full_once: str
    counters: dict[str, int]
    dead_letters: int
    log: str


def tensor_parallel_config(root: Path, model: Path, broker_url: str) -> Path:
    """The CPU config made to run here (model, broker, storage and state under `root`) with the extract lane on
    vLLM over two tensor-parallel ranks, in float32 so that the states can be held to the reference's rounding."""
    path = local_copy(CPU_CONFIG, root, model=model, tokenizer=model, broker_url=broker_url)
    tables = tomllib.loads(path.read_text())
    tables["model"]["dtype"] = "float32"
    tables["extract"].update(engine="vllm", hidden_dtype="float32", canary_samples=1)
    tables["extract"]["vllm"] = {
        "tensor_parallel_size": 2, "dtype": "float32", "enforce_eager": True, "log_stats_interval_s": 0,
        "shutdown_timeout_s": 60,
    }
    tables["generate"]["sampling"]["max_tokens"] = 32
    tables["quality"] = FLAG_EVERYTHING  # every sample reaches the extract lane, whatever the tiny model says
    path.write_text(tomli_w.dumps(tables))
    return path


@pytest.fixture(scope="module")
def family(tiny_family) -> Path:
    """Tiny Qwen3 with weights scaled so that a wrong state shows, and two key/value heads: one per rank."""
    return tiny_family("qwen3")


@pytest.fixture(scope="module")
def job(family, redis_server, tmp_path_factory) -> Job:
    from dflash_queue.data.readers import read_dataset
    from dflash_queue.data.samples import Sample

    root = tmp_path_factory.mktemp("tensor-parallel")
    redis.Redis.from_url(redis_server.url).flushall()
    config = load_config(tensor_parallel_config(root, family, redis_server.url))
    dataset = first_lines(SAMPLE, SAMPLES, root / "prompts.jsonl")
    samples = [s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
    full_once = samples[3]
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_CPU_OMP_THREADS_BIND"}
    environment.pop("VLLM_CPU_KVCACHE_SPACE", None)
    faulty = {
        **environment,
        ENV: json.dumps({"extract_vllm_states": {"no_space": [full_once]}}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")])),
    }
    logs = root / "logs"
    workers = [
        WorkerProcess("generate", Path(config.source), environment, logs / "generate.log", hostname="generate-tp@test"),
        WorkerProcess("extract", Path(config.source), faulty, logs / "extract.log", hostname="extract-tp@test",
                      module="dfq_testing.faulty_worker"),
    ]
    try:
        app = configure_app(config)
        for worker in workers:
            worker.wait_ready(app, timeout=900)
        ledger = Ledger.from_url(redis_server.url, config.run.name)
        report = Producer(config, ledger).enqueue([dataset])
        wait_for_states(ledger, report.shard_ids, {DONE}, timeout=900, workers=workers)
        counters = ledger.counters()
        dead = DeadLetters.from_url(redis_server.url, config.run.name).count()
    finally:
        for worker in workers:
            worker.stop(timeout=120)  # warm: vLLM's processes shut down, their connectors say what they wrote
    return Job(config, samples, full_once, counters, dead, (logs / "extract.log").read_text(errors="replace"))


def test_states_equal_the_checkpoints_own_forward_of_each_sample(job, family):
    dataset = ShardDataset(job.config.storage.url, hidden_dtype=torch.float32)
    assert len(dataset) == SAMPLES and job.dead_letters == 0
    assert sorted(dataset.meta(i).id for i in range(len(dataset))) == sorted(job.samples)
    meta = dataset.shards[0].metadata
    assert meta["extraction"] == "vllm"
    captured = list(zip(json.loads(meta["layer_ids"]), json.loads(meta["layer_states"])))
    model = reference_model(family)
    assert_each_sample_exact(dataset, model, captured)


def test_only_tensor_parallel_rank_0_writes_states(job):
    assert "hidden-states connector, tensor-parallel rank 0 of 2: writes each finished sequence's states" in job.log
    assert "hidden-states connector, tensor-parallel rank 1 of 2: writes nothing" in job.log
    # At shutdown each rank says how many states files it wrote: every sample, the canaries' reruns and the load
    # probes from rank 0 (the one write that failed not counted), none from rank 1.
    written = {int(rank): int(count) for rank, count in re.findall(
        r"hidden-states connector, tensor-parallel rank (\d): wrote (\d+) states file", job.log
    )}
    assert written.keys() == {0, 1}, job.log[-5000:]
    assert written[1] == 0 and written[0] >= SAMPLES + 2  # two shards: a canary rerun each


def test_the_worker_binds_each_rank_to_cores_of_its_own(job):
    binding = re.search(r"VLLM_CPU_OMP_THREADS_BIND=(\S+) \(one core range per rank", job.log)
    assert binding, job.log[-5000:]
    # vLLM's own account of the binding it applied: one rank per core set, the sets disjoint, within this
    # process's cores.
    ranks = dict(re.findall(r"local_rank=(\d), core ids=(\[[\d, ]+\])", job.log))
    assert sorted(ranks) == ["0", "1"], job.log[-5000:]
    cores = [set(json.loads(ranks[rank])) for rank in ("0", "1")]
    assert cores[0] and cores[1] and not cores[0] & cores[1]
    assert cores[0] | cores[1] <= set(os.sched_getaffinity(0))


def test_the_worker_sizes_the_kv_cache_for_the_sequences_in_flight(job):
    sized = re.search(r"KV cache ([\d.]+) GiB per rank for (\d+) sequence\(s\) of (\d+) tokens", job.log)
    assert sized, job.log[-5000:]
    sequences, max_model_len = int(sized.group(2)), int(sized.group(3))
    assert sequences == 2 * 8  # extract.vllm.inflight_tasks shards of dataset.shard_size samples
    # vLLM's own count of what the cache holds, from its own per-token sizes: at least those sequences.
    tokens = [int(n.replace(",", "")) for n in re.findall(r"KV cache size: ([\d,]+) tokens", job.log)]
    assert tokens and min(tokens) >= sequences * max_model_len, tokens


def test_a_full_transfer_directory_is_retried_and_counted(job):
    assert "StatesHandOverFailed" in job.log and "No space left on device" in job.log
    assert job.counters.get("transient_retries", 0) >= 1
    assert job.full_once in job.samples  # stored: see the first test
