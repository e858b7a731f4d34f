"""The lanes' own sections. `[extract]`: the extract engines' keys (`engines/config.py`) and the lane's own, which no
engine reads: the canary, the plausibility check, when a worker stops, the window of unconsumed shards, shard size.
`[audit]`: the reference audit of stored shards (lanes/audit.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from dflash_queue.config.sections import Section
from dflash_queue.engines.config import ExtractEngineSettings

# The largest extract.canary_tolerance: the loosest tolerance a calibration gives in any dtype
# (engines/state_checks.TOLERANCE_CEILINGS, which config loading does not import: it imports no torch).
CANARY_TOLERANCE_MAX = 0.25


class ExtractConfig(ExtractEngineSettings):
    canary_samples: Annotated[int, Field(ge=0)] = 1
    """Samples per shard recomputed alone and compared with their states from the shared pass (chosen from the shard
    id, so a re-delivery checks the same ones): through the model's own attention (Transformers engine), or as a
    batch of one through the same engine (vLLM). 0 turns the canary off."""
    canary_tolerance: Annotated[float, Field(ge=0, le=CANARY_TOLERANCE_MAX)] = 0.0
    """Relative error (per layer, over the whole sample and over its first 8 tokens, right after its pack boundary)
    above which the canary fails the task for good (after a re-check with both sides recomputed). 0: calibrated when
    the engine loads, in the production dtype and on the production device: 10 x the difference between probe
    sequences first in their pass (nothing can leak into them; the vLLM engine: batched as production batches) and
    alone, never below the dtype's floor (1e-5 float32, 2e-4 bfloat16, 1e-4 float16) nor above its ceiling (1e-2
    float32, 0.25 bfloat16 and float16). At most 0.25, and a worker refuses to start above its dtype's ceiling:
    the ceiling is the loosest tolerance a calibration gives, chosen below what a sample given another token's or
    another sequence's states differs by on the test models (0.5-1.5), so a configured tolerance above it would pass
    states a calibrated canary fails. On a trained model such states differ by less over the whole sample (0.04-0.11
    at the layers where a few tokens carry massive activations), which is what the per-token bound is for: it is
    never set here, always calibrated (3 x the worst token's noise, 0.1-0.6 in bfloat16, 1e-4-1e-2 float32)."""
    canary_longest_every: Annotated[int, Field(ge=0)] = 8
    """One shard in this many (drawn from the shard id, so a re-delivery does the same) gives one of its
    extract.canary_samples places to its longest sample that followed another sequence in its pass (the vLLM
    engine: the shard's longest; the Transformers engine, which packs the longest first: the longest packed after
    another; the longest where none was): long sequences are prefilled over several engine steps and meet code
    short ones never do. Every shard's other places go to a length stratum (a quarter of the shard's samples ranked
    by length) drawn from the shard id, its samples that followed another sequence first. 0: never."""
    canary_window_every: Annotated[int, Field(ge=0)] = 16
    """One shard in this many (drawn from the shard id) also has its canary run a sequence longer than the model's
    sliding window, attention chunk or linear-attention chunk, after another sequence in one pass, and compare it
    with the sequence alone: the code that only sequences that long reach (a shard's samples are rarely longer than
    a window of thousands of tokens). Built from the shard's own samples when none is long enough. 0: never."""
    rms_outlier_factor: Annotated[float, Field(gt=1)] = 50.0
    """A sample whose median token RMS at a layer is more than this factor above or below the shard's median at
    that layer fails the task (with all-zero and constant layers): states no forward pass gives."""
    stop_after_failed_checks: Annotated[int, Field(ge=0)] = 3
    """A worker whose engine fails the canary or the state checks (plausibility, what the vLLM engine handed over)
    on this many of the last extract.failed_checks_window shards it checked stops taking tasks and exits with status
    78, which the shipped systemd units do not restart on: a systematic fault (a failing GPU, a wrong kernel or
    setting), even one that hits only some shards (the long ones, one batch shape), leaves the remaining shards
    queued for a healthy worker instead of sending them to the dead letters. The shard whose failure completes the
    count is handed back to the queue; the failed ones before it are dead letters, listed in the stop record.
    `status` shows the stop and why. 0: never stop."""
    failed_checks_window: Annotated[int, Field(ge=1)] = 10
    """The shards extract.stop_after_failed_checks counts failures among: the last this many shards the worker
    checked (passed or failed; shards skipped as already stored or failed for other reasons do not count). At least
    extract.stop_after_failed_checks; equal to it, only failures in a row stop the worker."""
    max_unconsumed_shards: Annotated[int, Field(ge=0)] = 0
    """The window of a run trained while it extracts (`dflash_queue.live.LiveShards`): extraction waits while this
    many training shards are stored (or being extracted) that not every consumer has acknowledged yet; a waiting
    task is handed back to the queue after a short wait, so a worker never spins nor holds a shard for long. With
    storage.retention = "until-consumed" it bounds the states in storage. Keep it at least the consumers' ranks
    (each rank waits on a shard of its own). 0: no window."""
    max_shard_bytes: Annotated[int, Field(ge=1)] = 8 * 10**9
    """`plan` warns when a shard (dataset.shard_size samples of the expected length, in hidden_dtype) would be
    larger than this: each shard is staged whole on the worker's disk and uploaded and read back as one object."""

    @model_validator(mode="after")
    def _window_holds_the_count(self) -> ExtractConfig:
        if self.stop_after_failed_checks and self.failed_checks_window < self.stop_after_failed_checks:
            raise ValueError(
                f"extract.failed_checks_window ({self.failed_checks_window}) must be at least "
                f"extract.stop_after_failed_checks ({self.stop_after_failed_checks}): the failures that stop a worker "
                "are counted among that many shards"
            )
        return self


class AuditConfig(Section):
    """The reference audit: stored samples recomputed from their stored token ids by the checkpoint's own class, one
    decoder layer resident at a time (engines/reference/streamed.py), and compared with what was stored, off the
    extract lane's path, by `audit` workers (host cores or a spare GPU). A mismatch stops the extract worker that
    stored the shard (exit 78) and makes every shard it stored since its last passed audit suspect: `verify`,
    `export`, the training reader and live training never serve a suspect shard as good, and `dflash-queue suspects
    reextract` extracts them again once the engine is fixed."""

    enabled: bool = True
    """Send stored shards to the audit lane. `dflash-queue run` starts an audit worker; a fleet serves the lane with
    `dflash-queue worker audit` (systemd: `--audit`)."""
    every_shards: Annotated[int, Field(ge=1)] = 8
    """Each extract worker's first stored shard is audited, then one in this many of the shards it stores."""
    every_minutes: Annotated[float, Field(ge=0)] = 10.0
    """And at least one of its shards every this many minutes of its extraction, whatever every_shards says. 0: by
    count only."""
    samples_per_shard: Annotated[int, Field(ge=1)] = 1
    """Samples of an audited shard recomputed: the shard's longest in every other audit (the long sequences reach
    the engine's later prefill steps), else drawn from the shard id, so a re-delivered task checks the same ones."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reference runs: "auto" is the audit worker's GPU when it has one (`worker audit --gpus 7`), else
    the host CPU."""
