"""The broker process: `redis_server` (a private redis-server for single-box runs and tests) and `run_broker` (the
broker of a job `dflash-queue run` ran, and how the commands that read the broker find it afterwards)."""
