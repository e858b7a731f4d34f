"""The `[flower]` section: the Flower monitor `dflash-queue flower` runs."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from dflash_queue.config.sections import PositiveInt, Section


class FlowerConfig(Section):
    address: str = "127.0.0.1"
    """Loopback by default: reach it through an SSH tunnel or a TLS proxy. Basic auth comes from the
    FLOWER_BASIC_AUTH environment variable (user:password[,user2:password2]), never from this file."""
    port: Annotated[int, Field(ge=1, le=65535)] = 5555
    """Flower's listen port."""
    max_tasks: PositiveInt = 10000
    """Tasks kept in Flower's memory, oldest dropped first: a run makes two per shard."""
    persistent: bool = False
    """Keep Flower's task history across its restarts in `db` (default: run.state_dir/flower.db)."""
    db: str = ""
    """Flower's state file when `persistent`; empty: run.state_dir/flower.db."""
    purge_offline_workers_s: Annotated[int, Field(ge=0)] = 0
    """Forget workers offline for this long (0: keep them listed)."""
