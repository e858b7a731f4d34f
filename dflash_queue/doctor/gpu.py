"""GPUs: present when the config wants them, supported by the installed torch build, with memory to spare.

`check_gpus` is a pure function of the device properties and torch's arch list, so every verdict can be tested
with made-up devices (a Blackwell sm_120 card against a wheel built without sm_120 must fail here, not hours
into a run with "no kernel image is available for execution on the device").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_queue.doctor.result import Check

GIB = 1024**3
# Compute capabilities that run only code built for exactly them (integrated Jetson/Tegra parts).
_EXACT_ONLY = {53, 62, 72, 87, 101}
# Thor was renumbered from 10.1 to 11.0: code built for 10.1 runs on both.
_ALSO_RUNS_ON = {101: {110}}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int


def arch_code(arch: str) -> int:
    """'sm_90' -> 90, 'sm_90a' -> 90, 'compute_120' -> 120, 'sm_100f' -> 100."""
    match = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", arch)
    if not match:
        raise ValueError(f"not a CUDA architecture name: {arch!r}")
    return int(match.group(1))


def code_runs_on(code: int, device: int) -> bool:
    """Whether code built for `code` (cubin or PTX) runs on a device of compute capability `device`.

    NVIDIA keeps compatibility within a major version only (code for 8.0 runs on 8.6 and 8.9, never on 9.0):
    the same rule torch applies when it warns about unsupported GPUs. Integrated parts run only their own.
    """
    if device in _ALSO_RUNS_ON.get(code, ()):
        return True
    if code in _EXACT_ONLY or device in _EXACT_ONLY:
        return code == device
    return code // 10 == device // 10 and device % 10 >= code % 10


def capability_supported(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    device = capability[0] * 10 + capability[1]
    return any(code_runs_on(arch_code(arch), device) for arch in arch_list)


def check_gpus(
    gpus: Sequence[GpuInfo],
    arch_list: Sequence[str],
    *,
    device_setting: str,
    torch_cuda: str | None,
    memory_utilization: float,
    memory_is_required: bool,
) -> list[Check]:
    """Verdicts for the visible GPUs.

    `device_setting` is model.device; `memory_utilization` the share of each GPU an engine reserves at start
    (vLLM refuses to start with less free); `memory_is_required` makes too little free memory a failure rather
    than a warning (engines that reserve it up front).
    """
    if not gpus:
        build = "a CPU-only torch build" if torch_cuda is None else f"torch built for CUDA {torch_cuda}"
        message = f"no CUDA GPU visible ({build})"
        if device_setting == "cuda":
            return [Check.failed("cuda", f"{message} but model.device = cuda")]
        if device_setting == "auto":
            return [Check.warned("cuda", f"{message}: model.device = auto will run on the CPU, far slower")]
        return [Check.warned("cuda", f"{message}; model.device = cpu, so this machine runs on the CPU")]

    checks = []
    names = ", ".join(f"{g.index}: {g.name}" for g in gpus)
    if device_setting == "cpu":
        checks.append(Check.warned("cuda", f"{len(gpus)} GPU(s) visible ({names}) but model.device = cpu"))
    else:
        checks.append(Check.passed("cuda", f"CUDA {torch_cuda}, {len(gpus)} GPU(s): {names}"))

    built_for = " ".join(arch_list) or "nothing"
    for gpu in gpus:
        cc = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
        if capability_supported(gpu.capability, arch_list):
            detail = f"{gpu.name} ({cc}) is in this torch build ({built_for})"
            checks.append(Check.passed(f"gpu {gpu.index} arch", detail))
        else:
            checks.append(
                Check.failed(
                    f"gpu {gpu.index} arch",
                    f"{gpu.name} is {cc}, but this torch build has kernels only for {built_for}: install a torch "
                    f"(and vLLM) built for {cc}",
                )
            )

    for gpu in gpus:
        wanted = memory_utilization * gpu.total_bytes
        detail = (
            f"{gpu.free_bytes / GIB:.1f} GiB free of {gpu.total_bytes / GIB:.1f} GiB; "
            f"gpu_memory_utilization {memory_utilization:g} needs {wanted / GIB:.1f} GiB"
        )
        if gpu.free_bytes >= wanted:
            checks.append(Check.passed(f"gpu {gpu.index} memory", detail))
        elif memory_is_required:
            checks.append(Check.failed(f"gpu {gpu.index} memory", f"{detail}: another process holds the rest"))
        else:
            checks.append(Check.warned(f"gpu {gpu.index} memory", f"{detail}: another process holds the rest"))
    return checks


def read_gpus() -> tuple[list[GpuInfo], list[str], str | None]:
    """The visible GPUs (honours CUDA_VISIBLE_DEVICES), torch's arch list, and torch's CUDA version."""
    import torch

    if not torch.cuda.is_available():
        return [], [], torch.version.cuda
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(GpuInfo(index, props.name, (props.major, props.minor), total, free))
    return gpus, list(torch.cuda.get_arch_list()), torch.version.cuda
