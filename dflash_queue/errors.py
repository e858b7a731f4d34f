"""Exceptions with a meaning for the queue: permanent ones are never retried."""


class DflashQueueError(Exception):
    """Base class of this package's errors."""


class ConfigError(DflashQueueError):
    """The configuration cannot be used; the message names the file and the key."""


class BrokerLoginRefused(ConfigError):
    """The broker refuses the configured user or password (or the user lacks commands workers need)."""


class UnsupportedArchitecture(ConfigError):
    """The target cannot be run exactly by the extraction engine; the message names the model type and what is
    missing. Raised at load, before any task is taken."""


class ReferenceMismatch(UnsupportedArchitecture):
    """An engine's states differ from the checkpoint's own forward by more than rounding explains: the worker that
    holds it must not serve (it stops with exit status 78, which the process manager does not restart). `comparison`
    says, entry by entry, by how much (engines/reference/check.py)."""

    def __init__(self, message: str, comparison: object = None) -> None:
        super().__init__(message)
        self.comparison = comparison


class PermanentError(DflashQueueError):
    """Retrying cannot help: bad input, a config mismatch, a missing file that should exist."""


class FingerprintMismatch(PermanentError):
    """A message was produced under a different configuration than this worker runs."""


class ShardFormatError(PermanentError):
    """A stored shard does not have the expected structure."""


class StorageError(DflashQueueError):
    """A storage operation failed; may be transient."""


class GenerationRejected(PermanentError):
    """The engine refused a request (a prompt longer than the context, say); retrying cannot help."""


class TransientIOError(DflashQueueError):
    """A local file system refused a write in a way that may pass (full, failing: ENOSPC, EIO). The task is retried
    later and counted as a transient retry, like a broken connection; nothing of it is stored meanwhile."""


class StatesHandOverFailed(TransientIOError):
    """The vLLM engine could not write a sequence's states into its transfer directory (extract.vllm.transfer_dir):
    the directory's file system was full or failing."""


class EngineStartFailed(DflashQueueError):
    """The engine did not start; the message names the root cause its processes reported (out of memory, a setting
    the engine refuses). The worker exits with it."""


class EngineUnavailable(DflashQueueError):
    """The worker's resident engine has died; the worker must restart before it takes more tasks."""


class StorageUnavailable(StorageError):
    """The store did not answer or answered 5xx/throttling after the client's own retries: try again later."""


class StorageAccessError(StorageError, PermanentError):
    """The store refuses the request for good: no such bucket, access denied, no or wrong credentials."""


class ChecksumMismatch(StorageError, PermanentError):
    """An object's content does not match the checksum stored with it: the object is corrupt."""


class StorageCheckFailed(PermanentError):
    """The storage self-check at worker start-up failed; the message lists each check."""


class WorkerShuttingDown(DflashQueueError):
    """The worker is stopping before this task started its work: the task goes back to the queue."""


class WindowFull(DflashQueueError):
    """The window of unconsumed training shards stayed full while the task waited: it goes back to the queue."""


class SampleDependentError(DflashQueueError):
    """A batch failed in a way that depends on which samples it holds (an out-of-memory on one long sample at
    the smallest token budget, non-finite hidden states, a tokenizer crash). The lane splits the batch and runs
    the halves, down to the single sample, so that one bad sample costs one dead letter, not a shard.

    `sample_ids`, when the engine knows them, name the samples at fault; empty means "somewhere in the batch".
    """

    def __init__(self, message: str, sample_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.sample_ids = tuple(sample_ids)


class OutOfMemoryAtMinimumBudget(SampleDependentError):
    """The engine ran out of device memory even after shrinking its token budget to one sequence."""


class NonFiniteHiddenStates(SampleDependentError):
    """A forward pass produced NaN or infinite hidden states for the named samples. The extract engines raise it
    after checking every sequence's states and handing over the finite ones: the lane isolates the named samples
    (each costs a dead letter of its own) and stores the rest of the shard."""

    @classmethod
    def among(cls, sample_ids: list[str], total: int) -> "NonFiniteHiddenStates":
        """The error naming `sample_ids`, found among `total` samples (the first ten in the message)."""
        listed = ", ".join(sample_ids[:10]) + (" ..." if len(sample_ids) > 10 else "")
        return cls(
            f"{len(sample_ids)} of {total} samples have NaN or infinite hidden states: {listed}",
            sample_ids=tuple(sample_ids),
        )


class NonFiniteRowRefused(ShardFormatError):
    """The shard writer was handed NaN or infinite states for one row. An engine checks its states before handing
    them over (and raises NonFiniteHiddenStates for the samples at fault), so this is a caller that skipped that
    check, not a sample to isolate: the task fails for good, nothing of it is stored and no batch runs again."""

    def __init__(self, sample_id: str) -> None:
        super().__init__(
            f"sample {sample_id}: hidden states contain NaN or Inf; the shard writer refuses them (states reach it "
            "only after the engine's own check)"
        )
        self.sample_id = sample_id


class EngineStatesInvalid(PermanentError):
    """An engine handed over states that cannot be the sequence's own: for other tokens, of another shape, or with
    tokens whose state it never wrote. Nothing of the task is stored."""


class DatasetRefused(ConfigError):
    """The datasets gave no usable sample, or a file's bad records pass dataset.max_bad_share: the message names the
    files, their counts, the first problems (file, line, key) and the setting, and says what was enqueued."""
