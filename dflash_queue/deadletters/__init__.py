"""Dead letters: what could not be done, kept until an operator requeues or purges it.

`records` (the records in Redis and their filters), `recording` (written by workers: failed tasks, poison
samples, messages that cannot be run), `requeue` (sent back to their lane once the cause is fixed); the
`dflash-queue dead` commands are in cli/reliability.py.
"""

from dflash_queue.deadletters.records import (
    MESSAGE,
    SAMPLE,
    TASK,
    UNKNOWN_LANE,
    DeadLetter,
    DeadLetters,
    Filter,
    exception_fields,
    record_id,
)

__all__ = [
    "MESSAGE",
    "SAMPLE",
    "TASK",
    "UNKNOWN_LANE",
    "DeadLetter",
    "DeadLetters",
    "Filter",
    "exception_fields",
    "record_id",
]
