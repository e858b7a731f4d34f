from dfq_testing import polling


class StatesAfter:
    """A ledger whose shards reach `state` on the `calls`-th look."""

    def __init__(self, calls: int, state: str = "done") -> None:
        self.calls, self.state, self.looks = calls, state, 0

    def states(self, shard_ids):
        self.looks += 1
        return {shard_id: self.state if self.looks >= self.calls else "queued" for shard_id in shard_ids}


def test_wait_for_states_polls_at_the_interval_it_is_given(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)
    states = polling.wait_for_states(StatesAfter(3), ["a", "b"], {"done"}, timeout=60, poll_s=0.005)
    assert states == {"a": "done", "b": "done"}
    assert sleeps == [0.005, 0.005]


def test_wait_for_states_polls_every_fifth_of_a_second_by_default(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)
    polling.wait_for_states(StatesAfter(2), ["a"], {"done"}, timeout=60)
    assert sleeps == [0.2]
