"""The extract engine's transfer directory, its side: where it lies and whether it has room (a tmpfs shared with
vLLM's processes, one per engine), and the futures for the states files the connector writes into it."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dflash_queue.engines.architecture import coverage_length, profile_config
from dflash_queue.engines.vllm.states_connector import ERROR_SUFFIX, IO_ERROR_SUFFIX
from dflash_queue.engines.vllm.support import (
    DEFAULT_TRANSFER_DIR,
    VllmExtractSettings,
    transfer_bytes,
    transfer_room_shortfall,
)
from dflash_queue.errors import ConfigError, EngineStatesInvalid, StatesHandOverFailed
from dflash_queue.storage.process_dirs import make_process_dir

log = logging.getLogger(__name__)

# How often the transfer directory is looked at while something is awaited.
SCAN_MIN_S = 0.001
SCAN_MAX_S = 0.02
_DIR_PREFIX = "dfq-states-"




def coverage_length_of(text_config: Any) -> int:
    """The model's window, attention chunk or linear-attention chunk, as the Transformers engine reads it."""
    return coverage_length(profile_config(text_config))


def transfer_base(setting: str) -> Path:
    """extract.vllm.transfer_dir, else /dev/shm (memory), else the temporary directory (said in the log)."""
    if setting:
        return Path(setting)
    if DEFAULT_TRANSFER_DIR.is_dir() and os.access(DEFAULT_TRANSFER_DIR, os.W_OK):
        return DEFAULT_TRANSFER_DIR
    fallback = Path(tempfile.gettempdir())
    log.warning("no writable /dev/shm: states pass through %s (set extract.vllm.transfer_dir to a tmpfs)", fallback)
    return fallback


def open_transfer_dir(setup: VllmExtractSettings, text_config: Any) -> Path:
    """This engine's transfer directory under `transfer_base` (`process_dirs.make_process_dir`: one of its own, those
    of this host's dead processes removed), once its file system is seen to hold extract.vllm.inflight_tasks
    maximal sequences' states; else the worker refuses to start, saying which settings (or the container's
    --shm-size) fix it, rather than fail every long sample's task later."""
    base = transfer_base(setup.extract.vllm.transfer_dir)
    directory = make_process_dir(base, _DIR_PREFIX, tagged=True)
    shortfall = transfer_room_shortfall(setup, text_config, directory)
    if shortfall:
        shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError(f"{setup.source}: vLLM extract engine: {shortfall}")
    log.info(
        "vLLM extract engine: states pass through %s (%.2f GB free, %.2f GB for %d sequences of %d tokens)",
        directory, shutil.disk_usage(directory).free / 1e9, transfer_bytes(setup, text_config) / 1e9,
        setup.extract.vllm.inflight_tasks, setup.context_len,
    )
    return directory


class StatesArrivals:
    """Futures for the files the connector will write, resolved by one task that looks at the directory (rather
    than one poller per request): a file appears whole (renamed into place), or `<name>.ioerror` (the file system
    refused the write: StatesHandOverFailed, retried) or `<name>.error` (EngineStatesInvalid) appears."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._scanner: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    async def wait(self, path: str, timeout: float) -> str:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        name = os.path.basename(path)
        self._waiting[name] = future
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._scanner is None or self._scanner.done():
            self._scanner = loop.create_task(self._scan())
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiting.pop(name, None)

    async def _scan(self) -> None:
        delay = SCAN_MIN_S
        assert self._wake is not None
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                delay = SCAN_MIN_S
            present = set(os.listdir(self.directory))
            found = False
            for name, future in list(self._waiting.items()):
                if future.done():
                    continue
                if name in present:
                    future.set_result(str(self.directory / name))
                    found = True
                elif f"{name}{IO_ERROR_SUFFIX}" in present:  # the file system refused: the task is retried
                    reason = self._take(f"{name}{IO_ERROR_SUFFIX}") or "the transfer directory is full or failing"
                    future.set_exception(StatesHandOverFailed(
                        f"the vLLM engine could not write states into {self.directory}: {reason} (see "
                        "extract.vllm.transfer_dir)"
                    ))
                    found = True
                elif f"{name}{ERROR_SUFFIX}" in present:
                    reason = self._take(f"{name}{ERROR_SUFFIX}")
                    future.set_exception(EngineStatesInvalid(f"the vLLM engine could not hand over states: {reason}"))
                    found = True
            delay = SCAN_MIN_S if found else min(delay * 2, SCAN_MAX_S)
            await asyncio.sleep(delay)

    def _take(self, name: str) -> str:
        """The reason the connector left in `name`, which is removed."""
        path = self.directory / name
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""
        finally:
            path.unlink(missing_ok=True)
