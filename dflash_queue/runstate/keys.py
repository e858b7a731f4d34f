"""Every Redis key of a run, named here and nowhere else: `RunKeys(run.name)`.

A run's state lives under `dfq:{run.name}:`, beside the broker's own keys (kombu's queues and `unacked` hash),
so runs of several names share one Redis. A key's string is part of a running job's state: workers, `status` and
a restarted `run` read what others wrote, so a string never changes once released (tests/runstate/test_keys.py
holds every one).

Prefixes (`*_prefix`) end where the varying part begins: `prefix + "*"` is the scan pattern of that kind, and
`key[len(prefix):]` its varying part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunKeys:
    run_name: str

    @property
    def root(self) -> str:
        """`dfq:{run}`: every key below starts with it and a colon."""
        return f"dfq:{self.run_name}"

    # -- the ledger (ledger.py)

    @property
    def shard_states(self) -> str:
        """Hash: shard id -> its state in epoch 0 (shard_states.py)."""
        return f"{self.root}:shard_state"

    @property
    def shard_samples(self) -> str:
        """Hash: shard id -> samples, recorded when it was queued."""
        return f"{self.root}:shard_samples"

    @property
    def counters(self) -> str:
        """Hash: counter name -> the run's total."""
        return f"{self.root}:counters"

    @property
    def failures(self) -> str:
        """Hash: shard id -> why it failed for good."""
        return f"{self.root}:failures"

    @property
    def rate_prefix(self) -> str:
        return f"{self.root}:rate:"

    def rate_bucket(self, bucket: int) -> str:
        """Hash: counter name -> increments in one minute (`bucket` = epoch seconds // 60); expires."""
        return f"{self.rate_prefix}{bucket}"

    @property
    def first_add(self) -> str:
        """String: when the run's first progress was recorded (the start of a young run's rate window)."""
        return f"{self.root}:first_add"

    @property
    def counted(self) -> str:
        """Set: tokens of outputs already counted (`Ledger.add_once`)."""
        return f"{self.root}:counted"

    @property
    def maxima(self) -> str:
        """Hash: measurement name -> the largest value recorded (a canary's relative error)."""
        return f"{self.root}:maxima"

    @property
    def identity(self) -> str:
        """String: what the run's output is made with (run_identity.py), as its first producer recorded it."""
        return f"{self.root}:identity"

    @property
    def served_weights(self) -> str:
        """String: the inference servers' weights fingerprint (served_weights.py), as the run's first generate
        worker on them recorded it."""
        return f"{self.root}:served_weights"

    @property
    def delivery_prefix(self) -> str:
        return f"{self.root}:delivery:"

    def delivery(self, task_id: str, retries: int) -> str:
        """Counter: deliveries of one message (a task id at a retry count); expires."""
        return f"{self.delivery_prefix}{task_id}:{retries}"

    # -- a live dataset (window.py)

    @property
    def live_prefix(self) -> str:
        """Every key of a live dataset starts with it (the ledger's reset clears them all)."""
        return f"{self.root}:live:"

    @property
    def window(self) -> str:
        """Set: the places taken in the window of unconsumed shards, `{epoch}:{shard id}`."""
        return f"{self.live_prefix}window"

    @property
    def consumers(self) -> str:
        """Hash: consumer name -> its world size, seed and when it registered."""
        return f"{self.live_prefix}consumers"

    @property
    def waiting(self) -> str:
        """String: the extract task waiting for a place, while it waits; expires."""
        return f"{self.live_prefix}waiting"

    def acknowledged(self, consumer: str, epoch: int) -> str:
        """Set: shard ids a consumer's ranks consumed in an epoch."""
        return f"{self.live_prefix}acked:{consumer}:{epoch}"

    def ranks_seen(self, consumer: str) -> str:
        """Hash: a consumer's rank -> when it last looked for shards, and in which epoch."""
        return f"{self.live_prefix}seen:{consumer}"

    @property
    def epochs_wanted(self) -> str:
        """Hash: consumer name -> how many epochs it trains (`run` stays up until they are consumed)."""
        return f"{self.live_prefix}epochs_wanted"

    def readers_finished(self, consumer: str) -> str:
        """Hash: `{rank}:{reader index}` -> the rank's reader count, for each reader that served its last epoch."""
        return f"{self.live_prefix}finished:{consumer}"

    def _epoch(self, epoch: int, what: str) -> str:
        return f"{self.live_prefix}epoch:{epoch}:{what}"

    def epoch_shards(self, epoch: int) -> str:
        """Hash: shard id -> samples of an epoch."""
        return self._epoch(epoch, "shards")

    def epoch_sealed(self, epoch: int) -> str:
        """String: when the epoch's shards were all recorded."""
        return self._epoch(epoch, "sealed")

    def epoch_claimed(self, epoch: int) -> str:
        """String: set by whoever enqueues the epoch's extraction (once per epoch)."""
        return self._epoch(epoch, "claimed")

    def epoch_stored(self, epoch: int) -> str:
        """Sorted set: shard id by the position in which it was stored."""
        return self._epoch(epoch, "stored")

    def epoch_stored_count(self, epoch: int) -> str:
        """Counter: the next store position of the epoch."""
        return self._epoch(epoch, "count")

    def epoch_states(self, epoch: int) -> str:
        """Hash: shard id -> its state in a later epoch (epoch 0's are `shard_states`)."""
        return self._epoch(epoch, "state")

    def epoch_failures(self, epoch: int) -> str:
        """Hash: shard id -> why it failed for good in a later epoch."""
        return self._epoch(epoch, "failures")

    # -- workers (queue/liveness.py, stopped_workers.py, server_waits.py)

    @property
    def incarnations(self) -> str:
        """Hash: incarnation id -> its node name and process identity."""
        return f"{self.root}:incarnations"

    def alive(self, incarnation: str) -> str:
        """String: an incarnation's heartbeat; expires `broker.worker_liveness_s` after its last beat."""
        return f"{self.root}:alive:{incarnation}"

    @property
    def held_prefix(self) -> str:
        return f"{self.root}:held:"

    def held(self, incarnation: str) -> str:
        """Hash: task id -> delivery tag, queue and shard of each message an incarnation took and has not finished."""
        return f"{self.held_prefix}{incarnation}"

    @property
    def last_seen(self) -> str:
        """Hash: incarnation id -> its last heartbeat's time (kept after the heartbeat expires)."""
        return f"{self.root}:last_seen"

    @property
    def stopped_workers(self) -> str:
        """Hash: node name -> why its worker stopped (failing state checks)."""
        return f"{self.root}:stopped_workers"

    @property
    def servers_down_prefix(self) -> str:
        return f"{self.root}:servers_down:"

    def servers_down(self, worker: str) -> str:
        """String: since when every inference server of a generate worker is down, and why; expires."""
        return f"{self.servers_down_prefix}{worker}"

    # -- the reference audit (audits.py)

    @property
    def audit_sequence(self) -> str:
        """Counter: the next store position of a shard an extract worker stored (one order for the whole run)."""
        return f"{self.root}:audit:seq"

    @property
    def audit_worker_prefix(self) -> str:
        return f"{self.root}:audit:worker:"

    def audit_worker(self, incarnation: str) -> str:
        """Hash: an extract incarnation's audit state: its node, shards stored since its last audit was sent, when
        that was, and why it was halted."""
        return f"{self.audit_worker_prefix}{incarnation}"

    def audit_stored(self, incarnation: str) -> str:
        """Sorted set: `{epoch}:{shard id}` of each shard an incarnation stored, by store position."""
        return f"{self.root}:audit:stored:{incarnation}"

    def audit_passed(self, incarnation: str) -> str:
        """Sorted set: `{epoch}:{shard id}` of each shard of an incarnation whose audit passed, by store position."""
        return f"{self.root}:audit:passed:{incarnation}"

    @property
    def audit_shards(self) -> str:
        """Hash: `{epoch}:{shard id}` -> who stored the shard, at which position, and its audit's verdict (JSON)."""
        return f"{self.root}:audit:shards"

    @property
    def suspects(self) -> str:
        """Hash: `{epoch}:{shard id}` -> why the shard is suspect, and who had consumed it by then (JSON)."""
        return f"{self.root}:suspects"

    # -- dead letters (deadletters/records.py)

    @property
    def dead_letters(self) -> str:
        """Hash: dead-letter id -> the record."""
        return f"{self.root}:dead"
