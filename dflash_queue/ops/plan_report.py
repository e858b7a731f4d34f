"""A plan put together from the planner's pieces, as JSON and as text tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dflash_queue.lanes.registry import PIPELINE
from dflash_queue.ops import humanize
from dflash_queue.ops.extract_memory import ExtractMemory
from dflash_queue.ops.planner import BYTES_PER_VALUE, ModelShape, PromptStats, hidden_state_bytes, schedule
from dflash_queue.ops.shard_sizing import ShardSizing


@dataclass(frozen=True)
class Throughput:
    label: str
    tokens_per_s: float  # per worker
    assumption: str = ""  # how a rate nobody gave was arrived at


@dataclass(frozen=True)
class PlanInputs:
    datasets: list[str]
    stats: PromptStats
    output_tokens_per_prompt: float
    output_source: str
    shape: ModelShape
    # Per lane (dflash_queue.lanes.registry): the per-worker rates to plan with.
    throughputs: Mapping[str, Sequence[Throughput]]
    gpus: int
    gpus_per_worker: Mapping[str, int]  # per lane
    subsets: Sequence[int]
    thinking_policy: str
    shards: ShardSizing | None = None
    extract_memory: ExtractMemory | None = None


def build_plan(inputs: PlanInputs) -> dict:
    stats = inputs.stats
    populations = [stats.prompts, *inputs.subsets]
    prompt_tokens_per_prompt = stats.mean_prompt_tokens
    output = inputs.output_tokens_per_prompt
    total_tokens = stats.prompts * (prompt_tokens_per_prompt + output)

    def lane(name: str, throughputs: Sequence[Throughput], tokens_per_prompt: float) -> list[dict]:
        gpus, per_worker = inputs.gpus, inputs.gpus_per_worker.get(name, 1)
        return [
            {
                "label": t.label,
                "tokens_per_s": t.tokens_per_s,
                "assumption": t.assumption,
                "runs": [
                    asdict(schedule(n, tokens_per_prompt, t.tokens_per_s, gpus=gpus, gpus_per_worker=per_worker))
                    for n in populations
                ],
            }
            for t in throughputs
        ]

    return {
        "datasets": inputs.datasets,
        "prompts": stats.prompts,
        "duplicates": stats.duplicates,
        "bad_records": stats.bad_records,
        "prompt_tokens": {
            "total": stats.prompt_tokens,
            "standard_error": stats.prompt_tokens_se,
            "mean_per_prompt": stats.mean_prompt_tokens,
            "sample_size": stats.sample_size,
        },
        "thinking": {"policy": inputs.thinking_policy, "share": stats.thinking_share},
        "output_tokens": {"per_prompt": output, "total": stats.prompts * output, "source": inputs.output_source},
        "hidden_states": {
            "layers": inputs.shape.num_layers_kept,
            "hidden_size": inputs.shape.hidden_size,
            "tokens": total_tokens,
            **{
                f"{name}_bytes": hidden_state_bytes(
                    total_tokens, inputs.shape.num_layers_kept, inputs.shape.hidden_size, size
                )
                for name, size in BYTES_PER_VALUE.items()
            },
        },
        "shards": inputs.shards.to_dict() if inputs.shards else None,
        "extract_memory": inputs.extract_memory.to_dict() if inputs.extract_memory else None,
        "gpus": inputs.gpus,
        "gpus_per_worker": {spec.name: inputs.gpus_per_worker.get(spec.name, 1) for spec in PIPELINE},
        "populations": populations,
        # A lane that generates is paced by the tokens it generates; the others by whole sequences (one prefill
        # each).
        **{
            name: lane(
                name,
                inputs.throughputs.get(name, ()),
                output if spec.paced_by == "generated" else prompt_tokens_per_prompt + output,
            )
            for name, spec in ((spec.name, spec) for spec in PIPELINE)
        },
    }


def render_plan(plan: dict) -> Group:
    pt, out, hs = plan["prompt_tokens"], plan["output_tokens"], plan["hidden_states"]
    skipped = f"{plan['duplicates']:,} duplicates, {plan['bad_records']:,} bad records skipped"
    if pt["standard_error"]:
        error = f"± {humanize.count(pt['standard_error'])} (1 s.e.; {pt['sample_size']:,} prompts tokenised)"
    else:
        error = f"(exact: all {pt['sample_size']:,} prompts tokenised)"
    facts = Table.grid(padding=(0, 2))
    facts.add_row("prompts", f"{plan['prompts']:,} ({skipped})")
    facts.add_row("prompt tokens", f"{humanize.count(pt['total'])} {error}; {pt['mean_per_prompt']:,.0f} per prompt")
    thinking = plan["thinking"]
    facts.add_row("thinking", f"{thinking['share']:.0%} of prompts (dataset.thinking = {thinking['policy']})")
    facts.add_row(
        "output tokens",
        f"{out['per_prompt']:,.0f} per prompt ({out['source']}): {humanize.count(out['total'])} to generate",
    )
    facts.add_row(
        "hidden states",
        f"K={hs['layers']} x hidden {hs['hidden_size']:,} over {humanize.count(hs['tokens'])} tokens: "
        f"bf16 {humanize.size(hs['bf16_bytes'])} · fp8 {humanize.size(hs['fp8_bytes'])}",
    )
    parts: list = [facts]
    shards = plan.get("shards")
    if shards:
        facts.add_row(
            "shards",
            f"{shards['samples']:,} samples x {shards['tokens_per_sample']:,.0f} tokens: "
            f"{humanize.size(shards['shard_bytes'])} each (extract.max_shard_bytes {humanize.size(shards['max_shard_bytes'])})",
        )
        facts.add_row(
            "extract worker",
            f"host memory {humanize.size(shards['task_host_bytes'])} beyond the model ({shards['computing_tasks']} "
            f"task(s) computing; {shards['task_slots']} task slots), staging disk "
            f"{humanize.size(shards['staging_bytes'])}",
        )
        if shards["too_large"]:
            per_sample = shards["shard_bytes"] / shards["samples"]
            fits = max(1, int(shards["max_shard_bytes"] // per_sample))
            parts.append(Text(
                f"warning: a shard would be {humanize.size(shards['shard_bytes'])}, above extract.max_shard_bytes "
                f"({humanize.size(shards['max_shard_bytes'])}): set dataset.shard_size to {fits:,} or less, or "
                "store fp8 (extract.hidden_dtype = \"fp8_e4m3\")",
                style="bold yellow",
            ))
    memory = plan.get("extract_memory")
    if memory:
        facts.add_row("extract GPUs", extract_memory_text(memory))
        parts.extend(Text(f"warning: {warning}", style="bold yellow") for warning in memory["warnings"])
    for spec in PIPELINE:
        lane, what = spec.name, spec.plan_title
        if not plan[lane]:
            continue
        per_worker = plan["gpus_per_worker"][lane]
        table = Table(
            title=f"{what} on {plan['gpus']} GPU(s): {plan['gpus'] // per_worker} worker(s) of {per_worker} GPU(s)",
            title_justify="left",
        )
        table.add_column("throughput per worker")
        for n in plan["populations"]:
            table.add_column(f"{n:,} prompts", justify="right")
        for row in plan[lane]:
            table.add_row(
                f"{row['label']}",
                *(f"{humanize.duration(r['wall_s'])} · {humanize.hours(r['gpu_hours'])} GPU-h" for r in row["runs"]),
            )
        parts.append(Text(""))
        parts.append(table)
        parts.extend(
            Text(f"assumes {humanize.rate(row['tokens_per_s'], 'tok')} per worker: {row['assumption']}")
            for row in plan[lane]
            if row["assumption"]
        )
    return Group(*parts)


def extract_memory_text(memory: dict) -> str:
    """One line: what an extract worker holds per GPU."""
    gib = humanize.gib
    head = (
        f"{memory['engine']}, {memory['gpus_per_worker']} GPU(s) per worker of {gib(memory['gpu_memory_bytes'])}: "
        f"weights {gib(memory['weight_bytes_per_gpu'])} per GPU ({humanize.count(memory['parameters'])} parameters "
        f"from {memory['parameters_source']}, {humanize.count(memory['active_parameters'])} active per token)"
    )
    if memory["engine"] == "vllm":
        return (
            f"{head}; cache per token per GPU: KV {humanize.size(memory['kv_cache_bytes_per_token'])} + hidden "
            f"states {humanize.size(memory['hidden_state_cache_bytes_per_token'])}, "
            f"{humanize.count(memory['tokens_in_flight'])} tokens in flight at gpu_memory_utilization "
            f"{memory['gpu_memory_utilization']:g}"
        )
    return (
        f"{head} + a pass of {memory['token_budget']:,} tokens {gib(memory['activation_bytes'])} = "
        f"{gib(memory['bytes_per_gpu'])} per GPU"
    )
