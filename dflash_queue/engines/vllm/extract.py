"""Hidden-state extraction through one resident vLLM engine (`extract.engine = "vllm"`), tensor parallel over the
worker's GPU group.

vLLM's `extract_hidden_states` speculative method caches the residual stream before the requested layers
("aux" layer ids) for every token it prefills. Each sequence (prompt + completion ids, exactly as stored) is one
request with `max_tokens = 1`; when it finishes, this package's KV connector (engines/vllm/states_connector.py,
loaded inside vLLM's processes) writes its states into the engine's transfer directory, a tmpfs shared with this
process, which reads them, checks them and hands them to the shard writer. The engine is fed by several task
threads at once (`extract.vllm.inflight_tasks`), so it stays full across shards as the generate lane's does.

Layer conventions: vLLM's aux id k is the residual stream before decoder layer k, which is Transformers'
`hidden_states[k]` and this package's layer k-1 (the output of decoder layer k-1); aux id N (N layers) is the
last layer's output before the final norm. vLLM returns the aux layers in ascending order, whatever order the
config lists them in; they are put back in the config's order here. The final-norm entry is aux id N through the
checkpoint's own norm (engines/final_norm.py). Layer ids, `layer_states` and every shard field are those the
Transformers engine writes for the same config; the shard's `extraction` says "vllm".

What is checked on every sequence before it is stored: the token ids the engine prefilled are the request's, the
states have one row per token at every layer, and no row is all zero (the connector zeroes the cache blocks when
they are allocated, so a row the engine never wrote shows as zeros: chunked prefill, preemption, or vLLM's
all-zero bug for hybrid models, #46301), and every value is finite. The connector computes each token's largest
value, smallest and RMS where the states are (on the GPU) and sends them in the states file: these checks, and
the lane's (plausible RMS, constant layers), read those statistics, not the states (engines/vllm/states_file.py).
Then the canary.

The canary reruns a sample as a batch of one through the same engine: it waits until the requests already in the
engine have finished, and new ones wait for it (`EngineGate`). vLLM is not batch invariant, so its tolerance is
calibrated when the engine loads on probe sequences batched as production batches them, in the production dtype
(engines/vllm/calibration.py). An error the same batched and alone escapes the canary: so at load the engine's
states of a probe are also compared with the checkpoint's own Transformers forward (engines/reference/check.py),
and the engine refuses to start beyond the dtype's rounding.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dflash_queue.engines.base import CapturedStates, ExtractionRequest
from dflash_queue.engines.decoder import read_layout
from dflash_queue.engines.final_norm import FinalNorm
from dflash_queue.engines.layers import resolve_layer_ids, vllm_aux_ids_of_entries, vllm_aux_layer_ids
from dflash_queue.engines.passes import all_finite, summarize, token_stats
from dflash_queue.engines.reference.check import (
    HOST_PROBE_TOKENS,
    ReferenceComparison,
    compare_with_truth,
    reference_device,
    reference_probe_lengths,
    reference_truth,
    require_agreement,
)
from dflash_queue.engines.reference.streamed import StreamedDecoder
from dflash_queue.engines.state_checks import CanaryTolerance
from dflash_queue.engines.vllm import runtime as vllm_runtime
from dflash_queue.engines.vllm.calibration import (
    PROBES,
    avoid_single_token_tail,
    calibrate_batched,
    probe_lengths,
    probe_requests,
)
from dflash_queue.engines.vllm.extract_args import CONNECTOR, extract_engine_args, sequences_in_flight
from dflash_queue.engines.vllm.gate import EngineGate
from dflash_queue.engines.vllm.runtime import ResidentVllmEngine, token_prompt
from dflash_queue.engines.vllm.states_connector import (
    CANARY_PARAM,
    SAMPLE_PARAM,
    STATES_PATH_KEY,
)
from dflash_queue.engines.vllm.states_file import receive_states
from dflash_queue.engines.vllm.support import (
    FORCED_SETTINGS,
    VllmExtractSettings,
    vllm_refusal,
)
from dflash_queue.engines.vllm.transfer import StatesArrivals, coverage_length_of, open_transfer_dir
from dflash_queue.errors import (
    EngineStatesInvalid,
    EngineUnavailable,
    GenerationRejected,
    NonFiniteHiddenStates,
    UnsupportedArchitecture,
)
from dflash_queue.shards.training import FINAL_NORM

log = logging.getLogger(__name__)

# How long a finished request's states may take to appear (a copy of at most a few hundred MB).
STATES_WAIT_S = 300.0


# ---------------------------------------------------------------------------------------------------------------
# The engine


class VllmStateExtractor:
    name = "vllm"
    mode = "vllm"

    def __init__(self, setup: VllmExtractSettings) -> None:
        settings = setup.extract.vllm
        layout = read_layout(setup.model.path)
        refusal = vllm_refusal(layout.config)
        if refusal:
            raise UnsupportedArchitecture(f"{setup.model.path}: {refusal}")
        text: Any = layout.text_config
        self.num_model_layers: int = int(text.num_hidden_layers)
        self.hidden_size: int = int(text.hidden_size)
        self.vocab_size: int = int(text.vocab_size)
        self.layer_ids = resolve_layer_ids(
            setup.extract.layer_ids, self.num_model_layers, setup.extract.num_draft_layers
        )
        self.captured: list[tuple[int, str]] = setup.extract.captured_entries(self.num_model_layers)
        wanted = vllm_aux_ids_of_entries(self.captured, self.num_model_layers)
        self.aux_ids = vllm_aux_layer_ids(self.captured, self.num_model_layers)
        # Column of vLLM's states holding each captured entry (the final-norm entry: before its norm).
        self._columns = torch.tensor([self.aux_ids.index(aux) for aux in wanted])
        self._final_norm_entry = next(
            (position for position, (_, kind) in enumerate(self.captured) if kind == FINAL_NORM), None
        )
        self.concurrent_tasks = settings.inflight_tasks
        self.device = torch.device("cpu")  # states arrive in host memory
        self.configured_tolerance = setup.canary_tolerance
        self._model_path = setup.model.path
        self._decoder: StreamedDecoder | None = None  # the checkpoint's own forward (engines/reference/check.py)
        self._captures = iter(range(1 << 62))
        self._captures_lock = threading.Lock()

        vllm_runtime.prepare_environment(settings)
        self.transfer_dir = open_transfer_dir(setup, text)
        for setting, why in FORCED_SETTINGS:
            log.info("vLLM extract engine: %s (%s)", setting, why)
        if settings.enable_chunked_prefill:
            log.info("vLLM extract engine: chunked prefill on; every sequence is checked whole before it is stored")
        args = extract_engine_args(setup, wanted, str(self.transfer_dir))
        log.info(
            "vLLM extract engine: max_num_batched_tokens %d (%s)", args["max_num_batched_tokens"],
            "extract.vllm.max_num_batched_tokens" if settings.max_num_batched_tokens else "extract.token_budget",
        )
        try:
            self._resident = ResidentVllmEngine(
                args, settings, "vllm-extract-loop", in_flight=sequences_in_flight(setup)
            )
        except BaseException:
            shutil.rmtree(self.transfer_dir, ignore_errors=True)
            raise
        try:
            model_config = self._resident.engine.model_config
            self.dtype: torch.dtype = model_config.dtype
            self.max_model_len: int = int(model_config.max_model_len)
            self._final_norm = (
                FinalNorm(setup.model.path, self.dtype, layout) if setup.extract.final_norm_state else None
            )
            self._gate, self._arrivals = self._resident.run(self._make_loop_objects())
            self._coverage = coverage_length_of(text)
            # Whether the engine computes the model first: a canary is worth calibrating only for one that does.
            self.reference = self._check_reference(setup)
            self.calibrated_noise, self._tolerance = self._calibrate()
        except BaseException:
            self.close()
            raise

    async def _make_loop_objects(self) -> tuple[EngineGate, StatesArrivals]:
        return EngineGate(), StatesArrivals(self.transfer_dir)  # asyncio objects, made on the engine's loop

    # -----------------------------------------------------------------------------------------------------------
    # Extraction

    def extract(self, requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]:
        return [captured.states for captured in self.capture(requests)]

    def capture(
        self,
        requests: Sequence[ExtractionRequest],
        *,
        deliver: Callable[[int, CapturedStates], None] | None = None,
    ) -> list[CapturedStates]:
        """States and statistics, one per request (request order), or each to `deliver(index, captured)` as soon
        as the engine has finished its sequence (in the order they finish). Safe from several threads at once.

        Raises EngineStatesInvalid (the task fails for good) when the engine's states cannot be the sequence's
        own, NonFiniteHiddenStates naming the samples with NaN or infinite states (after the others were
        delivered), GenerationRejected for a sequence the engine refuses (longer than its context).
        """
        for request in requests:
            if not request.input_ids:
                raise ValueError(f"sample {request.sample_id}: no input ids to extract")
        out: list[CapturedStates | None] = [None] * len(requests)
        hand_over = deliver or out.__setitem__
        if not requests:
            return []
        with self._captures_lock:
            capture = next(self._captures)
        arrived: queue.Queue[tuple[int, str]] = queue.Queue()
        running = self._resident.submit(self._run_all(capture, requests, arrived))
        position = 1 if len(requests) > 1 else 0
        nonfinite: list[str] = []
        received = 0
        try:
            while received < len(requests):
                try:
                    index, path = arrived.get(timeout=0.2)
                except queue.Empty:
                    if running.done():
                        running.result()  # raises what ended it early
                    continue
                received += 1
                states, stats = self._receive(requests[index], path)
                if not all_finite(stats):
                    nonfinite.append(requests[index].sample_id)
                    continue
                hand_over(index, CapturedStates(states, summarize(stats), position))
            running.result()
        except BaseException:
            running.cancel()
            self._remove_files(capture)
            raise
        if nonfinite:
            raise NonFiniteHiddenStates.among(nonfinite, len(requests))
        return [] if deliver else out  # type: ignore[return-value]

    def reference_states(self, request: ExtractionRequest, *, on_device: bool = False) -> torch.Tensor:
        """The states of `request` run as a batch of one: the engine is drained of other requests first, and
        takes none until it is done. [T, K, H] on the CPU."""
        with self._captures_lock:
            capture = next(self._captures)
        try:
            path = self._resident.run(self._run_alone(capture, request))
        except BaseException:
            self._remove_files(capture)
            raise
        return self._receive(request, path)[0]

    def canary_tolerance(self) -> CanaryTolerance:
        return self._tolerance

    def coverage_length(self) -> int:
        return self._coverage

    @property
    def pass_tokens(self) -> int:
        return self.max_model_len

    def run_together(self, requests: Sequence[ExtractionRequest]) -> list[CapturedStates]:
        """These sequences batched in the engine (the order does not matter to it)."""
        return self.capture(requests)

    async def _run_all(
        self, capture: int, requests: Sequence[ExtractionRequest], arrived: queue.Queue[tuple[int, str]]
    ) -> None:
        async with self._gate.shared():
            tasks = [
                asyncio.create_task(self._run_one(f"c{capture}.{i}", request, arrived, i))
                for i, request in enumerate(requests)
            ]
            await self._resident.gather_checked(tasks, "extracting hidden states")

    async def _run_alone(self, capture: int, request: ExtractionRequest) -> str:
        async with self._gate.exclusive():
            return await self._run_one(f"c{capture}.0", request, None, 0, canary=True)

    async def _run_one(
        self,
        request_id: str,
        request: ExtractionRequest,
        arrived: queue.Queue[tuple[int, str]] | None,
        index: int,
        *,
        canary: bool = False,
    ) -> str:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self._resident.engine
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": {SAMPLE_PARAM: request.sample_id, CANARY_PARAM: canary}},
        )
        final = None
        try:
            async for output in engine.generate(token_prompt(engine, request.input_ids), params, request_id):
                final = output
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the vLLM engine died while extracting sample {request.sample_id}") from exc
        except (VLLMClientError, ValueError) as exc:
            raise GenerationRejected(f"sample {request.sample_id}: vLLM refused the sequence: {exc}") from exc
        if final is None or not final.finished:
            raise EngineUnavailable(f"sample {request.sample_id}: the vLLM engine returned no finished output")
        path = (final.kv_transfer_params or {}).get(STATES_PATH_KEY)
        if not path:
            raise EngineStatesInvalid(
                f"sample {request.sample_id}: the vLLM engine finished without handing over states (is the "
                f"{CONNECTOR} connector loaded?)"
            )
        try:
            await self._arrivals.wait(path, STATES_WAIT_S)
        except TimeoutError:
            if engine.errored:
                raise EngineUnavailable("the vLLM engine died while handing over states") from None
            raise EngineUnavailable(
                f"sample {request.sample_id}: its states did not arrive in {STATES_WAIT_S:.0f} s"
            ) from None
        if arrived is not None:
            arrived.put((index, path))
        return path

    def _receive(self, request: ExtractionRequest, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The states the connector wrote for `request`, checked from their token ids and statistics
        (engines/vllm/states_file.py), in the captured entries' order: ([T, K, H], [T, K, 3] statistics)."""
        received = receive_states(
            path, request.sample_id, request.input_ids, self.aux_ids, self._columns, self.hidden_size
        )
        states, stats = received.states, received.stats
        if self._final_norm is not None and self._final_norm_entry is not None:
            # In place: the tensors view this process's map of the (removed) file, or a copy of it.
            entry = self._final_norm_entry
            states[:, entry] = self._final_norm(states[:, entry])
            stats[:, entry] = token_stats(states[:, entry : entry + 1])[:, 0]
        return states, stats

    def _remove_files(self, capture: int) -> None:
        """Files of an abandoned capture: those already there (the connector may still write others; they go
        with the directory when the engine stops)."""
        for path in self.transfer_dir.glob(f"c{capture}.*"):
            path.unlink(missing_ok=True)

    # -----------------------------------------------------------------------------------------------------------
    # Load-time calibration of the canary

    def _calibrate(self) -> tuple[float, CanaryTolerance]:
        """(largest relative difference between probe sequences batched and alone, the canary's tolerance); see
        engines/vllm/calibration.py."""
        scheduler = self._resident.engine.vllm_config.scheduler_config
        step_tokens = int(scheduler.max_num_batched_tokens)
        count = min(PROBES, int(scheduler.max_num_seqs))
        lengths = probe_lengths(self.max_model_len, step_tokens, self._coverage, count)
        calibration = calibrate_batched(
            self.capture,
            self.reference_states,
            probe_requests(lengths, self.vocab_size),
            self.dtype,
            groups=self.concurrent_tasks,
        )
        measured = calibration.tolerance
        noise = measured.noise_whole
        shown = "/".join(map(str, calibration.lengths))
        if calibration.beyond_rounding(self.dtype):
            raise UnsupportedArchitecture(
                f"vLLM extract engine: probe sequences of {shown} tokens batched differ from the same sequences "
                f"alone by {calibration.typical:.2e} relative (median; largest {noise:.2e}), more than {self.dtype} "
                "rounding explains: this engine does not extract this model exactly (extract.engine = "
                "'transformers' may)"
            )
        configured = self.configured_tolerance
        tolerance = measured.configured(configured, self.dtype) if configured else measured
        log.info(
            "vLLM extract engine: probe sequences of %s tokens (steps of %d tokens) batched vs alone differ by %.2e "
            "relative at most (median %.2e, first tokens %.2e, worst token %.2e, %s); canary tolerance %.2e whole "
            "sample, %.2e first tokens%s, %.2e per token (%.1f s)",
            shown, step_tokens, noise, calibration.typical, measured.noise_head, measured.noise_token,
            str(self.dtype).removeprefix("torch."), tolerance.whole, tolerance.head,
            " (extract.canary_tolerance)" if configured else "", tolerance.token, calibration.seconds,
        )
        if noise > tolerance.whole:
            log.warning("vLLM extract engine: a probe differs batched from alone by more than the canary's tolerance "
                        "(%.2e > %.2e): expect canary mismatches on this engine", noise, tolerance.whole)
        if measured.noise_token > tolerance.token:
            log.warning("vLLM extract engine: a probe token differs batched from alone by more than the canary's "
                        "per-token bound (%.2e > %.2e, the %s ceiling): expect canary mismatches on this engine",
                        measured.noise_token, tolerance.token, str(self.dtype).removeprefix("torch."))
        return noise, tolerance

    def _check_reference(self, setup: VllmExtractSettings) -> ReferenceComparison | None:
        """This engine's states of a probe batch against the checkpoint's own Transformers forward, streamed one
        decoder layer at a time (see engines/reference/check.py), at every captured entry; raises ReferenceMismatch
        beyond the dtype's rounding.

        The probe is PROBE_SEQUENCES sequences of different lengths run as one batch, as production batches them,
        so that slot mapping across requests is exercised; where the reference can afford it (vLLM's CPU build, a
        spare GPU) they reach past the engine's first prefill step (extract.vllm.reference_tokens, else a step and a
        half); on host cores beside a GPU engine, HOST_PROBE_TOKENS (the run-time audit covers long sequences)."""
        settings = setup.extract.vllm
        if not settings.reference_check:
            log.warning("vLLM extract engine: its states are not compared with the checkpoint's own forward "
                        "(extract.vllm.reference_check = false)")
            return None
        step_tokens = int(self._resident.engine.vllm_config.scheduler_config.max_num_batched_tokens)
        engine_on_gpu = self._resident.engine.vllm_config.device_config.device.type == "cuda"
        self._decoder = StreamedDecoder(setup.model.path, layout=read_layout(setup.model.path))
        past_a_step = step_tokens + step_tokens // 2 + self._coverage
        self._decoder.device = reference_device(
            self._decoder, settings.tensor_parallel_size, settings.reference_tokens or past_a_step
        )
        beside_gpu = engine_on_gpu and self._decoder.device.type == "cpu"
        budget = settings.reference_tokens or (HOST_PROBE_TOKENS if beside_gpu else past_a_step)
        lengths = [avoid_single_token_tail(n, step_tokens) for n in reference_probe_lengths(budget, self.max_model_len - 1)]
        comparison = self.compare_with_checkpoint(probe_requests(lengths, self.vocab_size, seed=1))
        require_agreement(comparison, "vLLM extract engine", "refusing to start (extract.engine = 'transformers' runs "
                          "the checkpoint's own class)")
        log.info("vLLM extract engine: states as the checkpoint's own (steps of %d tokens): %s", step_tokens,
                 comparison.describe())
        return comparison

    def compare_with_checkpoint(self, requests: Sequence[ExtractionRequest]) -> ReferenceComparison:
        """These sequences run as one batch, as production batches them, against the checkpoint's own forward
        (streamed on the reference's device), at every captured entry."""
        if self._decoder is None:
            self._decoder = StreamedDecoder(self._model_path)
        got = [captured.states for captured in self.capture(requests)]
        truth = reference_truth(self._decoder, [r.input_ids for r in requests], self.captured, self.dtype)
        return compare_with_truth(got, truth, self.captured)

    def close(self) -> None:
        resident = getattr(self, "_resident", None)
        try:
            if resident is not None:
                resident.close()  # stopping its loop cancels the arrivals' scanner too
        finally:
            shutil.rmtree(self.transfer_dir, ignore_errors=True)
