"""Generation with Transformers `generate`: simple and exact, for CPUs, tests and small jobs.

Batches are length-sorted and left-padded; a batch waits for its slowest sequence, which is why large jobs
use the vLLM engine instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer

from dflash_queue.engines.base import Generation, GenerationRequest
from dflash_queue.engines.config import ModelConfig, SamplingConfig
from dflash_queue.engines.devices import resolve_device, resolve_dtype
from dflash_queue.engines.hf.causal_lm import load_causal_lm


class TransformersGenerateEngine:
    name = "transformers"

    def __init__(self, model: ModelConfig, sampling: SamplingConfig, *, batch_size: int) -> None:
        """`batch_size`: generate.batch_size, the sequences of one `generate` call."""
        self.sampling = sampling
        self.batch_size = batch_size
        self.device = resolve_device(model.device)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model.tokenizer_path)
        # A multimodal checkpoint gives its text-only causal LM: prompts here are text.
        self.model: Any = load_causal_lm(model.path, dtype=resolve_dtype(model.dtype, self.device), device=self.device)
        self.model.eval()
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        results: dict[int, Generation] = {}
        # Length-sorted batches waste less on padding; each budget group runs separately.
        order = sorted(
            range(len(requests)),
            key=lambda i: (self._budget(requests[i]), len(requests[i].prompt_ids)),
        )
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            budgets = {self._budget(requests[i]) for i in chunk}
            for budget in sorted(budgets):
                group = [i for i in chunk if self._budget(requests[i]) == budget]
                for index, generation in zip(group, self._generate_batch([requests[i] for i in group], budget)):
                    results[index] = generation
        return [results[i] for i in range(len(requests))]

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _budget(self, request: GenerationRequest) -> int:
        return request.max_tokens or self.sampling.max_tokens

    @torch.inference_mode()
    def _generate_batch(self, batch: list[GenerationRequest], max_new_tokens: int) -> list[Generation]:
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            ids = torch.tensor(request.prompt_ids, dtype=torch.long)
            input_ids[row, width - len(ids) :] = ids
            attention[row, width - len(ids) :] = 1
        # Seeded from the samples, so a re-delivered task regenerates the same replies.
        torch.manual_seed(_batch_seed(self.sampling.seed, batch))
        sampling = self.sampling
        do_sample = sampling.temperature > 0
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=sampling.temperature if do_sample else None,
            top_p=sampling.top_p if do_sample else None,
            top_k=(sampling.top_k if sampling.top_k > 0 else None) if do_sample else None,
            min_p=(sampling.min_p or None) if do_sample else None,
            repetition_penalty=sampling.repetition_penalty,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            stop_strings=list(sampling.stop) or None,
            tokenizer=self.tokenizer if sampling.stop else None,
        )
        new_tokens = output[:, width:].tolist()
        return [self._finish(request, tokens, max_new_tokens) for request, tokens in zip(batch, new_tokens)]

    def _finish(self, request: GenerationRequest, tokens: list[int], budget: int) -> Generation:
        """The reply the model produced, out of a row of `generate`'s output.

        A row ends at the first end-of-sequence token (kept: the model produced it), at the token that completed
        a stop string (kept, as vLLM keeps it), or at the budget. After a row stops, `generate` pads it with the
        pad id, which is often also an end-of-sequence id: a stop string is therefore looked for before the
        first end-of-sequence token is believed, or the padding would become a token the model never produced.
        """
        ends = []
        first_eos = next((i for i, token in enumerate(tokens) if token in self.eos_ids), None)
        if first_eos is not None:
            ends.append(first_eos + 1)
        stop_end = self._stop_string_end(tokens[: first_eos] if first_eos is not None else tokens)
        if stop_end is not None:
            ends.append(stop_end)
        finish_reason: str
        if ends:
            completion, finish_reason = tokens[: min(ends)], "stop"
        else:
            completion, finish_reason = tokens[:budget], "length"
        text = self.tokenizer.decode(completion, skip_special_tokens=False)
        return Generation(request.sample_id, list(request.prompt_ids), completion, finish_reason, text)

    def _stop_string_end(self, tokens: list[int]) -> int | None:
        """The length of the shortest prefix of `tokens` whose text holds a stop string (binary search: a longer
        prefix's text only grows), or None."""
        stops = self.sampling.stop
        if not stops or not tokens:
            return None

        def holds(length: int) -> bool:
            text = self.tokenizer.decode(tokens[:length], skip_special_tokens=False)
            return any(stop in text for stop in stops)

        if not holds(len(tokens)):
            return None
        low, high = 1, len(tokens)
        while low < high:
            middle = (low + high) // 2
            if holds(middle):
                high = middle
            else:
                low = middle + 1
        return low


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for token in source if isinstance(source, list) else [source]:
            if token not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the model defines no end-of-sequence token")
    return ids


def _batch_seed(seed: int, batch: Sequence[GenerationRequest]) -> int:
    digest = hashlib.sha256(str(seed).encode())
    for request in batch:
        digest.update(request.sample_id.encode())
        if request.attempt:
            digest.update(f"#{request.attempt}".encode())
    return int.from_bytes(digest.digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
