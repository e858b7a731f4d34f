"""GPU verdicts from device properties given as data: no GPU needed to test them."""

from __future__ import annotations

import pytest
import torch

from dflash_queue.doctor.gpu import GIB, GpuInfo, arch_code, capability_supported, check_gpus, code_runs_on

# Arch lists of real torch wheels (torch.cuda.get_arch_list()).
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
H200 = GpuInfo(0, "NVIDIA H200", (9, 0), 140 * GIB, 139 * GIB)
RTX_PRO_6000 = GpuInfo(1, "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 96 * GIB, 95 * GIB)
L40S = GpuInfo(2, "NVIDIA L40S", (8, 9), 45 * GIB, 44 * GIB)


def verdicts(checks) -> dict[str, str]:
    return {c.name: c.verdict for c in checks}


def run(gpus, arch_list, *, device="cuda", utilization=0.9, required=True):
    return check_gpus(
        gpus, arch_list, device_setting=device, torch_cuda="12.8", memory_utilization=utilization,
        memory_is_required=required,
    )


def test_blackwell_card_fails_on_a_wheel_built_without_sm_120():
    checks = run([H200, RTX_PRO_6000], CU126)
    assert verdicts(checks)["gpu 0 arch"] == "pass"
    failed = [c for c in checks if c.name == "gpu 1 arch"][0]
    assert failed.verdict == "fail"
    assert "sm_120" in failed.detail and "sm_90" in failed.detail


def test_blackwell_card_passes_on_a_wheel_built_for_it():
    assert verdicts(run([RTX_PRO_6000], CU128))["gpu 1 arch"] == "pass"
    assert capability_supported((12, 0), ["compute_120"])  # PTX for the same family
    assert not capability_supported((12, 0), ["sm_90", "compute_90"])  # an older family's PTX is not enough here


def test_compatibility_within_a_major_version_only():
    assert capability_supported((8, 9), ["sm_80", "sm_86"])  # L40S runs Ampere code
    assert not capability_supported((8, 6), ["sm_89", "sm_90"])  # newer minor, or another major: no
    assert not capability_supported((9, 0), ["sm_80", "sm_86"])
    assert capability_supported((9, 0), ["sm_90a"])
    assert not capability_supported((8, 7), ["sm_80"])  # Jetson Orin runs only its own code
    assert arch_code("sm_100f") == 100 and arch_code("compute_120") == 120
    with pytest.raises(ValueError):
        arch_code("gfx942")


@pytest.mark.skipif(not hasattr(torch.cuda, "DEVICE_REQUIREMENT"), reason="this torch has no compatibility table")
def test_rule_agrees_with_the_installed_torch_table():
    devices = sorted({*torch.cuda.DEVICE_REQUIREMENT, 35, 89, 103, 110, 121})
    for code in torch.cuda.DEVICE_REQUIREMENT:
        for device in devices:
            assert code_runs_on(code, device) == (device in torch.cuda.DEVICE_REQUIREMENT[code]), (code, device)


def test_free_memory_against_gpu_memory_utilization():
    busy = GpuInfo(0, "NVIDIA H200", (9, 0), 140 * GIB, 100 * GIB)
    checks = run([busy], CU126, utilization=0.9)
    memory = [c for c in checks if c.name == "gpu 0 memory"][0]
    assert memory.verdict == "fail"
    assert "100.0 GiB free of 140.0 GiB" in memory.detail and "needs 126.0 GiB" in memory.detail
    assert verdicts(run([busy], CU126, utilization=0.9, required=False))["gpu 0 memory"] == "warn"
    assert verdicts(run([busy], CU126, utilization=0.7))["gpu 0 memory"] == "pass"


@pytest.mark.parametrize(
    ("device", "verdict", "words"),
    [
        ("cpu", "warn", "runs on the CPU"),
        ("auto", "warn", "will run on the CPU"),
        ("cuda", "fail", "model.device = cuda"),
    ],
)
def test_no_gpu_is_said_plainly(device, verdict, words):
    checks = check_gpus(
        [], [], device_setting=device, torch_cuda=None, memory_utilization=0.9, memory_is_required=True
    )
    assert [(c.name, c.verdict) for c in checks] == [("cuda", verdict)]
    assert "no CUDA GPU visible (a CPU-only torch build)" in checks[0].detail and words in checks[0].detail


def test_gpus_present_but_config_says_cpu():
    checks = run([L40S], CU126, device="cpu")
    assert verdicts(checks)["cuda"] == "warn" and verdicts(checks)["gpu 2 arch"] == "pass"
