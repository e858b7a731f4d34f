"""The extract engine's vLLM arguments: its settings, `extract_hidden_states` at the aux layers, this package's
KV connector, and what extraction forces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_queue.engines.vllm.runtime import common_engine_args
from dflash_queue.engines.vllm.states_connector import FAULTS_KEY, TRANSFER_DIR_KEY
from dflash_queue.engines.vllm.support import VllmExtractSettings

CONNECTOR = "HiddenStatesConnector"
CONNECTOR_MODULE = "dflash_queue.engines.vllm.states_connector"


def extract_engine_args(setup: VllmExtractSettings, aux_ids: Sequence[int], transfer_dir: str) -> dict[str, Any]:
    """`AsyncEngineArgs` keywords of the extract lane's engine: its settings, extract_hidden_states at `aux_ids`
    (sorted, distinct: the order vLLM caches them in), this package's connector, and what extraction forces."""
    settings = setup.extract.vllm
    extra: dict[str, Any] = {TRANSFER_DIR_KEY: transfer_dir}
    if setup.connector_faults:
        extra[FAULTS_KEY] = dict(setup.connector_faults)
    return {
        **common_engine_args(setup.model, settings),
        "max_model_len": setup.context_len,
        "max_num_batched_tokens": step_tokens(setup),
        "enable_prefix_caching": False,  # see support.FORCED_SETTINGS
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(set(aux_ids))}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        },
    }


def step_tokens(setup: VllmExtractSettings) -> int:
    """Tokens one engine step prefills: extract.vllm.max_num_batched_tokens, else extract.token_budget (the
    Transformers engine's tokens per pass), and never less than one whole sequence without chunked prefill."""
    settings = setup.extract.vllm
    tokens = settings.max_num_batched_tokens or setup.extract.token_budget
    return tokens if settings.enable_chunked_prefill else max(tokens, setup.context_len)


def sequences_in_flight(setup: VllmExtractSettings) -> int:
    """The sequences the lane keeps in the engine: every task in flight submits its shard at once."""
    settings = setup.extract.vllm
    return min(settings.max_num_seqs, settings.inflight_tasks * setup.shard_size)
