"""The vLLM extract engine's parts that need no engine: layer conventions and engine arguments, which targets vLLM
can extract exactly, the final norm from the checkpoint's weights, the transfer directory, the arrival of states
and the gate that lets a canary rerun have the engine alone."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
import torch

from dflash_queue import faults
from dflash_queue.engines.vllm.extract_args import CONNECTOR, CONNECTOR_MODULE, extract_engine_args
from dflash_queue.engines.vllm.gate import EngineGate
from dflash_queue.engines.vllm.transfer import StatesArrivals
from dflash_queue.errors import EngineStatesInvalid, StatesHandOverFailed
from dflash_queue.lanes.extract import vllm_extract_settings
from dfq_testing.writes import WriteWatch


def test_engine_arguments_force_what_extraction_needs(make_config, monkeypatch):
    config = make_config(
        dataset={"max_model_len": 1000},
        extract={"engine": "vllm", "layer_ids": [4, 0], "final_norm_state": True},
        **{"extract.vllm": {"tensor_parallel_size": 2, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False}},
    )
    args = extract_engine_args(vllm_extract_settings(config), [5, 1, 6], "/dev/shm/x")
    assert args["enable_prefix_caching"] is False
    assert args["max_model_len"] == 1001  # the longest staged sequence and the one token vLLM samples after it
    assert args["pipeline_parallel_size"] == 1 and args["tensor_parallel_size"] == 2
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 4096
    speculative = args["speculative_config"]
    assert speculative["method"] == "extract_hidden_states" and speculative["num_speculative_tokens"] == 1
    # vLLM caches its aux layers sorted and distinct: the engine is asked for them so.
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5, 6]
    transfer = args["kv_transfer_config"]
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (CONNECTOR, CONNECTOR_MODULE)
    assert transfer["kv_connector_extra_config"] == {"transfer_dir": "/dev/shm/x"}  # no faults unless injected
    faults.install({"extract_vllm_states": {"zero": ["a"]}})
    try:
        injected = extract_engine_args(vllm_extract_settings(config), [1], "/dev/shm/x")["kv_transfer_config"]["kv_connector_extra_config"]
    finally:
        faults.uninstall()
    assert injected["faults"] == {"zero": ["a"]}


def test_the_engine_steps_extract_token_budget_tokens_unless_told_otherwise(make_config):
    """vLLM's own default under the engine context is 2,048 tokens a step; the lane's token budget is the figure
    its operator sized (and the Transformers engine's tokens per pass)."""
    config = make_config(dataset={"max_model_len": 1000}, extract={"engine": "vllm", "token_budget": 6000})
    assert extract_engine_args(vllm_extract_settings(config), [1], "/dev/shm/x")["max_num_batched_tokens"] == 6000
    small = make_config("small.toml", dataset={"max_model_len": 1000}, extract={"engine": "vllm", "token_budget": 300})
    assert extract_engine_args(vllm_extract_settings(small), [1], "/dev/shm/x")["max_num_batched_tokens"] == 300  # chunked prefill
    unchunked = make_config("unchunked.toml", dataset={"max_model_len": 1000},
                            extract={"engine": "vllm", "token_budget": 300},
                            **{"extract.vllm": {"enable_chunked_prefill": False}})
    assert extract_engine_args(vllm_extract_settings(unchunked), [1], "/dev/shm/x")["max_num_batched_tokens"] == 1001  # a whole sequence
    told = make_config("told.toml", extract={"engine": "vllm", "token_budget": 6000},
                       **{"extract.vllm": {"max_num_batched_tokens": 512}})
    assert extract_engine_args(vllm_extract_settings(told), [1], "/dev/shm/x")["max_num_batched_tokens"] == 512


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("family", "refused"),
    [
        ("qwen3", None),
        ("qwen3_moe", None),
        ("mistral", None),
        ("gpt_oss", None),
        ("gemma3_text", "does not hand out the residual stream of its layers (no EAGLE-3 aux hidden states)"),
    ],
)
def test_vllm_refuses_targets_it_cannot_extract_exactly(tiny_family, family, refused):
    from transformers import AutoConfig

    from dflash_queue.engines.vllm.support import vllm_refusal

    refusal = vllm_refusal(AutoConfig.from_pretrained(tiny_family(family)))
    if refused is None:
        assert refusal is None
    else:
        assert refusal is not None and refused in refusal and 'extract.engine = "transformers"' in refusal


def test_gpt_oss_whose_windows_are_not_on_every_other_layer_is_refused():
    """vLLM's gpt-oss places sliding windows on layers 0, 2, 4, ... whatever config.layer_types says."""
    from transformers import GptOssConfig

    from dflash_queue.engines.vllm.support import vllm_refusal

    kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = GptOssConfig(num_hidden_layers=4, layer_types=kinds, architectures=["GptOssForCausalLM"])
    assert "whatever config.layer_types says" in (vllm_refusal(config) or "")


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_5"])
def test_the_final_norm_is_the_checkpoints_own_module_and_weights(tiny_family, family):
    """Gemma scales by 1 + weight, Qwen3.5's norm sits under the multimodal checkpoint's language model: each
    family's own class and weights (randomised, so that another formula or another weight shows)."""
    from dflash_queue.engines.final_norm import FinalNorm
    from dfq_testing.references import reference_model

    path = tiny_family(family)
    model = reference_model(path)
    norm = model.get_decoder().norm
    assert norm.weight.std() > 0.1
    states = torch.randn(9, norm.weight.shape[0]) * 3
    torch.testing.assert_close(FinalNorm(str(path), torch.float32)(states), norm(states), rtol=0, atol=0)


def test_states_arrive_when_their_file_appears_whole_or_fail_with_the_connectors_reason(tmp_path):
    async def scenario():
        arrivals = StatesArrivals(tmp_path)
        waiting = asyncio.ensure_future(arrivals.wait(str(tmp_path / "c0.0.safetensors"), timeout=5))
        failing = asyncio.ensure_future(arrivals.wait(str(tmp_path / "c0.1.safetensors"), timeout=5))
        full = asyncio.ensure_future(arrivals.wait(str(tmp_path / "c0.3.safetensors"), timeout=5))
        too_full = asyncio.ensure_future(arrivals.wait(str(tmp_path / "c0.4.safetensors"), timeout=5))
        late = asyncio.ensure_future(arrivals.wait(str(tmp_path / "c0.2.safetensors"), timeout=0.2))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        (tmp_path / "c0.0.safetensors.partial").write_bytes(b"x")  # being written: not there yet
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.replace(tmp_path / "c0.0.safetensors.partial", tmp_path / "c0.0.safetensors")
        (tmp_path / "c0.1.safetensors.error").write_text("gathering the states failed: ValueError: 3 blocks")
        # The file system refused the write: retried, not a wrong engine.
        (tmp_path / "c0.3.safetensors.ioerror").write_text("OSError: [Errno 28] No space left on device")
        (tmp_path / "c0.4.safetensors.ioerror").write_text("")  # too full even for the reason
        assert await waiting == str(tmp_path / "c0.0.safetensors")
        with pytest.raises(EngineStatesInvalid, match="3 blocks"):
            await failing
        with pytest.raises(StatesHandOverFailed, match=r"into \S+: OSError: \[Errno 28\] No space left on device"):
            await full
        with pytest.raises(StatesHandOverFailed, match="the transfer directory is full or failing"):
            await too_full
        with pytest.raises(TimeoutError):
            await late
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.0.safetensors"]  # the reasons were taken

    asyncio.run(scenario())


@pytest.mark.parametrize("room", ["room for the reason", "too full for the reason"])
def test_the_connectors_error_file_appears_only_once_its_reason_is_in_it(tmp_path, monkeypatch, room):
    """The worker reads `<name>.ioerror` the moment its name appears (StatesArrivals): were the file made under its
    own name and then written, the worker could read it empty and lose the reason. While the reason is written, no
    file of that name is there; a file system too full for the reason still gets the (empty) file."""
    from dflash_queue.engines.vllm import states_connector as connector

    path = str(tmp_path / "c0.3.safetensors")
    reason = f"writing {path} failed: OSError: [Errno 28] No space left on device"
    watch = WriteWatch(tmp_path, fail_with=errno.ENOSPC if room == "too full for the reason" else None)
    real_open = open
    monkeypatch.setattr(connector, "open", lambda *args, **kwargs: watch.wrap(real_open(*args, **kwargs)),
                        raising=False)
    connector._write_error(path, reason, io_error=True)
    assert watch.listings and all("c0.3.safetensors.ioerror" not in names for names in watch.listings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.3.safetensors.ioerror"]
    expected = reason if room == "room for the reason" else ""
    assert (tmp_path / "c0.3.safetensors.ioerror").read_text() == expected


def test_the_transfer_directory_must_hold_the_tasks_in_flight(make_config, tmp_path):
    """One maximal sequence's states for each task in flight, measured on the directory's file system (a container's
    /dev/shm is 64 MB unless --shm-size says otherwise): else the worker refuses to start, naming the fixes."""
    import shutil

    from transformers import AutoConfig

    from dflash_queue.engines.vllm.support import sample_states_bytes, transfer_bytes
    from dflash_queue.engines.vllm.transfer import open_transfer_dir
    from dflash_queue.errors import ConfigError

    base = tmp_path / "shm"
    settings = {"transfer_dir": str(base), "max_model_len": 4096, "dtype": "bfloat16"}
    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {**settings, "inflight_tasks": 2}})
    text = AutoConfig.from_pretrained(config.model.path)
    # 4,096 tokens x 3 aux layers (layers 1, 2, 3 of the tiny model) x hidden 128 x 2 bytes (bfloat16).
    assert sample_states_bytes(vllm_extract_settings(config), text) == 4096 * 3 * 128 * 2
    assert transfer_bytes(vllm_extract_settings(config), text) == 2 * sample_states_bytes(vllm_extract_settings(config), text)
    directory = open_transfer_dir(vllm_extract_settings(config), text)
    assert directory.parent == base and directory.is_dir()
    # As many tasks in flight as this file system's free room holds maximal sequences, and one more.
    fitting = shutil.disk_usage(base).free // sample_states_bytes(vllm_extract_settings(config), text)
    crowded = make_config("crowded.toml", extract={"engine": "vllm"},
                          **{"extract.vllm": {**settings, "inflight_tasks": fitting + 1}})
    with pytest.raises(ConfigError) as refused:
        open_transfer_dir(vllm_extract_settings(crowded), text)
    message = str(refused.value)
    assert message.startswith(f"{crowded.source}: vLLM extract engine: the transfer directory {base}/dfq-states-")
    assert f"extract.vllm.inflight_tasks ({fitting + 1}) sequences of max_model_len (4,096 tokens" in message
    assert "docker run --shm-size=" in message and "point extract.vllm.transfer_dir at a larger tmpfs" in message
    assert [p for p in base.iterdir()] == [directory]  # the refused engine's directory is gone again


def test_a_canary_rerun_waits_for_the_captures_holding_the_engine_and_keeps_new_ones_waiting():
    async def scenario():
        gate = EngineGate()
        events: list[str] = []
        release_first = asyncio.Event()

        async def capture(name: str, hold: asyncio.Event | None = None):
            async with gate.shared():
                events.append(f"{name} in")
                if hold is not None:
                    await hold.wait()
                else:
                    await asyncio.sleep(0.01)
                events.append(f"{name} out")

        async def canary():
            async with gate.exclusive():
                events.append("canary in")
                await asyncio.sleep(0.01)
                events.append("canary out")

        first = asyncio.create_task(capture("first", release_first))
        second = asyncio.create_task(capture("second"))
        await asyncio.sleep(0.005)
        rerun = asyncio.create_task(canary())
        await asyncio.sleep(0.005)
        third = asyncio.create_task(capture("third"))
        await asyncio.sleep(0.05)
        assert "canary in" not in events and "third in" not in events  # first still holds the engine
        release_first.set()
        await asyncio.gather(first, second, rerun, third)
        return events

    events = asyncio.run(scenario())
    # Captures overlap each other; the rerun runs alone, after the first two and before the third.
    assert events.index("second in") < events.index("first out")
    assert events.index("canary in") > max(events.index("first out"), events.index("second out"))
    assert events.index("canary out") < events.index("third in")
