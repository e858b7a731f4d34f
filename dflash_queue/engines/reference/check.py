"""States held to the checkpoint's own forward: the comparison at load (and in `doctor`), and the audit's.

The canary compares an engine with itself, batched against alone: an error that is the same both ways (a layer
off by one, rows read from the wrong cache slots, the last layer's state taken after the final norm, a kernel
computing something else) passes it by construction. Here the states are compared with the checkpoint's own class
run by Transformers over the same tokens, streamed one decoder layer at a time (engines/reference/streamed.py), at
every captured entry, the last-layer and final-norm entries included.

What "the same" means is measured, not assumed. The checkpoint's own class runs twice: in float32 (the truth) and
in the engine's dtype, its result then rounded as the shard stores it (`stored_as`). Per entry, three measures, each
against what the checkpoint's own class differs by from the truth on the same tokens, times `ROUNDING_FACTOR`, and
never below the dtype's floor (`FLOORS`):

* the whole sequence: relative L2 error over its tokens (the worst sequence);
* the tokens' tail: each token's relative error |got_t - truth_t| / |truth_t|, at its 99th percentile over every
  compared token: a fault that touches more than one token in a hundred (a state of the next token or layer, rows
  one slot off past a position) moves it, and rounding's rare large draws do not;
* any single token: the largest per-token error, bound at least by a gross floor (0.5 in bfloat16): a state of
  another token or request is off by 0.25-1.5, so a swap that changes a handful of tokens shows here, while a token
  that rounding alone leaves far off (a state that nearly cancels) does not fail a correct engine.

Why per token: a trained model's residual stream has a few tokens of massive activation (the first token's state
can be 50 x an ordinary one's), which dominate a whole-sequence norm: a state of the wrong token, layer or request on
every ordinary token moves the whole-sequence error by a few percent (measured on SmolLM2-135M-Instruct: a state of
the next layer 0.036, a swap after a 249-token shared prefix 0.075) while each wrong token is off by 0.25-1.2.
Measured on that model in bfloat16, vLLM's CPU build against the truth and the class's own bfloat16 against the
truth, per entry: at the 99th percentile of tokens 0.008-0.035 and 0.009-0.054, at their worst token 0.012-0.10 and
0.019-0.107 on chat text; on random token ids (the load check's probe) their worst tokens reach 0.31 and 1.5 (tokens
whose state nearly cancels), their 99th percentiles stay at 0.007-0.034 and 0.008-0.044.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_queue.engines.reference.streamed import StreamedDecoder
from dflash_queue.errors import ReferenceMismatch
from dflash_queue.shards.fp8 import dequantize_fp8, quantize_fp8

log = logging.getLogger(__name__)

ROUNDING_FACTOR = 4.0
# The tokens' tail: this quantile of the per-token errors.
TAIL = 0.99
# Per dtype: (whole sequence, tokens' tail, any single token), the least each bound is. In float32 an engine differs
# from the truth by 1e-7 to 1e-6 (a bfloat16 shard's rounding, 4e-3 per token, counts in the class's own); a state
# of the wrong token, layer or request by 0.25 and more per token, 0.8 typically.
FLOORS = {
    torch.float32: (1e-3, 1e-2, 5e-2),
    torch.float64: (1e-6, 1e-5, 1e-4),
    torch.bfloat16: (2e-2, 5e-2, 0.5),
    torch.float16: (1e-2, 3e-2, 0.5),
}
_DEFAULT_FLOORS = (2e-2, 5e-2, 0.5)
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The load-time probe: this many sequences of different lengths, run as one batch.
PROBE_SEQUENCES = 4
# The probe's tokens when the reference runs on host cores beside a GPU engine: a 27B target's two passes over them
# take minutes of a host's cores (docs/extraction.md); the run-time audit covers the long sequences.
HOST_PROBE_TOKENS = 1024


@dataclass(frozen=True)
class EntryComparison:
    """One captured entry over every compared sequence: each measure of the engine's (or the stored) states against
    the truth, the same measure of the checkpoint's own class in the engine's dtype, and the bound."""

    name: str  # "14 (decoder_output)"
    error: float  # relative L2 error over a sequence, the worst sequence
    rounding: float
    bound: float
    tail_error: float  # the TAIL quantile of the per-token relative errors
    tail_rounding: float
    tail_bound: float
    token_error: float  # the largest per-token relative error
    token_rounding: float
    token_bound: float
    worst_token: tuple[int, int]  # (sequence, position) of token_error

    @property
    def agrees(self) -> bool:
        return self.error <= self.bound and self.tail_error <= self.tail_bound and self.token_error <= self.token_bound

    @property
    def excess(self) -> float:
        """How far past its bounds (above 1: beyond them)."""
        return max(self.error / self.bound, self.tail_error / self.tail_bound, self.token_error / self.token_bound)

    def describe(self) -> str:
        sequence, position = self.worst_token
        return (
            f"worst token {self.token_error:.2e} (sequence {sequence}, token {position}; bound "
            f"{self.token_bound:.1e}), tokens' 99th percentile {self.tail_error:.2e} (bound {self.tail_bound:.1e}), "
            f"whole sequence {self.error:.2e} (bound {self.bound:.1e})"
        )


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
        stored = f", stored as {self.stored}" if self.stored and self.stored != dtype else ""
        return (
            f"{len(self.entries)} entries compared with the checkpoint's own forward ({self.architecture}, streamed "
            f"on {self.device}) over {len(self.lengths)} sequence(s) of {'/'.join(map(str, self.lengths))} tokens; "
            f"closest to its bounds: layer {worst.name}, {worst.describe()}; bounds {ROUNDING_FACTOR:g} x what the "
            f"checkpoint's own class differs by in {dtype}{stored}; {self.seconds:.1f} s"
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
    floor, tail_floor, token_floor = FLOORS.get(reference.dtype, _DEFAULT_FLOORS)
    entries = []
    for k, (layer, kind) in enumerate(captured):
        error = rounding = 0.0
        errors, roundings = [], []
        for index, (states, truth, own) in enumerate(zip(got, reference.truth, reference.own)):
            if states.shape != truth.shape:
                raise ValueError(f"sequence {index}: states of shape {tuple(states.shape)}, the reference's "
                                 f"{tuple(truth.shape)}")
            want = truth[:, k]
            error = max(error, _relative(states[:, k], want))
            rounding = max(rounding, _relative(own[:, k], want))
            errors.append(_per_token(states[:, k], want))
            roundings.append(_per_token(own[:, k], want))
        per_token, own_per_token = torch.cat(errors), torch.cat(roundings)
        worst = int(per_token.argmax())
        sequence = next(i for i, end in enumerate(itertools.accumulate(len(e) for e in errors)) if worst < end)
        tail_rounding = float(torch.quantile(own_per_token, TAIL))
        token_rounding = float(own_per_token.max())
        entries.append(EntryComparison(
            name=f"{layer} ({kind})",
            error=error,
            rounding=rounding,
            bound=max(ROUNDING_FACTOR * rounding, floor),
            tail_error=float(torch.quantile(per_token, TAIL)),
            tail_rounding=tail_rounding,
            tail_bound=max(ROUNDING_FACTOR * tail_rounding, tail_floor),
            token_error=float(per_token[worst]),
            token_rounding=token_rounding,
            token_bound=max(ROUNDING_FACTOR * token_rounding, token_floor),
            worst_token=(sequence, worst - sum(len(e) for e in errors[:sequence])),
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
    raise ReferenceMismatch(
        f"{engine}: layer {worst.name} differs from the checkpoint's own forward: {worst.describe()}, more than "
        f"{dtype} rounding explains ({len(beyond)} of {len(comparison.entries)} entries beyond their bounds; "
        f"{comparison.describe()}): these states are not the model's (a layer or token off by one, rows read from the "
        "wrong cache slots or of another request, a state taken after the final norm, a kernel computing something "
        "else)" + (f"; {consequence}" if consequence else ""),
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

