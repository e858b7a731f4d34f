"""Generation on running inference servers (vLLM's or SGLang's): the worker holds no model.

Each prompt goes out as the token ids the chat template rendered, and the completion comes back as the ids the
server sampled (engines/server/protocols.py), with the finish reason, the per-sample seed and every sampling
setting carried as the in-process engines carry them. Requests spread over the servers that are up and survive
their outages (engines/server/pool.py); several task threads share the one event loop, so the servers stay full
across task boundaries.

At start each server is checked to serve the target (engines/server/admission.py): the model name, a context at
least as long as staging admits, a probe text's token ids equal to the local tokenizer's (through its tokenize
endpoint, where it has one), replies that carry token ids, per-request seeds honoured when sampling is random, and
the run's weights (the weights probe's fingerprint, recorded with the run by the first worker that sees one). A
server that fails is refused, saying why; the worker refuses to start when no server passes. The same check runs
again after an outage, after a broken connection and every `recheck_interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

from transformers import AutoTokenizer

from dflash_queue.engines.base import Generation, GenerationRequest, request_seed
from dflash_queue.engines.config import SamplingConfig, ServerConfig
from dflash_queue.engines.loop_thread import EventLoopThread
from dflash_queue.engines.server.admission import Admission, ServedTarget
from dflash_queue.engines.server.fingerprint import FingerprintRecord, WeightsReference
from dflash_queue.engines.server.pool import Outage, RequestFailed, RequestRejected, Server, ServerPool
from dflash_queue.engines.server.protocols import PROTOCOLS, GenerationParams
from dflash_queue.errors import ConfigError, EngineUnavailable, GenerationRejected, SampleDependentError

log = logging.getLogger(__name__)

# Results of a batch that failed for some of its samples, kept for the lane's retry of the rest (poison
# isolation runs the other samples again): at most this many.
KEPT_RESULTS = 4096


class ServerRejectedSample(GenerationRejected):
    """A server refused these samples' requests (over its context length, a 4xx); the message holds its words."""

    def __init__(self, message: str, sample_ids: tuple[str, ...]) -> None:
        super().__init__(message)
        self.sample_ids = sample_ids


class ServerGenerateEngine:
    name = "server"

    def __init__(
        self, settings: ServerConfig, sampling: SamplingConfig, target: ServedTarget, *, source: str = "<memory>",
        served_weights: FingerprintRecord | None = None,
    ) -> None:
        """`served_weights`: where the run records its servers' weights fingerprint (the first this engine sees,
        unless one is recorded); without it, the first server's is the one the others must match."""
        self.settings = settings
        self.sampling = sampling
        self.target = target
        self.source = source
        self.protocol = PROTOCOLS[settings.kind]
        self._kept: dict[tuple, Generation] = {}
        # Request ids unique to this engine: two workers never send the same one.
        self._ids = f"dfq-{os.urandom(4).hex()}"
        self.weights = WeightsReference(served_weights, settings.fingerprint_tolerance)
        self.admission = Admission(
            self.protocol, target, sampling, AutoTokenizer.from_pretrained(target.tokenizer_path), self.weights,
            self._ids,
        )
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
        pool = ServerPool(self.settings, self.protocol, self.admission, api_key)
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
        await pool.close()
        refused = f"{self.source}: no inference server can serve {self.target.model} (generate.server.urls)"
        if len(pool.servers) == 1:  # one line, whole where only an error's first line is shown (a run's summary)
            raise ConfigError(f"{refused}: {pool.servers[0].url}: {pool.servers[0].reason}")
        raise ConfigError(refused + "".join(f"\n  {s.url}: {s.reason}" for s in pool.servers))

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


def _key(request: GenerationRequest) -> tuple:
    return (request.sample_id, request.attempt, request.max_tokens, hash(tuple(request.prompt_ids)))
