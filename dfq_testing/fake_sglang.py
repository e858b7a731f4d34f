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
  * POST /tokenize {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"} (left out with
    `tokenize=False`: 404, as a server without the endpoint);
  * GET /health -> 200;
  * with `"return_logprob": true` and `"top_logprobs_num": k`, `meta_info` also holds `output_token_logprobs`
    (`[logprob, token id, null]` per generated token) and `output_top_logprobs` (the k most likely, each
    `[logprob, token id, null]`, per generated token).

Replies come from a backend: `VllmBackend` asks a real vLLM server for the same generation (so the fake's
replies are the tiny model's own), `ToyBackend` makes up deterministic ones without any model (its `weights`
name stands for a checkpoint: another name, other tokens and logprobs). Faults for the tests: answer 500 for the
next requests, refuse a token id with 400, answer 503 as if overloaded, drop the connection mid-request, leave
`output_ids` out, stop and start listening on the same port.

`python -m dfq_testing.fake_sglang` runs it as a server process of its own on a ToyBackend
(dfq_testing/fake_sglang_process.py starts and kills one): faults are set through `POST /fake/faults`, and
`POST /fake/weights` changes its checkpoint in place (a balancer routing to another replica from then on).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from dfq_testing.servers import free_port


@dataclass
class Generated:
    ids: list[int]
    finish: str  # "stop" or "length"
    matched: int | None  # the stop token that ended it
    # Per generated token: its logprob, and the most likely tokens' (logprob, id), most likely first.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


# What a backend generates for (input ids, sampling params, max new tokens, top logprobs wanted per token).
Backend = Callable[[list[int], dict[str, Any], int, int], Awaitable[Generated]]


class ToyBackend:
    """Deterministic replies without a model: each token from a hash of the checkpoint's name (`weights`), the
    prompt, the seed (when sampling) and the position; `eos_id` ends a reply with probability ~1/`mean_length`
    per token. Each token is the most likely, with a made-up logprob (and the runner-up's, below it); `noise`
    moves every logprob by up to that much, afresh for each request (batch and kernel noise between identical
    servers), and `logprob_shift` moves them all by that much (a checkpoint trained a little further: the same
    greedy tokens, other logprobs)."""

    def __init__(self, vocab_size: int, eos_id: int, mean_length: int = 12, *, weights: str = "",
                 noise: float = 0.0, logprob_shift: float = 0.0) -> None:
        self.vocab_size, self.eos_id, self.mean_length = vocab_size, eos_id, mean_length
        self.weights, self.noise, self.logprob_shift = weights, noise, logprob_shift

    async def __call__(self, input_ids: list[int], params: dict[str, Any], max_new: int, top: int = 0) -> Generated:
        seed = params.get("sampling_seed") if params.get("temperature", 1.0) > 0 else 0
        base = hashlib.sha256(repr((self.weights, input_ids, seed) if self.weights else (input_ids, seed)).encode())
        out = Generated([], "length", None)
        for position in range(max_new):
            draw = int.from_bytes(hashlib.sha256(base.digest() + position.to_bytes(4, "little")).digest()[:8], "little")
            token = self.eos_id if draw % self.mean_length == 0 else 300 + draw % (self.vocab_size - 600)
            out.ids.append(token)
            logprob = -0.5 - (draw >> 16) % 1000 / 500 + self.logprob_shift + random.uniform(-self.noise, self.noise)
            runner_up = logprob - 0.1 - (draw >> 32) % 100 / 50 + random.uniform(-self.noise, self.noise)
            out.logprobs.append(logprob)
            out.top_logprobs.append([(logprob, token), (runner_up, 300 + (token + 1) % (self.vocab_size - 600))][:top])
            if token == self.eos_id:
                out.finish, out.matched = "stop", self.eos_id
                break
        return out


class VllmBackend:
    """The same generation from a vLLM server's /v1/completions (sampling_seed as its seed)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    async def __call__(self, input_ids: list[int], params: dict[str, Any], max_new: int, top: int = 0) -> Generated:
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
        if top:
            body |= {"logprobs": top, "return_tokens_as_token_ids": True}
        async with aiohttp.ClientSession() as session, session.post(self.url + "/v1/completions", json=body) as answer:
            answer.raise_for_status()
            choice = (await answer.json())["choices"][0]
        ids = choice["token_ids"]
        if choice["finish_reason"] == "length":
            out = Generated(ids, "length", None)
        else:
            out = Generated(ids, "stop", ids[-1] if ids and choice.get("stop_reason") is None else None)
        if top:
            logprobs = choice["logprobs"]
            out.logprobs = list(logprobs["token_logprobs"])
            out.top_logprobs = [
                sorted(((lp, int(name.removeprefix("token_id:"))) for name, lp in entry.items()), reverse=True)
                for entry in logprobs["top_logprobs"]
            ]
        return out


@dataclass
class Faults:
    fail_next: int = 0  # answer 500 to this many /generate requests
    # Answer 500 to this many /generate requests for more than 8 new tokens (the engine's checks ask for at most 8):
    # an engine that fails only on longer generations.
    fail_next_long: int = 0
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
    tokenize: bool = True
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
            web.get("/health", self._health),
            web.post("/fake/faults", self._set_faults),
            web.post("/fake/weights", self._set_weights),
            web.get("/fake/stats", self._stats),
        ])
        if self.tokenize:
            app.add_routes([web.post("/tokenize", self._tokenize)])
        # Stopping drops requests in flight at once, as a server that is killed does.
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def _set_faults(self, request: web.Request) -> web.Response:
        for name, value in (await request.json()).items():
            if not hasattr(self.faults, name):
                return _error(400, f"no fault {name!r}")
            setattr(self.faults, name, value)
        return web.json_response({})

    async def _set_weights(self, request: web.Request) -> web.Response:
        """Another checkpoint from now on (a balancer that now routes to a replica with other weights)."""
        if not isinstance(self.backend, ToyBackend):
            return _error(400, "only a ToyBackend's weights can be changed")
        self.backend.weights = (await request.json())["weights"]
        return web.json_response({})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"generate_requests": self.generate_requests})

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
        if faults.fail_next_long and int((body.get("sampling_params") or {}).get("max_new_tokens", 128)) > 8:
            faults.fail_next_long -= 1
            return _error(500, "Internal server error: out of KV cache")
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
        top = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0
        generated = await self.backend(input_ids, params, max_new, top)
        output, finish, matched = generated.ids, generated.finish, generated.matched
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
        if body.get("return_logprob"):
            kept = len(output)
            reply["meta_info"]["output_token_logprobs"] = [
                [logprob, token, None] for logprob, token in zip(generated.logprobs[:kept], output)
            ]
            reply["meta_info"]["output_top_logprobs"] = [
                [[logprob, token, None] for logprob, token in entry] for entry in generated.top_logprobs[:kept]
            ]
        return web.json_response(reply)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def main(argv: list[str] | None = None) -> None:
    """`python -m dfq_testing.fake_sglang --tokenizer PATH --port N ...`: the fake as a server process of its own,
    on a ToyBackend; faults set through `POST /fake/faults` (Faults' fields), other weights from then on through
    `POST /fake/weights`, counts at `GET /fake/stats`."""
    import argparse
    import signal

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m dfq_testing.fake_sglang")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default="tiny-qwen3")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--weights", default="", help="the checkpoint's name: another one, other replies")
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--logprob-shift", type=float, default=0.0)
    parser.add_argument("--no-tokenize", action="store_true", help="no /tokenize endpoint")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    backend = ToyBackend(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"), weights=args.weights,
                         noise=args.noise, logprob_shift=args.logprob_shift)
    fake = FakeSglang(args.tokenizer, backend, model_path=args.model_path, context_length=args.context_length,
                      tokenize=not args.no_tokenize, port=args.port).start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print(f"fake SGLang server on {fake.url} (weights {args.weights!r})", flush=True)
    stopped.wait()
    fake.close()


if __name__ == "__main__":
    main()
