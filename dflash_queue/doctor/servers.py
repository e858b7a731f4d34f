"""The generate lane's inference servers (`generate.engine = "server"`): each checked as a worker checks it at
start (the model it serves, its context, its tokenizer, token ids in its replies, seeds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_queue.doctor.result import Check
from dflash_queue.engines.config import GenerateConfig
from dflash_queue.errors import ConfigError


def check_servers(generate: GenerateConfig, model: str, build_engine: Callable[[], Any]) -> list[Check]:
    """One check per server, each asked to serve `model` by the engine `build_engine` builds as a worker does; none
    when the generate lane runs its own model."""
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
    return [
        Check.passed("server", f"{server.url}: serves {model}, checked") if server.up
        else Check.warned("server", f"{server.url}: not used: {server.reason}")
        for server in servers
    ]
