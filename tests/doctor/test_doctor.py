"""The doctor command on this machine, and its disk checks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from dflash_queue.doctor.disk import check_free_disk
from dflash_queue.doctor.gpu import GIB, GpuInfo
from dflash_queue.doctor.preflight import memory_utilization, run_doctor
from dfq_testing.commands import dflash_queue


def doctor(config) -> subprocess.CompletedProcess:
    return dflash_queue("doctor", "-c", config.source, timeout=300)


def test_doctor_passes_a_good_cpu_config_and_says_there_is_no_gpu(make_config):
    result = doctor(make_config())
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    names = [line.split()[1] for line in lines[:-1]]
    assert names[:3] == ["broker", "broker", "broker"] and "storage" in names and "cuda" in names
    cuda = [line for line in lines if line.split()[1] == "cuda"][0]
    assert cuda.startswith("WARN") and "no CUDA GPU visible" in cuda
    assert lines[-1].endswith("0 failed")


def test_doctor_fails_when_the_config_wants_cuda_and_there_is_none(make_config):
    result = doctor(make_config(model={"device": "cuda"}))
    assert result.returncode == 1
    assert any(line.startswith("FAIL") and "model.device = cuda" in line for line in result.stdout.splitlines())


def test_gpu_readings_flow_into_the_checks(make_config):
    """run_doctor with device properties given as data: a Blackwell card on a wheel without sm_120."""
    config = make_config(model={"device": "cuda"})
    card = GpuInfo(0, "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 96 * GIB, 90 * GIB)
    checks = run_doctor(config, gpu_reader=lambda: ([card], ["sm_80", "sm_86", "sm_90"], "12.6"))
    by_name = {c.name: c for c in checks}
    assert by_name["gpu 0 arch"].verdict == "fail"
    assert by_name["gpu 0 memory"].verdict == "pass"  # 90 of 96 GiB free >= 0.9 x 96 (transformers engine)
    assert memory_utilization({}, config.generate, config.extract) == 0.9


def test_json_output(make_config):
    result = dflash_queue("doctor", "-c", make_config().source, "--json", timeout=300)
    checks = json.loads(result.stdout)
    assert {c["verdict"] for c in checks} <= {"pass", "warn"} and checks[0]["name"] == "broker reachable"


def test_free_disk_thresholds(tmp_path):
    missing = tmp_path / "not" / "yet"  # measured on the nearest existing parent
    assert check_free_disk("state", missing, warn_below_gb=0, fail_below_gb=0).verdict == "pass"
    assert check_free_disk("state", missing, warn_below_gb=1e12, fail_below_gb=0).verdict == "warn"
    failed = check_free_disk("state", missing, warn_below_gb=1e12, fail_below_gb=1e12)
    assert failed.verdict == "fail" and "GB free" in failed.detail
    said = check_free_disk("state", missing, warn_below_gb=0, fail_below_gb=0).detail
    assert said.startswith(f"{missing}: missing (created at start); ") and said.endswith(f"GB free on {tmp_path}")


def test_a_missing_directory_this_user_cannot_create_fails(tmp_path, monkeypatch):
    from dflash_queue.doctor import disk

    # As root every directory is writable: the user's rights are what os.access answers.
    monkeypatch.setattr(disk.os, "access", lambda path, mode: Path(path) != tmp_path)
    check = check_free_disk("staging", tmp_path / "staging", warn_below_gb=0, fail_below_gb=0)
    assert check.verdict == "fail" and check.detail.endswith(f"on {tmp_path}, which this user cannot create it in")
    assert check_free_disk("staging", tmp_path, warn_below_gb=0, fail_below_gb=0).verdict == "pass"  # it exists


def test_doctor_reports_the_configured_staging_directory(make_config, tmp_path):
    from dflash_queue.doctor.preflight import writable_dirs

    config = make_config(storage={"uploader": {"staging_dir": str(tmp_path / "fast-disk" / "staging")}})
    assert writable_dirs(config.run, config.storage, config.staging_dir)["staging"] == tmp_path / "fast-disk" / "staging"
    default = make_config("default.toml")
    assert writable_dirs(default.run, default.storage, default.staging_dir)["staging"] == Path(default.run.state_dir) / "staging"
