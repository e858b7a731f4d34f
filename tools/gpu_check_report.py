#!/usr/bin/env python
"""The two ends of `tools/gpu_check.sh`: what the machine has, and every figure of its steps in one JSON file.

    environment --json FILE     Python, torch and CUDA, the device, transformers, triton, flash-linear-attention,
                                causal-conv1d and vLLM (version, or why it does not import), and which Gated DeltaNet
                                and short-convolution kernels Transformers' Qwen3.5 classes bind here.
    merge --work DIR --out FILE the steps' records and reports in DIR -> one JSON object, its summary printed.

The figures (DEVELOPERS.md, "On a GPU machine", says what each means):

  transformers.dense / .hybrid   tokens_per_s and mfu of the Transformers extract lane (tools/bench_extract.py;
                                 MFU against peak_tflops), engine_alone_tokens_per_s / engine_alone_mfu (its engine
                                 without the lane), canary_share (of a shard's extract time), linear_attention (which
                                 Gated DeltaNet kernel ran), agreement (bfloat16 states against the checkpoint's own
                                 class, relative error per layer);
  host_path                      tools/bench_host_path.py's report, or why there is none;
  vllm                           the vLLM figures, or why there are none.

Standard library only: it runs under the image's python3 even when nothing else does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
FORMAT = 1
# The conformance suite's bounds for bfloat16 rounding (tests/test_conformance.py): 4 steps of bfloat16 over a
# sample's layer, 16 at its worst token.
BFLOAT16_STEP = 2.0**-7
BOUNDS = {"whole": 4 * BFLOAT16_STEP, "token": 16 * BFLOAT16_STEP}
PACKAGES = ("transformers", "triton", "fla", "causal_conv1d", "vllm", "accelerate", "safetensors", "tokenizers", "numpy")
# What Transformers imports of flash-linear-attention for Gated DeltaNet (`fla` itself imports without triton).
FLA_OPS = "fla.ops.gated_delta_rule"


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


# -----------------------------------------------------------------------------------------------------------------
# environment


def bench_extract() -> Any:
    spec = importlib.util.spec_from_file_location("bench_extract", TOOLS / "bench_extract.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def describe_environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "packages": {}, "import_errors": {},
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(device_name=properties.name, device_memory_bytes=properties.total_memory,
                    device_count=torch.cuda.device_count())
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # absent, or present and broken: both mean it does not run here
            info["packages"][name] = None
            info["import_errors"][name] = f"{type(error).__name__}: {error}"
        else:
            info["packages"][name] = str(getattr(module, "__version__", "?"))
    if info["packages"]["fla"] is not None:
        try:
            importlib.import_module(FLA_OPS)
        except Exception as error:
            info["import_errors"][FLA_OPS] = f"{type(error).__name__}: {error}"
    try:
        modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
        info["qwen3_5_kernels"] = bench_extract().module_kernels(modeling)
    except Exception as error:
        info["qwen3_5_kernels"] = {"error": f"{type(error).__name__}: {error}"}
    return info


def environment(args: argparse.Namespace) -> int:
    info = describe_environment()
    device = info.get("device_name", "no CUDA device")
    print(f"python {info['python']} ({info['executable']}), torch {info['torch']} (CUDA {info['torch_cuda']}), "
          f"{device}; " + ", ".join(f"{n} {v or 'absent'}" for n, v in info["packages"].items()))
    for name, error in info["import_errors"].items():
        print(f"  {name} does not import: {error}")
    print("  Qwen3.5 kernels: " + ", ".join(f"{k} = {v}" for k, v in info["qwen3_5_kernels"].items()))
    Path(args.json).write_text(json.dumps(info, indent=1) + "\n")
    return 0


# -----------------------------------------------------------------------------------------------------------------
# merge


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def linear_attention(kernels: dict[str, str]) -> str | None:
    """Which Gated DeltaNet implementation the model bound: flash-linear-attention's, Transformers' PyTorch one, or
    none (a model without linear attention)."""
    chosen = [v for k, v in kernels.items() if "gated_delta_rule" in k]
    if not chosen:
        return None
    if all(v.startswith("fla.") for v in chosen):
        return "flash-linear-attention (triton kernels)"
    if all(v.startswith("transformers.") for v in chosen):
        return "Transformers' PyTorch fallback"
    return "mixed: " + ", ".join(chosen)


def engine_figures(report: dict[str, Any], engine: str) -> dict[str, Any]:
    summary = report["engines"][engine]
    runs = summary["runs"]
    figures = {
        "tokens_per_s": summary["median_tokens_per_s"],
        "mfu": summary["median_mfu"],
        "tflops": statistics.median(r["tflops"] for r in runs),
        "flops_per_token": summary["flops_per_token"],
        "layers_run": summary["layers_run"],
        "canary_share": summary["median_canary_share"],
        "canary_alone_over_batched": statistics.median(r["canary"]["alone_over_batched"] for r in runs),
        "peak_host_bytes": summary["peak_bytes"],
        "load_s": runs[-1]["load_s"],
        "mode": summary["mode"],
        "rounds": len(runs),
        "tokens_per_round": runs[-1]["tokens"],
    }
    if "engine_alone" in summary:
        figures["engine_alone_tokens_per_s"] = summary["engine_alone"]["median_tokens_per_s"]
        figures["engine_alone_mfu"] = summary["engine_alone"]["median_mfu"]
    if engine == "transformers":
        figures["kernels"] = summary["kernels"]
        figures["linear_attention"] = linear_attention(summary["kernels"])
    return figures


def agreement(reference: dict[str, Any] | None) -> dict[str, Any] | None:
    if not reference:
        return None
    return {
        "reference_class": reference["reference_class"],
        "dtype": reference["dtype"],
        "reference_kernels": linear_attention(reference["kernels"]) or "Transformers' own",
        "samples": len(reference["samples"]),
        "sample_tokens": [s["tokens"] for s in reference["samples"]],
        "worst_relative_error": reference["worst_whole"],
        "worst_token_relative_error": reference["worst_token"],
        "per_layer": reference["per_layer_whole"],
        "per_layer_token": reference["per_layer_token"],
        "layers": reference["captured"],
        "bounds": BOUNDS,
        "within_bfloat16_rounding": reference["worst_whole"] <= BOUNDS["whole"]
        and reference["worst_token"] <= BOUNDS["token"],
    }


def model_figures(report: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if not report or "transformers" not in report.get("engines", {}):
        return None
    figures: dict[str, Any] = {"bench": name, "model": report["model"], "peak_tflops": report["peak_tflops"],
                               **engine_figures(report, "transformers"),
                               "agreement": agreement(report.get("reference_agreement")),
                               "settings": report["settings"]}
    return figures


def step_records(work: Path) -> list[dict[str, Any]]:
    records = []
    for line in (work / "steps.jsonl").read_text().splitlines() if (work / "steps.jsonl").is_file() else []:
        record = json.loads(line)
        if record["status"] in ("failed", "timeout"):
            err = work / f"{record['name']}.err"
            record["stderr_tail"] = err.read_text(errors="replace")[-3000:] if err.is_file() else ""
        records.append(record)
    return records


def merge(args: argparse.Namespace) -> int:
    work = Path(args.work)
    steps = step_records(work)
    status = {s["name"]: s["status"] for s in steps}
    benches = {name: read_json(work / f"{name}.json") for name in ("bench-dense", "bench-hybrid", "bench-hybrid-torch")}
    hybrid_name = "bench-hybrid" if benches["bench-hybrid"] else "bench-hybrid-torch"
    dense = benches["bench-dense"]
    host = read_json(work / "host-path.json")
    host_status = status.get("host-path", "not run")
    host_path: dict[str, Any] = {"status": host_status if host is not None or host_status != "ok" else "no report"}
    if host is not None:
        host_path["report"] = host
    vllm: dict[str, Any]
    environment = read_json(work / "environment.json")
    if status.get("vllm") == "skipped":
        error = (environment or {}).get("import_errors", {}).get("vllm", "vllm does not import")
        vllm = {"status": "skipped", "reason": f"vllm does not import: {error}"}
    elif dense and "vllm" in dense.get("engines", {}):
        vllm = {"status": "ok", "dense": engine_figures(dense, "vllm"), "ratio_vllm_over_transformers":
                dense.get("ratio"), "agreement_with_transformers": dense.get("agreement"),
                "speculative": status.get("bench-speculative", "not run")}
    else:
        vllm = {"status": "no figures"}
    now = time.time()
    figures = {
        "format": FORMAT,
        "started": iso(args.started), "finished": iso(now), "seconds": round(now - args.started, 1),
        "shape": args.shape, "device": args.device,
        "environment": environment,
        "install": read_json(work / "install.json"),
        "transformers": {"dense": model_figures(dense, "bench-dense"),
                         "hybrid": model_figures(benches[hybrid_name], hybrid_name)},
        "host_path": host_path,
        "vllm": vllm,
        "steps": steps,
        "reports": {name: report for name, report in benches.items() if report},
    }
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    for line in summary_lines(figures):
        print(line)
    return 0


def summary_lines(figures: dict[str, Any]) -> list[str]:
    lines = []
    for name, model in figures["transformers"].items():
        if model is None:
            lines.append(f"transformers {name}: no figures (see the steps)")
            continue
        shape = model["model"]
        line = (f"transformers {name} ({shape['model_type']}, {shape['layers']} layers, hidden {shape['hidden']}): "
                f"{model['tokens_per_s']:.1f} tokens/s, MFU {model['mfu']:.4g} of {model['peak_tflops']:g} TFLOP/s")
        if "engine_alone_tokens_per_s" in model:
            line += (f" (the engine alone {model['engine_alone_tokens_per_s']:.1f} tokens/s, MFU "
                     f"{model['engine_alone_mfu']:.4g})")
        line += f"; canary {model['canary_share']:.5f} of a shard's extract time"
        if model["linear_attention"]:
            line += f"; Gated DeltaNet: {model['linear_attention']}"
        lines.append(line)
        agree = model["agreement"]
        if agree:
            lines.append(f"  bfloat16 agreement with {agree['reference_class']} (each sample alone, "
                         f"{agree['reference_kernels']} kernels) over {agree['samples']} samples: worst relative "
                         f"error per layer {agree['worst_relative_error']:.3e}, at a token "
                         f"{agree['worst_token_relative_error']:.3e}; within bfloat16 rounding: "
                         f"{'yes' if agree['within_bfloat16_rounding'] else 'NO'}")
    host = figures["host_path"]
    lines.append(f"host path: {host['status']}" + (f": {json.dumps(host['report'])[:600]}" if "report" in host else ""))
    vllm = figures["vllm"]
    lines.append(f"vllm: {vllm['status']}" + (f" ({vllm['reason']})" if "reason" in vllm else ""))
    bad = [f"{s['name']} {s['status']}" for s in figures["steps"] if s["status"] not in ("ok", "skipped")]
    lines.append("steps: " + (", ".join(bad) if bad else "all ran") + f"; {figures['seconds']} s in all")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("environment")
    env.add_argument("--json", required=True)
    put = commands.add_parser("merge")
    put.add_argument("--work", required=True)
    put.add_argument("--out", required=True)
    put.add_argument("--started", type=float, default=time.time())
    put.add_argument("--shape", default="full")
    put.add_argument("--device", default="unknown")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return environment(args) if args.command == "environment" else merge(args)


if __name__ == "__main__":
    raise SystemExit(main())
