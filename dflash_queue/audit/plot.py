"""The audit's histograms as one PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plot(report: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(_panels(report))
    if not panels:
        panels = [("nothing to plot", {"count": 0}, None)]
    columns = min(3, len(panels))
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (title, summary, threshold) in zip(axes.flat, panels):
        axis.set_title(title, fontsize=10)
        histogram = summary.get("histogram") if summary else None
        if not histogram:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
            continue
        edges, counts = histogram["edges"], histogram["counts"]
        widths = [b - a for a, b in zip(edges, edges[1:])]
        axis.bar(edges[:-1], counts, width=widths, align="edge", color="#4c72b0", edgecolor="white")
        if threshold is not None:
            axis.axvline(threshold, color="#c44e52", linestyle="--", label=f"stub threshold {threshold}")
            axis.legend(fontsize=8)
        axis.set_ylabel("samples")
    verdict = "PASS" if report.get("passed") else "FAIL"
    figure.suptitle(f"dflash-queue audit: {verdict} (stub share {report.get('stub_fraction', 0):.1%})")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _panels(report: dict[str, Any]):
    for part in report.get("parts", []):
        if part["kind"] == "dataset":
            responses = part["responses"]
            if part.get("prompt_tokens"):
                yield "prompt tokens (chat template)", part["prompt_tokens"], None
            yield f"response length ({responses['length_unit']})", responses["length"], responses["min_answer_tokens"]
            turns = part["turns_per_conversation"]
            if turns:
                keys = sorted(turns, key=int)
                yield "messages per conversation", {"histogram": _discrete(keys, turns)}, None
        else:
            name = part["kind"]
            yield f"{name}: loss_mask sum per sample", part["loss_mask_sum"], None
            yield f"{name}: tokens per sample", part["tokens_per_sample"], None
            if part["answer_tokens"].get("count"):
                yield f"{name}: answer tokens per sample", part["answer_tokens"], part["min_answer_tokens"]


def _discrete(keys: list[str], counts: dict[str, int]) -> dict[str, list]:
    low, high = int(keys[0]), int(keys[-1])
    values = list(range(low, high + 1))
    return {"edges": [v - 0.5 for v in values] + [high + 0.5], "counts": [counts.get(str(v), 0) for v in values]}
