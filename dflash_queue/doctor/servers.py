"""The generate lane's inference servers (`generate.engine = "server"`): each checked as a worker checks it at
start (the model it serves, its context, its tokenizer, token ids in its replies, seeds, its weights: the weights
probe's fingerprint against the first server's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_queue.doctor.result import Check
from dflash_queue.engines.config import GenerateConfig
from dflash_queue.errors import ConfigError


def check_servers(generate: GenerateConfig, model: str, build_engine: Callable[[], Any]) -> list[Check]:
    """One check per server, each asked to serve `model` by the engine `build_engine` builds as a worker does; none
    when the generate lane runs its own model. A server that passes but whose tokenizer could not be checked (no
    tokenize endpoint) is a warning."""
    if generate.engine != "server":
        return []
    try:
        engine = build_engine()
    except ConfigError as exc:
        return [Check.failed("servers", str(exc))]
    try:
        servers = engine.servers()
    finally:
        engine.close()
    return [_check(server, model) for server in servers]


def _check(server: Any, model: str) -> Check:
    if not server.up:
        return Check.warned("server", f"{server.url}: not used: {server.reason}")
    weights = "" if server.weights_apart is None else f", weights within {server.weights_apart:.3g} nats of the first's"
    detail = f"{server.url}: serves {model}, checked{weights}"
    if server.unchecked:
        return Check.warned("server", f"{detail}; but {'; '.join(server.unchecked)}")
    return Check.passed("server", detail)
