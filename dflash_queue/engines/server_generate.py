"""Generation on running inference servers (vLLM's or SGLang's): the worker holds no model.

Each prompt goes out as the token ids the chat template rendered, and the completion comes back as the ids the
server sampled (engines/server_protocols.py), with the finish reason, the per-sample seed and every sampling
setting carried as the in-process engines carry them. Requests spread over the servers that are up and survive
their outages (engines/server_pool.py); several task threads share the one event loop, so the servers stay full
across task boundaries.

At start each server is checked to serve the target: the model name, a context at least as long as staging
admits, a probe text's token ids equal to the local tokenizer's (through its tokenize endpoint, where it has
one), replies that carry token ids, and per-request seeds honoured when sampling is random. A server that fails
is refused, saying why; the worker refuses to start when no server passes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import AutoTokenizer

from dflash_queue.engines.base import Generation, GenerationRequest
from dflash_queue.engines.config import SamplingConfig, ServerConfig
from dflash_queue.engines.loop_thread import EventLoopThread
from dflash_queue.engines.server_pool import Outage, RequestFailed, RequestRejected, Server, ServerPool
from dflash_queue.engines.server_protocols import PROTOCOLS, GenerationParams, ReplyError, ServedModel
from dflash_queue.engines.vllm_generate import request_seed
from dflash_queue.errors import ConfigError, EngineUnavailable, GenerationRejected, SampleDependentError

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
# Results of a batch that failed for some of its samples, kept for the lane's retry of the rest (poison
# isolation runs the other samples again): at most this many.
KEPT_RESULTS = 4096


@dataclass(frozen=True)
class ServedTarget:
    """What the servers must serve: the model name they answer to, the tokenizer the worker renders prompts
    with, and the context the job's sequences need (dataset.max_model_len, else the model's own)."""

    model: str
    tokenizer_path: str
    context_len: int


class ServerRejectedSample(GenerationRejected):
    """A server refused these samples' requests (over its context length, a 4xx); the message holds its words."""

    def __init__(self, message: str, sample_ids: tuple[str, ...]) -> None:
        super().__init__(message)
        self.sample_ids = sample_ids


class ServerGenerateEngine:
    name = "server"

    def __init__(
        self, settings: ServerConfig, sampling: SamplingConfig, target: ServedTarget, *, source: str = "<memory>"
    ) -> None:
        self.settings = settings
        self.sampling = sampling
        self.target = target
        self.source = source
        self.protocol = PROTOCOLS[settings.kind]
        tokenizer = AutoTokenizer.from_pretrained(target.tokenizer_path)
        self.probe_text = probe_text(tokenizer)
        self.probe_ids: list[int] = tokenizer.encode(self.probe_text, add_special_tokens=False)
        self._kept: dict[tuple, Generation] = {}
        # Request ids unique to this engine: two workers never send the same one.
        self._ids = f"dfq-{os.urandom(4).hex()}"
        self._loop = EventLoopThread("server-engine-loop")
        try:
            self._pool: ServerPool = self._loop.run(self._start(self._api_key()))
        except BaseException:
            self._loop.stop()
            raise
        self._closed = False

    def _api_key(self) -> str | None:
        try:
            return self.settings.api_key()
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc}") from None

    async def _start(self, api_key: str | None) -> ServerPool:
        pool = ServerPool(self.settings, self.protocol, self._admit, api_key)
        up = await pool.start()
        if up:
            log.info(
                "generating on %d of %d %s servers: %s", len(up), len(pool.servers), self.settings.kind,
                ", ".join(s.url for s in up),
            )
            for server in pool.servers:
                if not server.up:
                    log.error("inference server %s refused for now: %s", server.url, server.reason)
            return pool
        reasons = "\n".join(f"  {s.url}: {s.reason}" for s in pool.servers)
        await pool.close()
        raise ConfigError(
            f"{self.source}: no inference server can serve {self.target.model} (generate.server.urls):\n{reasons}"
        )

    async def _admit(self, pool: ServerPool, server: Server) -> str:
        """Why the server may not serve this job ("" when it may): the model it serves, its context, its
        tokenizer, its seeds, and a one-token generation of the probe that must come back as token ids."""

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
        params = GenerationParams(self.probe_ids, 1, 0, f"{self._ids}-probe-{server.sent}")
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

    # -- GenerateEngine --------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One generation per request, in request order. Safe to call from several threads at once."""
        if self._closed:
            raise EngineUnavailable("the inference-server engine is closed")
        if not requests:
            return []
        return self._loop.run(self._generate_all(list(requests)))

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[Generation]:
        tasks = [asyncio.create_task(self._generate_one(request)) for request in requests]
        try:
            await asyncio.wait(tasks)
        finally:
            for task in tasks:
                task.cancel()
        errors: list[tuple[GenerationRequest, BaseException]] = [
            (request, error) for request, task in zip(requests, tasks) if (error := task.exception()) is not None
        ]
        if not errors:
            return [task.result() for task in tasks]
        others = [error for _, error in errors if not isinstance(error, SampleDependentError | ServerRejectedSample)]
        if others:  # not the samples' doing (a stopping worker): that goes first
            raise others[0]
        # The lane runs the other samples again (poison isolation): their replies are kept, so that they are not
        # generated twice.
        for request, task in zip(requests, tasks):
            if not task.exception():
                self._keep(request, task.result())
        ids = tuple(request.sample_id for request, _ in errors)
        first = errors[0][1]
        message = str(first) + (f" (and {len(ids) - 1} more samples)" if len(ids) > 1 else "")
        if all(isinstance(error, ServerRejectedSample) for _, error in errors):
            raise ServerRejectedSample(message, ids)
        raise SampleDependentError(message, ids)

    async def _generate_one(self, request: GenerationRequest) -> Generation:
        kept = self._kept.pop(_key(request), None)
        if kept is not None:
            return kept
        max_tokens = request.max_tokens or self.sampling.max_tokens
        seed = request_seed(self.sampling.seed, request.sample_id, request.attempt)

        def body(request_id: str) -> dict:
            params = GenerationParams(
                list(request.prompt_ids), max_tokens, seed, f"{self._ids}-{request_id}-{request.sample_id}"
            )
            return self.protocol.generation_body(self.target.model, self.sampling, params)

        sent = GenerationParams(list(request.prompt_ids), max_tokens, seed, "")
        try:
            reply = await self._pool.request(
                self.protocol.generate_path, body, lambda answer: self.protocol.parse_generation(answer, sent)
            )
        except RequestRejected as exc:
            raise ServerRejectedSample(
                f"sample {request.sample_id}: the inference server refused the request ({exc})", (request.sample_id,)
            ) from None
        except RequestFailed as exc:
            raise SampleDependentError(
                f"sample {request.sample_id}: the inference servers could not generate it: {exc}", (request.sample_id,)
            ) from None
        return Generation(request.sample_id, list(request.prompt_ids), reply.completion_ids, reply.finish_reason,
                          reply.text)

    def _keep(self, request: GenerationRequest, generation: Generation) -> None:
        if len(self._kept) >= KEPT_RESULTS:
            self._kept.clear()
        self._kept[_key(request)] = generation

    # -- operations ------------------------------------------------------------------------------------------

    def outage(self) -> Outage | None:
        """Every server down: since when and why (for `status`); None while one is up."""
        return None if self._closed else self._pool.outage()

    def servers(self) -> list[Server]:
        """The servers as this worker sees them (up, outstanding requests, requests sent)."""
        return list(self._pool.servers)

    def begin_shutdown(self) -> None:
        """Warm shutdown: requests waiting for a server give up, so that their tasks go back to the queue."""
        if not self._closed:
            self._loop.loop.call_soon_threadsafe(self._pool.begin_shutdown)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._pool.close(), timeout=30)
        finally:
            self._loop.stop(timeout=5)


def identity_problems(
    served: ServedModel, target: ServedTarget, probe_ids: list[int], sampling: SamplingConfig
) -> list[str]:
    """Why a server with this identity cannot serve the target (empty: it can)."""
    problems = []
    if target.model not in served.names:
        problems.append(f"serves {', '.join(served.names) or 'no model'}, not {target.model} (generate.server.model)")
    if served.context_len is None:
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


def _key(request: GenerationRequest) -> tuple:
    return (request.sample_id, request.attempt, request.max_tokens, hash(tuple(request.prompt_ids)))
