"""Every redis-py client of the broker, from one connection URL: a plain `redis://` URL, or Redis Sentinel's.

A Sentinel connection URL names the sentinels, the database and what else a client needs in its query:

    sentinel://USER:PASSWORD@HOST:PORT;sentinel://HOST:PORT/DB?master_name=NAME&sentinel_password=SECRET

The primary is found through the sentinels (`Sentinel.master_for`) at each new connection, so a client whose
primary died reconnects to the promoted replica once its connection breaks. The same URL gives kombu's form (the
`;`-joined sentinel URLs without the query) and the transport options it needs (`kombu_broker`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

if TYPE_CHECKING:  # redis is the worker extra's: the config parses Sentinel URLs without it
    import redis
    from redis.sentinel import Sentinel

SENTINEL_SCHEME = "sentinel"
MASTER_NAME_PARAM = "master_name"
SENTINEL_PASSWORD_PARAM = "sentinel_password"


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME + "://")


@dataclass(frozen=True)
class SentinelTarget:
    """The primary a Sentinel URL names: where the sentinels are and how to log in to both."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    def url(self) -> str:
        """The connection URL (credentials in it: never shown)."""
        userinfo = ""
        if self.username or self.password is not None:
            userinfo = quote(self.username or "", safe="")
            if self.password is not None:
                userinfo += ":" + quote(self.password, safe="")
            userinfo += "@"
        hosts = ";".join(f"{SENTINEL_SCHEME}://{userinfo}{_netloc(host, port)}" for host, port in self.sentinels)
        query = {MASTER_NAME_PARAM: self.master_name}
        if self.sentinel_password is not None:
            query[SENTINEL_PASSWORD_PARAM] = self.sentinel_password
        return f"{hosts}/{self.db}?{urlencode(query)}"

    def shown(self) -> str:
        """The URL as it may be shown: no credentials, the master's name."""
        hosts = ";".join(f"{SENTINEL_SCHEME}://{_netloc(host, port)}" for host, port in self.sentinels)
        return f"{hosts}/{self.db} (master {self.master_name!r})"

    def sentinel_kwargs(self, **socket_options: Any) -> dict[str, Any]:
        """What a client of the sentinels themselves connects with (their own password, not the primary's)."""
        kwargs = dict(socket_options)
        if self.sentinel_password is not None:
            kwargs["password"] = self.sentinel_password
        return kwargs

    def sentinel(self, **options: Any) -> Sentinel:
        """A Sentinel over these sentinels; `options` (timeouts, retries) apply to the primary's connections."""
        from redis.sentinel import Sentinel

        socket_options = {k: v for k, v in options.items() if k.startswith("socket_")}
        return Sentinel(list(self.sentinels), sentinel_kwargs=self.sentinel_kwargs(**socket_options), **options)

    def master_client(self, **options: Any) -> redis.Redis:
        return self.sentinel(**options).master_for(
            self.master_name, db=self.db, username=self.username, password=self.password
        )


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The target a `sentinel://` connection URL names; ValueError saying what is wrong with it."""
    parts = [urlsplit(part) for part in url.split(";")]
    sentinels: list[tuple[str, int]] = []
    for part in parts:
        if part.scheme != SENTINEL_SCHEME or not part.hostname:
            raise ValueError(f"each address of a Sentinel URL must be sentinel://HOST:PORT, got {part.scheme}://...")
        sentinels.append((part.hostname, part.port or 26379))
    last = parts[-1]
    db_text = last.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ValueError(f"the database of a Sentinel URL must be a number, got {db_text!r}")
    query = {key: values[-1] for key, values in parse_qs(last.query).items()}
    master_name = query.get(MASTER_NAME_PARAM, "")
    if not master_name:
        raise ValueError(f"a Sentinel URL needs ?{MASTER_NAME_PARAM}=NAME (the primary's name in the sentinels)")
    first = parts[0]
    return SentinelTarget(
        sentinels=tuple(sentinels),
        master_name=master_name,
        db=int(db_text),
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password is not None else None,
        sentinel_password=query.get(SENTINEL_PASSWORD_PARAM),
    )


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client of the broker at `url` (plain or Sentinel); `options` are redis-py's client options."""
    import redis

    if is_sentinel_url(url):
        return parse_sentinel_url(url).master_client(**options)
    return redis.Redis.from_url(url, **options)


def kombu_broker(url: str) -> tuple[str, dict[str, Any]]:
    """The broker URL kombu connects with and the transport options it adds to the usual ones: for a Sentinel
    URL, the `;`-joined sentinel addresses (the primary's credentials on the first), the master's name and the
    sentinels' password; a plain URL as it is, with none."""
    if not is_sentinel_url(url):
        return url, {}
    target = parse_sentinel_url(url)
    kombu_url = target.url().partition("?")[0]
    return kombu_url, {"master_name": target.master_name, "sentinel_kwargs": target.sentinel_kwargs()}
