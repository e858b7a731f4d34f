"""Run an audit over PATHs and gate on the stub share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dflash_queue.audit.inputs import AuditSettings, audit_dataset, dataset_lines
from dflash_queue.audit.outputs import completion_rows, output_lines, shard_rows, summarize_rows
from dflash_queue.audit.targets import Targets, locate
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_keys, run_shard_keys
from dflash_queue.shards.training import TrainingShard


def audit(paths: list[str], settings: AuditSettings) -> dict[str, Any]:
    """The full report: one part per kind of content found, and the gate's verdict."""
    targets = locate(paths)
    parts: list[dict[str, Any]] = []
    if targets.datasets:
        parts.append(audit_dataset(targets.datasets, settings))
    completions = list(_completion_rows(targets))
    if completions:
        summary = summarize_rows(completions, min_answer_tokens=settings.min_answer_tokens)
        parts.append({"kind": "completions", **summary})
    shard_rows_, dropped, shard_count = _shard_rows(targets)
    if shard_count:
        summary = summarize_rows(shard_rows_, min_answer_tokens=settings.min_answer_tokens, dropped=dropped)
        parts.append({"kind": "training shards", "shards": shard_count, **summary})
    for part in parts:
        if part["kind"] != "dataset":
            part["stub_fraction"] = part["stub_share"]
            part["max_stub_fraction"] = settings.max_stub_fraction
            part["passed"] = part["stub_share"] <= settings.max_stub_fraction
    gated = _gated_parts(parts)
    stub_fraction = max((p["stub_fraction"] for p in gated), default=0.0)
    return {
        "paths": paths,
        "parts": parts,
        "gated_on": [p["kind"] for p in gated],
        "stub_fraction": stub_fraction,
        "max_stub_fraction": settings.max_stub_fraction,
        "passed": bool(parts) and all(p["passed"] for p in gated),
    }


def _gated_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Training shards are what training sees: when they are at hand they decide for the outputs.
    kinds = {p["kind"] for p in parts}
    return [p for p in parts if not (p["kind"] == "completions" and "training shards" in kinds)]


def _completion_rows(targets: Targets):
    for path in targets.completion_files:
        yield from completion_rows(decode_completions(path.read_bytes(), what=str(path)))
    for storage in targets.storages:
        for key in completions_keys(storage):
            yield from completion_rows(decode_completions(storage.read_bytes(key), what=key))


def _shard_rows(targets: Targets) -> tuple[list, int, int]:
    rows: list = []
    dropped, count = 0, 0

    def add(shard: TrainingShard) -> None:
        nonlocal dropped, count
        rows.extend(shard_rows(shard))
        dropped += len(shard.dropped)
        count += 1

    for path in targets.shard_files:
        add(TrainingShard(path))
    for storage in targets.storages:
        for key in run_shard_keys(storage):
            with storage.local_copy(key) as path:
                add(TrainingShard(path))
    return rows, dropped, count


def report_lines(report: dict[str, Any]) -> Iterator[str]:
    if not report["parts"]:
        yield f"nothing to audit in {', '.join(report['paths'])}"
    for part in report["parts"]:
        if part["kind"] == "dataset":
            yield from dataset_lines(part)
        else:
            yield from output_lines(part["kind"], part)
    limit = report["max_stub_fraction"]
    for part in report["parts"]:
        if part["kind"] not in report["gated_on"]:
            continue
        what = "placeholder responses" if part["kind"] == "dataset" else f"stubs in {part['kind']}"
        verdict = "PASS" if part["passed"] else "FAIL"
        yield f"{verdict}: {part['stub_fraction']:.1%} {what} (max {limit:.1%})"
