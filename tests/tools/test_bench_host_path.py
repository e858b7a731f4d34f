"""The host-path benchmark at a small shape: both engines' whole paths, through the production code, beside a copy
into mapped memory and one GPU's state rate on the seed target; the report and the JSON agree; and it runs with
none of the packages the GPU machine lacks (no Celery, Redis, vLLM, orjson, pydantic, click or rich), since the GPU
check script calls it there."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent.parent
NUMBER = r"[\d.,]+"
SMALL = ["--tokens", "96", "--layers", "3", "--hidden", "512", "--repeats", "2"]
# Imports refused in the benchmark's process: what the GPU machine's Python does not have.
ABSENT = ["celery", "kombu", "redis", "boto3", "orjson", "vllm", "pydantic", "click", "rich", "zstandard", "pyarrow"]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    refuse = "; ".join(f"sys.modules[{name!r}] = None" for name in ABSENT)
    code = (
        f"import runpy, sys; {refuse}; sys.argv = ['tools/bench_host_path.py', *{list(args)!r}]; "
        "runpy.run_path('tools/bench_host_path.py', run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


def seed_flops_bounds(layers_run: int, tokens: int) -> tuple[float, float]:
    """FLOPs per token of the seed's first `layers_run` layers: 2 per weight, and at most the attention and
    linear-attention terms of a `tokens`-token sequence more."""
    from transformers import AutoConfig

    from dflash_queue.ops.model_size import count_parameters

    text = AutoConfig.from_pretrained(REPO / "examples" / "qwen3.6-27b-class").get_text_config()
    weights = 2.0 * sum(count_parameters(text).active_layers[:layers_run])
    mixing = layers_run * (4 * text.num_attention_heads * text.head_dim * tokens
                           + 6 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim)
    return weights, weights + mixing


def test_a_small_run_reports_each_engines_whole_path_next_to_a_copy_and_the_gpus_state_rate(tmp_path):
    out = tmp_path / "host.json"
    done = run_bench(*SMALL, "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stdout
    assert re.search(r"^host path: 96 tokens x 3 layers x 512 hidden bfloat16 = 0\.3 MB per sample on cpu, 2 rounds",
                     text, re.M), text
    copy = float(re.search(rf"^copy into mapped memory: ({NUMBER}) GB/s$", text, re.M).group(1))
    figures = json.loads(out.read_text())
    assert figures["sample_bytes"] == 96 * 3 * 512 * 2 and figures["repeats"] == 2
    assert figures["shape"] == {"tokens": 96, "layers": 3, "hidden": 512, "dtype": "bfloat16"}
    assert round(figures["copy_gbps"], 2) == copy and len(figures["seconds"]["copy"]) == 2

    gpu = figures["gpu_state_rate"]
    assert gpu["hidden"] == 5120 and len(gpu["layer_ids"]) == 3 and gpu["layers_run"] == max(gpu["layer_ids"]) + 1
    low, high = seed_flops_bounds(gpu["layers_run"], 96)
    assert low < gpu["flops_per_token"] <= high
    assert abs(gpu["tokens_per_s"] - 0.6 * 989e12 / gpu["flops_per_token"]) < 1e-6 * gpu["tokens_per_s"]
    assert gpu["bytes_per_token"] == 3 * 5120 * 2
    assert abs(gpu["gbps"] - gpu["tokens_per_s"] * gpu["bytes_per_token"] / 1e9) < 1e-9
    line = re.search(rf"^one GPU's state rate: ({NUMBER}) GB/s = ({NUMBER}) tokens/s x 30,720 bytes \(3 layers x "
                     rf"hidden 5120 bfloat16\); tokens/s = 0\.6 x 989 TFLOP/s / ({NUMBER}) GFLOP per token", text, re.M)
    assert line, text
    assert float(line.group(1)) == round(gpu["gbps"], 3) and line.group(2) == f"{gpu['tokens_per_s']:,.0f}"

    for engine in ("transformers", "vllm"):
        line = re.search(rf"^{engine}: ({NUMBER}) GB/s, ({NUMBER}) of the copy, ({NUMBER})x one GPU's state rate "
                         r"\((keeps up with one GPU|slower than one GPU makes states)\)$", text, re.M)
        assert line, text
        entry = figures["engines"][engine]
        assert round(entry["gbps"], 2) == float(line.group(1)) and round(entry["of_copy"], 2) == float(line.group(2))
        assert round(entry["of_gpu_state_rate"], 2) == float(line.group(3))
        assert len(figures["seconds"][engine]) == 2 and all(s > 0 for s in figures["seconds"][engine])
        assert abs(entry["of_copy"] - entry["gbps"] / figures["copy_gbps"]) < 1e-9
        assert abs(entry["of_gpu_state_rate"] - entry["gbps"] / gpu["gbps"]) < 1e-9
    # The connector's part is within the vLLM form's time, so at least as fast.
    assert len(figures["seconds"]["connector"]) == 2 and figures["connector_gbps"] > figures["engines"]["vllm"]["gbps"]
    assert figures["date"] and figures["machine"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_host_path", REPO / "tools" / "bench_host_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_form_runs_the_connectors_own_hand_over_and_its_stored_states_are_checked(monkeypatch):
    """The connector's gather reading one slot on (a slot-mapping bug) fails the run: the bench times the production
    `StatesSender` and checks what its untimed round stored."""
    from dflash_queue.engines.vllm.states_sender import StatesSender

    gather = StatesSender.gather
    monkeypatch.setattr(StatesSender, "gather", lambda self, transfer: gather(self, transfer).roll(1, 0))
    with pytest.raises(RuntimeError, match="vllm: the stored shard does not hold the sample's states"):
        load_bench().main(SMALL)


def test_each_round_of_each_engine_goes_through_the_production_functions(monkeypatch):
    """Every production step of both hand-overs is called once per round (the untimed first round and the two timed
    ones): a form that re-implemented one would leave its count short."""
    import dflash_queue.engines.hf.extract as hf_extract
    import dflash_queue.engines.vllm.states_file as states_file
    import dflash_queue.engines.vllm.states_sender as states_sender
    from dflash_queue.shards.training_writer import TrainingShardWriter

    calls: dict[str, int] = {}

    def counted(owner, name: str) -> None:
        production, key = getattr(owner, name), f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

        def count(*args, **kwargs):
            calls[key] = calls.get(key, 0) + 1
            return production(*args, **kwargs)

        monkeypatch.setattr(owner, name, count)

    for owner, name in [(hf_extract, "finish_pass"), (hf_extract, "hand_over"), (states_file, "receive_states"),
                        (states_sender, "save_states"), (states_sender.StatesSender, "send"),
                        (states_sender.StatesSender, "gather"), (states_sender.StatesSender, "write"),
                        (TrainingShardWriter, "write"), (TrainingShardWriter, "finish")]:
        counted(owner, name)
    load_bench().main(SMALL)  # loaded after the patches: the names it imports are the counted functions
    rounds = 1 + 2
    assert calls == {
        "extract.finish_pass": rounds, "extract.hand_over": rounds, "states_file.receive_states": rounds,
        "StatesSender.send": rounds, "StatesSender.gather": rounds, "StatesSender.write": rounds,
        "states_sender.save_states": rounds, "TrainingShardWriter.write": 2 * rounds,
        "TrainingShardWriter.finish": 2 * rounds,
    }, calls


def test_the_copy_goes_into_memory_mapped_before_the_rounds(tmp_path):
    bench = load_bench()
    path = bench.HostPath(bench.parse_args(SMALL), tmp_path, tmp_path)
    mapped = path.mapped.data_ptr()
    assert path.mapped.count_nonzero() == 0
    path.copy()
    assert path.mapped.data_ptr() == mapped and torch.equal(path.mapped, path.states)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "must be >= 1"),
        (["--mfu", "1.5"], "--mfu must be in (0, 1]"),
        (["--model-config", str(REPO / "examples")], f"--model-config {REPO / 'examples'}: no config.json there"),
    ],
)
def test_options_it_cannot_honour_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        load_bench().parse_args(argv)
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_cuda_is_refused_where_torch_sees_none(capsys):
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    with pytest.raises(SystemExit):
        load_bench().parse_args(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
