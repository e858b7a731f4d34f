"""Commands over finished training shards: export, inspect."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_queue.cli.common import load
from dflash_queue.errors import ConfigError, ShardFormatError, StorageError

shards_argument = click.argument("shards", metavar="SHARDS")


@click.command()
@shards_argument
@click.option(
    "-f", "--format", "format_name", required=True,
    type=click.Choice(["specforge", "speculators", "messages", "parquet"]),
    help="specforge: data_N.ckpt files for SpecForge's offline trainer; speculators: the datasets table and "
    "hidden_states/hs_N.safetensors files speculators' trainer reads; messages: the regenerated conversations as "
    "OpenAI-messages JSONL; parquet: the same as a Parquet table (for these two, SHARDS is the run's storage and -c "
    "or --tokenizer decodes the replies).",
)
@click.option("--method", type=click.Choice(["dflash", "eagle3"]), default="dflash", show_default=True,
              help="specforge / speculators: the drafter the export is for (SpecForge's EAGLE-3 layout differs from "
              "its DFlash one; for speculators it sets the speculator type of the train command).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="speculators: seed of the file order (its trainer holds out the last rows for validation).")
@click.option("-c", "--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="messages / parquet: the deployment config whose tokenizer decodes the replies.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, path_type=Path),
              help="messages / parquet: the target's tokenizer directory (wins over the config's).")
@click.argument("out", metavar="OUT")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True,
              help="dtype of the exported hidden states (fp8 shards are dequantised to it).")
@click.option("--finish-reason", "finish_reasons", multiple=True,
              help="Keep only samples that ended so (repeatable), e.g. stop.")
@click.option("--exclude-flag", "exclude_flags", multiple=True,
              help="Leave out samples with this quality flag (repeatable).")
@click.option("--drop-flagged", is_flag=True, help="Leave out samples with any quality flag.")
@click.option("--skip-suspect", is_flag=True,
              help="Export without the shards the reference audit found suspect (listed, and recorded in "
              "export.json); without it, an export that would leave any out is refused and writes nothing.")
@click.option("--draft-vocab-size", type=click.IntRange(min=1), default=None,
              help="speculators: the draft's vocabulary, given to its trainer in export.json's arguments (default "
              "32,000, or every supervised token when there are fewer).")
def export(
    shards: str,
    format_name: str,
    method: str,
    seed: int,
    config_path: Path | None,
    tokenizer_path: Path | None,
    out: str,
    dtype: str,
    finish_reasons: tuple[str, ...],
    exclude_flags: tuple[str, ...],
    drop_flagged: bool,
    skip_suspect: bool,
    draft_vocab_size: int | None,
) -> None:
    """Write every sample of SHARDS (a shard, a directory or a storage URL) to OUT, one file per sample, in
    the layout SpecForge's or vLLM speculators' trainer reads for the drafter of --method, with the layer ids and
    config fields to give the trainer in OUT/export.json; or the regenerated conversations of a run's storage
    (SHARDS) as OpenAI-messages JSONL or Parquet."""
    from dflash_queue.exports import export_dataset, export_format
    from dflash_queue.exports.sample_files import hidden_dtype_named, refuse_suspects
    from dflash_queue.storage import open_storage
    from dflash_queue.training import ShardDataset

    console = Console(stderr=True, soft_wrap=True)
    if format_name in ("messages", "parquet"):
        _export_conversations(shards, format_name, out, _tokenizer(config_path, tokenizer_path), console)
        return
    try:
        with warnings.catch_warnings():  # bad shards are listed in the report below
            warnings.simplefilter("ignore", UserWarning)
            dataset = ShardDataset(
                shards,
                hidden_dtype=hidden_dtype_named(dtype),
                finish_reasons=finish_reasons or None,
                exclude_flags=exclude_flags,
                drop_flagged=drop_flagged,
                on_suspect_shard="skip",  # refused just below, or left out and recorded with --skip-suspect
            )
        refuse_suspects(dataset, shards, skip_suspect)
        if not dataset.shards:
            problems = "\n".join(f"  {key}: {problem}" for key, problem in [*dataset.bad_shards, *dataset.suspect_shards])
            raise click.ClickException(f"{shards}: no readable shard\n{problems}")
        target = open_storage(str(Path(out).resolve()) if "://" not in out else out)
        with Progress(TextColumn("export"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("samples", total=len(dataset))
            report = export_dataset(
                dataset,
                export_format(format_name, method, draft_vocab_size=draft_vocab_size),
                target,
                source=shards,
                seed=seed,
                on_sample=lambda n: bar.advance(task, n),
                skip_suspect=skip_suspect,
            )
    except (ShardFormatError, StorageError, ConfigError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in report.lines():
        click.echo(line)
    if report.bad_shards:
        sys.exit(1)


@click.command()
@click.argument("shard", metavar="SHARD")
@click.option("-c", "--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Deployment config whose tokenizer decodes the preview.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, path_type=Path),
              help="Tokenizer directory for the preview (wins over the config's).")
@click.option("--sample", "sample", type=click.IntRange(min=0), default=0, show_default=True, help="Sample to preview.")
@click.option("--tokens", "num_tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="Tokens shown from the start of the sample and of its completion.")
@click.option("--no-checksum", is_flag=True, help="Skip the sha256 pass over the whole object.")
@click.option("--deep", is_flag=True, help="Also check that every hidden state is finite (reads all of them).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(
    shard: str,
    config_path: Path | None,
    tokenizer_path: Path | None,
    sample: int,
    num_tokens: int,
    no_checksum: bool,
    deep: bool,
    as_json: bool,
) -> None:
    """Show what SHARD holds (metadata, samples, tokens, layers, dtype, size) and check that it is whole
    (structure, loss mask, checksum); preview the first tokens of one sample, decoded when a tokenizer is given."""
    from dflash_queue.shards.inspection import inspect_shard, sample_preview
    from dflash_queue.shards.locate import locate_shards

    try:
        located = locate_shards(shard)
        if len(located.keys) != 1:
            raise click.ClickException(f"{shard}: {len(located.keys)} shards; name one .safetensors file or URL")
        key = located.keys[0]
        report = inspect_shard(located.storage, key, checksum=not no_checksum, deep=deep)
        preview = None
        if report.index is not None and report.index.num_samples:
            if sample >= report.index.num_samples:
                held = report.index.num_samples
                raise click.ClickException(f"{report.where}: --sample {sample}, but the shard holds {held}")
            preview = sample_preview(located.storage, key, report.index, sample)
    except (ShardFormatError, StorageError) as exc:
        raise click.ClickException(str(exc)) from None
    tokenizer = _tokenizer(config_path, tokenizer_path) if preview else None
    if preview is not None:
        preview.update(_decoded(preview, tokenizer, num_tokens))

    if as_json:
        click.echo(json.dumps(_as_json(report, preview), indent=2))
    else:
        _print_report(report, preview, num_tokens)
    if not report.ok:
        sys.exit(1)


def _export_conversations(root: str, format_name: str, out: str, tokenizer: Any, console: Console) -> None:
    from dflash_queue.exports.conversations import export_conversations
    from dflash_queue.shards.keys import completions_keys
    from dflash_queue.storage import open_storage

    if tokenizer is None:
        raise click.UsageError(f"--format {format_name} decodes the replies: give -c CONFIG or --tokenizer")
    try:
        storage = open_storage(root if "://" in root else str(Path(root).resolve()))
        shards = len(completions_keys(storage))
        if not shards:
            raise click.ClickException(f"{root}: no completions shards (is it a run's storage root?)")
        target = open_storage(str(Path(out).resolve()) if "://" not in out else out)
        with Progress(TextColumn("export"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("shards", total=shards)
            report = export_conversations(
                storage, target, tokenizer, format_name, on_shard=lambda n: bar.advance(task, n)
            )
    except (ShardFormatError, StorageError, ConfigError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in report.lines():
        click.echo(line)


def _tokenizer(config_path: Path | None, tokenizer_path: Path | None) -> Any:
    if tokenizer_path is None and config_path is not None:
        tokenizer_path = Path(load(config_path).model.tokenizer_path)
    if tokenizer_path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_path))


def _decoded(preview: dict[str, Any], tokenizer: Any, count: int) -> dict[str, Any]:
    ids = preview["input_ids"]
    start = preview["completion_start"]
    head = ids[:count]
    completion = ids[start : start + count] if start is not None else []
    out: dict[str, Any] = {"first_ids": head, "completion_ids": completion}
    if tokenizer is not None:
        out["first_text"] = tokenizer.decode(head, skip_special_tokens=False)
        out["completion_text"] = tokenizer.decode(completion, skip_special_tokens=False)
    return out


def _as_json(report: Any, preview: dict[str, Any] | None) -> dict[str, Any]:
    out = report.summary()
    out["ok"] = report.ok
    out["checks"] = [{"name": c.name, "status": c.status, "detail": c.detail} for c in report.checks]
    out["sha256"] = report.sha256
    out["suspect"] = asdict(report.suspect) if report.suspect is not None else None
    out["finish_reasons"] = dict(report.finish_reasons)
    out["quality_flags"] = dict(report.quality_flags)
    if report.index is not None:
        out["metadata"] = report.index.shard_info()
    if preview is not None:
        out["preview"] = {k: v for k, v in preview.items() if k != "input_ids"}
    return out


def _print_report(report: Any, preview: dict[str, Any] | None, count: int) -> None:
    console = Console(soft_wrap=True)
    facts = Table(title=report.where, show_header=False, title_justify="left")
    facts.add_column(style="bold")
    facts.add_column()
    for name, value in report.summary().items():
        if name == "tokens_per_sample" and value:
            value = f"min {value[0]}, mean {value[1]}, max {value[2]}"
        facts.add_row(name, str(value))
    if report.index is not None:
        facts.add_row("finish_reasons", ", ".join(f"{k}: {v}" for k, v in sorted(report.finish_reasons.items())))
        facts.add_row("quality_flags", ", ".join(f"{k}: {v}" for k, v in sorted(report.quality_flags.items())) or "none")
        for name, value in sorted(report.index.shard_info().items()):
            if name not in {"dtype", "layer_ids", "layer_convention", "num_model_layers", "hidden_size", "target_model"}:
                facts.add_row(f"meta.{name}", value)
    console.print(facts)
    checks = Table("check", "status", "detail", title="checks", title_justify="left")
    for check in report.checks:
        style = "red" if check.status in ("FAILED", "SUSPECT") else ("green" if check.status == "ok" else "yellow")
        checks.add_row(check.name, f"[{style}]{check.status}[/{style}]", check.detail)
    console.print(checks)
    if preview is not None:
        console.print(
            f"sample {preview['sample']}: id {preview['id']}, {preview['tokens']} tokens, "
            f"finish_reason {preview['finish_reason']}, thinking requested {preview['thinking_requested']} "
            f"(in the reply: {preview['thinking']}), "
            f"flags {preview['quality_flags'] or 'none'}"
        )
        console.print(f"first {count} ids: {preview['first_ids']}")
        if "first_text" in preview:
            console.print("first tokens:", repr(preview["first_text"]), markup=False)
        console.print(f"completion starts at token {preview['completion_start']}: {preview['completion_ids']}")
        if "completion_text" in preview:
            console.print("completion:", repr(preview["completion_text"]), markup=False)
        if "first_text" not in preview:
            console.print("(pass -c CONFIG or --tokenizer PATH to decode)")


COMMANDS = [export, inspect]
