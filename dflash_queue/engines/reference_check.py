"""States held to the checkpoint's own forward: the comparison at load (and in `doctor`), and the audit's.

The canary compares an engine with itself, batched against alone: an error that is the same both ways (a layer
off by one, rows read from the wrong cache slots, the last layer's state taken after the final norm, a kernel
computing something else) passes it by construction. Here the states are compared with the checkpoint's own class
run by Transformers over the same tokens, streamed one decoder layer at a time (engines/streamed_reference.py), at
every captured entry, the last-layer and final-norm entries included.

What "the same" means is measured, not assumed. The checkpoint's own class runs twice: in float32 (the truth) and
in the engine's dtype, its result then rounded as the shard stores it (`stored_as`). Per entry, two measures, each
against what the checkpoint's own class differs by from the truth on the same tokens:

* the whole sequence: relative L2 error over its tokens (the worst sequence);
* the worst token: each token's relative error, |got_t - truth_t| / |truth_t|, at its largest.

A trained model's residual stream has a few tokens of massive activation (the first token's state can be 50 x an
ordinary one's): they dominate a whole-sequence norm, so a state of the wrong token, layer or request on every
ordinary token moves the whole-sequence error by a few percent (measured on SmolLM2-135M-Instruct: a state of the
next layer 0.036, a swap after a 249-token shared prefix 0.075) while each wrong token is off by 0.25-1.2. The
per-token measure sees it. The bound of each measure is `ROUNDING_FACTOR` times what the checkpoint's own class
differs by in the engine's dtype, at least the dtype's floor (`FLOORS`). Measured on that trained model in
bfloat16: its own class per token at most 0.013-0.094 across the captured layers; vLLM's CPU build in bfloat16 at
most 0.011-0.117 (1.25 x its own class at worst); a token's state one position off at least 0.24.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_queue.engines.streamed_reference import StreamedDecoder
from dflash_queue.errors import ReferenceMismatch
from dflash_queue.shards.fp8 import dequantize_fp8, quantize_fp8

log = logging.getLogger(__name__)

ROUNDING_FACTOR = 4.0
# Per dtype: (whole sequence, worst token), the least each bound is. In float32 an engine differs from the truth by
# 1e-7 to 1e-6; a state of the wrong token, layer or request by 0.2 and more per token.
FLOORS = {
    torch.float32: (1e-3, 1e-2),
    torch.float64: (1e-6, 1e-5),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (1e-2, 3e-2),
}
_DEFAULT_FLOORS = (2e-2, 5e-2)
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The load-time probe: this many sequences of different lengths, run as one batch.
PROBE_SEQUENCES = 4
# The probe's tokens when the reference runs on host cores beside a GPU engine: a 27B target's two passes over them
# take minutes of a host's cores (docs/extraction.md); the run-time audit covers the long sequences.
HOST_PROBE_TOKENS = 1024


@dataclass(frozen=True)
class EntryComparison:
    """One captured entry over every compared sequence."""

    name: str  # "14 (decoder_output)"
    error: float  # relative L2 error of the engine's states against the truth, the worst sequence
    rounding: float  # the same for the checkpoint's own class in the engine's dtype (as stored)
    token_error: float  # the largest per-token relative error of the engine's states
    token_rounding: float  # the same for the checkpoint's own class
    bound: float
    token_bound: float
    worst_token: tuple[int, int]  # (sequence, position) of token_error

    @property
    def agrees(self) -> bool:
        return self.error <= self.bound and self.token_error <= self.token_bound

    @property
    def excess(self) -> float:
        """How far past its bounds (above 1: beyond them)."""
        return max(self.error / self.bound, self.token_error / self.token_bound)


@dataclass(frozen=True)
class ReferenceComparison:
    entries: tuple[EntryComparison, ...]
    lengths: tuple[int, ...]  # of the compared sequences
    architecture: str
    device: str  # where the reference ran
    dtype: torch.dtype  # the engine's
    stored: str  # how the compared states were stored ("" when not: the engine's own states)
    seconds: float  # the reference's time, both passes

    @property
    def agrees(self) -> bool:
        return all(entry.agrees for entry in self.entries)

    @property
    def worst(self) -> EntryComparison:
        return max(self.entries, key=lambda entry: entry.excess)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def describe(self) -> str:
        worst = self.worst
        dtype = str(self.dtype).removeprefix("torch.")
        sequence, position = worst.worst_token
        stored = f", stored as {self.stored}" if self.stored and self.stored != dtype else ""
        return (
            f"{len(self.entries)} entries compared with the checkpoint's own forward ({self.architecture}, streamed "
            f"on {self.device}) over {len(self.lengths)} sequence(s) of {'/'.join(map(str, self.lengths))} tokens; "
            f"closest to its bound: layer {worst.name}, worst token {worst.token_error:.2e} (sequence {sequence}, "
            f"token {position}; bound {worst.token_bound:.1e}), whole sequence {worst.error:.2e} (bound "
            f"{worst.bound:.1e}); bounds {ROUNDING_FACTOR:g} x what the checkpoint's own class differs by in {dtype}"
            f"{stored}; {self.seconds:.1f} s"
        )


def stored_as(states: torch.Tensor, hidden_dtype: str) -> torch.Tensor:
    """`states` ([T, K, H]) as a shard of `hidden_dtype` stores them, read back in float32."""
    if hidden_dtype == "fp8_e4m3":
        quantized, scales = quantize_fp8(states)
        return dequantize_fp8(quantized, scales, torch.float32)
    return states.to(STORED_DTYPES[hidden_dtype]).float()


@dataclass(frozen=True)
class Truth:
    """The checkpoint's own states of some sequences: in float32, and in the engine's dtype as stored."""

    truth: list[torch.Tensor]
    own: list[torch.Tensor]
    dtype: torch.dtype
    stored: str
    seconds: float
    device: str
    architecture: str


def reference_truth(
    decoder: StreamedDecoder,
    sequences: Sequence[Sequence[int]],
    captured: Sequence[tuple[int, str]],
    dtype: torch.dtype,
    stored: str = "",
) -> Truth:
    """Both passes of the streamed forward over `sequences`: float32, and `dtype` (skipped when float32), the
    latter rounded as `stored` (a hidden_dtype) when given."""
    truth = decoder.run(sequences, captured, torch.float32)
    own, seconds = truth.states, truth.seconds
    if dtype != torch.float32:
        rounded = decoder.run(sequences, captured, dtype)
        own, seconds = rounded.states, seconds + rounded.seconds
    if stored:
        own = [stored_as(states, stored) for states in own]
    config = decoder.layout.config
    architecture = ",".join(getattr(config, "architectures", None) or [decoder.layout.model_type])
    return Truth(truth.states, own, dtype, stored, seconds, str(decoder.device), architecture)


def compare_with_truth(
    got: Sequence[torch.Tensor], reference: Truth, captured: Sequence[tuple[int, str]]
) -> ReferenceComparison:
    """The engine's (or the stored) states of each sequence ([T, K, H], the captured entries' order) against
    `reference`."""
    if len(got) != len(reference.truth):
        raise ValueError(f"{len(got)} sequences' states compared with {len(reference.truth)} references")
    floor, token_floor = FLOORS.get(reference.dtype, _DEFAULT_FLOORS)
    entries = []
    for k, (layer, kind) in enumerate(captured):
        error = rounding = token_error = token_rounding = 0.0
        worst_token = (0, 0)
        for index, (states, truth, own) in enumerate(zip(got, reference.truth, reference.own)):
            if states.shape != truth.shape:
                raise ValueError(f"sequence {index}: states of shape {tuple(states.shape)}, the reference's "
                                 f"{tuple(truth.shape)}")
            want = truth[:, k]
            error = max(error, _relative(states[:, k], want))
            rounding = max(rounding, _relative(own[:, k], want))
            per_token = _per_token(states[:, k], want)
            position = int(per_token.argmax())
            if float(per_token[position]) > token_error:
                token_error, worst_token = float(per_token[position]), (index, position)
            token_rounding = max(token_rounding, float(_per_token(own[:, k], want).max()))
        entries.append(EntryComparison(
            name=f"{layer} ({kind})",
            error=error,
            rounding=rounding,
            token_error=token_error,
            token_rounding=token_rounding,
            bound=max(ROUNDING_FACTOR * rounding, floor),
            token_bound=max(ROUNDING_FACTOR * token_rounding, token_floor),
            worst_token=worst_token,
        ))
    return ReferenceComparison(
        entries=tuple(entries),
        lengths=tuple(len(t) for t in reference.truth),
        architecture=reference.architecture,
        device=reference.device,
        dtype=reference.dtype,
        stored=reference.stored,
        seconds=reference.seconds,
    )


def require_agreement(comparison: ReferenceComparison, engine: str, consequence: str = "") -> None:
    """Raise ReferenceMismatch, naming the entry and the error (then `consequence`), when the states are beyond a
    bound anywhere."""
    if comparison.agrees:
        return
    beyond = [entry for entry in comparison.entries if not entry.agrees]
    worst = max(beyond, key=lambda entry: entry.excess)
    dtype = str(comparison.dtype).removeprefix("torch.")
    sequence, position = worst.worst_token
    raise ReferenceMismatch(
        f"{engine}: layer {worst.name} differs from the checkpoint's own forward: worst token {worst.token_error:.2e} "
        f"(sequence {sequence}, token {position}; bound {worst.token_bound:.1e}), whole sequence {worst.error:.2e} "
        f"(bound {worst.bound:.1e}), more than {dtype} rounding explains ({len(beyond)} of "
        f"{len(comparison.entries)} entries beyond their bounds; {comparison.describe()}): these states are not the "
        "model's (a layer or token off by one, rows read from the wrong cache slots or of another request, a state "
        "taken after the final norm, a kernel computing something else)" + (f"; {consequence}" if consequence else ""),
        comparison,
    )


def reference_probe_lengths(total: int, longest: int, count: int = PROBE_SEQUENCES) -> list[int]:
    """`count` distinct lengths adding up to about `total` tokens (1, 2, ..., count parts of it), none longer than
    `longest`."""
    parts = count * (count + 1) // 2
    lengths = [max(2, min(longest, total * (i + 1) // parts)) for i in range(count)]
    for i in range(count - 2, -1, -1):  # distinct, shortest first, when `longest` caps several
        lengths[i] = max(2, min(lengths[i], lengths[i + 1] - 1))
    return lengths


def reference_device(decoder: StreamedDecoder, tensor_parallel_size: int, tokens: int) -> torch.device:
    """A spare GPU (visible, beyond the engine's tensor-parallel group, which takes the first ones) with room for
    the streamed forward (one decoder layer's weights in float32 twice over, the embeddings and the activations of
    `tokens` tokens), else the host CPU."""
    if not torch.cuda.is_available() or torch.cuda.device_count() <= tensor_parallel_size:
        return torch.device("cpu")
    spare = torch.device("cuda", tensor_parallel_size)
    free, _ = torch.cuda.mem_get_info(spare)
    text = decoder.layout.text_config
    embeddings = 4 * int(getattr(text, "vocab_size", 0)) * decoder.hidden_size
    activations = 4 * 16 * tokens * decoder.hidden_size
    needed = 2 * decoder.layer_bytes(torch.float32) + embeddings + activations
    return spare if free >= needed else torch.device("cpu")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    tiny = torch.finfo(torch.float32).tiny
    return float(torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want).clamp_min(tiny))


def _per_token(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[T]: each token's relative error."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.linalg.vector_norm(got.float() - want, dim=-1) / torch.linalg.vector_norm(want, dim=-1).clamp_min(tiny)

