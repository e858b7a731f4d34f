"""A run's state in its broker (Redis), every key under `dfq:{run.name}:` and named in `keys.py`.

`ledger` (shard states, counters and their rates, delivery counts, the run's recorded identity), `shard_states`
(the states a shard moves through, as plain names), `window` (a live dataset: epochs, consumers and the window of
unconsumed shards), `run_identity` (what a run's output is made with), `stopped_workers` (workers stopped by
failing state checks), `server_waits` (generate workers waiting for their inference servers), `served_weights`
(the inference servers' weights fingerprint, as the run first saw it).
"""
