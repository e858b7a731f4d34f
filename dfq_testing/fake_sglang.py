"""A small stand-in for SGLang's HTTP server, for testing the inference-server engine's SGLang protocol here
(SGLang has no CPU build).

It follows SGLang's documented native API (docs/basic_usage/native_api and sampling_params):
  * POST /generate {"input_ids": [...], "sampling_params": {...}, "rid", "stream": false} ->
    {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": <token id or
    string>} | {"type": "length", "length": <n>}, "prompt_tokens", "completion_tokens", "cached_tokens"}};
    `output_ids` hold every generated token; without `no_stop_trim` the matched stop token is trimmed from them
    (as SGLang trims it from its output); a prompt as long as the context or longer is refused with 400 and
    `{"error": {"message": ...}}`; `max_new_tokens` is cut to what the context leaves;
  * GET /get_model_info -> {"model_path", "tokenizer_path", "is_generation", ...};
  * GET /get_server_info -> the server's arguments, among them `context_length` and
    `enable_deterministic_inference` (SGLang honours `sampling_params.sampling_seed` only with it);
  * POST /tokenize {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"};
  * GET /health -> 200.

Replies come from a backend: `VllmBackend` asks a real vLLM server for the same generation (so the fake's
replies are the tiny model's own), `ToyBackend` makes up deterministic ones without any model. Faults for the
tests: answer 500 for the next requests, refuse a token id with 400, answer 503 as if overloaded, drop the
connection mid-request, leave `output_ids` out, stop and start listening on the same port.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from dfq_testing.servers import free_port

# (output ids, finish type "stop"/"length", matched stop token) for (input ids, sampling params, max new tokens).
Backend = Callable[[list[int], dict[str, Any], int], Awaitable[tuple[list[int], str, int | None]]]


class ToyBackend:
    """Deterministic replies without a model: each token from a hash of the prompt, the seed (when sampling)
    and the position; `eos_id` ends a reply with probability ~1/`mean_length` per token."""

    def __init__(self, vocab_size: int, eos_id: int, mean_length: int = 12) -> None:
        self.vocab_size, self.eos_id, self.mean_length = vocab_size, eos_id, mean_length

    async def __call__(self, input_ids: list[int], params: dict[str, Any], max_new: int):
        seed = params.get("sampling_seed") if params.get("temperature", 1.0) > 0 else 0
        base = hashlib.sha256(repr((input_ids, seed)).encode()).digest()
        out: list[int] = []
        for position in range(max_new):
            draw = int.from_bytes(hashlib.sha256(base + position.to_bytes(4, "little")).digest()[:8], "little")
            if draw % self.mean_length == 0:
                out.append(self.eos_id)
                return out, "stop", self.eos_id
            out.append(300 + draw % (self.vocab_size - 600))
        return out, "length", None


class VllmBackend:
    """The same generation from a vLLM server's /v1/completions (sampling_seed as its seed)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    async def __call__(self, input_ids: list[int], params: dict[str, Any], max_new: int):
        top_k = params.get("top_k", -1)
        body = {
            "model": self.model,
            "prompt": input_ids,
            "max_tokens": max_new,
            "temperature": params.get("temperature", 1.0),
            "top_p": params.get("top_p", 1.0),
            "top_k": top_k if top_k > 0 else 0,
            "min_p": params.get("min_p", 0.0),
            "repetition_penalty": params.get("repetition_penalty", 1.0),
            "seed": params.get("sampling_seed"),
            "stop": params.get("stop"),
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        async with aiohttp.ClientSession() as session, session.post(self.url + "/v1/completions", json=body) as answer:
            answer.raise_for_status()
            choice = (await answer.json())["choices"][0]
        ids = choice["token_ids"]
        if choice["finish_reason"] == "length":
            return ids, "length", None
        return ids, "stop", ids[-1] if ids and choice.get("stop_reason") is None else None


@dataclass
class Faults:
    fail_next: int = 0  # answer 500 to this many /generate requests
    overloaded: bool = False  # answer 503 to every /generate request
    drop_next: int = 0  # close the connection without an answer
    refused_token: int | None = None  # a prompt holding this id is refused with 400
    omit_output_ids: bool = False
    delay_s: float = 0.0  # before answering /generate


@dataclass
class FakeSglang:
    tokenizer_path: Path
    backend: Backend
    model_path: str = "tiny-qwen3"
    context_length: int = 1024
    deterministic: bool = True
    # When set, every endpoint but /health answers 401 without `Authorization: Bearer <api_key>` (SGLang's
    # --api-key).
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    faults: Faults = field(default_factory=Faults)
    generate_requests: int = 0
    bodies: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-sglang", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def start(self) -> FakeSglang:
        self._run(self._start())
        return self

    def stop(self) -> None:
        """Stop listening (new connections are refused) and drop the open ones."""
        if self._runner is not None:
            self._run(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key and request.path != "/health":
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return _error(401, "Unauthorized")
        return await handler(request)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._authorize])
        app.add_routes([
            web.post("/generate", self._generate),
            web.get("/get_model_info", self._model_info),
            web.get("/get_server_info", self._server_info),
            web.post("/tokenize", self._tokenize),
            web.get("/health", self._health),
        ])
        # Stopping drops requests in flight at once, as a server that is killed does.
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.faults.overloaded else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "context_length": self.context_length,
            "enable_deterministic_inference": self.deterministic,
            "version": "fake",
        })

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.context_length})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generate_requests += 1
        self.bodies.append(body)
        faults = self.faults
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if faults.drop_next:
            faults.drop_next -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if faults.overloaded:
            return _error(503, "The server is overloaded")
        if faults.fail_next:
            faults.fail_next -= 1
            return _error(500, "Internal server error: the scheduler crashed")
        input_ids, params = body["input_ids"], dict(body.get("sampling_params") or {})
        if faults.refused_token is not None and faults.refused_token in input_ids:
            return _error(400, f"Token id {faults.refused_token} is not allowed here")
        if len(input_ids) >= self.context_length:
            return _error(
                400,
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).",
            )
        max_new = min(int(params.get("max_new_tokens", 128)), self.context_length - len(input_ids))
        output, finish, matched = await self.backend(input_ids, params, max_new)
        if finish == "stop" and matched is not None and not params.get("no_stop_trim", False):
            output = output[:-1]
        reply: dict[str, Any] = {
            "text": self.tokenizer.decode(output, skip_special_tokens=params.get("skip_special_tokens", True)),
            "meta_info": {
                "id": body.get("rid") or "fake",
                "finish_reason": {"type": "stop", "matched": matched} if finish == "stop"
                else {"type": "length", "length": len(output)},
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(output),
                "cached_tokens": 0,
            },
        }
        if not faults.omit_output_ids:
            reply["output_ids"] = output
        return web.json_response(reply)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
