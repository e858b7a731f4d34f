"""Doctor's account of what each lane's worker would warn about at start."""

from __future__ import annotations

from dflash_queue.doctor.workers import check_worker_settings


def test_a_lanes_contradicting_settings_are_a_warning_and_agreeing_ones_pass(make_config):
    # The extract engine's context holds sequences one token shorter than what staging admits.
    tight = make_config(dataset={"max_model_len": 1024}, extract={"engine": "vllm"},
                        **{"extract.vllm": {"max_model_len": 1024}})
    checks = {c.name: c for c in check_worker_settings(tight)}
    assert checks["generate worker"].verdict == "pass"
    assert checks["extract worker"].verdict == "warn"
    assert "holds sequences of at most 1023 tokens" in checks["extract worker"].detail
    agreed = make_config("agreed.toml", dataset={"max_model_len": 1024}, extract={"engine": "vllm"})
    checks = {c.name: c for c in check_worker_settings(agreed)}
    assert checks["extract worker"].verdict == "pass" and checks["extract worker"].detail.startswith("4 task slot(s)")  # 2 computing, 2 uploading
