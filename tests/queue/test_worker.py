"""Worker start-up choices that need no broker: how many tasks a lane runs at once."""

from __future__ import annotations

import logging

from dflash_queue.queue.worker import _warn_if_engine_can_drain, lane_concurrency
from dflash_queue.testing.configs import tiny_vllm_overrides


def test_the_vllm_lane_runs_its_configured_tasks_in_flight(make_config):
    vllm = make_config("vllm.toml", **tiny_vllm_overrides(inflight_tasks=4))
    transformers = make_config("hf.toml")
    assert lane_concurrency(vllm, "generate") == 4
    assert lane_concurrency(vllm, "extract") == 1
    assert lane_concurrency(transformers, "generate") == 1


def test_a_warning_when_the_other_tasks_cannot_fill_the_engine(make_config, caplog):
    config = make_config(**tiny_vllm_overrides(max_num_seqs=32), dataset={"shard_size": 8})
    with caplog.at_level(logging.WARNING, logger="dflash_queue.queue.worker"):
        _warn_if_engine_can_drain(config, "generate", concurrency=5)  # 4 other tasks hold 32 requests
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="dflash_queue.queue.worker"):
        _warn_if_engine_can_drain(config, "generate", concurrency=2)
    assert "fewer than generate.vllm.max_num_seqs (32)" in caplog.text
