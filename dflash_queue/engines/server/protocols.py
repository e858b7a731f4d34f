"""What each kind of inference server is sent for one generation, what it answers, and how it says which model it
serves.

Token ids travel both ways: the prompt goes out as the ids the chat template rendered, and the completion comes
back as the ids the server sampled (never re-tokenised text). Every sampling setting the project carries is sent
explicitly, so a server's own defaults (a model's generation_config.json) never fill in for one.

* vllm: vLLM's OpenAI-compatible server. POST /v1/completions with a token-id `prompt` and
  `"return_token_ids": true`; each choice answers `token_ids` (the completion) and `prompt_token_ids` (checked
  against what was sent). GET /v1/models lists the served names with `max_model_len`; POST /tokenize tokenises
  the identity probe. Per-request `seed`, `top_k`, `min_p` and `repetition_penalty` are vLLM's sampling
  parameters, as the in-process engine sets them.
* openai: any server answering /v1/completions in vLLM's shape (token ids included). Only the OpenAI API's
  sampling keys are sent (the config refuses the others unless neutral); /tokenize is used when there is one.
* sglang: SGLang's native API. POST /generate with `input_ids` and `sampling_params`; the reply holds
  `output_ids` and `meta_info.finish_reason` ({"type": "stop" | "length" | "abort", ...}). `no_stop_trim` keeps
  the matched stop token in `output_ids`, as vLLM keeps it. GET /get_model_info gives `model_path`, GET
  /get_server_info the server's arguments (`enable_deterministic_inference`: SGLang honours a request's
  `sampling_seed` only then), POST /tokenize (`{"prompt", "add_special_tokens"}` -> `{"tokens", "max_model_len"}`).

The weights probe (engines/server/fingerprint.py) is a greedy generation asking for logprobs: vLLM's and OpenAI's
`logprobs: 2` (`choices[0].logprobs.token_logprobs` and `.top_logprobs`; vLLM names the tokens by id with
`return_tokens_as_token_ids`), SGLang's `return_logprob` with `top_logprobs_num: 2` (`meta_info.output_token_logprobs`
and `.output_top_logprobs`, entries `[logprob, token id, text]`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dflash_queue.engines.config import SamplingConfig, ServerKind
from dflash_queue.engines.server.fingerprint import PROBE_TOP_LOGPROBS, ProbeToken

# (HTTP status, decoded JSON body or None) of one call to a server.
Fetch = Callable[[str, str, Any], Awaitable[tuple[int, Any]]]


class ReplyError(Exception):
    """A server's reply to a generation lacks what the lane needs (the message names it), or says the request
    ended some other way than stopping or running out of budget."""


@dataclass(frozen=True)
class Reply:
    completion_ids: list[int]
    finish_reason: str  # "stop" or "length"
    text: str


@dataclass(frozen=True)
class ServedModel:
    """What a server says it serves."""

    names: tuple[str, ...]
    # Its context length (prompt and reply together); None when it does not say.
    context_len: int | None
    # The probe's token ids as its tokenizer makes them; None when it has no tokenize endpoint.
    probe_ids: list[int] | None
    # Whether it samples each request with the seed the request carries.
    seeded: bool


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    request_id: str


class ServerProtocol:
    kind: ServerKind
    generate_path: str
    # A cheap endpoint answering 200 while the server can serve.
    health_path: str

    def generation_body(self, model: str, sampling: SamplingConfig, params: GenerationParams) -> dict[str, Any]:
        raise NotImplementedError

    def parse_generation(self, body: Any, params: GenerationParams) -> Reply:
        raise NotImplementedError

    async def served_model(self, fetch: Fetch, model: str, probe: str) -> ServedModel:
        raise NotImplementedError

    def fingerprint_body(self, model: str, params: GenerationParams) -> dict[str, Any]:
        """The weights probe: a greedy generation of `params` asking for each token's logprob and the runner-up's."""
        raise NotImplementedError

    def parse_fingerprint(self, body: Any, params: GenerationParams) -> list[ProbeToken]:
        raise NotImplementedError


# The weights probe samples greedily, whatever the job samples with.
GREEDY = SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, stop=())


def _logprob(value: Any, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ReplyError(f"the reply to the weights probe has no logprobs in {what}")
    return float(value)


def _runner_up(values: list[float]) -> float | None:
    """The second largest of a position's top logprobs (the largest is the greedy token's)."""
    return sorted(values, reverse=True)[1] if len(values) > 1 else None


def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(token, int) and not isinstance(token, bool) for token in value):
        raise ReplyError(f"the reply has no token ids in {what}")
    return value


async def _tokenize(fetch: Fetch, model: str, probe: str) -> tuple[list[int] | None, int | None]:
    """(the probe's ids, the context length the endpoint reports) from POST /tokenize; (None, None) without one."""
    status, body = await fetch("POST", "/tokenize", {"model": model, "prompt": probe, "add_special_tokens": False})
    if status == 404:
        return None, None
    if status != 200 or not isinstance(body, dict):
        raise ReplyError(f"POST /tokenize answered {status}: {server_words(body)}")
    context = body.get("max_model_len")
    return _ids(body.get("tokens"), "/tokenize's tokens"), context if isinstance(context, int) else None


def server_words(body: Any) -> str:
    """What a server said in an error reply, in its own words."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:1000]


class OpenAICompletions(ServerProtocol):
    """/v1/completions in vLLM's shape, with only the OpenAI API's sampling keys."""

    kind: ServerKind = "openai"
    generate_path = "/v1/completions"
    health_path = "/v1/models"

    def generation_body(self, model: str, sampling: SamplingConfig, params: GenerationParams) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": params.prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": params.seed,
            "stop": list(sampling.stop) or None,
            "n": 1,
            "stream": False,
            "return_token_ids": True,
        }

    def parse_generation(self, body: Any, params: GenerationParams) -> Reply:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ReplyError("the reply has no single choice")
        choice = choices[0]
        completion = _ids(choice.get("token_ids"), "choices[0].token_ids (vLLM's return_token_ids)")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != params.prompt_ids:
            raise ReplyError("the reply's prompt_token_ids differ from the prompt ids sent")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise ReplyError(f"the generation ended with finish_reason={reason!r}")
        return Reply(completion, reason, str(choice.get("text") or ""))

    async def served_model(self, fetch: Fetch, model: str, probe: str) -> ServedModel:
        status, body = await fetch("GET", "/v1/models", None)
        data = body.get("data") if isinstance(body, dict) else None
        if status != 200 or not isinstance(data, list):
            raise ReplyError(f"GET /v1/models answered {status}: {server_words(body)}")
        names = tuple(str(entry.get("id")) for entry in data if isinstance(entry, dict))
        entry = next((e for e in data if isinstance(e, dict) and e.get("id") == model), {})
        context = entry.get("max_model_len")
        probe_ids, tokenize_context = await _tokenize(fetch, model, probe)
        return ServedModel(
            names,
            context if isinstance(context, int) else tokenize_context,
            probe_ids,
            seeded=True,
        )


    def fingerprint_body(self, model: str, params: GenerationParams) -> dict[str, Any]:
        return {**self.generation_body(model, GREEDY, params), "logprobs": PROBE_TOP_LOGPROBS}

    def parse_fingerprint(self, body: Any, params: GenerationParams) -> list[ProbeToken]:
        ids = self.parse_generation(body, params).completion_ids
        logprobs = body["choices"][0].get("logprobs")
        if not isinstance(logprobs, dict):
            raise ReplyError("the reply to the weights probe has no logprobs (choices[0].logprobs)")
        chosen, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
        if not isinstance(chosen, list) or not isinstance(tops, list) or not len(chosen) == len(tops) == len(ids):
            raise ReplyError("the reply to the weights probe has no logprob for each token (choices[0].logprobs)")
        tokens = []
        for position, (token_id, logprob, top) in enumerate(zip(ids, chosen, tops)):
            where = f"choices[0].logprobs at token {position}"
            values = [_logprob(v, where) for v in top.values()] if isinstance(top, dict) else []
            tokens.append(ProbeToken(token_id, _logprob(logprob, where), _runner_up(values)))
        return tokens


class VllmCompletions(OpenAICompletions):
    """vLLM's OpenAI-compatible server: every sampling parameter the in-process vLLM engine sets."""

    kind: ServerKind = "vllm"
    health_path = "/health"

    def generation_body(self, model: str, sampling: SamplingConfig, params: GenerationParams) -> dict[str, Any]:
        return {
            **super().generation_body(model, sampling, params),
            "top_k": sampling.top_k if sampling.top_k > 0 else 0,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            # Keep <think> and friends in the decoded text, as the other engines do.
            "skip_special_tokens": False,
            "request_id": params.request_id,
        }

    def fingerprint_body(self, model: str, params: GenerationParams) -> dict[str, Any]:
        # Tokens named by id: two tokens of one text stay two entries of top_logprobs.
        return {**super().fingerprint_body(model, params), "return_tokens_as_token_ids": True}


class SglangGenerate(ServerProtocol):
    """SGLang's native /generate."""

    kind: ServerKind = "sglang"
    generate_path = "/generate"
    health_path = "/health"

    def generation_body(self, model: str, sampling: SamplingConfig, params: GenerationParams) -> dict[str, Any]:
        sampling_params: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "skip_special_tokens": False,
            # Keep the matched stop token in output_ids: it is part of what the model generated.
            "no_stop_trim": True,
            "sampling_seed": params.seed,
            "n": 1,
        }
        if sampling.stop:
            sampling_params["stop"] = list(sampling.stop)
        return {"input_ids": params.prompt_ids, "sampling_params": sampling_params, "rid": params.request_id,
                "stream": False}

    def parse_generation(self, body: Any, params: GenerationParams) -> Reply:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict):
            raise ReplyError("the reply is not one generation")
        completion = _ids(body.get("output_ids"), "output_ids")
        meta = body.get("meta_info")
        if not isinstance(meta, dict):
            raise ReplyError("the reply has no meta_info")
        prompt_tokens = meta.get("prompt_tokens")
        if prompt_tokens is not None and prompt_tokens != len(params.prompt_ids):
            raise ReplyError(
                f"the reply counts {prompt_tokens} prompt tokens, {len(params.prompt_ids)} were sent"
            )
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        if reason not in ("stop", "length"):
            detail = f" ({finish.get('message')})" if isinstance(finish, dict) and finish.get("message") else ""
            raise ReplyError(f"the generation ended with finish_reason={reason!r}{detail}")
        return Reply(completion, reason, str(body.get("text") or ""))

    def fingerprint_body(self, model: str, params: GenerationParams) -> dict[str, Any]:
        return {**self.generation_body(model, GREEDY, params), "return_logprob": True,
                "top_logprobs_num": PROBE_TOP_LOGPROBS, "logprob_start_len": -1}

    def parse_fingerprint(self, body: Any, params: GenerationParams) -> list[ProbeToken]:
        ids = self.parse_generation(body, params).completion_ids
        meta = (body[0] if isinstance(body, list) else body)["meta_info"]
        chosen, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if not isinstance(chosen, list) or not isinstance(tops, list) or not len(chosen) == len(tops) == len(ids):
            raise ReplyError("the reply to the weights probe has no logprob for each token "
                             "(meta_info.output_token_logprobs, output_top_logprobs)")
        tokens = []
        for position, (token_id, entry, top) in enumerate(zip(ids, chosen, tops)):
            where = f"meta_info.output_token_logprobs at token {position}"
            if not isinstance(entry, list) or not entry or not isinstance(top, list):
                raise ReplyError(f"the reply to the weights probe has no logprobs in {where}")
            values = [_logprob(e[0], where) for e in top if isinstance(e, list) and e]
            tokens.append(ProbeToken(token_id, _logprob(entry[0], where), _runner_up(values)))
        return tokens

    async def served_model(self, fetch: Fetch, model: str, probe: str) -> ServedModel:
        status, info = await fetch("GET", "/get_model_info", None)
        if status != 200 or not isinstance(info, dict):
            raise ReplyError(f"GET /get_model_info answered {status}: {server_words(info)}")
        names = tuple(str(info[key]) for key in ("model_path", "served_model_name") if info.get(key))
        status, server = await fetch("GET", "/get_server_info", None)
        if status != 200 or not isinstance(server, dict):
            raise ReplyError(f"GET /get_server_info answered {status}: {server_words(server)}")
        probe_ids, context = await _tokenize(fetch, model, probe)
        configured = server.get("context_length")
        return ServedModel(
            names,
            context if context is not None else configured if isinstance(configured, int) else None,
            probe_ids,
            seeded=bool(server.get("enable_deterministic_inference")),
        )


PROTOCOLS: dict[str, ServerProtocol] = {p.kind: p for p in (VllmCompletions(), OpenAICompletions(), SglangGenerate())}
