"""`dflash-queue reextract`: a job run on this machine, then its stored completions extracted again with the last
layer's state into a new output (nothing generated), which speculators' export then takes. Real runs of the tiny
model, real redis-server, the documented commands."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dflash_queue.config import load_config
from dflash_queue.reextraction import check_reextraction
from dflash_queue.shards.training import LAST_LAYER, TrainingShard
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.jobs import first_lines

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def dfq(*args: str) -> subprocess.CompletedProcess:
    return dflash_queue(*args)


def configs(tiny_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    sampling = {"generate.sampling": {"max_tokens": 12}}
    old = write_config(tmp_path / "job.toml", tables, dataset={"shard_size": 4, "thinking": "never"}, **sampling)
    new = write_config(
        tmp_path / "job-last-layer.toml", tables, dataset={"shard_size": 4, "thinking": "never"}, **sampling,
        run={"name": "test-last-layer"}, storage={"url": str(tmp_path / "out-last-layer")},
        extract={"last_layer_state": True},
    )
    return old, new


def test_a_job_is_extracted_again_with_the_last_layer_without_generating_and_exports_for_speculators(
    tiny_model, tmp_path
):
    old, new = configs(tiny_model, tmp_path)
    dataset = first_lines(SAMPLE, 10, tmp_path / "prompts.jsonl")  # 3 shards
    first = dfq("run", dataset, "-c", old)
    assert first.returncode == 0, first.stderr[-3000:]

    # The job's shards lack the last layer: speculators' export is refused, naming the command that adds it.
    refused = dfq("export", tmp_path / "out", "-f", "speculators", tmp_path / "sp-refused")
    assert refused.returncode == 1 and "dflash-queue reextract -c NEW_CONFIG --from CONFIG" in refused.stderr, (
        refused.stderr
    )

    completions = {p.name: p.read_bytes() for p in (tmp_path / "out" / "completions").glob("*.jsonl")}
    generate_log = tmp_path / "state" / "logs" / "generate.log"
    generate_logged = generate_log.read_bytes()
    again = dfq("reextract", "-c", new, "--from", old)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "started workers: extract (pid" in again.stderr and "generate (pid" not in again.stderr, again.stderr
    assert "tokens generated:  0 " in again.stdout and "shards:            3 done, 0 failed" in again.stdout, (
        again.stdout
    )
    assert generate_log.read_bytes() == generate_logged  # no generate worker ran
    # The completions are the job's, byte for byte.
    copied = {p.name: p.read_bytes() for p in (tmp_path / "out-last-layer" / "completions").glob("*.jsonl")}
    assert copied == completions and len(copied) == 3

    old_config, new_config = load_config(old), load_config(new)
    assert new_config.fingerprint() != old_config.fingerprint()
    for path in sorted((tmp_path / "out-last-layer" / "shards").glob("*.safetensors")):
        info = TrainingShard(path).info()
        assert LAST_LAYER in json.loads(info["layer_states"]), info
        assert info["config_fingerprint"] == new_config.fingerprint(), info
    assert len(list((tmp_path / "out-last-layer" / "shards").glob("*.safetensors"))) == 3

    exported = dfq("export", tmp_path / "out-last-layer", "-f", "speculators", tmp_path / "sp")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert list((tmp_path / "sp" / "hidden_states").glob("hs_*.safetensors"))

    # Run again, it finds everything stored: nothing sent, nothing extracted twice.
    rerun = dfq("reextract", "-c", new, "--from", old)
    assert rerun.returncode == 0 and "3 were already done" in rerun.stdout, rerun.stdout + rerun.stderr[-2000:]


def test_a_reextraction_may_change_extract_settings_only_and_writes_elsewhere(tiny_model, tmp_path):
    old, new = configs(tiny_model, tmp_path)
    check_reextraction(load_config(old), load_config(new))
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    other_sampling = write_config(
        tmp_path / "sampling.toml", tables, dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 40}}, run={"name": "x"}, storage={"url": str(tmp_path / "o2")},
        extract={"last_layer_state": True},
    )
    with pytest.raises(Exception, match=r"differs from .*job.toml in sampling: its completions would be other"):
        check_reextraction(load_config(old), load_config(other_sampling))
    same_output = write_config(
        tmp_path / "same.toml", tables, dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 12}}, run={"name": "x"}, extract={"last_layer_state": True},
    )
    with pytest.raises(Exception, match=r"a re-extraction writes a new output"):
        check_reextraction(load_config(old), load_config(same_output))
    refused = dfq("reextract", "-c", other_sampling, "--from", old)
    assert refused.returncode == 1 and "only extract settings may differ" in refused.stderr
    assert "Traceback" not in refused.stderr
