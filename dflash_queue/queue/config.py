"""The `[broker]` section: the Redis broker and how tasks are delivered and retried."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, field_validator, model_validator

from dflash_queue.config.sections import PositiveFloat, PositiveInt, Section
from dflash_queue.errors import ConfigError
from dflash_queue.redaction import redact

# Where the broker's password comes from, first found first: the password itself, a file holding it, then
# broker.password_file. Never from the config file, which is copied to every node.
PASSWORD_ENV = "DFQ_BROKER_PASSWORD"
PASSWORD_FILE_ENV = "DFQ_BROKER_PASSWORD_FILE"


class BrokerConfig(Section):
    url: str = ""
    """Empty: `dflash-queue run` starts a private redis-server; workers need a URL. No password here: it comes
    from DFQ_BROKER_PASSWORD, DFQ_BROKER_PASSWORD_FILE or broker.password_file."""
    username: str = ""
    """Redis ACL user to log in as (a least-rights worker user, see docs/operations.md); empty: Redis's default
    user (`requirepass`)."""
    password_file: str = ""
    """File holding the broker's password (its first line; read when connecting). DFQ_BROKER_PASSWORD, else
    DFQ_BROKER_PASSWORD_FILE, take precedence. Empty, and neither set: no password."""
    visibility_timeout_s: PositiveInt = 4 * 3600
    """Redis has no lease a running task can extend: an unacked message older than this is handed to another
    worker. It must exceed the longest task."""
    task_timeout_s: PositiveInt = 2 * 3600
    """The longest a task may take; warm shutdown waits this long (plus a margin) for a running task."""
    worker_liveness_s: Annotated[int, Field(ge=3)] = 30
    """A worker's heartbeat (a key refreshed every third of this) expires this long after the worker stops: the
    messages it held (running or reserved) are then put back on their queues by any live worker within about
    1.3 times this, instead of after visibility_timeout_s."""
    max_deliveries: PositiveInt = 3
    """A task delivered more often than this (its worker died each time: OOM-kill, segfault, SIGKILL) goes to the
    dead letters instead of taking down one more worker."""
    transient_retries: PositiveInt = 8
    """Retries of a task whose broker or storage connection failed (exponential backoff with jitter)."""
    retry_backoff_max_s: PositiveFloat = 120.0
    """Cap of the delay between retries of a task: a random delay of 1 s up to 2 s, 4 s, 8 s ... (exponential
    backoff with full jitter)."""

    @model_validator(mode="after")
    def _visibility_exceeds_longest_task(self) -> BrokerConfig:
        if self.visibility_timeout_s <= self.task_timeout_s:
            raise ValueError(
                f"visibility_timeout_s ({self.visibility_timeout_s}) must exceed task_timeout_s "
                f"({self.task_timeout_s}), or running tasks are re-delivered to other workers"
            )
        return self

    @field_validator("url")
    @classmethod
    def _redis_url_without_credentials(cls, url: str) -> str:
        if url and not url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {redact(url)!r}")
        parts = urlsplit(url)
        if parts.password is not None:
            # Not even the URL goes in the message: it holds the password.
            raise ValueError(
                f"url holds a password: it would be copied with the config file and shown wherever the URL is. "
                f"Put the password in {PASSWORD_ENV}, in a file named by {PASSWORD_FILE_ENV} or "
                "broker.password_file, and the user (if any) in broker.username"
            )
        if parts.username:
            raise ValueError(
                f"url names a user ({parts.username!r}): put it in broker.username, the password in "
                f"{PASSWORD_ENV}, {PASSWORD_FILE_ENV} or broker.password_file"
            )
        return url

    def password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The broker's password: DFQ_BROKER_PASSWORD, else the file DFQ_BROKER_PASSWORD_FILE or
        broker.password_file name (read now, its first line); None when none is set. ConfigError naming the
        file and where it was named when it cannot be read."""
        environ: Mapping[str, str] = os.environ if env is None else env
        if environ.get(PASSWORD_ENV):
            return environ[PASSWORD_ENV]
        for origin, path in ((PASSWORD_FILE_ENV, environ.get(PASSWORD_FILE_ENV, "")),
                             ("broker.password_file", self.password_file)):
            if path:
                return _read_password(path, origin)
        return None

    def password_origin(self, env: Mapping[str, str] | None = None) -> str:
        """Where `password()` comes from, for messages ("DFQ_BROKER_PASSWORD", "broker.password_file (PATH)");
        "" when no password is set."""
        environ: Mapping[str, str] = os.environ if env is None else env
        if environ.get(PASSWORD_ENV):
            return PASSWORD_ENV
        if environ.get(PASSWORD_FILE_ENV):
            return f"{PASSWORD_FILE_ENV} ({environ[PASSWORD_FILE_ENV]})"
        if self.password_file:
            return f"broker.password_file ({self.password_file})"
        return ""

    def connection_url(self, env: Mapping[str, str] | None = None) -> str:
        """`url` with the user and password put in (percent-encoded): what clients connect with. Never shown:
        display `url`, which holds neither."""
        password = self.password(env)
        if not self.url or (password is None and not self.username):
            return self.url
        parts = urlsplit(self.url)
        userinfo = quote(self.username, safe="")
        if password is not None:
            userinfo += ":" + quote(password, safe="")
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


def _read_password(path: str, origin: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"{origin}: cannot read the broker password from {path}: {reason}") from None
    lines = text.splitlines()
    password = lines[0] if lines else ""
    if not password:
        raise ConfigError(f"{origin}: the broker password file {path} is empty")
    return password
