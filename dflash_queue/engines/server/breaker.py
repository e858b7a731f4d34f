"""A server's breaker: a storm of failures from a server whose health check passes takes it out of use.

A server that answers its health check but fails every generation (a 5xx storm: a broken engine behind a live
HTTP front) would otherwise spend the tries of every request in flight on it and dead-letter them one by one.
After `threshold` failed requests in a row the breaker opens: the server counts as down (its requests go to the
others, or wait), for a backoff that doubles while it keeps failing. When the backoff has passed and the server
passes its check again, the breaker is half-open: the server takes one trial request at a time; its first
success closes the breaker, a failure opens it again.

What a failure costs the request: the failures that opened the breaker (and any that come back from the server
once it is out of use) are not counted against the request's tries; a failed trial request is, since the server
had just passed its check and the request may be at fault (a poison request is still given up, after max_tries
trials).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

State = Literal["closed", "open", "trial"]
CLOSED: Final = "closed"
OPEN: Final = "open"
TRIAL: Final = "trial"


@dataclass
class Breaker:
    threshold: int
    state: State = CLOSED
    failures_in_row: int = 0
    # Times it opened out of a storm (from closed): a request's failures on the server before that are not counted.
    storms: int = 0
    # Times it opened since it last closed (the backoff doubles with each).
    opened_in_row: int = 0

    def admits(self, outstanding: int) -> bool:
        """Whether the server may take another request (half-open: one at a time)."""
        return self.state == CLOSED or (self.state == TRIAL and outstanding == 0)

    def succeeded(self) -> bool:
        """A request succeeded; True when that closed a half-open breaker."""
        self.failures_in_row = 0
        if self.state != TRIAL:
            return False
        self.state, self.opened_in_row = CLOSED, 0
        return True

    def failed(self) -> Literal["", "storm", "trial"]:
        """A request failed on the server while it was in use: "storm" when that opened a closed breaker, "trial"
        when a trial request failed (opened again), "" when the breaker stays as it was."""
        self.failures_in_row += 1
        if self.state == TRIAL:
            self._open()
            return "trial"
        if self.state == CLOSED and self.failures_in_row >= self.threshold:
            self.storms += 1
            self._open()
            return "storm"
        return ""

    def _open(self) -> None:
        self.state = OPEN
        self.opened_in_row += 1
        self.failures_in_row = 0

    def passed_check(self) -> bool:
        """The server passed its check (health, identity); True when that made an open breaker half-open."""
        if self.state != OPEN:
            return False
        self.state = TRIAL
        return True

    def open_for_s(self, initial_s: float, max_s: float) -> float:
        return min(initial_s * 2 ** max(0, self.opened_in_row - 1), max_s)


@dataclass
class Tries:
    """A request's failed tries, each with its server's breaker as it was: those on a server whose breaker opened
    in a storm since do not count."""

    spent: list[tuple[Breaker, int]] = field(default_factory=list)

    def spend(self, breaker: Breaker) -> None:
        self.spent.append((breaker, breaker.storms))

    def counted(self) -> int:
        return sum(1 for breaker, storms in self.spent if breaker.storms == storms)
