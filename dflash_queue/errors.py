"""Exceptions with a meaning for the queue: permanent ones are never retried."""


class DflashQueueError(Exception):
    """Base class of this package's errors."""


class ConfigError(DflashQueueError):
    """The configuration cannot be used; the message names the file and the key."""


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


class EngineUnavailable(DflashQueueError):
    """The worker's resident engine has died; the worker must restart before it takes more tasks."""
