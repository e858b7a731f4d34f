"""Background uploads of finished shards, bounded so that a slow store slows the producer instead of filling
the disk.

A shard is written to a file in a local staging directory (`stage`), then handed to a small thread pool that
stores it (`upload`, which returns a future). At most `max_pending` shards are staged or uploading at once:
`stage` blocks while that many are in flight, which is the back-pressure. The staged file is removed once its
upload finished, whether it succeeded or not (a failed task recomputes its shard).

Each process stages into its own sub-directory (`process_dirs`: host and pid in the name); those of dead processes
on this host are removed when an uploader starts.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dflash_queue.storage.base import Storage
from dflash_queue.storage.config import UploaderConfig
from dflash_queue.storage.process_dirs import make_process_dir

log = logging.getLogger(__name__)


class UploaderFull(TimeoutError):
    """No staging slot became free within the timeout."""


class StagedFile:
    """A path in the staging directory holding one uploader slot until released."""

    def __init__(self, uploader: ShardUploader, path: Path) -> None:
        self.uploader = uploader
        self.path = path
        self._released = False

    def release(self) -> None:
        """Remove the file and free the slot (idempotent)."""
        if self._released:
            return
        self._released = True
        self.path.unlink(missing_ok=True)
        self.uploader._free_slot()

    def __enter__(self) -> StagedFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Leaving the block with an error before the file was handed to `upload`: give the slot back.
        if exc_type is not None:
            self.release()


class ShardUploader:
    def __init__(
        self, storage: Storage, staging_root: Path, *, max_pending: int = 2, parallel_uploads: int = 2
    ) -> None:
        if not 1 <= parallel_uploads <= max_pending:
            raise ValueError(f"need 1 <= parallel_uploads ({parallel_uploads}) <= max_pending ({max_pending})")
        self.storage = storage
        self.max_pending = max_pending
        self.staging_root = Path(staging_root)
        self.directory = make_process_dir(self.staging_root)
        self._slots = threading.Semaphore(max_pending)
        self._pending = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(parallel_uploads, thread_name_prefix="dfq-upload")
        self._closed = False

    @property
    def pending(self) -> int:
        """Shards staged or uploading now."""
        with self._lock:
            return self._pending

    def stage(self, name: str, *, timeout: float | None = None) -> StagedFile:
        """A staging path for the shard `name`; blocks while `max_pending` shards are in flight.

        Raises UploaderFull when `timeout` (seconds) passes without a free slot.
        """
        if self._closed:
            raise RuntimeError("the uploader is closed")
        if not self._slots.acquire(timeout=timeout):
            raise UploaderFull(f"{self.max_pending} shards are already waiting for storage")
        with self._lock:
            self._pending += 1
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return StagedFile(self, self.directory / f"{safe}.{uuid.uuid4().hex[:8]}.part")

    def upload(self, staged: StagedFile, key: str) -> Future[None]:
        """Store the staged file under `key` in the background; the future resolves once it is durable."""
        return self._pool.submit(self._store, staged, key)

    def _store(self, staged: StagedFile, key: str) -> None:
        try:
            self.storage.write_file(key, staged.path)
        finally:
            staged.release()

    def _free_slot(self) -> None:
        with self._lock:
            self._pending -= 1
        self._slots.release()

    def close(self) -> None:
        """Finish every upload already handed over, then remove this process's staging directory."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def from_settings(cls, settings: UploaderConfig, staging_dir: Path, storage: Storage) -> ShardUploader:
        """`staging_dir`: Config.staging_dir (settings.staging_dir, or the state directory's staging/)."""
        return cls(storage, staging_dir, max_pending=settings.max_pending, parallel_uploads=settings.parallel_uploads)
