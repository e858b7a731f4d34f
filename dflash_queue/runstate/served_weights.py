"""The weights the run's inference servers run, as the run first saw them.

A generate worker on inference servers (`generate.engine = "server"`) fingerprints each server's weights with a
fixed greedy probe (engines/server/fingerprint.py). The first fingerprint any worker of the run makes is recorded
under `dfq:{run}:served_weights` (JSON: the probe's prompt ids, each greedy token with its logprob and the
runner-up's, the server that gave it); every worker compares every server against it, so that a fleet upgraded
halfway under one served name, or a server restarted with other weights, is refused instead of mixing two models'
replies into one dataset. Starting the run over (`run --rebuild`) clears it.
"""

from __future__ import annotations

from typing import Any

from dflash_queue.runstate.keys import RunKeys


class ServedWeights:
    """The record, on a Redis client with decode_responses=True."""

    def __init__(self, client: Any, run_name: str) -> None:
        self.client = client
        self.key = RunKeys(run_name).served_weights

    def claim(self, fingerprint: str) -> str | None:
        """Record `fingerprint` unless one is recorded; returns the one recorded before (None: none was)."""
        pipe = self.client.pipeline()
        pipe.set(self.key, fingerprint, nx=True)
        pipe.get(self.key)
        claimed, recorded = pipe.execute()
        return None if claimed else recorded

    def recorded(self) -> str | None:
        return self.client.get(self.key)
