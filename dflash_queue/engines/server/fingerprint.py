"""Which weights a server runs, told by a fixed greedy request: the weights probe.

Two servers may serve the same name, tokenizer and context with other weights (a fleet half-upgraded under one
served name, a server restarted with a new checkpoint behind the same URL), and their replies would mix two
models into one dataset. The probe sends fixed prompt ids (the probe text without chat template) and asks for a
few greedy tokens with each token's logprob and the runner-up's (the second most likely token's). The first
fingerprint a run sees is recorded with the run (runstate/served_weights.py); every server, at
start and at every re-check, must match it:

  * the same greedy token ids, and at each one logprobs (the token's and the runner-up's) within the tolerance.
    Batch composition and kernels move logprobs a little between identical servers; another checkpoint moves
    them more;
  * where two servers pick different tokens, it may be a near-tie that noise tipped: accepted only when both
    sides' top two are within the tolerance of each other and of the other side's; the tokens after it follow
    different prefixes and are not compared.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# Greedy tokens the probe asks for, and the logprobs it asks for at each (the token's and the runner-up's).
PROBE_TOKENS = 8
PROBE_TOP_LOGPROBS = 2


@dataclass(frozen=True)
class ProbeToken:
    token_id: int
    logprob: float
    # The second most likely token's logprob; None when the server gave one logprob only.
    runner_up: float | None


@dataclass(frozen=True)
class WeightsFingerprint:
    """A server's greedy answer to the weights probe, and the server that gave it."""

    prompt_ids: tuple[int, ...]
    tokens: tuple[ProbeToken, ...]
    server: str = ""

    def to_json(self) -> str:
        return json.dumps({
            "prompt_ids": list(self.prompt_ids),
            "tokens": [[t.token_id, t.logprob, t.runner_up] for t in self.tokens],
            "server": self.server,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightsFingerprint:
        data = json.loads(text)
        try:
            tokens = tuple(ProbeToken(int(i), float(lp), None if up is None else float(up)) for i, lp, up in data["tokens"])
            return cls(tuple(int(i) for i in data["prompt_ids"]), tokens, str(data.get("server", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a weights fingerprint ({type(exc).__name__}: {exc}): {str(text)[:200]}") from None

    def describe(self) -> str:
        return ", ".join(f"{t.token_id} ({t.logprob:.3f})" for t in self.tokens)


def compare(recorded: WeightsFingerprint, found: WeightsFingerprint, tolerance: float) -> tuple[str, float]:
    """(why `found` is not the recorded weights, "" when it is; the largest logprob difference compared)."""
    if recorded.prompt_ids != found.prompt_ids:
        return ("the probe's prompt differs from the one the record was made with (another tokenizer, or another "
                "version of dflash-queue made the record)", 0.0)
    largest = 0.0
    for position, (mine, theirs) in enumerate(zip(recorded.tokens, found.tokens)):
        pairs = [(mine.logprob, theirs.logprob)]
        if mine.runner_up is not None and theirs.runner_up is not None:
            pairs.append((mine.runner_up, theirs.runner_up))
        if mine.token_id != theirs.token_id:
            if _near_tie(mine, theirs, tolerance):
                return "", largest  # noise tipped a tie: what follows continues other prefixes
            return (f"at greedy token {position} it picks {theirs.token_id} (logprob {theirs.logprob:.4f}), the "
                    f"record {mine.token_id} (logprob {mine.logprob:.4f})", largest)
        for which, (want, got) in zip(("its logprob", "the runner-up's logprob"), pairs):
            largest = max(largest, abs(want - got))
            if abs(want - got) > tolerance:
                return (f"at greedy token {position} ({mine.token_id}) {which} is {got:.4f}, the record's "
                        f"{want:.4f}: {abs(want - got):.4f} apart, more than generate.server.fingerprint_tolerance "
                        f"({tolerance})", largest)
    if len(recorded.tokens) != len(found.tokens):
        return (f"its greedy reply has {len(found.tokens)} tokens, the record's {len(recorded.tokens)} (one stopped "
                "where the other did not)", largest)
    return "", largest


def _near_tie(mine: ProbeToken, theirs: ProbeToken, tolerance: float) -> bool:
    if mine.runner_up is None or theirs.runner_up is None:
        return False
    return (
        mine.logprob - mine.runner_up <= tolerance
        and theirs.logprob - theirs.runner_up <= tolerance
        and abs(mine.logprob - theirs.logprob) <= tolerance
    )


class FingerprintRecord(Protocol):
    """Where a run keeps the first fingerprint it saw (runstate/served_weights.py's ServedWeights is one)."""

    def claim(self, fingerprint: str) -> str | None:
        """Record `fingerprint` unless one is recorded; returns the one recorded before (None: none was)."""
        ...


class WeightsReference:
    """The weights every server of this worker must run: the run's recorded fingerprint, or, without a record
    (doctor, a worker without a broker), the first one a server of this worker gave."""

    def __init__(self, record: FingerprintRecord | None, tolerance: float) -> None:
        self.record = record
        self.tolerance = tolerance
        self.recorded: WeightsFingerprint | None = None
        self._lock = asyncio.Lock()

    async def problem(self, found: WeightsFingerprint) -> tuple[str, float | None]:
        """(why the server that gave `found` runs other weights than the run's, "" when it runs the same; the
        largest logprob difference compared, None when nothing was compared)."""
        async with self._lock:
            if self.recorded is None:
                try:
                    await self._adopt(found)
                except Exception as exc:  # the broker or the record itself: the server waits for the next check
                    return f"cannot read the run's recorded weights fingerprint: {type(exc).__name__}: {exc}", None
        assert self.recorded is not None
        why, largest = compare(self.recorded, found, self.tolerance)
        if why:
            origin = f" recorded from {self.recorded.server}" if self.recorded.server else ""
            return (f"it runs other weights than the run's (the weights probe's fingerprint{origin}): {why}. A fleet "
                    "upgraded halfway mixes two models' replies in one dataset: run these weights everywhere, or "
                    "start another run (run.name) for the new ones"), largest
        log.debug("%s: weights fingerprint within %.2g of the run's", found.server, largest)
        return "", largest

    async def _adopt(self, found: WeightsFingerprint) -> None:
        if self.record is None:
            self.recorded = found
            return
        record = self.record
        before = await asyncio.to_thread(record.claim, found.to_json())
        if before is None:
            log.info("the run records the served weights' fingerprint, from %s: greedy tokens %s", found.server,
                     found.describe())
            self.recorded = found
        else:
            self.recorded = WeightsFingerprint.from_json(before)
