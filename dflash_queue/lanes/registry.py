"""Every lane, declared once: its queue and task, the ledger states it moves a shard through, the counters it
keeps, how its resident engine is built, how many tasks a worker runs at once, and the lane that follows it.

The Celery app, the tasks, workers, `status`, `requeue`, dead letters and the single-box runner all read this
table; a lane's work itself lives in its own module (`lanes/generate.py`, `lanes/extract.py`), named here by
import path so that reading the table loads no engine. DEVELOPERS.md shows how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from dflash_queue.runstate.shard_states import CANARY_ERROR, DONE, GENERATED, QUEUED

if TYPE_CHECKING:
    from dflash_queue.config import Config
    from dflash_queue.engines.config import GenerateConfig
    from dflash_queue.lanes.config import ExtractConfig
    from dflash_queue.storage import Storage
    from dflash_queue.storage.config import UploaderConfig


class LaneSummary(Protocol):
    """What a lane's `run(shard_id, redo=...)` and `already_stored(shard_id)` return, as the generic lane task uses
    it."""

    skipped: bool  # the output was already stored: nothing was computed, nothing is counted
    poisoned: tuple[tuple[str, BaseException], ...]  # samples left out, each to a dead letter

    def counters(self) -> dict[str, int]: ...

    def maxima(self) -> dict[str, float]: ...

    @property
    def handed_on(self) -> int: ...  # samples the next lane receives

    def describe(self) -> str: ...


class ResidentLane(Protocol):
    """A lane's worker-side object: loaded once per worker process, then `run` per shard.

    The lane task asks `already_stored` first (unless `redo`), for every lane, and runs the lane only when it
    answers None (queue/steps/already_stored.py): `run` computes and stores the shard's output.
    """

    def already_stored(self, shard_id: str, *, epoch: int = 0) -> LaneSummary | None:
        """The summary of a skip (`skipped`: nothing computed, nothing counted) when the shard's output for `epoch`
        is already stored; None when the lane must compute it."""
        ...

    def run(self, shard_id: str, *, redo: bool = False, epoch: int = 0) -> LaneSummary: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LaneSpec:
    name: str  # also its queue's name
    task_name: str
    # "module:function" of `(config, storage) -> ResidentLane`, imported only by a worker of this lane.
    builder: str
    # The lane's task slots by default, from the sections its lane reads (the table hands each its own).
    default_slots: Callable[[Config], int]
    # The state of a shard waiting for this lane (set again when a dead letter of this lane is requeued), the
    # states that count as waiting, the state this lane's task leaves behind, and the states past this lane.
    waiting_state: str
    pending_states: frozenset[str]
    finished_state: str
    done_states: frozenset[str]
    # (ledger counter, label) shown by `status`, each with a rate; `{name}_shards` is counted per shard too.
    counters: tuple[tuple[str, str], ...]
    # How `status` shows the lane's volume: (counter label, caption, "tokens" or "bytes"), in order.
    volume: tuple[tuple[str, str, str], ...] = ()
    # Rows of the status view that only some lanes fill: "turns" and "quality gate" (a lane that generates).
    status_rows: frozenset[str] = frozenset()
    # The ledger maximum of a lane that checks its states with a canary (its status row shows it); None: none.
    canary_error: str | None = None
    next_lane: str | None = None
    # How `plan` paces the lane: by the tokens it generates ("generated"), or by whole sequences, prompt and
    # completion, one prefill each ("sequence"); `work_counter` counts those tokens (over the lane's busy time,
    # the measured rate), `plan_title` heads its table.
    paced_by: Literal["generated", "sequence"] = "sequence"
    work_counter: str = ""
    plan_title: str = ""
    # Warnings a worker logs at start-up for this lane's settings, given its task slots.
    startup_warnings: Callable[[Config, int], list[str]] = lambda config, slots: []
    # A lane of the pipeline every shard passes through (prompts to training shard); False: a side lane that some
    # shards are sent to (the audit), which moves no shard on and has no place in `plan` or the run's progress.
    pipeline: bool = True
    # Whether a run of this config uses the lane at all (a side lane can be turned off).
    in_use: Callable[[Config], bool] = lambda config: True

    @property
    def queue(self) -> str:
        return self.name

    @property
    def busy_counter(self) -> str:
        return f"{self.name}_busy_ms"

    @property
    def shards_counter(self) -> str:
        return f"{self.name}_shards"

    @property
    def samples_counter(self) -> str:
        return f"{self.name}_samples"

    @property
    def canary_counter(self) -> str:
        return f"{self.name}_canary_samples"

    def build(self, config: Config, storage: Storage | None = None) -> ResidentLane:
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)(config, storage)


def _generate_slots(generate: GenerateConfig) -> int:
    """The vLLM lane keeps `inflight_tasks` shards feeding one engine, the inference-server engine
    `generate.server.inflight_tasks` feeding its servers; the Transformers engine runs one."""
    if generate.engine == "server":
        return generate.server.inflight_tasks
    return generate.vllm.inflight_tasks if generate.engine == "vllm" else 1


def _extract_compute_slots(extract: ExtractConfig) -> int:
    """Tasks computing at once: one on the Transformers model, extract.vllm.inflight_tasks on the vLLM engine."""
    return extract.vllm.inflight_tasks if extract.engine == "vllm" else 1


def extract_slots(extract: ExtractConfig, uploader: UploaderConfig) -> int:
    """Tasks computing while others wait for their uploads: a task holds one of the uploader's max_pending
    staging slots from before its compute until its shard is stored; the extra slots are tasks that wait for a
    staging slot, ready to compute."""
    return _extract_compute_slots(extract) + uploader.max_pending


def _extract_warnings(
    extract: ExtractConfig, uploader: UploaderConfig, context_lengths: Callable[[], tuple[int, int]]
) -> list[str]:
    """`context_lengths`: the vLLM engine's context and the longest sequence staging admits, asked for only when
    the engine is vLLM (they may read the model's config.json)."""
    if extract.engine != "vllm":
        return []
    warnings = []
    computing = _extract_compute_slots(extract)
    pending = uploader.max_pending
    if computing > 1 and pending < computing:
        warnings.append(
            f"storage.uploader.max_pending ({pending}) is below extract.vllm.inflight_tasks ({computing}): a task "
            f"holds a staging slot while it computes, so at most {pending} tasks feed the engine at once; raise "
            "storage.uploader.max_pending"
        )
    context, longest = context_lengths()
    if context <= longest:
        warnings.append(
            f"the vLLM extract engine's context ({context} tokens) holds sequences of at most {context - 1} "
            f"tokens (it samples one token after each); staging admits {longest}: longer samples will be "
            "dead-lettered"
        )
    return warnings


def _generate_warnings(generate: GenerateConfig, shard_size: int, slots: int) -> list[str]:
    if generate.engine == "server":
        waiting = (slots - 1) * shard_size
        wanted = generate.server.requests_in_flight
        if waiting >= wanted:
            return []
        return [
            f"with {slots} tasks in flight of {shard_size} samples each, the other tasks hold "
            f"{waiting} requests while one task finishes, fewer than generate.server.requests_in_flight ({wanted}): "
            "the servers will run part-empty at task boundaries; raise generate.server.inflight_tasks or "
            "dataset.shard_size"
        ]
    if generate.engine != "vllm":
        return []
    waiting = (slots - 1) * shard_size
    if waiting >= generate.vllm.max_num_seqs:
        return []
    return [
        f"with {slots} tasks in flight of {shard_size} samples each, the other tasks hold "
        f"{waiting} requests while one task finishes, fewer than generate.vllm.max_num_seqs "
        f"({generate.vllm.max_num_seqs}): the engine will run part-empty at task boundaries; raise "
        "generate.vllm.inflight_tasks or dataset.shard_size"
    ]


GENERATE = LaneSpec(
    name="generate",
    task_name="dfq.generate",
    builder="dflash_queue.lanes.generate:build_generate_lane",
    default_slots=lambda config: _generate_slots(config.generate),
    waiting_state=QUEUED,
    pending_states=frozenset({QUEUED}),
    finished_state=GENERATED,
    done_states=frozenset({GENERATED, DONE}),
    counters=(
        ("generate_samples", "samples"),
        ("generate_prompt_tokens", "prompt_tokens"),
        ("generate_completion_tokens", "generated_tokens"),
    ),
    volume=(("prompt_tokens", "prompt", "tokens"), ("generated_tokens", "generated", "tokens")),
    status_rows=frozenset({"turns", "quality gate"}),
    next_lane="extract",
    paced_by="generated",
    work_counter="generate_completion_tokens",
    plan_title="generation (generated tokens)",
    startup_warnings=lambda config, slots: _generate_warnings(config.generate, config.dataset.shard_size, slots),
)

EXTRACT = LaneSpec(
    name="extract",
    task_name="dfq.extract",
    builder="dflash_queue.lanes.extract:build_extract_lane",
    default_slots=lambda config: extract_slots(config.extract, config.storage.uploader),
    waiting_state=GENERATED,
    pending_states=frozenset({QUEUED, GENERATED}),
    finished_state=DONE,
    done_states=frozenset({DONE}),
    counters=(
        ("extract_samples", "samples"),
        ("extract_tokens", "tokens"),
        ("extract_bytes", "bytes"),
    ),
    volume=(("tokens", "", "tokens"), ("bytes", "", "bytes")),
    canary_error=CANARY_ERROR,
    paced_by="sequence",
    work_counter="extract_tokens",
    plan_title="extraction (prompt + completion tokens)",
    startup_warnings=lambda config, slots: _extract_warnings(
        config.extract, config.storage.uploader, lambda: (config.extract_context_len(), config.max_model_len())
    ),
)

AUDIT = LaneSpec(
    name="audit",
    task_name="dfq.audit",
    builder="dflash_queue.lanes.audit:build_audit_lane",
    default_slots=lambda config: 1,  # one reference at a time: it takes the worker's cores or its GPU
    # It leaves a shard's state as it was: the shard is stored (done) before it is sent here, and stays so.
    waiting_state=DONE,
    pending_states=frozenset(),
    finished_state=DONE,
    done_states=frozenset({DONE}),
    counters=(
        ("audit_samples", "samples"),
        ("audit_tokens", "tokens"),
        ("audit_failed", "failed"),
    ),
    volume=(("tokens", "", "tokens"),),
    paced_by="sequence",
    work_counter="audit_tokens",
    pipeline=False,
    in_use=lambda config: config.audit.enabled,
)

# The lane of a dead letter whose task name or queue names no lane.
UNKNOWN_LANE = "unknown"

# Every lane; the pipeline's in order: the first takes staged shards, the last one's output is the training shard.
LANES: dict[str, LaneSpec] = {spec.name: spec for spec in (GENERATE, EXTRACT, AUDIT)}
PIPELINE: tuple[LaneSpec, ...] = tuple(spec for spec in LANES.values() if spec.pipeline)
FIRST_LANE = PIPELINE[0]
FINAL_LANE = PIPELINE[-1]


def lane(name: str) -> LaneSpec:
    try:
        return LANES[name]
    except KeyError:
        raise ValueError(f"unknown lane {name!r}; expected one of {sorted(LANES)}") from None


def lane_of_task(task_name: str) -> LaneSpec | None:
    return next((spec for spec in LANES.values() if spec.task_name == task_name), None)

