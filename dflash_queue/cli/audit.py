"""`dflash-queue audit`: datasets before a run, completions and training shards after it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Deployment config: the target's tokenizer (token counts), thinking policy, regeneration mode, "
    "max_model_len and quality.min_answer_tokens. Without it lengths of inputs are in words.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON on stdout.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write histograms to this PNG.")
@click.option(
    "--max-stub-fraction",
    type=click.FloatRange(0, 1),
    default=0.05,
    show_default=True,
    help="Fail (exit 1) when the share of placeholder responses (datasets) or stubs (outputs) exceeds this.",
)
@click.option(
    "--min-answer-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="An answer shorter than this is a stub [default: quality.min_answer_tokens of the config, else 8].",
)
def audit(
    paths: tuple[str, ...],
    config_path: Path | None,
    as_json: bool,
    plot: Path | None,
    max_stub_fraction: float,
    min_answer_tokens: int | None,
) -> None:
    """Audit PATHS: dataset files (JSONL, JSON, gzip/zstd, Parquet), completions or training shards, a
    directory of them, or a storage root. Exits 1 when the stub share exceeds --max-stub-fraction."""
    from dflash_queue.audit.plot import write_plot
    from dflash_queue.audit.run import audit as run_audit
    from dflash_queue.audit.run import report_lines

    for path in paths:
        if "://" not in path and not Path(path).exists():
            raise click.BadParameter(f"no such file or directory: {path}", param_hint="PATHS")
    settings = _settings(config_path, max_stub_fraction, min_answer_tokens)
    report = run_audit(list(paths), settings)
    if plot is not None:
        report["plot"] = str(write_plot(report, plot))
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        for line in report_lines(report):
            click.echo(line)
        if plot is not None:
            click.echo(f"histograms: {report['plot']}")
    if not report["passed"]:
        sys.exit(1)


def _settings(config_path: Path | None, max_stub_fraction: float, min_answer_tokens: int | None):
    from dflash_queue.audit.inputs import AuditSettings

    if config_path is None:
        return AuditSettings(min_answer_tokens=min_answer_tokens or 8, max_stub_fraction=max_stub_fraction)
    from transformers import AutoTokenizer

    from dflash_queue.cli.common import load
    from dflash_queue.data.chat_template import ChatFormatter

    config = load(config_path)
    return AuditSettings(
        min_answer_tokens=min_answer_tokens or config.quality.min_answer_tokens,
        max_stub_fraction=max_stub_fraction,
        max_record_bytes=config.dataset.max_record_bytes,
        regenerate=config.dataset.regenerate,
        thinking=config.dataset.thinking,
        formatter=ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path)),
        max_model_len=config.max_model_len(),
        generation_budget=config.generation_budget,
    )


COMMANDS = [audit]
