"""Hidden-state extraction: one prefill over exactly the generated ids, capturing K decoder layers by hooks.

Only the base model is loaded (no LM head), and layers above the highest captured one are dropped, so no
FLOP or byte is spent on what is thrown away. `output_hidden_states=True` would materialise every layer.

Sequences are packed (see `packing`): each forward pass is one row of up to `token_budget` tokens with position
ids restarting per sequence and attention confined to each sequence, so no FLOP goes to padding and no sample
sees another. Attention backends:

* "sdpa": `packed_sdpa_attention`, one causal SDPA call per sequence (no mask is built; on CUDA SDPA picks its
  flash kernel), so attention costs sum(len^2), not pack_len^2;
* "flash_attention_2": the flash-attn varlen kernel, given the packed sequence offsets (cu_seqlens);
* "eager": Transformers builds a block-diagonal causal mask from the restarting position ids (slow; reference).

The hooks copy each captured layer into one [tokens, K, H] buffer per pack, so only the K captured layers outlive
their layer. On CUDA that buffer goes to pinned host memory on a side stream while the next pack computes; the
copies are awaited once, before `extract` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AutoModel

from dflash_queue.engines.devices import resolve_device, resolve_dtype
from dflash_queue.engines.layers import resolve_layer_ids
from dflash_queue.engines.packing import cu_seqlens, packed_position_ids, plan_packs
from dflash_queue.errors import NonFiniteHiddenStates, OutOfMemoryAtMinimumBudget

log = logging.getLogger(__name__)

# The name must not contain "flash": Transformers would take it for a flash-attention kernel.
PACKED_SDPA = "packed_causal_sdpa"


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_bounds: Sequence[int] | None = None,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. query [B, heads, T, d], key/value [B, kv_heads, T, d];
    returns [B, T, heads, d]. `packed_bounds` are the sequences' offsets in the row (cu_seqlens)."""
    if attention_mask is not None:
        raise ValueError("packed SDPA attention takes sequence bounds, not an attention mask")
    bounds = packed_bounds if packed_bounds is not None else (0, query.shape[2])
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for start, end in zip(bounds[:-1], bounds[1:]):
        attended = nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        out[:, start:end] = attended.transpose(1, 2)
    return out, None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)


@dataclass(frozen=True)
class ExtractionRequest:
    sample_id: str
    input_ids: list[int]


@dataclass
class _PackResult:
    indices: list[int]
    bounds: list[int]
    states: torch.Tensor  # [tokens, K, H], on the CPU once `ready` has completed
    nonfinite: torch.Tensor  # [sequences], non-finite values per sequence
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class HiddenStateExtractor:
    name = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        layer_ids: Sequence[int] = (),
        num_draft_layers: int = 5,
        device: str = "auto",
        dtype: str = "bfloat16",
        token_budget: int = 16384,
        attn_implementation: str = "sdpa",
        pin_memory: bool = True,
    ) -> None:
        resolved = resolve_device(device)
        model = AutoModel.from_pretrained(
            model_path, dtype=resolve_dtype(dtype, resolved), attn_implementation=_backend(attn_implementation)
        )
        self._attach(model.to(resolved), layer_ids, num_draft_layers, token_budget, attn_implementation, pin_memory)

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        *,
        layer_ids: Sequence[int] = (),
        num_draft_layers: int = 5,
        token_budget: int = 16384,
        attn_implementation: str = "sdpa",
        pin_memory: bool = True,
    ) -> HiddenStateExtractor:
        """An extractor around a base model already in memory, on its device and in its dtype. The model is
        changed in place: layers above the highest captured one are dropped and the attention backend is set."""
        model.set_attn_implementation(_backend(attn_implementation))
        extractor = cls.__new__(cls)
        extractor._attach(model, layer_ids, num_draft_layers, token_budget, attn_implementation, pin_memory)
        return extractor

    def _attach(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        num_draft_layers: int,
        token_budget: int,
        attn_implementation: str,
        pin_memory: bool,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        text_config = model.config.get_text_config()
        self.num_model_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.layer_ids = resolve_layer_ids(tuple(layer_ids), self.num_model_layers, num_draft_layers)
        self.token_budget = token_budget
        # Shrinks (and stays shrunk) when a forward pass runs out of device memory.
        self.effective_token_budget = token_budget
        self.attn_implementation = attn_implementation
        self.model = _truncate_layers(model, max(self.layer_ids) + 1).eval()
        self._cuda = self.device.type == "cuda"
        self._pin = pin_memory and self._cuda
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._buffer: torch.Tensor | None = None
        self._hooks = [
            self._decoder_layers()[layer_id].register_forward_hook(self._capture_hook(position))
            for position, layer_id in enumerate(self.layer_ids)
        ]

    def extract(self, requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]:
        """Hidden states [T, K, H] on the CPU, one per request, in request order, in the model's dtype.

        Raises OutOfMemoryAtMinimumBudget when one sequence alone does not fit in device memory, and
        NonFiniteHiddenStates naming every sample with a NaN or infinite value.
        """
        lengths = [len(r.input_ids) for r in requests]
        for request, length in zip(requests, lengths):
            if length < 1:
                raise ValueError(f"sample {request.sample_id}: no input ids to extract")
        results: list[_PackResult] = []
        pending = list(range(len(requests)))
        while pending:
            plan = plan_packs([lengths[i] for i in pending], self.effective_token_budget)
            packs = [[pending[j] for j in pack] for pack in plan]
            failed: list[int] | None = None
            for number, pack in enumerate(packs):
                try:
                    results.append(self._run_pack(pack, requests))
                except torch.OutOfMemoryError:
                    failed = pack
                    pending = [i for later in packs[number:] for i in later]
                    break
            if failed is None:
                pending = []
            else:
                self._recover_from_oom(failed, requests, lengths)
        return self._collect(results, requests)

    def activation_bytes(self, tokens: int) -> int:
        """Estimated device memory a forward pass over `tokens` packed tokens needs beyond the weights.

        tokens x dtype bytes x (2 K H  +  3 H  +  max(2 (q_heads + kv_heads) head_dim,  3 I)) + tokens x H:
        the capture buffers of this pack and of the previous one (still copying to the host), the residual
        stream, a layer's input norm and output, the larger of attention's q, k, v, output and the MLP's gate,
        up and product, and the finiteness check's boolean temporary. Allocator rounding and the attention
        kernel's workspace (O(tokens) for flash-style kernels) come on top.
        """
        config = self.model.config
        hidden, intermediate = config.hidden_size, config.intermediate_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        per_token = (
            2 * len(self.layer_ids) * hidden
            + 3 * hidden
            + max(2 * (heads + kv_heads) * head_dim, 3 * intermediate)
        )
        return tokens * (per_token * self.dtype.itemsize + hidden)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.model
        if self._cuda:
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _run_pack(self, pack: list[int], requests: Sequence[ExtractionRequest]) -> _PackResult:
        lengths = [len(requests[i].input_ids) for i in pack]
        bounds = cu_seqlens(lengths)
        ids = self._to_device(torch.tensor([t for i in pack for t in requests[i].input_ids]).unsqueeze(0))
        positions = self._to_device(packed_position_ids(lengths))
        buffer = torch.empty((bounds[-1], len(self.layer_ids), self.hidden_size), dtype=self.dtype, device=self.device)
        self._buffer = buffer
        try:
            self.model(input_ids=ids, position_ids=positions, use_cache=False, **self._attention_kwargs(bounds))
        finally:
            self._buffer = None
        nonfinite = self._nonfinite_per_sequence(buffer, bounds)
        if not self._cuda:
            return _PackResult(pack, bounds, buffer, nonfinite, None)
        computed = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(computed)
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=self._pin)
            host.copy_(buffer, non_blocking=self._pin)
            host_nonfinite = torch.empty(nonfinite.shape, dtype=nonfinite.dtype, pin_memory=self._pin)
            host_nonfinite.copy_(nonfinite, non_blocking=self._pin)
            # The caching allocator must not hand these to the next pack before the copies have read them.
            buffer.record_stream(self._copy_stream)
            nonfinite.record_stream(self._copy_stream)
            ready = self._copy_stream.record_event()
        return _PackResult(pack, bounds, host, host_nonfinite, ready)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host to device without making the host wait for the queued kernels (from pinned memory on CUDA)."""
        if self._pin:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _attention_kwargs(self, bounds: list[int]) -> dict:
        if self.attn_implementation == "sdpa":
            return {"packed_bounds": tuple(bounds)}
        if self.attn_implementation == "flash_attention_2":
            offsets = self._to_device(torch.tensor(bounds, dtype=torch.int32))
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            return {
                "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest
            }
        return {}  # Transformers derives a block-diagonal mask from the restarting position ids

    def _nonfinite_per_sequence(self, buffer: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Count of tokens with a NaN or infinite value, per sequence, computed on the device (no sync)."""
        finite = torch.isfinite(buffer[:, 0]).all(dim=1)
        for k in range(1, buffer.shape[1]):  # one layer at a time: a [tokens, H] temporary, not [tokens, K, H]
            finite &= torch.isfinite(buffer[:, k]).all(dim=1)
        bad_tokens = (~finite).to(torch.int32)
        running = torch.nn.functional.pad(bad_tokens.cumsum(0, dtype=torch.int32), (1, 0))
        offsets = self._to_device(torch.tensor(bounds))
        return running[offsets[1:]] - running[offsets[:-1]]

    def _recover_from_oom(self, pack: list[int], requests: Sequence[ExtractionRequest], lengths: list[int]) -> None:
        self._buffer = None
        if self._cuda:
            torch.cuda.empty_cache()
        if len(pack) == 1:
            sample_id = requests[pack[0]].sample_id
            raise OutOfMemoryAtMinimumBudget(
                f"sample {sample_id} ({lengths[pack[0]]} tokens) runs out of device memory even alone",
                sample_ids=(sample_id,),
            )
        pack_tokens = sum(lengths[i] for i in pack)
        # Below the failed pack's size, so that it is split whatever the budget was.
        self.effective_token_budget = max(1, min(self.effective_token_budget, pack_tokens) // 2)
        log.warning(
            "out of device memory on a pack of %d sequences (%d tokens); token budget now %d",
            len(pack), pack_tokens, self.effective_token_budget,
        )

    def _collect(self, results: list[_PackResult], requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(requests)
        nonfinite: list[str] = []
        for result in results:
            result.wait()
            counts = result.nonfinite.tolist()
            for slot, index in enumerate(result.indices):
                out[index] = result.states[result.bounds[slot] : result.bounds[slot + 1]]
                if counts[slot]:
                    nonfinite.append(requests[index].sample_id)
        if nonfinite:
            raise NonFiniteHiddenStates(
                f"{len(nonfinite)} of {len(requests)} samples have NaN or infinite hidden states: "
                + ", ".join(nonfinite[:10]) + (" ..." if len(nonfinite) > 10 else ""),
                sample_ids=tuple(nonfinite),
            )
        return out  # type: ignore[return-value]

    def _capture_hook(self, position: int):
        def hook(_module: nn.Module, _inputs, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if self._buffer is not None:
                self._buffer[:, position].copy_(hidden[0])

        return hook

    def _decoder_layers(self) -> nn.ModuleList:
        return self.model.layers


def _backend(attn_implementation: str) -> str:
    return PACKED_SDPA if attn_implementation == "sdpa" else attn_implementation


def _truncate_layers(model: nn.Module, keep: int) -> nn.Module:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder 'layers' list; this architecture is not supported")
    if keep < len(layers):
        model.layers = nn.ModuleList(list(layers)[:keep])
        model.config.num_hidden_layers = keep
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:keep]
    return model
