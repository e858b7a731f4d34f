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
from dflash_queue.runstate.redis_connect import SENTINEL_SCHEME, SentinelTarget, is_sentinel_url

# Where the broker's password comes from, first found first: the password itself, a file holding it, then
# broker.password_file. Never from the config file, which is copied to every node.
PASSWORD_ENV = "DFQ_BROKER_PASSWORD"
PASSWORD_FILE_ENV = "DFQ_BROKER_PASSWORD_FILE"
# The sentinels' own password (Redis Sentinel's `requirepass`, which may differ from the primary's), the same way.
SENTINEL_PASSWORD_ENV = "DFQ_SENTINEL_PASSWORD"
SENTINEL_PASSWORD_FILE_ENV = "DFQ_SENTINEL_PASSWORD_FILE"


class BrokerConfig(Section):
    url: str = ""
    """Empty: `dflash-queue run` starts a private redis-server; workers need a URL. No password here: it comes
    from DFQ_BROKER_PASSWORD, DFQ_BROKER_PASSWORD_FILE or broker.password_file. Redis Sentinel (a broker that
    survives losing its machine): `sentinel://HOST:PORT;sentinel://HOST:PORT;.../DB`, every sentinel's address,
    with broker.sentinel_master (see docs/reliability.md, Redis Sentinel)."""
    sentinel_master: str = ""
    """With a `sentinel://` url: the name the sentinels monitor the primary under (`sentinel monitor NAME ...`).
    The sentinels' own password, if they have one, comes from DFQ_SENTINEL_PASSWORD or the file
    DFQ_SENTINEL_PASSWORD_FILE names; the primary's and replicas' from the broker's password settings."""
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

    @model_validator(mode="after")
    def _sentinel_master_with_sentinel_url(self) -> BrokerConfig:
        if is_sentinel_url(self.url) and not self.sentinel_master:
            raise ValueError(
                "a sentinel:// url needs sentinel_master: the name the sentinels monitor the primary under "
                "(`sentinel monitor NAME HOST PORT QUORUM` in their config)"
            )
        if self.sentinel_master and not is_sentinel_url(self.url):
            raise ValueError(
                f"sentinel_master ({self.sentinel_master!r}) is set but url is not a sentinel:// URL: list the "
                "sentinels' addresses as sentinel://HOST:PORT;sentinel://HOST:PORT/DB"
            )
        return self

    @field_validator("url")
    @classmethod
    def _redis_url_without_credentials(cls, url: str) -> str:
        if is_sentinel_url(url):
            for part in url.split(";"):
                _check_sentinel_address(part)
            return url
        if url and not url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            raise ValueError(
                f"url must be a redis:// or rediss:// URL, or sentinel://HOST:PORT;sentinel://HOST:PORT/DB for "
                f"Redis Sentinel, got {redact(url)!r}"
            )
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

    @property
    def uses_sentinel(self) -> bool:
        return is_sentinel_url(self.url)

    def sentinel_password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The sentinels' own password: DFQ_SENTINEL_PASSWORD, else the file DFQ_SENTINEL_PASSWORD_FILE names
        (read now, its first line); None when neither is set."""
        environ: Mapping[str, str] = os.environ if env is None else env
        if environ.get(SENTINEL_PASSWORD_ENV):
            return environ[SENTINEL_PASSWORD_ENV]
        path = environ.get(SENTINEL_PASSWORD_FILE_ENV, "")
        return _read_password(path, SENTINEL_PASSWORD_FILE_ENV, "sentinels'") if path else None

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
        display `url`, which holds neither. A Sentinel url also gets the master's name and the sentinels'
        password (dflash_queue.runstate.redis_connect reads it)."""
        password = self.password(env)
        if self.uses_sentinel:
            return self._sentinel_target(password, self.sentinel_password(env)).url()
        if not self.url or (password is None and not self.username):
            return self.url
        parts = urlsplit(self.url)
        userinfo = quote(self.username, safe="")
        if password is not None:
            userinfo += ":" + quote(password, safe="")
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


    def _sentinel_target(self, password: str | None, sentinel_password: str | None) -> SentinelTarget:
        parts = [urlsplit(part) for part in self.url.split(";")]
        db = parts[-1].path.strip("/") or "0"
        return SentinelTarget(
            sentinels=tuple((p.hostname or "", p.port or 26379) for p in parts),
            master_name=self.sentinel_master,
            db=int(db),
            username=self.username or None,
            password=password,
            sentinel_password=sentinel_password,
        )


def _check_sentinel_address(part: str) -> None:
    """One `sentinel://HOST:PORT[/DB]` of a Sentinel url: no credentials, no query, a numeric database."""
    parts = urlsplit(part)
    shown = redact(part)
    if parts.scheme != SENTINEL_SCHEME or not parts.hostname:
        raise ValueError(f"each sentinel of url must be sentinel://HOST:PORT (joined by ';'), got {shown!r}")
    if parts.username or parts.password is not None:
        raise ValueError(
            "url names a user or password: the primary's come from broker.username and "
            f"{PASSWORD_ENV}/{PASSWORD_FILE_ENV}/broker.password_file, the sentinels' from {SENTINEL_PASSWORD_ENV} "
            f"or {SENTINEL_PASSWORD_FILE_ENV}"
        )
    if parts.query:
        raise ValueError(f"url {shown!r}: no query in a sentinel url; the master's name goes in broker.sentinel_master")
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        raise ValueError(f"url {shown!r}: the port of a sentinel must be a number") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"url {shown!r}: the database after the last sentinel must be a number, got {db!r}")


def _read_password(path: str, origin: str, whose: str = "broker") -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"{origin}: cannot read the {whose} password from {path}: {reason}") from None
    lines = text.splitlines()
    password = lines[0] if lines else ""
    if not password:
        raise ConfigError(f"{origin}: the {whose} password file {path} is empty")
    return password
