"""The steps a lane task passes through, one concern each, composed in order by dflash_queue/queue/tasks.py.

Around the task body (`LaneTask.__call__`): `deliveries.py`, `injected_faults.py`, `window_requeue.py`,
`hand_back.py`; `dead_letters.py` and `retries.py` also serve Celery's failure and retry handlers. In the body
(`run_lane_task`): `fingerprint.py`, `retries.py`, `already_stored.py`, then the lane, `dead_letters.py`,
`counting.py`, `handing_on.py`. `lane_message.py` is the message they all read.
"""
