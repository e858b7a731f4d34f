"""The KV connector that takes each sequence's hidden states out of vLLM (loaded inside vLLM's own processes).

vLLM's `extract_hidden_states` speculative method writes, at every engine step, the residual stream before the
requested layers ("aux" layer ids) of every scheduled token into a cache group of its own ([blocks, K,
block_size, H]). When a request finishes, the scheduler side of this connector keeps its blocks from being freed
and hands their ids to the worker side in the next step's metadata; the worker side (tensor-parallel rank 0
only: every rank holds the same residual stream) gathers the sequence's rows, reduces their per-token statistics
(largest value, smallest, RMS per token and aux layer: engines/passes.py) on the cache's device, and writes the
three, states, token ids and statistics, as one safetensors file in the engine's transfer directory, a tmpfs
(`extract.vllm.transfer_dir`; the format: engines/vllm/states_file.py): memory shared with the extract worker,
which maps it, checks the sequence from its token ids and statistics, and removes it. The states are read once
more on the host, by the shard writer's copy: the checks travel with them, computed where they were. The file
appears whole (written under a temporary name, then renamed); a write that fails leaves `<name>.ioerror` (the
file system refused: full or failing, worth a retry) or `<name>.error` (anything else) with the reason instead.

Wholeness: the blocks of the hidden-state group are zeroed when the scheduler allocates them, before the forward
pass that first writes them (`bind_connector_metadata`). A token whose state the engine never wrote is then an
all-zero row, which the extract worker refuses (see engines/vllm/extract.py). That makes chunked prefill and
preemption safe to use: a sequence whose states are not whole never reaches a shard.

On CUDA the statistics are computed on the device after the gather, then states and statistics are copied on a
side stream into pinned host memory and written by a thread, and the blocks are released once the copy is done; on
CPU all of it happens in the step. That hand-over, gather to file, is engines/vllm/states_sender.py (no vLLM import:
tools/bench_host_path.py times it where vLLM is absent).

Each request names its sample in `kv_transfer_params` ({"sample": id, "canary": bool}, set by the worker).
Fault injection (tests only): `kv_connector_extra_config["faults"]` may zero, make constant, leave half
unwritten, shift by one token, swap, or put a NaN or an infinity into the states of named samples, or hand them
over with other token ids, to prove that the worker's checks catch what such bugs would store. The canary's reruns
of a sample alone are not altered by these: they stand for batching bugs, which a batch of one does not have.
`"no_space": [id, ...]` makes the first write of each named sample's states fail as a full tmpfs would (ENOSPC).
Two faults are not batching bugs: a slot offset (`slot_offset`: every request's rows read that many slots on,
canary reruns included, an error the same batched and alone, which only the load-time comparison with
Transformers can see), and a flake (`flake`: a named sample shifted by one token the first time it is handed over
in a batch, never again; `flake_canary`: the same on its first rerun alone), which the canary's re-check must tell
from a persistent fault.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from dflash_queue.engines.passes import token_stats
from dflash_queue.engines.vllm.states_sender import PARTIAL_SUFFIX, StatesSender, StatesTransfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, whose handler prints from vLLM's processes (with the process's name).
log = logging.getLogger(f"vllm.{__name__}")

# The key of kv_transfer_params (in the request's output) that names the file holding its states.
STATES_PATH_KEY = "dfq_states_path"
# Keys of kv_connector_extra_config.
TRANSFER_DIR_KEY = "transfer_dir"
FAULTS_KEY = "faults"
# Keys of a request's kv_transfer_params (SamplingParams.extra_args["kv_transfer_params"]).
SAMPLE_PARAM = "sample"
CANARY_PARAM = "canary"
# Suffixes of the file left beside a states file that could not be written: an I/O failure (retried), or another.
IO_ERROR_SUFFIX = ".ioerror"
ERROR_SUFFIX = ".error"


def states_file(transfer_dir: str, request_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in request_id)[:200]
    return os.path.join(transfer_dir, f"{safe}.safetensors")


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    transfers: list[StatesTransfer] = field(default_factory=list)
    # Blocks of the hidden-state group allocated in this step: zeroed before its forward pass.
    new_blocks: list[int] = field(default_factory=list)


def hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV-cache group that holds the hidden states (found by its spec type)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [i for i, group in enumerate(groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(
        f"cannot tell which of {len(groups)} KV-cache groups holds the hidden states: the extract_hidden_states "
        "layer must have a group of its own (MLA targets are not supported)"
    )


class HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None:
            raise ValueError("HiddenStatesConnector needs the 'extract_hidden_states' speculative method")
        self._group = hidden_state_group(kv_cache_config)
        if kv_cache_config is not None:
            self._block_size = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        else:
            self._block_size = vllm_config.cache_config.block_size
        transfer = self._kv_transfer_config
        self._dir = str(transfer.get_from_extra_config(TRANSFER_DIR_KEY, ""))
        if not self._dir:
            raise ValueError(f"HiddenStatesConnector needs kv_connector_extra_config[{TRANSFER_DIR_KEY!r}]")
        self._faults: dict[str, Any] = dict(transfer.get_from_extra_config(FAULTS_KEY, None) or {})
        # Scheduler side.
        self._scheduled: set[str] = set()
        self._finished: list[StatesTransfer] = []
        # Worker side.
        self._cache: torch.Tensor | None = None
        self._writer = True  # tensor-parallel rank 0; set in register_kv_caches
        self._rank = 0
        self._sender: StatesSender | None = None  # gathers, checks and writes the states; set in register_kv_caches
        self._held: dict[str, tuple[StatesTransfer, torch.Tensor]] = {}  # a swap fault's first half
        self._no_space = set(self._faults.get("no_space", ()))  # samples whose first write fails (test fault)
        self._flaked: set[tuple[str, str]] = set()  # (fault, sample) of the flakes that fired

    # ---------------------------------------------------------------------------------------------------------
    # Scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # nothing is ever loaded

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(transfers=self._finished)
        self._finished = []
        for new in scheduler_output.scheduled_new_reqs:
            self._scheduled.add(new.req_id)
            meta.new_blocks.extend(new.block_ids[self._group])
        for blocks in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if blocks is not None:
                meta.new_blocks.extend(blocks[self._group])
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        if request_id not in self._scheduled:
            return False, None  # aborted before it was ever scheduled: nothing was computed
        self._scheduled.discard(request_id)
        if request.status == RequestStatus.FINISHED_ABORTED or request.prompt_token_ids is None:
            return False, None  # nobody waits for these states
        path = states_file(self._dir, request_id)
        params = request.kv_transfer_params or {}
        self._finished.append(
            StatesTransfer(
                request_id,
                path,
                list(block_ids),
                list(request.prompt_token_ids),
                sample=str(params.get(SAMPLE_PARAM, "")),
                canary=bool(params.get(CANARY_PARAM, False)),
            )
        )
        return True, {STATES_PATH_KEY: path}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 sends

    # ---------------------------------------------------------------------------------------------------------
    # Worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self._rank, self._writer = rank, rank == 0
        log.info(
            "hidden-states connector, tensor-parallel rank %d of %d: %s", rank, ranks,
            f"writes each finished sequence's states to {self._dir}" if self._writer
            else "writes nothing (rank 0 holds the same residual stream)",
        )
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}: {layers}")
        cache = kv_caches[layers[0]]
        if cache.dim() != 4 or cache.shape[2] != self._block_size:
            raise ValueError(
                f"hidden-state cache of shape {tuple(cache.shape)}: expected [blocks, layers, {self._block_size}, "
                "hidden]; the rows read would be the wrong ones"
            )
        self._cache = cache
        self._sender = StatesSender(cache, self._block_size, _write_error)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not self._writer or self._cache is None or not isinstance(connector_metadata, HiddenStatesMetadata):
            return
        if connector_metadata.new_blocks:
            # Queued before this step's forward pass, on the stream it runs on.
            blocks = torch.tensor(connector_metadata.new_blocks, dtype=torch.long, device=self._cache.device)
            self._cache.index_fill_(0, blocks, 0)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the states are in the cache already; they are taken out when the request finishes

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._writer:
            return None, None
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, HiddenStatesMetadata):
                for transfer in metadata.transfers:
                    self._send(transfer)
        done = self._sender.done() if self._sender is not None else set()
        return done or None, None

    def _gather(self, transfer: StatesTransfer) -> torch.Tensor:
        """The sequence's rows of the cache: [tokens, K, H] (on the cache's device)."""
        assert self._sender is not None
        return self._sender.gather(transfer)

    def _send(self, transfer: StatesTransfer) -> None:
        """Gathered (`_gather`), altered by the test faults, then reduced and written (StatesSender.send)."""
        assert self._sender is not None
        self._sender.send(transfer, lambda t: self._apply_faults(t, self._gather(t)), self._write_fault)

    def _apply_faults(self, transfer: StatesTransfer, states: torch.Tensor) -> torch.Tensor | None:
        if not self._faults:
            return states
        offset = int(self._faults.get("slot_offset", 0))
        if offset:  # each token's row read `offset` slots on, within the sequence's slots
            states = torch.roll(states, shifts=-offset, dims=0)
        sample = transfer.sample
        flake = "flake_canary" if transfer.canary else "flake"
        if sample in self._faults.get(flake, ()) and (flake, sample) not in self._flaked:
            self._flaked.add((flake, sample))
            return torch.roll(states, shifts=1, dims=0)
        if transfer.canary:
            return states
        if sample in self._faults.get("zero", ()):
            return torch.zeros_like(states)
        if sample in self._faults.get("constant", ()):
            return torch.full_like(states, 0.5)
        nonfinite = self._faults.get("nonfinite", {})
        if sample in nonfinite:  # one value of the middle token, first aux layer, made NaN or infinite
            states = states.clone()
            states[len(states) // 2, 0, 0] = float(nonfinite[sample])
            return states
        if sample in self._faults.get("drop_tail", ()):  # the last half of the rows never written
            states = states.clone()
            states[len(states) // 2 :] = 0
            return states
        if sample in self._faults.get("shift", ()):
            return torch.roll(states, shifts=1, dims=0)
        if sample in self._faults.get("other_tokens", ()):  # another sequence's states handed over for this one
            transfer.token_ids = transfer.token_ids[::-1]
            return states
        for pair in self._faults.get("swap", ()):
            if sample in pair:
                partner = next(s for s in pair if s != sample)
                if partner not in self._held:
                    self._held[sample] = (transfer, states.clone())  # its blocks released (StatesSender.send)
                    return None
                other, other_states = self._held.pop(partner)
                tokens = torch.tensor(other.token_ids, dtype=torch.int64)
                assert self._sender is not None
                self._sender.write(other.path, states.clone(), tokens, token_stats(states))
                return other_states
        return states

    def _write_fault(self, transfer: StatesTransfer) -> int:
        """The errno the write of this transfer fails with (test fault `no_space`, first write only); 0: none."""
        if transfer.canary or transfer.sample not in self._no_space:
            return 0
        self._no_space.discard(transfer.sample)
        return errno.ENOSPC

    def shutdown(self) -> None:
        if self._sender is not None:  # the worker side
            log.info("hidden-states connector, tensor-parallel rank %d: wrote %d states file(s)", self._rank,
                     self._sender.files_written)
            self._sender.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # each token's K states together, as the gather above reads them


def _write_error(path: str, message: str, *, io_error: bool = False) -> None:
    """`<path>.ioerror` or `<path>.error` holding `message`, renamed into place once written (the worker reads the
    file as soon as its name appears). A file system too full for the message still gets the (empty) file: its
    name alone tells the worker what happened."""
    log.error("%s", message)
    marker = f"{path}{IO_ERROR_SUFFIX if io_error else ERROR_SUFFIX}"
    partial = f"{marker}{PARTIAL_SUFFIX}"
    try:
        with open(partial, "w") as out:
            out.write(message)
    except OSError:
        pass  # too full for the message (the file may still have been made): its name says enough
    try:
        os.replace(partial, marker)
    except OSError:
        log.exception("cannot leave the error beside %s", path)
