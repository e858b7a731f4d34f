"""`dflash-queue plan`: tokens, GPU-hours, wall-clock and storage for a dataset, before the run."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from dflash_queue.cli.common import architecture_options, config_option, load, model_overrides
from dflash_queue.lanes.registry import EXTRACT, GENERATE, PIPELINE


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@config_option
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="GPUs running each lane's workers [default: one worker of the lane with the most GPUs per worker].")
@click.option("--gpus-per-worker", type=click.IntRange(min=1), default=None,
              help="GPUs per worker of every lane; throughputs are per worker [default: a lane's "
              "vllm.tensor_parallel_size when it runs vLLM, else 1].")
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Memory of one GPU, for the extract workers' per-GPU figures [default: 140.4, an H200 as "
              "nvidia-smi reports it (143,771 MiB)].")
@click.option("--tokens-per-second", "tokens_per_s", type=click.FloatRange(min=0, min_open=True), multiple=True,
              help="Generated tokens/s per worker to compare (repeatable) [default: 160 and 1200].")
@click.option("--extract-tokens-per-second", "extract_tokens_per_s", type=click.FloatRange(min=0, min_open=True),
              multiple=True, help="Extracted (prefill) tokens/s per worker to compare (repeatable).")
@click.option(
    "--subset", type=click.IntRange(min=1), multiple=True, help="Also plan for this many prompts (repeatable)."
)
@click.option("--sample-size", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Prompts tokenised to estimate prompt tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt sample.")
@click.option("--thinking-tokens", type=click.IntRange(min=1), default=None,
              help="Expected completion tokens with thinking on [default: 2048, capped at max_tokens].")
@click.option("--plain-tokens", type=click.IntRange(min=1), default=None,
              help="Expected completion tokens with thinking off [default: 512, capped at max_tokens].")
@click.option("--measured", is_flag=True,
              help="Use the output length and throughputs a run under this config measured (ledger counters).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@architecture_options
def plan(
    datasets: tuple[Path, ...],
    config_path: Path,
    gpus: int | None,
    gpus_per_worker: int | None,
    gpu_memory_gib: float | None,
    tokens_per_s: tuple[float, ...],
    extract_tokens_per_s: tuple[float, ...],
    subset: tuple[int, ...],
    sample_size: int,
    seed: int,
    thinking_tokens: int | None,
    plain_tokens: int | None,
    measured: bool,
    as_json: bool,
    model_config: Path | None,
    tokenizer_dir: Path | None,
) -> None:
    """Count DATASETS' prompts and prompt tokens, estimate output tokens, and print time and storage.

    Prompts are counted exactly; prompt tokens with the target's tokenizer and chat template on a random
    sample (with its standard error); output tokens from the thinking policy's defaults or, with --measured,
    from a run's averages. Wall-clock is for --gpus GPUs at each throughput. The extract workers' memory per GPU
    and, unless a rate is given or measured, the prefill rate assumed for them come from the model's
    shapes and the extract engine's settings.
    """
    from transformers import AutoConfig, AutoTokenizer

    from dflash_queue.lanes.tensor_parallel import vllm_tensor_parallel
    from dflash_queue.ops import humanize
    from dflash_queue.ops.extract_memory import H200_MEMORY_GIB, extract_memory
    from dflash_queue.ops.plan_report import PlanInputs, Throughput, build_plan, render_plan
    from dflash_queue.ops.planner import (
        DEFAULT_PLAIN_TOKENS,
        DEFAULT_THINKING_TOKENS,
        DEFAULT_THROUGHPUTS,
        count_prompts,
        model_shape,
        policy_output_tokens,
    )
    from dflash_queue.ops.shard_sizing import size_shards

    config = load(config_path, model=model_overrides(model_config, tokenizer_dir))
    tensor_parallel = vllm_tensor_parallel(config.generate, config.extract)
    per_worker = {spec.name: gpus_per_worker or tensor_parallel.get(spec.name, 1) for spec in PIPELINE}
    gpus = gpus or max(per_worker.values())
    for lane, size in per_worker.items():
        if gpus % size:
            raise click.BadParameter(f"{gpus} GPUs do not split into {lane} workers of {size}", param_hint="--gpus")
    try:
        shape = model_shape(config.model, config.extract)
        memory = extract_memory(
            config.model,
            config.extract,
            AutoConfig.from_pretrained(config.model.path),
            gpus_per_worker=per_worker[EXTRACT.name],
            gpu_memory_gib=gpu_memory_gib or H200_MEMORY_GIB,
        )
    except (OSError, ValueError, AttributeError) as exc:
        raise click.ClickException(f"{config_path}: model {config.model.path}: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
    stats = count_prompts(config.dataset, config.model, list(datasets), tokenizer, sample_size=sample_size, seed=seed)
    if stats.prompts == 0:
        names = ", ".join(map(str, datasets))
        raise click.ClickException(f"no valid prompts in {names} ({stats.bad_records} bad records)")

    max_tokens = config.generate.sampling.max_tokens
    thinking_tokens = thinking_tokens or DEFAULT_THINKING_TOKENS
    plain_tokens = plain_tokens or DEFAULT_PLAIN_TOKENS
    output = policy_output_tokens(
        stats.thinking_share, max_tokens, thinking_tokens=thinking_tokens, plain_tokens=plain_tokens
    )
    source = f"thinking {thinking_tokens:,} / plain {plain_tokens:,}, capped at max_tokens {max_tokens:,}"
    throughputs = {
        GENERATE.name: [Throughput(humanize.rate(t, "tok"), t) for t in (tokens_per_s or DEFAULT_THROUGHPUTS)],
        EXTRACT.name: [Throughput(humanize.rate(t, "tok"), t) for t in extract_tokens_per_s],
    }
    if measured:
        run = _measured(config)
        if run.output_tokens_per_sample is not None:
            output = run.output_tokens_per_sample
            source = f"measured over {run.samples:,} generated samples"
        for lane, rate in run.tokens_per_s.items():
            if rate:
                throughputs[lane].append(Throughput(f"measured {humanize.rate(rate, 'tok')}", rate))
    if not throughputs[EXTRACT.name]:
        label = f"assumed {humanize.rate(memory.tokens_per_s, 'tok')}"
        throughputs[EXTRACT.name].append(Throughput(label, memory.tokens_per_s, memory.assumption))

    result = build_plan(
        PlanInputs(
            datasets=[str(d) for d in datasets],
            stats=stats,
            output_tokens_per_prompt=output,
            output_source=source,
            shape=shape,
            throughputs=throughputs,
            gpus=gpus,
            gpus_per_worker=per_worker,
            subsets=list(subset),
            thinking_policy=config.dataset.thinking,
            shards=size_shards(
                config.extract,
                config.dataset,
                config.storage.uploader,
                config.model,
                num_layers=shape.num_layers_kept,
                hidden_size=shape.hidden_size,
                tokens_per_sample=stats.mean_prompt_tokens + output,
            ),
            extract_memory=memory,
        )
    )
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        Console(highlight=False).print(render_plan(result))


def _measured(config):
    import redis

    from dflash_queue.ops.planner import measured_from_counters
    from dflash_queue.runstate.ledger import Ledger

    if not config.broker.url:
        raise click.ClickException(
            "--measured reads the run's counters from the broker: set broker.url (or DFQ_BROKER_URL)"
        )
    try:
        counters = Ledger.from_url(config.broker.connection_url(), config.run.name).counters()
    except redis.RedisError as exc:
        raise click.ClickException(f"broker {config.broker.url}: {exc}") from None
    run = measured_from_counters(counters)
    if run.output_tokens_per_sample is None:
        raise click.ClickException(f"run {config.run.name!r} has no generated samples to measure yet")
    return run


COMMANDS = [plan]
