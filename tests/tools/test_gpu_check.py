"""tools/gpu_check.sh as a lent GPU machine runs it, here on the CPU: the same script, its small shapes, under a
Python that has only what the GPU image has (torch, transformers 5.17, accelerate, safetensors, tokenizers, numpy
and what they require; no vLLM, Celery, Redis client, orjson, pydantic ...), with the bundle that
tools/build_gpu_bundle.py builds, and with the network refused. The image's triton is left out here: without a
GPU, flash-linear-attention cannot run, so the hybrid runs Transformers' PyTorch Gated DeltaNet (and the figures
say so). The full-size commands, which only a GPU runs, are checked against the tools' own parsers and the
checkpoint shapes they build (on the meta device)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
CACHE = REPO / ".cache" / "gpu-check"
# The GPU image's Python packages: transformers 5.17.0, accelerate 1.15.0, safetensors 0.8.0, tokenizers 0.23.2 and
# what they require (torch: this machine's CPU build of the version on its disk). The image has typer, which
# transformers requires, and no pydantic, which typer requires from 0.28 on.
IMAGE = ("torch==2.13.0", "transformers==5.17.0", "accelerate==1.15.0", "safetensors==0.8.0", "tokenizers==0.23.2",
         "numpy==2.4.6", "typer==0.27.2")
UNROUTABLE = "http://127.0.0.1:9"


def offline(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment with no way to a registry or a hub: no pip configuration or index, proxies that refuse. Python
    writes bytecode, as on the GPU image (this machine's PYTHONDONTWRITEBYTECODE is dropped)."""
    base = env if env is not None else dict(os.environ)
    out = {k: v for k, v in base.items()
           if not k.startswith("PIP_")
           and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    out.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               no_proxy="", NO_PROXY="")
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        out[name] = UNROUTABLE
    out.update(extra)
    return out


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{shlex.join(map(str, command))}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done


def no_network_prefix() -> list[str]:
    """`unshare -n`: a network namespace with no interface at all, where this machine allows one."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.fixture(scope="session")
def image_python() -> Path:
    """A venv with only the GPU image's packages, installed offline from a wheelhouse (filled once from pip's
    configured sources: this machine's wheel cache and local index), kept in .cache/gpu-check keyed by what it
    holds. Torch is this environment's own install of the same release and build, linked in rather than unpacked
    and compiled again; the rest is not compiled at install (most of the time it took to make): the check's first
    step to import a module compiles it, once (`offline` lets Python write bytecode, as the image's does)."""
    key = hashlib.sha256(json.dumps([IMAGE, sys.version_info[:2]]).encode()).hexdigest()[:12]
    root = CACHE / f"image-venv-{key}"
    python = root / "bin" / "python"
    marker = root / "complete.json"
    if marker.is_file():
        return python
    wheelhouse = CACHE / "wheelhouse"
    run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheelhouse), *IMAGE])
    shutil.rmtree(root, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(root)], env=offline())
    link_distribution("torch", Path(site_packages_dir(python)))
    run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index", "--find-links", str(wheelhouse),
         *IMAGE],
        env=offline())
    marker.write_text(json.dumps({"packages": IMAGE}) + "\n")
    return python


def link_distribution(name: str, site: Path) -> None:
    """This environment's install of `name` (its packages and metadata, not its scripts) linked into `site`, where
    pip then finds the requirement met; only the release the image pins."""
    from importlib.metadata import distribution

    installed = distribution(name)
    pinned = next(p.split("==", 1)[1] for p in IMAGE if p.startswith(f"{name}=="))
    assert installed.version.split("+")[0] == pinned, (name, installed.version, pinned)
    origin = Path(installed.locate_file(""))
    for top in sorted({f.parts[0] for f in installed.files or () if f.parts[0] != ".."}):
        (site / top).symlink_to(origin / top)


@pytest.fixture(scope="session")
def gpu_bundle(tiny_model: Path) -> Path:
    """The bundle as `tools/build_gpu_bundle.py build` makes it (its third-party wheels reused while their inputs
    are the same; this checkout's wheel rebuilt every session)."""
    out = CACHE / "bundle"
    run([sys.executable, "tools/build_gpu_bundle.py", "build", "--out", str(out), "--tokenizer-from", str(tiny_model)],
        cwd=REPO, timeout=900)
    return out


def site_packages_dir(python: Path) -> str:
    return run([str(python), "-c", "import site; print(site.getsitepackages()[0])"]).stdout.strip()


def site_packages(python: Path) -> list[str]:
    """What is installed in `python`'s site-packages (not the bytecode Python writes as it imports)."""
    return sorted(name for name in os.listdir(site_packages_dir(python)) if name != "__pycache__")


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def decoder_parameters(checkpoint: Path, layers: int) -> int:
    """Parameters of the first `layers` decoder layers, counted from the checkpoint's tensors."""
    from safetensors import safe_open

    total = 0
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
                if found and int(found.group(1)) < layers and "visual" not in name:
                    total += math.prod(f.get_slice(name).get_shape())
    return total


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_images_packages_with_the_network_refused(image_python, gpu_bundle, tmp_path):
    before = site_packages(image_python)
    work, out = tmp_path / "work", tmp_path / "out"
    env = offline(PYTHON=str(image_python), GPU_CHECK_BUNDLE=str(gpu_bundle), GPU_CHECK_SHAPE="small",
                  GPU_CHECK_WORK=str(work))
    done = subprocess.run([*no_network_prefix(), "bash", "tools/gpu_check.sh", str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)
    transcript = done.stdout + done.stderr
    assert done.returncode == 0, transcript[-6000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    figures = json.loads((out / "gpu_check.json").read_text())

    # Every step ran, or was skipped with its reason: vLLM does not import here, and bench_host_path.py is another
    # tool (when the checkout has it, it must run).
    steps = {s["name"]: s["status"] for s in figures["steps"]}
    host_tool = (REPO / "tools" / "bench_host_path.py").is_file()
    assert steps == {"install": "ok", "environment": "ok", "build-dense": "ok", "bench-dense": "ok",
                     "host-path": "ok" if host_tool else "skipped", "build-hybrid": "ok", "bench-hybrid": "ok",
                     "vllm": "skipped"}, figures["steps"]
    assert figures["vllm"] == {"status": "skipped",
                               "reason": "vllm does not import: ModuleNotFoundError: No module named 'vllm'"}
    assert transcript.count("== vllm: skipped, vllm does not import (ModuleNotFoundError") == 1
    if host_tool:
        assert figures["host_path"]["status"] == "ok" and figures["host_path"]["report"]
    else:
        assert figures["host_path"] == {"status": "skipped"}

    # The image's own Python and packages; what it lacked came from the bundle, nothing from an index.
    environment, install = figures["environment"], figures["install"]
    assert Path(environment["executable"]) == image_python and environment["packages"]["transformers"] == "5.17.0"
    assert environment["packages"]["vllm"] is None and environment["packages"]["triton"] is None
    assert "triton" in environment["import_errors"]["fla.ops.gated_delta_rule"]
    assert install["installer"].startswith("pip ") and install["fetched"] == []
    installed = {d["name"] for d in install["installed"]}
    assert {"dflash-queue", "pydantic", "pydantic-core", "orjson", "pybase64", "redis", "fla-core"} <= installed
    assert {"torch", "transformers", "accelerate", "numpy"} <= {d["name"] for d in install["from_image"]}
    assert install["import_check"].startswith(str(work / "site"))
    assert site_packages(image_python) == before  # the image's environment untouched
    hub = work / "hf-home" / "hub"
    assert not hub.exists() or not any(hub.iterdir())

    for name, layers in (("dense", 3), ("hybrid", 4)):
        model = figures["transformers"][name]
        for key in ("tokens_per_s", "mfu", "tflops", "flops_per_token", "canary_share", "canary_alone_over_batched",
                    "engine_alone_tokens_per_s", "engine_alone_mfu", "load_s"):
            assert positive(model[key]), (name, key, model[key])
        assert model["peak_tflops"] == 790.0 and model["layers_run"] == layers
        assert math.isclose(model["mfu"], model["tflops"] / 790.0, rel_tol=1e-9)
        assert math.isclose(model["tflops"] * 1e12, model["tokens_per_s"] * model["flops_per_token"], rel_tol=1e-6)
        # The FLOP count from the shapes: 2 x the layers' parameters (counted here from the checkpoint's own
        # tensors) per token, plus attention's and linear attention's work, which is less than 4 * heads *
        # head_dim * (the longest sequence) per attention layer and 6 * state per linear-attention layer.
        weights = decoder_parameters(work / "checkpoints" / name, layers)
        mixing = model["flops_per_token"] - 2 * weights
        bound = layers * (4 * 4 * 32 * model["settings"]["max_len"] + 6 * 4 * 32 * 32)
        assert 0 < mixing < bound, (name, weights, model["flops_per_token"])
        agreement = model["agreement"]
        assert agreement["samples"] == 2 and agreement["dtype"] == "bfloat16"
        assert len(agreement["per_layer"]) == len(agreement["layers"]) == layers
        assert all(isinstance(e, float) and math.isfinite(e) for e in agreement["per_layer"])
        assert agreement["within_bfloat16_rounding"] is True
    assert figures["transformers"]["dense"]["linear_attention"] is None
    assert figures["transformers"]["dense"]["agreement"]["reference_class"] == "Qwen3ForCausalLM"
    hybrid = figures["transformers"]["hybrid"]
    assert hybrid["agreement"]["reference_class"] == "Qwen3_5ForConditionalGeneration"
    assert hybrid["linear_attention"] == "Transformers' PyTorch fallback"
    assert "Gated DeltaNet: Transformers' PyTorch fallback" in transcript


# -----------------------------------------------------------------------------------------------------------------
# What only a GPU runs: the full-size commands


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(tmp_path: Path, shape: str) -> dict[str, list[str]]:
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_CHECK_SHAPE=shape, GPU_CHECK_DEVICE="cuda",
               GPU_CHECK_WORK=str(tmp_path / f"work-{shape}"))
    done = run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], env=env, cwd=REPO)
    return {m.group(1): shlex.split(m.group(3)) for m in re.finditer(r"^DRY (\S+) (\d+): (.*)$", done.stdout, re.M)}


@pytest.mark.parametrize("shape", ["full", "small"])
def test_every_command_of_the_gpu_check_parses_with_its_tool(shape, tmp_path):
    assert run(["bash", "-n", "tools/gpu_check.sh"], cwd=REPO)
    commands = dry_run(tmp_path, shape)
    assert list(commands) == ["install", "environment", "build-dense", "bench-dense", "host-path", "build-hybrid",
                              "bench-hybrid", "bench-hybrid-torch", "bench-speculative"]
    tools = {"bench_extract": load_tool("bench_extract"), "build_random_checkpoint": load_tool(
        "build_random_checkpoint"), "build_gpu_bundle": load_tool("build_gpu_bundle"),
        "gpu_check_report": load_tool("gpu_check_report"), "bench_host_path": load_tool("bench_host_path")}
    for name, words in commands.items():
        if words[0] == "env":
            words = words[2:]
        script = Path(words[1]).stem
        if script == "bench_speculative":  # it has no build_parser: its options are in its --help
            usage = run([sys.executable, words[1], "--help"], cwd=REPO).stdout
            assert all(w in usage for w in words[2:] if w.startswith("--")), words
            continue
        args = tools[script].build_parser().parse_args(words[2:])  # an unknown option or a bad value exits
        if script == "bench_extract":
            args = tools[script].parse_args(words[2:])
            assert args.device == "cuda" and args.dtype == "bfloat16" and args.engines == ["transformers", "vllm"] \
                or name.startswith("bench-hybrid")
            assert args.reference_samples >= 2 and args.json_file
        if script == "bench_host_path":
            assert args.device == "cuda" and args.json
        if script == "build_random_checkpoint":
            check_shape(tools[script], args, shape, name)


def check_shape(builder, args, shape: str, name: str) -> None:
    """The checkpoint the command would build: its config is the shape asked for, and its class builds from it."""
    import torch
    import transformers

    raw = builder.shape_config(args)
    text = raw.get("text_config", raw)
    assert text["hidden_size"] == (5120 if shape == "full" else 128)
    if name == "build-hybrid":
        assert set(text["layer_types"]) == {"linear_attention", "full_attention"}
        assert len(text["layer_types"]) == text["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:  # as the builder reads it
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        config = transformers.AutoConfig.from_pretrained(tmp)
    with torch.device("meta"):
        model = builder.model_class(config)._from_config(config)
    assert sum(p.numel() for p in model.parameters()) > (10**9 if shape == "full" else 10**5)


def leftover_work_dirs() -> set[str]:
    return {p.name for p in Path("/tmp").glob("dfq-gpu-check.*")}


def test_without_a_gpu_the_full_check_is_refused_at_once_and_leaves_nothing(tmp_path):
    """A user on a node whose torch sees no GPU: refused before anything is made, saying what to do instead."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    before = leftover_work_dirs()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    done = subprocess.run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], capture_output=True, text=True,
                          env={**env, "PYTHON": sys.executable}, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sees no CUDA device" in done.stderr and "GPU_CHECK_SHAPE=small" in done.stderr
    assert not (tmp_path / "out").exists() and leftover_work_dirs() == before


def test_the_work_folder_it_made_is_removed_unless_asked_to_keep_it(tmp_path):
    before = leftover_work_dirs()
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_CHECK_SHAPE="small", GPU_CHECK_DEVICE="cuda")
    env.pop("GPU_CHECK_WORK", None)
    run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], env=env, cwd=REPO)
    assert leftover_work_dirs() == before
    kept = run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], env={**env, "GPU_CHECK_KEEP_WORK": "1"},
               cwd=REPO)
    made = leftover_work_dirs() - before
    try:
        assert len(made) == 1 and f"work in /tmp/{next(iter(made))}" in kept.stdout
    finally:
        for name in made:
            shutil.rmtree(Path("/tmp") / name, ignore_errors=True)


# -----------------------------------------------------------------------------------------------------------------
# The installer's refusals


def test_the_installer_names_what_neither_the_image_nor_the_bundle_has(tmp_path):
    bundle = load_tool("build_gpu_bundle")
    manifest = {"roots": ["dflash-queue"], "wheels": [
        {"file": "dflash_queue-0.1.0-py3-none-any.whl", "name": "dflash-queue", "version": "0.1.0",
         "tags": ["py3-none-any"], "requires": ["torch>=2.6", "no-such-distribution-here>=1"]},
    ]}
    with pytest.raises(SystemExit, match=r"no-such-distribution-here>=1 is needed: the image has no "
                                         r"no-such-distribution-here and the bundle carries none"):
        bundle.plan_install(manifest)
    manifest["wheels"][0]["requires"] = ["torch>=99"]
    with pytest.raises(SystemExit, match=r"torch>=99 is needed: the image has torch 2\.\d+.* and the bundle carries "
                                         r"none"):
        bundle.plan_install(manifest)
    manifest["wheels"][0]["tags"] = ["cp399-cp399-manylinux_2_17_x86_64"]
    with pytest.raises(SystemExit, match="the bundle has no wheel for this interpreter"):
        bundle.plan_install(manifest)


def test_the_bundle_is_refused_above_its_size_limit(gpu_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(gpu_bundle, copy)
    done = subprocess.run([sys.executable, "tools/build_gpu_bundle.py", "build", "--out", str(copy), "--max-mib", "1",
                           "--tokenizer-from", str(gpu_bundle / "tokenizer")], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode != 0
    assert re.search(r"the bundle is [\d.]+ MiB, over 1 MiB; largest wheels: pydantic_core-", done.stderr), done.stderr
    size = sum(p.stat().st_size for p in gpu_bundle.rglob("*") if p.is_file())
    assert size <= 48 * 2**20  # and the real one fits
