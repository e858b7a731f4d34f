"""The generate lane's inference servers (`generate.engine = "server"`): each checked as a worker checks it at
start (the model it serves, its context, its tokenizer, token ids in its replies, seeds)."""

from __future__ import annotations

from dflash_queue.config import Config
from dflash_queue.doctor.result import Check
from dflash_queue.errors import ConfigError


def check_servers(config: Config) -> list[Check]:
    """One check per server; none when the generate lane runs its own model."""
    if config.generate.engine != "server":
        return []
    from dflash_queue.lanes.generate import build_generate_engine

    try:
        engine = build_generate_engine(config)
    except ConfigError as exc:
        return [Check.failed("servers", str(exc))]
    try:
        servers = engine.servers()  # type: ignore[attr-defined]
    finally:
        engine.close()
    model = config.served_model_name
    return [
        Check.passed("server", f"{server.url}: serves {model}, checked") if server.up
        else Check.warned("server", f"{server.url}: not used: {server.reason}")
        for server in servers
    ]
