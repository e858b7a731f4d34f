"""The whole path on real parts: Redis, two `dflash-queue worker` processes, the tiny model, local storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_pipeline_produces_exact_training_shards(make_config, redis_url, start_worker, tmp_path, tiny_model):
    config = make_config(dataset={"shard_size": 8, "thinking": "never"}, quality=FLAG_EVERYTHING)
    configure_app(config)
    dataset = first_lines(SAMPLE, 32, tmp_path / "prompts.jsonl")
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]

    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.samples == 32 and report.enqueued == 4
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)

    storage = open_storage(config.storage.url)
    samples = {s.id: s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    formatter = ChatFormatter(tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen: set[str] = set()
    finish_reasons: set[str] = set()

    for shard_id in report.shard_ids:
        completions = {c.id: c for c in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)}
        with storage.local_copy(shard_key(shard_id)) as path:
            shard = TrainingShard(path)
            meta = shard.info()
            assert meta["target_model"] == "tiny-qwen3"
            assert json.loads(meta["layer_ids"]) == [1, 2, 3]  # DFlash rule for 6 layers, K=3
            assert meta["dtype"] == "bfloat16" and meta["layer_convention"] == "decoder_layer_output"
            assert meta["config_fingerprint"] == config.fingerprint()
            assert set(json.loads(meta["versions"])) >= {"torch", "transformers", "dflash_queue"}
            assert len(shard) == 8
            for index in range(len(shard)):
                item = shard[index]
                record = completions[item.id]
                sample = samples[item.id]
                # Prompt ids are the chat template's, thinking off; nothing re-tokenised on the way.
                assert record.prompt_ids == formatter.prompt_ids(sample.messages, enable_thinking=False)
                assert item.input_ids.tolist() == record.prompt_ids + record.completion_ids
                assert item.loss_mask.tolist() == [0] * len(record.prompt_ids) + [1] * len(record.completion_ids)
                assert item.hidden_states.shape == (len(item.input_ids), 3, 128)
                assert item.finish_reason == record.finish_reason
                if record.finish_reason == "stop":
                    assert record.completion_ids[-1] == eos
                else:
                    assert len(record.completion_ids) == config.generate.sampling.max_tokens
                finish_reasons.add(record.finish_reason)
                with torch.inference_mode():
                    out = reference(item.input_ids.long()[None], output_hidden_states=True)
                expected = torch.stack([out.hidden_states[i + 1][0] for i in (1, 2, 3)], dim=1)
                torch.testing.assert_close(
                    item.hidden_states.float(), expected.to(torch.bfloat16).float(), rtol=1.6e-2, atol=1e-3
                )
                seen.add(item.id)
    assert seen == set(samples)
    assert finish_reasons == {"stop", "length"}
    counters = ledger.counters()
    assert counters["extract_samples"] == 32 and counters["generate_samples"] == 32


def test_run_command_does_the_whole_job_on_one_box(tiny_model, tmp_path):
    """`dflash-queue run` with no broker configured: private redis-server, workers, summary, clean exit."""
    from dfq_testing.configs import tiny_config_tables, write_config

    tables = tiny_config_tables(tiny_model, tmp_path / "unused-storage", "", tmp_path / "state")
    config_path = write_config(tmp_path / "run.toml", tables)
    dataset = first_lines(SAMPLE, 20, tmp_path / "prompts.jsonl")
    with open(dataset, "a") as handle:
        handle.write('{"conversations": [{"from": "alien", "value": "hi"}]}\n')
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config_path), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    summary = result.stdout
    assert "samples:           20 read, 0 duplicates, 1 bad records skipped" in summary
    assert "shards:            3 done, 0 failed" in summary
    assert "quality gate:      " in summary and " kept, " in summary
    assert f"{dataset}:21 [conversations[0].from]: unknown role: 'alien'" in summary
    shards = sorted((out / "shards").glob("*.safetensors"))
    assert len(shards) == 3
    # Every sample is in a shard, or listed in its shard's metadata as dropped by the quality gate.
    assert sum(len(TrainingShard(p)) + len(TrainingShard(p).dropped) for p in shards) == 20
    aof = tmp_path / "state" / "redis"
    assert (aof / "appendonlydir").is_dir() or (aof / "appendonly.aof").is_file()  # the private broker kept an AOF
    # Nothing left running: the private redis-server and both workers are gone.
    leftovers = subprocess.run(["pgrep", "-f", str(config_path)], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""

    rerun = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config_path), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "3 were already done" in rerun.stdout
    assert "tokens generated:  0 " in rerun.stdout

    # After the run, the commands that read the broker answer from its private broker's data (no broker.url).
    assert not (aof / "broker.url").exists()  # the run's URL is forgotten when its server stops
    verified = dflash_queue("verify", dataset, "-c", config_path, timeout=300,
                            env={**os.environ, "DFQ_STORAGE_URL": str(out)})
    assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
    assert "missing: 0" in verified.stdout and "duplicated: 0" in verified.stdout

    # The same run name with another model and another output: refused, saying why, never reported done.
    import shutil

    other_model = tmp_path / "tiny-other"
    shutil.copytree(tiny_model, other_model)
    other_tables = tiny_config_tables(other_model, tmp_path / "unused-storage", "", tmp_path / "state")
    other_tables["model"]["name"] = ""
    other_config = write_config(tmp_path / "other.toml", other_tables)
    out2 = tmp_path / "out2"
    other = [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(other_config), "-o", str(out2)]
    refused = subprocess.run(other, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1, refused.stdout
    assert "this broker's run `test` was made with model tiny-qwen3, yours with model tiny-other" in refused.stderr
    assert "started workers" not in refused.stderr  # refused before any model was loaded
    assert not list(out2.glob("shards/*"))
    # --rebuild starts the run over with the new model: its output is complete.
    rebuilt = subprocess.run([*other, "--rebuild"], capture_output=True, text=True, timeout=600)
    assert rebuilt.returncode == 0, rebuilt.stderr[-4000:]
    assert "shards:            3 done, 0 failed, 0 were already done" in rebuilt.stdout
    rebuilt_shards = sorted((out2 / "shards").glob("*.safetensors"))
    assert [p.name for p in rebuilt_shards] == [p.name for p in shards]
    assert {TrainingShard(p).metadata["target_model"] for p in rebuilt_shards} == {"tiny-other"}


def test_ctrl_c_stops_everything_and_a_rerun_finishes_the_job(tiny_model, tmp_path):
    """First Ctrl-C: warm shutdown; second: workers killed. Nothing is left running, and the next run
    requeues what was in flight and completes every shard."""
    import signal
    import time

    from dfq_testing.configs import tiny_config_tables, write_config
    from dfq_testing.terminal import foreground_job

    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    config_path = write_config(tmp_path / "run.toml", tables, **{"generate.sampling": {"max_tokens": 400}})
    dataset = first_lines(SAMPLE, 24, tmp_path / "prompts.jsonl")
    command = [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config_path)]
    process = foreground_job(command)
    generate_log = tmp_path / "state" / "logs" / "generate.log"
    deadline = time.monotonic() + 120
    while not (generate_log.exists() and "Task dfq.generate" in generate_log.read_text()):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the generate worker never started a task"
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    for marker in (str(config_path), str(tmp_path / "state" / "redis")):
        leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        assert leftovers.strip() == "", f"processes left running: {leftovers}"

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    shards = sorted((tmp_path / "out" / "shards").glob("*.safetensors"))
    assert len(shards) == 3
    ids = [i for path in shards for i in TrainingShard(path).sample_ids]
    ids += [d["id"] for path in shards for d in TrainingShard(path).dropped]
    assert len(ids) == len(set(ids)) == 24
