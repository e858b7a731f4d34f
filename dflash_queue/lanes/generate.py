"""Generate lane: prompts shard in, completions shard out, with the exact token ids generated and the quality
gate's verdict on every sample (dropped ones included, so that each staged sample is accounted for)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from dflash_queue import faults
from dflash_queue.config import Config
from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.config import DatasetConfig
from dflash_queue.data.samples import Sample
from dflash_queue.engines.base import GenerateEngine
from dflash_queue.lanes.isolation import run_isolating
from dflash_queue.lanes.turns import TurnGenerator
from dflash_queue.quality.checks import TokenMarkers
from dflash_queue.quality.config import QualityConfig
from dflash_queue.quality.gate import GateCounts, QualityGate, gate_summary
from dflash_queue.shards.completions import CompletionRecord, decode_completions, encode_completions
from dflash_queue.shards.keys import completions_key, prompts_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.config import StorageConfig

if TYPE_CHECKING:
    from dflash_queue.engines.server.fingerprint import FingerprintRecord
    from dflash_queue.runstate.server_waits import OutageReporter


@dataclass(frozen=True)
class GenerateSummary:
    shard_id: str
    num_samples: int
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: dict[str, int] = field(default_factory=dict)
    skipped: bool = False
    # Samples the quality gate kept (flagged ones included); the rest are dropped.
    kept: int = 0
    gate: dict[str, int] = field(default_factory=dict)
    # (sample id, error) of each sample isolated as the cause of an engine failure: left out of the shard.
    poisoned: tuple[tuple[str, BaseException], ...] = ()

    def counters(self) -> dict[str, int]:
        counts = {
            "generate_samples": self.num_samples,
            "generate_prompt_tokens": self.prompt_tokens,
            "generate_completion_tokens": self.completion_tokens,
            "generate_shards": 1,
        }
        counts.update({f"finish_{reason}": n for reason, n in self.finish_reasons.items()})
        counts.update(self.gate)
        return counts

    def maxima(self) -> dict[str, float]:
        return {}

    @property
    def handed_on(self) -> int:
        """Samples the extract lane receives: those the quality gate kept."""
        return self.kept

    def describe(self) -> str:
        return (
            f"generated shard {self.shard_id}: {self.num_samples} samples, {self.completion_tokens} completion "
            f"tokens; quality gate: {'; '.join(gate_summary(self.gate))}"
            + (f"; {len(self.poisoned)} dead-lettered" if self.poisoned else "")
            + (" (already stored)" if self.skipped else "")
        )


def summarize(
    shard_id: str,
    records: list[CompletionRecord],
    *,
    skipped: bool,
    poisoned: tuple[tuple[str, BaseException], ...] = (),
) -> GenerateSummary:
    gate = GateCounts()
    for record in records:
        if record.quality is not None:
            gate.add(record.quality)
    generated = sum(r.generated_tokens for r in records)
    return GenerateSummary(
        shard_id=shard_id,
        num_samples=len(records),
        prompt_tokens=sum(r.num_tokens for r in records) - generated,
        completion_tokens=generated,
        # Every generated turn's, not only each sample's last turn's.
        finish_reasons=dict(Counter(reason for r in records for reason in r.turn_finish_reasons())),
        skipped=skipped,
        kept=sum(1 for r in records if r.kept),
        gate=gate.as_dict(),
        poisoned=poisoned,
    )


@dataclass(frozen=True)
class GenerateLaneSettings:
    """What the generate lane reads of the configuration (`generate_lane_settings` takes it from a whole Config)."""

    storage: StorageConfig  # opened when the lane is handed no storage
    tokenizer_path: str
    dataset: DatasetConfig  # its thinking policy, and the history later turns are generated from
    quality: QualityConfig
    max_tokens: int  # generate.sampling.max_tokens
    retry_max_tokens: int
    max_model_len: int
    source: str  # where the config came from: named when the chat template cannot honour the thinking policy


class GenerateLane:
    def __init__(self, settings: GenerateLaneSettings, engine: GenerateEngine, storage: Storage | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.outage_reporter: OutageReporter | None = None
        self.storage = storage or open_storage(settings.storage)
        tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
        self.formatter = ChatFormatter(tokenizer)
        # Refused at worker start, with the message `doctor` gives, rather than recorded wrongly sample by sample.
        self.formatter.require_thinking_policy(settings.dataset.thinking, settings.source)
        self.turns = TurnGenerator(
            engine,
            self.formatter,
            QualityGate(settings.quality, TokenMarkers.from_tokenizer(tokenizer)),
            max_tokens=settings.max_tokens,
            retry_max_tokens=settings.retry_max_tokens,
            max_model_len=settings.max_model_len,
            history=settings.dataset.history,
        )

    def already_stored(self, shard_id: str, *, epoch: int = 0) -> GenerateSummary | None:
        """The stored completions file's summary, marked skipped; None when the shard has none."""
        out_key = completions_key(_epoch_zero(shard_id, epoch))
        if not self.storage.exists(out_key):
            return None
        return summarize(shard_id, decode_completions(self.storage.read_bytes(out_key), what=out_key), skipped=True)

    def run(self, shard_id: str, *, redo: bool = False, epoch: int = 0) -> GenerateSummary:
        """Generate one shard's completions (the lane task asks `already_stored` first). With `redo` (a requeued
        dead letter) a stored completions file is kept: only the samples it lacks are generated and added to it."""
        out_key = completions_key(_epoch_zero(shard_id, epoch))
        existing: list[CompletionRecord] = []
        if redo and self.storage.exists(out_key):
            existing = decode_completions(self.storage.read_bytes(out_key), what=out_key)

        in_key = prompts_key(shard_id)
        samples = decode_prompts(self.storage.read_bytes(in_key), what=in_key)
        have = {r.id for r in existing}
        todo = [s for s in samples if s.id not in have]
        isolated = run_isolating(todo, self._generate, [s.id for s in todo])
        fresh = {todo[i].id: isolated.result(i) for i in isolated.ok}
        by_id = {r.id: r for r in existing} | fresh
        records = [by_id[s.id] for s in samples if s.id in by_id]
        self.storage.write_bytes(out_key, encode_completions(records))
        poisoned = tuple((todo[i].id, exc) for i, exc in isolated.poisoned)
        return summarize(shard_id, [fresh[i] for i in fresh], skipped=False, poisoned=poisoned)

    def _generate(self, samples: list[Sample]) -> list[CompletionRecord]:
        faults.check_poison("generate", (s.id for s in samples))
        return self.turns.run(samples)

    def begin_shutdown(self) -> None:
        """Warm shutdown: an engine that waits for servers lets its waiting tasks go back to the queue."""
        begin = getattr(self.engine, "begin_shutdown", None)
        if begin is not None:
            begin()

    def close(self) -> None:
        if self.outage_reporter is not None:
            self.outage_reporter.stop()
        self.engine.close()


def _epoch_zero(shard_id: str, epoch: int) -> str:
    """Completions are made once, in epoch 0."""
    if epoch:
        raise ValueError(f"shard {shard_id}: completions are generated in epoch 0 only, not in epoch {epoch}")
    return shard_id


def generate_lane_settings(config: Config) -> GenerateLaneSettings:
    """What the generate lane reads, taken from the whole configuration (the derived lengths included)."""
    return GenerateLaneSettings(
        storage=config.storage,
        tokenizer_path=config.model.tokenizer_path,
        dataset=config.dataset,
        quality=config.quality,
        max_tokens=config.generate.sampling.max_tokens,
        retry_max_tokens=config.retry_max_tokens,
        max_model_len=config.max_model_len(),
        source=config.source,
    )


def build_generate_lane(config: Config, storage: Storage | None = None) -> GenerateLane:
    served_weights = None
    if config.generate.engine == "server" and config.broker.url:
        # Every worker's servers must run the weights the run's first one saw.
        from dflash_queue.runstate.ledger import resilient_client
        from dflash_queue.runstate.served_weights import ServedWeights

        served_weights = ServedWeights(resilient_client(config.broker.connection_url()), config.run.name)
    lane = GenerateLane(
        generate_lane_settings(config), build_generate_engine(config, served_weights=served_weights), storage
    )
    outage = getattr(lane.engine, "outage", None)
    if outage is not None and config.broker.url:
        # `status` shows a worker whose every inference server is down, and since when.
        from dflash_queue.runstate.ledger import resilient_client
        from dflash_queue.runstate.server_waits import OutageReporter, ServerWaits

        waits = ServerWaits(resilient_client(config.broker.connection_url()), config.run.name)
        lane.outage_reporter = OutageReporter(outage, waits)
    return lane


def build_generate_engine(config: Config, *, served_weights: FingerprintRecord | None = None) -> GenerateEngine:
    """The generate lane's engine; `served_weights`, for the inference-server engine, is where the run records its
    servers' weights fingerprint (none: the engine's first server's is the reference, as doctor checks)."""
    if config.generate.engine == "transformers":
        from dflash_queue.engines.hf.generate import TransformersGenerateEngine

        return TransformersGenerateEngine(
            config.model, config.generate.sampling, batch_size=config.generate.batch_size
        )
    if config.generate.engine == "vllm":
        from dflash_queue.engines.vllm.generate import VllmGenerateEngine

        return VllmGenerateEngine(config.model, config.generate.vllm, config.generate.sampling, source=config.source)
    if config.generate.engine == "server":
        from dflash_queue.engines.server.generate import ServedTarget, ServerGenerateEngine

        target = ServedTarget(config.served_model_name, config.model.tokenizer_path, config.max_model_len())
        return ServerGenerateEngine(
            config.generate.server, config.generate.sampling, target, source=config.source, served_weights=served_weights
        )
    raise ValueError(f"unknown generate engine {config.generate.engine!r}")
