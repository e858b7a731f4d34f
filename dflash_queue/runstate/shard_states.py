"""The states a shard moves through in the ledger, and the ledger's named maxima: plain names, importable
without a broker client."""

QUEUED = "queued"
GENERATED = "generated"
DONE = "done"
FAILED = "failed"
# States in which a shard needs no new message from the producer.
IN_PROGRESS_OR_DONE = frozenset({QUEUED, GENERATED, DONE})
# The largest relative error of any canary sample against itself run alone (`Ledger.maxima`).
CANARY_ERROR = "extract_canary_error"
