"""Generate lane: prompts shard in, completions shard out, with the exact token ids generated."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from dflash_queue.config import Config
from dflash_queue.engines.base import GenerateEngine, GenerationRequest
from dflash_queue.engines.chat import ChatFormatter
from dflash_queue.shards.completions import CompletionRecord, decode_completions, encode_completions
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.keys import completions_key, prompts_key


@dataclass(frozen=True)
class GenerateSummary:
    shard_id: str
    num_samples: int
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: dict[str, int] = field(default_factory=dict)
    skipped: bool = False

    def counters(self) -> dict[str, int]:
        counts = {
            "generate_samples": self.num_samples,
            "generate_prompt_tokens": self.prompt_tokens,
            "generate_completion_tokens": self.completion_tokens,
            "generate_shards": 1,
        }
        counts.update({f"finish_{reason}": n for reason, n in self.finish_reasons.items()})
        return counts


def summarize(shard_id: str, records: list[CompletionRecord], *, skipped: bool) -> GenerateSummary:
    return GenerateSummary(
        shard_id=shard_id,
        num_samples=len(records),
        prompt_tokens=sum(len(r.prompt_ids) for r in records),
        completion_tokens=sum(len(r.completion_ids) for r in records),
        finish_reasons=dict(Counter(r.finish_reason for r in records)),
        skipped=skipped,
    )


class GenerateLane:
    def __init__(self, config: Config, engine: GenerateEngine, storage: Storage | None = None) -> None:
        self.config = config
        self.engine = engine
        self.storage = storage or open_storage(config.storage)
        self.formatter = ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path))

    def run(self, shard_id: str) -> GenerateSummary:
        out_key = completions_key(shard_id)
        if self.storage.exists(out_key):
            existing = decode_completions(self.storage.read_bytes(out_key), what=out_key)
            return summarize(shard_id, existing, skipped=True)

        in_key = prompts_key(shard_id)
        samples = decode_prompts(self.storage.read_bytes(in_key), what=in_key)
        requests = [
            GenerationRequest(s.id, self.formatter.prompt_ids(s.messages, enable_thinking=s.thinking))
            for s in samples
        ]
        generations = self.engine.generate(requests)
        records = [
            CompletionRecord(
                id=sample.id,
                prompt_ids=generation.prompt_ids,
                completion_ids=generation.completion_ids,
                finish_reason=generation.finish_reason,
                thinking=sample.thinking,
                text=generation.text,
                source=sample.source,
            )
            for sample, generation in zip(samples, generations, strict=True)
        ]
        self.storage.write_bytes(out_key, encode_completions(records))
        return summarize(shard_id, records, skipped=False)

    def close(self) -> None:
        self.engine.close()


def build_generate_engine(config: Config) -> GenerateEngine:
    if config.generate.engine == "transformers":
        from dflash_queue.engines.hf_generate import TransformersGenerateEngine

        return TransformersGenerateEngine(config)
    raise ValueError(f"unknown generate engine {config.generate.engine!r}")
