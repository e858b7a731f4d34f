"""`dflash-queue reextract`: a job run on this machine, then its stored completions extracted again with the last
layer's state into a new output (nothing generated), which speculators' export then takes. Real runs of the tiny
model, real redis-server, the documented commands."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_queue.config import load_config
from dflash_queue.errors import ConfigError
from dflash_queue.reextraction import check_configs, check_made_with, check_reextraction
from dflash_queue.runstate.run_identity import MANIFEST_KEY, RunIdentity
from dflash_queue.shards.keys import completions_key
from dflash_queue.shards.training import LAST_LAYER, TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.checkpoints import fine_tune
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.jobs import first_lines

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def dfq(*args: str) -> subprocess.CompletedProcess:
    return dflash_queue(*args)


def configs(model: Path, tmp_path: Path, max_tokens: int = 12, tag: str = "") -> tuple[Path, Path]:
    """The job's config, and one that extracts its completions again with the last layer (into out-last-layer)."""
    tables = tiny_config_tables(model, tmp_path / "out", "", tmp_path / "state")
    sampling = {"generate.sampling": {"max_tokens": max_tokens}}
    old = write_config(tmp_path / f"job{tag}.toml", tables, dataset={"shard_size": 4, "thinking": "never"}, **sampling)
    new = write_config(
        tmp_path / f"job-last-layer{tag}.toml", tables, dataset={"shard_size": 4, "thinking": "never"}, **sampling,
        run={"name": f"test-last-layer{tag}", "state_dir": str(tmp_path / f"state-last-layer{tag}")},
        storage={"url": str(tmp_path / f"out-last-layer{tag}")},
        extract={"last_layer_state": True},
    )
    return old, new


def test_a_job_is_extracted_again_with_the_last_layer_without_generating_and_exports_for_speculators(
    tiny_model, tmp_path
):
    model = shutil.copytree(tiny_model, tmp_path / "model")  # its own copy: another checkpoint takes its place below
    old, new = configs(model, tmp_path)
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

    # The job's config edited since it ran, and a re-extraction's copied from it: the two agree, but the job's
    # output records what made its completions, and the edit is named.
    edited_old, edited_new = configs(model, tmp_path, max_tokens=40, tag="-edited")
    with pytest.raises(ConfigError) as edited:
        check_reextraction(load_config(edited_old), load_config(edited_new))
    assert str(edited.value).startswith(f"{edited_old}: reads otherwise than when it made {tmp_path / 'out'} (its "
                                        "dflash-queue-run.json): the completions there were made with other "
                                        "generate.sampling.max_tokens;"), str(edited.value)
    assert str(edited.value).endswith("\n  generate.sampling.max_tokens: 12; now: 40")

    # Another checkpoint behind the job's model.path: a fine-tune (the same config.json, name and tokenizer).
    fine_tune(model)
    _, after_tune = configs(model, tmp_path, tag="-after-tune")
    refused = dfq("reextract", "-c", after_tune, "--from", old)
    assert refused.returncode == 1, refused.stdout + refused.stderr[-3000:]
    assert f"the completions there were made with other model.weights (its model.path, {model}, holds another " \
           "checkpoint than the one that made them)" in refused.stderr, refused.stderr
    assert re.search(r'\n  model\.weights: "[0-9a-f]{16}"; now: "[0-9a-f]{16}"', refused.stderr), refused.stderr
    assert "Traceback" not in refused.stderr
    assert not list((tmp_path / "out-last-layer-after-tune").glob("completions/*"))  # nothing copied


def test_a_reextraction_may_change_extract_settings_only_and_writes_elsewhere(tiny_model, tmp_path):
    old, new = configs(tiny_model, tmp_path)
    check_configs(load_config(old), load_config(new))
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    other_sampling = write_config(
        tmp_path / "sampling.toml", tables, dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 40}}, run={"name": "x"}, storage={"url": str(tmp_path / "o2")},
        extract={"last_layer_state": True},
    )
    with pytest.raises(ConfigError, match=r"differs from .*job.toml in generate.sampling.max_tokens: its "
                       r"completions would be other ones.*\n  generate.sampling.max_tokens: 12; yours: 40$"):
        check_configs(load_config(old), load_config(other_sampling))
    same_output = write_config(
        tmp_path / "same.toml", tables, dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 12}}, run={"name": "x"}, extract={"last_layer_state": True},
    )
    with pytest.raises(ConfigError, match=r"a re-extraction writes a new output"):
        check_configs(load_config(old), load_config(same_output))
    same_state = write_config(
        tmp_path / "same-state.toml", tables, dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 12}}, run={"name": "x"}, storage={"url": str(tmp_path / "o3")},
        extract={"last_layer_state": True},
    )
    with pytest.raises(ConfigError, match=r"run.state_dir is .*job.toml's .*give it another run.state_dir"):
        check_configs(load_config(old), load_config(same_state))
    # A job not run: nothing to extract again.
    refused = dfq("reextract", "-c", new, "--from", old)
    assert refused.returncode == 1 and "out holds no completions: run that job first" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_jobs_output_must_record_what_made_it_and_is_compared_on_what_it_records(tiny_model, tmp_path):
    old_path, _ = configs(tiny_model, tmp_path)
    old = load_config(old_path)
    output = open_storage(old.storage)
    output.write_bytes(completions_key("a-shard"), b"{}\n")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'out'} holds completions but no {MANIFEST_KEY}"):
        check_made_with(old)

    made = RunIdentity.of(old, old.storage.url)
    assert made.weights is not None

    def record(identity: RunIdentity) -> None:
        output.write_bytes(MANIFEST_KEY, identity.to_json().encode())

    record(made)
    check_made_with(old)
    # Recorded by a node without the weights (a producer with the config and tokenizer only): the rest decides.
    unweighed = {**made.settings, "model": {k: v for k, v in made.settings["model"].items() if k != "weights"}}
    record(RunIdentity(made.fingerprint, unweighed, made.storage))
    check_made_with(old)
    # The job's extract settings edited since: its completions are the same.
    extracted_otherwise = {**made.settings, "extract": {**made.settings["extract"], "last_layer_state": True}}
    record(RunIdentity("0" * 16, extracted_otherwise, made.storage))
    check_made_with(old)
    # The same settings under another fingerprint: hashed otherwise than they read now, named.
    record(RunIdentity("0" * 16, made.settings, made.storage))
    with pytest.raises(ConfigError, match=rf"other fingerprint;.*\n  fingerprint: 0{{16}}; now: {old.fingerprint()}$"):
        check_made_with(old)
