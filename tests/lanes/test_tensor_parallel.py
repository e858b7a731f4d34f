"""Which lanes run vLLM over how many GPUs, and the GPU groups their workers must have."""

from __future__ import annotations

from dflash_queue.lanes.tensor_parallel import group_size_error, vllm_tensor_parallel
from dfq_testing.configs import tiny_vllm_overrides


def test_the_lanes_on_vllm_and_their_tensor_parallel_size(make_config):
    transformers = make_config()
    assert vllm_tensor_parallel(transformers.generate, transformers.extract) == {}  # both lanes on Transformers
    generate = make_config("g.toml", **tiny_vllm_overrides(tensor_parallel_size=2))
    assert vllm_tensor_parallel(generate.generate, generate.extract) == {"generate": 2}
    both = make_config("b.toml", **tiny_vllm_overrides(), extract={"engine": "vllm"},
                       **{"extract.vllm": {"tensor_parallel_size": 4}})
    assert vllm_tensor_parallel(both.generate, both.extract) == {"generate": 1, "extract": 4}


def test_a_group_must_have_exactly_tensor_parallel_size_gpus():
    assert group_size_error("extract", (4, 5, 6, 7), 4) is None
    assert group_size_error("extract", (0, 1), 4) == (
        "extract GPU group 0,1 has 2 GPU(s) but extract.vllm.tensor_parallel_size is 4: a vLLM engine spans exactly "
        "tensor_parallel_size GPUs; give groups of 4 (e.g. 0-3) or change the setting"
    )
    assert "has 8 GPU(s) but generate.vllm.tensor_parallel_size is 1" in group_size_error("generate", tuple(range(8)), 1)
