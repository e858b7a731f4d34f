"""The work of each lane as plain objects: resident engines plus a `run(shard_id)` that tasks call."""
