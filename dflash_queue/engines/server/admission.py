"""What a server must show before it gets a worker's requests, at start and at every check after (engines/
server/pool.py says when): the model name, a context at least as long as staging admits, a probe text's token ids
equal to the local tokenizer's (through its tokenize endpoint, where it has one: without one the worker warns once),
a one-token generation with the job's sampling settings that comes back as token ids, per-request seeds when
sampling is random, and the run's weights (engines/server/fingerprint.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_queue.engines.config import SamplingConfig
from dflash_queue.engines.server.fingerprint import PROBE_TOKENS, WeightsFingerprint, WeightsReference
from dflash_queue.engines.server.pool import RequestRejected
from dflash_queue.engines.server.protocols import GenerationParams, ReplyError, ServedModel, ServerProtocol

if TYPE_CHECKING:
    from dflash_queue.engines.server.pool import Server, ServerPool

log = logging.getLogger(__name__)

# The identity probe: a conversation through the target's own chat template (its special tokens, the thinking
# markers), with text whose tokenisation differs between vocabularies.
PROBE_MESSAGES = (
    {"role": "system", "content": "You check that a server runs the right tokenizer."},
    {
        "role": "user",
        "content": "Probe 0: 12 345 6789 -1.5e-3, ünïcödé ÄÖÜß, 漢字かなカナ, emoji 🙂🚀, tabs\tand  double  spaces,\n"
        "new lines\n\n\nand code `x = {'a': [1, 2]}`; http://example.com/a?b=c",
    },
)
NO_TOKENIZE = "its tokenizer is not checked: it has no tokenize endpoint (/tokenize)"


@dataclass(frozen=True)
class ServedTarget:
    """What the servers must serve: the model name they answer to, the tokenizer the worker renders prompts
    with, and the context the job's sequences need (dataset.max_model_len, else the model's own)."""

    model: str
    tokenizer_path: str
    context_len: int


class Admission:
    """The check: `await admission(pool, server)` is why the server may not serve this job ("" when it may)."""

    def __init__(
        self, protocol: ServerProtocol, target: ServedTarget, sampling: SamplingConfig, tokenizer,
        weights: WeightsReference, request_ids: str,
    ) -> None:
        self.protocol = protocol
        self.target = target
        self.sampling = sampling
        self.weights = weights
        self.request_ids = request_ids
        self.probe_text = probe_text(tokenizer)
        self.probe_ids: list[int] = tokenizer.encode(self.probe_text, add_special_tokens=False)
        # The weights probe continues plain text: a chat template's first reply tokens are near-certain for any
        # checkpoint of a model, and tell checkpoints apart less.
        self.weights_prompt: list[int] = tokenizer.encode(PROBE_MESSAGES[1]["content"], add_special_tokens=False)
        self._warned_untokenized: set[str] = set()

    async def __call__(self, pool: ServerPool, server: Server) -> str:
        async def fetch(method: str, path: str, body: object) -> tuple[int, object]:
            status, answer = await pool.call(server, method, path, body, timeout=pool.settings.connect_timeout_s * 6)
            if status in (401, 403):
                pool.classify(status, answer)  # raises ServerDown: the key is refused
            return status, answer

        try:
            served = await self.protocol.served_model(fetch, self.target.model, self.probe_text)
        except ReplyError as exc:
            return str(exc)
        problems = identity_problems(served, self.target, self.probe_ids, self.sampling)
        if problems:
            return "; ".join(problems)
        server.unchecked = (NO_TOKENIZE,) if served.probe_ids is None else ()
        if served.probe_ids is None and server.url not in self._warned_untokenized:
            self._warned_untokenized.add(server.url)
            log.warning(
                "inference server %s has no tokenize endpoint (/tokenize): its tokenizer cannot be checked against "
                "the local one (model.tokenizer); prompts go to it as token ids the local tokenizer made, and the "
                "weights probe still compares its replies", server.url,
            )
        problem = await self._generates(pool, server)
        if problem:
            return problem
        return await self._runs_the_weights(pool, server)

    async def _generates(self, pool: ServerPool, server: Server) -> str:
        """A one-token generation of the probe with the job's sampling settings must come back as token ids."""
        params = GenerationParams(self.probe_ids, 1, 0, f"{self.request_ids}-probe-{server.sent}")
        status, body = await pool.call(
            server, "POST", self.protocol.generate_path,
            self.protocol.generation_body(self.target.model, self.sampling, params),
        )
        if status != 200:
            try:
                return f"refuses a generation with these sampling settings: {pool.classify(status, body)}"
            except RequestRejected as exc:
                return f"refuses a generation with these sampling settings: {exc}"
        try:
            self.protocol.parse_generation(body, params)
        except ReplyError as exc:
            return f"cannot serve this job: {exc}"
        return ""

    async def _runs_the_weights(self, pool: ServerPool, server: Server) -> str:
        params = GenerationParams(self.weights_prompt, PROBE_TOKENS, 0, f"{self.request_ids}-weights-{server.sent}")
        status, body = await pool.call(
            server, "POST", self.protocol.generate_path, self.protocol.fingerprint_body(self.target.model, params)
        )
        if status != 200:
            try:
                return f"refuses the weights probe (greedy, with logprobs): {pool.classify(status, body)}"
            except RequestRejected as exc:
                return f"refuses the weights probe (greedy, with logprobs): {exc}"
        try:
            tokens = self.protocol.parse_fingerprint(body, params)
        except ReplyError as exc:
            return f"cannot be fingerprinted: {exc}"
        problem, server.weights_apart = await self.weights.problem(
            WeightsFingerprint(tuple(self.weights_prompt), tuple(tokens), server.url)
        )
        return problem


def identity_problems(
    served: ServedModel, target: ServedTarget, probe_ids: list[int], sampling: SamplingConfig
) -> list[str]:
    """Why a server with this identity cannot serve the target (empty: it can)."""
    problems = []
    if target.model not in served.names:
        problems.append(f"serves {', '.join(served.names) or 'no model'}, not {target.model} (generate.server.model)")
    # A server answers for its context under the name it serves: asked under another, it says nothing of it.
    elif served.context_len is None:
        problems.append("does not say its context length (max_model_len from /v1/models or /tokenize)")
    elif served.context_len < target.context_len:
        problems.append(
            f"its context is {served.context_len} tokens, shorter than the {target.context_len} the job's sequences "
            "may take (dataset.max_model_len, else the model's own): longer samples would be refused"
        )
    if served.probe_ids is not None and served.probe_ids != probe_ids:
        at = next((i for i, (a, b) in enumerate(zip(served.probe_ids, probe_ids)) if a != b),
                  min(len(served.probe_ids), len(probe_ids)))
        problems.append(
            f"its tokenizer gives other token ids than the local one (model.tokenizer) for the probe text: from "
            f"token {at} on, server {served.probe_ids[at:at + 4]}, local {probe_ids[at:at + 4]}"
        )
    if sampling.temperature > 0 and not served.seeded:
        problems.append(
            "it ignores per-request seeds, so a sample would not get the same reply twice (SGLang honours "
            "sampling_seed only when started with --enable-deterministic-inference); or set "
            "generate.sampling.temperature = 0"
        )
    return problems


def probe_text(tokenizer) -> str:
    """The identity probe's text: PROBE_MESSAGES through the chat template (thinking on), or their text alone
    for a tokenizer without a template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            list(PROBE_MESSAGES), tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
    return "\n".join(m["content"] for m in PROBE_MESSAGES)
