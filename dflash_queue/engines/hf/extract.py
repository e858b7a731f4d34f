"""Hidden-state extraction: one prefill over exactly the generated ids, capturing K decoder layers by hooks.

Only the text decoder is loaded (no LM head, no vision tower; see `decoder`), and layers above the highest
captured one are dropped, so no FLOP or byte is spent on what is thrown away. `output_hidden_states=True`
would materialise every layer.

How sequences share a forward pass is chosen per model at load (`architecture.profile_config`), confirmed by a
probe that compares a packed pass with each sequence run alone, and logged:

* "packed": sequences concatenated in one row of up to `token_budget` tokens, position ids restarting per
  sequence, every token mixer confined to its sequence. Attention backends: "sdpa" is `packed_attention` (one
  causal SDPA call per sequence, the layer's window, soft-capping and sinks applied inside it);
  "flash_attention_2" takes the sequence offsets (cu_seqlens); "eager" builds a block-diagonal mask from the
  restarting position ids. Linear-attention layers run on each sequence in turn;
* "padded": right-padded batches (rows x longest row within the budget) with an attention mask, through the
  model's own attention.

The hooks copy each captured layer into one [tokens, K, H] buffer per pass, so only the K captured layers outlive
their layer. On CUDA that buffer goes to pinned host memory on a side stream while the next pass computes; a
pass's copy is awaited once the next pass is queued, and its sequences are then handed over (`deliver`: the lane
writes them to the shard file and drops them), so the host holds about two passes of states. The states are
checked where they are computed, once: per token and layer the largest value, the smallest and the RMS
(`passes.token_stats`) are reduced on the device before the copy, and only those [tokens, K, 3] statistics are
looked at on the host: a sequence with a NaN or infinite value is named (its largest or smallest value is not
finite), the others are handed over with their per-layer summary for the lane's plausibility checks, and the
shard writer takes the summary as proof that its states were checked (it does not read them again).

`reference_states` runs one sequence alone through the model's own attention (eager where SDPA would drop
soft-capping or sinks): the ground truth the load probe and the lane's canary compare packed results with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from dflash_queue.engines.activation_memory import pass_activation_bytes
from dflash_queue.engines.architecture import ArchitectureProfile, coverage_length, native_attention, require_supported
from dflash_queue.engines.base import CapturedStates, ExtractionRequest
from dflash_queue.engines.decoder import decoder_layers, load_text_decoder, read_layout, spread_device_map
from dflash_queue.engines.devices import resolve_device, resolve_dtype, spread_gpu_count
from dflash_queue.engines.hf.packed_attention import PACKED_ATTENTION, packed_attention, segment_sequences
from dflash_queue.engines.hf.probe import confirm_mode
from dflash_queue.engines.layers import captured_entries, resolve_layer_ids
from dflash_queue.engines.passes import (
    all_finite,
    packed_inputs,
    padded_inputs,
    plan_passes,
    summarize,
    token_stats,
)
from dflash_queue.engines.state_checks import CanaryTolerance
from dflash_queue.errors import NonFiniteHiddenStates, OutOfMemoryAtMinimumBudget, UnsupportedArchitecture
from dflash_queue.faults import applied_extract_faults
from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER

log = logging.getLogger(__name__)

__all__ = ["CapturedStates", "ExtractionRequest", "HiddenStateExtractor"]


@dataclass
class PassResult:
    indices: list[int]
    spans: list[tuple[int, int]]  # each sequence's rows in `states`
    states: torch.Tensor  # [rows, K, H], on the CPU once `ready` has completed
    token_stats: torch.Tensor  # [rows, K, 3] float32: max, min, RMS per token and layer
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class HiddenStateExtractor:
    name = "transformers"
    concurrent_tasks = 1  # one forward pass at a time on the model

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
        packing: str = "auto",
        final_norm_state: bool = False,
        last_layer_state: bool = False,
    ) -> None:
        resolved = resolve_device(device)
        layout = read_layout(model_path)
        profile = require_supported(layout.config, attn_implementation, packing)
        gpus = spread_gpu_count(device)
        device_map = spread_device_map(model_path, layout, gpus) if gpus > 1 else None
        model = load_text_decoder(
            model_path,
            dtype=resolve_dtype(dtype, resolved),
            device=resolved,
            attn_implementation=native_attention(profile, attn_implementation),
            layout=layout,
            device_map=device_map,
        )
        if device_map:
            log.info("decoder layers spread over %d GPUs: %s", gpus, _layers_per_gpu(device_map))
        self._attach(model, profile, layer_ids, num_draft_layers, token_budget, attn_implementation, pin_memory,
                     final_norm_state, last_layer_state)

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
        packing: str = "auto",
        final_norm_state: bool = False,
        last_layer_state: bool = False,
    ) -> HiddenStateExtractor:
        """An extractor around a base model already in memory, on its device and in its dtype. The model is
        changed in place: layers above the highest captured one are dropped and the attention backend is set."""
        profile = require_supported(model.config, attn_implementation, packing)
        extractor = cls.__new__(cls)
        extractor._attach(model, profile, layer_ids, num_draft_layers, token_budget, attn_implementation,
                          pin_memory, final_norm_state, last_layer_state)
        return extractor

    def _attach(
        self,
        model: nn.Module,
        profile: ArchitectureProfile,
        layer_ids: Sequence[int],
        num_draft_layers: int,
        token_budget: int,
        attn_implementation: str,
        pin_memory: bool,
        final_norm_state: bool,
        last_layer_state: bool = False,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        # Inputs go where the embedding is (the first GPU of a spread decoder), and so do the captured states.
        decoder: Any = model
        parameter = next(decoder.get_input_embeddings().parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.profile = profile
        self.num_model_layers: int = profile.num_layers
        self.hidden_size: int = profile.hidden_size
        self.layer_ids = resolve_layer_ids(tuple(layer_ids), self.num_model_layers, num_draft_layers)
        # What each captured entry is: (decoder layer id, DECODER_OUTPUT, LAST_LAYER or FINAL_NORM).
        self.captured: list[tuple[int, str]] = captured_entries(
            self.layer_ids, self.num_model_layers, last_layer_state=last_layer_state, final_norm_state=final_norm_state
        )
        self.token_budget = token_budget
        # Shrinks (and stays shrunk) when a forward pass runs out of device memory.
        self.effective_token_budget = token_budget
        self.attn_implementation = attn_implementation
        self.reference_attention = native_attention(profile, attn_implementation)
        keep = self.num_model_layers if final_norm_state or last_layer_state else max(self.layer_ids) + 1
        # A Transformers decoder: its config's attributes depend on the architecture.
        self.model: Any = _truncate_layers(model, keep).eval()
        self.mode: str = profile.mode
        self._cuda = self.device.type == "cuda"
        self._pin = pin_memory and self._cuda
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._buffer: torch.Tensor | None = None
        self._hooks = [
            decoder_layers(self.model)[layer_id].register_forward_hook(self._capture_hook(position))
            for position, (layer_id, kind) in enumerate(self.captured)
            if kind in (DECODER_OUTPUT, LAST_LAYER)
        ]
        if final_norm_state:
            norm = getattr(self.model, "norm", None)
            if not isinstance(norm, nn.Module):
                raise UnsupportedArchitecture(
                    f"{profile.text_model_type} has no final norm module ('norm'): extract.final_norm_state needs one"
                )
            final = next(position for position, (_, kind) in enumerate(self.captured) if kind == FINAL_NORM)
            self._hooks.append(norm.register_forward_hook(self._capture_hook(final)))
        self._segment_linear_attention()
        self.use_mode(self.mode)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.mode, self.tolerance = confirm_mode(self)

    # ---------------------------------------------------------------------------------------------------------
    # Extraction

    def extract(self, requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]:
        """Hidden states [T, K, H] on the CPU, one per request, in request order, in the model's dtype."""
        return [captured.states for captured in self.capture(requests)]

    def capture(
        self,
        requests: Sequence[ExtractionRequest],
        *,
        deliver: Callable[[int, CapturedStates], None] | None = None,
    ) -> list[CapturedStates]:
        """States and per-layer statistics, one per request, in request order.

        With `deliver`, each request's result goes to `deliver(request index, captured)` as soon as its pass is
        done, and nothing is kept or returned: the host then holds about one pass's states (two on CUDA, where
        a pass's copy to the host overlaps the next pass), whatever the number of requests.

        Raises OutOfMemoryAtMinimumBudget when one sequence alone does not fit in device memory, and
        NonFiniteHiddenStates naming every sample with a NaN or infinite value (after the other samples were
        delivered). Faults the test suite applies around a capture (`faults.extract_faults_applied`, to prove the
        checks that must catch them) make the shared passes wrong in the ways dflash_queue/faults.py describes.
        """
        lengths = [len(r.input_ids) for r in requests]
        for request, length in zip(requests, lengths):
            if length < 1:
                raise ValueError(f"sample {request.sample_id}: no input ids to extract")
        out: list[CapturedStates | None] = [None] * len(requests)
        deliver_one = deliver or out.__setitem__
        nonfinite: list[str] = []
        in_flight: list[PassResult] = []
        pending = list(range(len(requests)))
        while pending:
            plan = plan_passes(self.mode, [lengths[i] for i in pending], self.effective_token_budget)
            passes = [[pending[j] for j in group] for group in plan]
            failed: list[int] | None = None
            for number, group in enumerate(passes):
                try:
                    in_flight.append(self._run(group, requests))
                except torch.OutOfMemoryError:
                    failed = group
                    pending = [i for later in passes[number:] for i in later]
                    break
                # The pass before this one has been copying to the host while this one computed.
                while len(in_flight) > 1:
                    hand_over(in_flight.pop(0), requests, deliver_one, nonfinite)
            if failed is None:
                pending = []
            else:
                self._recover_from_oom(failed, requests, lengths)
        while in_flight:
            hand_over(in_flight.pop(0), requests, deliver_one, nonfinite)
        if nonfinite:
            raise NonFiniteHiddenStates.among(nonfinite, len(requests))
        return [] if deliver else out  # type: ignore[return-value]

    @torch.inference_mode()
    def reference_states(self, request: ExtractionRequest, *, on_device: bool = False) -> torch.Tensor:
        """The states of one sequence run alone through the model's own attention: [T, K, H] on the CPU, or
        left on the model's device (`on_device`) to compare them there."""
        self._set_attention(self.reference_attention)
        try:
            ids = torch.tensor([request.input_ids], device=self.device)
            buffer = torch.empty((ids.shape[1], len(self.captured), self.hidden_size), dtype=self.dtype,
                                 device=self.device)
            self._buffer = buffer
            try:
                self.model(input_ids=ids, use_cache=False)
            finally:
                self._buffer = None
        finally:
            self.use_mode(self.mode)
        return buffer if on_device else buffer.cpu()

    def canary_tolerance(self) -> CanaryTolerance:
        """Calibrated by the load probe in this engine's dtype and on its device (see hf/probe.py)."""
        return self.tolerance

    @property
    def pass_tokens(self) -> int:
        return self.effective_token_budget

    def run_together(self, requests: Sequence[ExtractionRequest]) -> list[CapturedStates]:
        """These sequences in one pass, in this order (packed or padded as the engine runs)."""
        captured: dict[int, CapturedStates] = {}
        nonfinite: list[str] = []
        run = self._run(list(range(len(requests))), requests)
        hand_over(run, requests, captured.__setitem__, nonfinite)
        if nonfinite:
            raise NonFiniteHiddenStates.among(nonfinite, len(requests))
        return [captured[i] for i in range(len(requests))]

    def coverage_length(self) -> int:
        """How far the model's token mixers reach (window, attention chunk, linear-attention chunk); 0: none."""
        return coverage_length(self.profile)

    def activation_bytes(self, tokens: int) -> int:
        """Estimated device memory a forward pass over `tokens` packed tokens needs beyond the weights (see
        `activation_memory.pass_activation_bytes`)."""
        return pass_activation_bytes(self.model.config, tokens, len(self.captured), self.dtype.itemsize)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.model
        if self._cuda:
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------------------------------
    # Passes

    @torch.inference_mode()
    def _run(
        self,
        group: list[int],
        requests: Sequence[ExtractionRequest],
    ) -> PassResult:
        faults = applied_extract_faults()  # the test suite's, applied around the lane's capture
        sequences = [requests[i].input_ids for i in group]
        if self.mode == "packed":
            built = packed_inputs(sequences)
            assert built.bounds is not None  # packed inputs always have them
            bounds = [0, built.bounds[-1]] if faults and faults.break_packing else built.bounds
            extra = self._packing_kwargs(bounds)
        else:
            built, extra = padded_inputs(sequences), {}
        spans = built.spans
        inputs = {name: self._to_device(tensor) for name, tensor in built.tensors.items()} | extra
        rows = inputs["input_ids"].numel()
        buffer = torch.empty((rows, len(self.captured), self.hidden_size), dtype=self.dtype, device=self.device)
        self._buffer = buffer
        window_ignored = bool(faults and faults.ignore_window and self.mode == "packed")
        if window_ignored:
            self._set_attention(PACKED_ATTENTION_IGNORING_WINDOWS)
        try:
            self.model(**inputs, use_cache=False)
        finally:
            self._buffer = None
            if window_ignored:
                self.use_mode(self.mode)
        if faults and faults.head_leak is not None:
            _leak_into_heads(buffer, spans, *faults.head_leak)
        return finish_pass(group, spans, buffer, self._copy_stream, pin=self._pin)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host to device without making the host wait for the queued kernels (from pinned memory on CUDA)."""
        if self._pin:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _packing_kwargs(self, bounds: list[int]) -> dict:
        kwargs: dict = {"packed_bounds": tuple(bounds)}  # read by packed_attention and segmented linear attention
        if self.attn_implementation == "flash_attention_2":
            offsets = self._to_device(torch.tensor(bounds, dtype=torch.int32))
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            kwargs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest, max_length_k=longest)
        return kwargs

    def _recover_from_oom(self, group: list[int], requests: Sequence[ExtractionRequest], lengths: list[int]) -> None:
        self._buffer = None
        if self._cuda:
            torch.cuda.empty_cache()
        if len(group) == 1:
            sample_id = requests[group[0]].sample_id
            raise OutOfMemoryAtMinimumBudget(
                f"sample {sample_id} ({lengths[group[0]]} tokens) runs out of device memory even alone",
                sample_ids=(sample_id,),
            )
        rows = len(group) * max(lengths[i] for i in group) if self.mode == "padded" else 0
        pass_tokens = rows or sum(lengths[i] for i in group)
        # Below the failed pass's size, so that it is split whatever the budget was.
        self.effective_token_budget = max(1, min(self.effective_token_budget, pass_tokens) // 2)
        log.warning(
            "out of device memory on a pass of %d sequences (%d tokens); token budget now %d",
            len(group), pass_tokens, self.effective_token_budget,
        )

    def _capture_hook(self, position: int):
        def hook(_module: nn.Module, _inputs, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if self._buffer is not None:
                self._buffer[:, position].copy_(hidden.reshape(-1, hidden.shape[-1]))

        return hook

    # ---------------------------------------------------------------------------------------------------------
    # Mode set-up and the load probe

    def _segment_linear_attention(self) -> None:
        for layer in decoder_layers(self.model):
            mixer = getattr(layer, "linear_attn", None)
            if mixer is not None:
                mixer.forward = segment_sequences(mixer.forward)

    def use_mode(self, mode: str) -> None:
        """Run later passes packed or padded (the attention backend follows)."""
        self.mode = mode
        if mode == "packed" and self.attn_implementation == "sdpa":
            self._set_attention(PACKED_ATTENTION)
        else:
            self._set_attention(self.reference_attention)

    def _set_attention(self, name: str) -> None:
        if self.model.config._attn_implementation != name:
            self.model.set_attn_implementation(name)


def finish_pass(
    group: list[int],
    spans: list[tuple[int, int]],
    buffer: torch.Tensor,
    copy_stream: torch.cuda.Stream | None,
    *,
    pin: bool = True,
) -> PassResult:
    """A pass's captured states [rows, K, H], checked where they are: their token statistics reduced on their device
    (`token_stats`); then, on CUDA, states and statistics copied to the host on `copy_stream` (pinned memory when
    `pin`), overlapping the next pass. On the CPU the buffer itself is the result."""
    stats = token_stats(buffer)
    if copy_stream is None:
        return PassResult(group, spans, buffer, stats, None)
    computed = torch.cuda.current_stream(buffer.device).record_event()
    with torch.cuda.stream(copy_stream):
        copy_stream.wait_event(computed)
        host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=pin)
        host.copy_(buffer, non_blocking=pin)
        host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=pin)
        host_stats.copy_(stats, non_blocking=pin)
        # The caching allocator must not hand these to the next pass before the copies have read them.
        buffer.record_stream(copy_stream)
        stats.record_stream(copy_stream)
        ready = copy_stream.record_event()
    return PassResult(group, spans, host, host_stats, ready)


def hand_over(
    result: PassResult,
    requests: Sequence[ExtractionRequest],
    deliver: Callable[[int, CapturedStates], None],
    nonfinite: list[str],
) -> None:
    """Each finite sequence of a finished pass to `deliver`, with its per-layer summary; the others are named in
    `nonfinite`. Only the statistics are read here, never the states."""
    result.wait()
    for position, ((start, end), index) in enumerate(zip(result.spans, result.indices)):
        stats = result.token_stats[start:end]
        if not all_finite(stats):
            nonfinite.append(requests[index].sample_id)
            continue
        deliver(index, CapturedStates(result.states[start:end], summarize(stats), position))


def _layers_per_gpu(device_map: dict[str, int]) -> str:
    """"0: layers 0-23, 1: layers 24-46, ..." from a spread decoder's device map."""
    runs: dict[int, list[int]] = {}
    for name, gpu in device_map.items():
        if name.startswith("layers."):
            runs.setdefault(gpu, []).append(int(name.split(".")[1]))
    return ", ".join(f"{gpu}: layers {min(ids)}-{max(ids)}" for gpu, ids in sorted(runs.items()))


def _packed_attention_ignoring_windows(*args, sliding_window=None, **kwargs):
    """Fault injection (faults.ExtractFaults.ignore_window): packed attention without the layers' windows."""
    return packed_attention(*args, **kwargs)


PACKED_ATTENTION_IGNORING_WINDOWS = "dfq_packed_ignoring_windows"
AttentionInterface.register(PACKED_ATTENTION_IGNORING_WINDOWS, _packed_attention_ignoring_windows)


def _leak_into_heads(buffer: torch.Tensor, spans: list[tuple[int, int]], share: float, tokens: int) -> None:
    """Fault injection (faults.head_leak): the first `tokens` states of every sequence that follows another in its
    pass get `share` of the previous sequence's last state, at their own scale: what a convolution or recurrent
    state carried across a pack boundary does."""
    for (_, previous_end), (start, end) in zip(spans[:-1], spans[1:]):
        carried = buffer[previous_end - 1].float()  # [K, H]
        direction = carried / torch.linalg.vector_norm(carried, dim=-1, keepdim=True).clamp_min(1e-30)
        head = buffer[start : min(start + tokens, end)]
        scale = torch.linalg.vector_norm(head.float(), dim=-1, keepdim=True)
        head.copy_((head.float() + share * scale * direction).to(buffer.dtype))


def _truncate_layers(model: Any, keep: int) -> Any:
    layers = decoder_layers(model)
    if keep < len(layers):
        model.layers = nn.ModuleList(list(layers)[:keep])
        model.config.num_hidden_layers = keep
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:keep]
    return model
