"""S3 and S3-compatible stores (MinIO, Ceph, R2) with boto3.

* Where and who: endpoint, region and addressing style from ``[storage.s3]`` or the AWS chain; credentials only
  from the AWS chain (environment, profile, instance or pod role).
* Integrity: every object carries the sha256 of its content in its metadata (``x-amz-meta-dfq-sha256``),
  checked on every read; uploads also send an S3 checksum (``storage.s3.checksum_algorithm``) that the store
  verifies on receipt, part by part for multipart uploads, and botocore checks it on whole-object reads.
* Atomic: an object appears under its key only when PutObject or CompleteMultipartUpload succeeds, so a reader
  never sees part of one. A failed multipart upload is aborted (now, or once the endpoint answers again), and
  uploads left by killed workers are aborted at start-up once older than ``abort_stale_uploads_after_s``.
* Retries: botocore's standard/adaptive retry modes handle throttling, 5xx and connection errors; what still
  fails is raised as StorageUnavailable (try later) or StorageAccessError (never retried).
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from io import BytesIO
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

import dflash_queue
from dflash_queue.errors import ChecksumMismatch, ConfigError, StorageError
from dflash_queue.storage.checks import FAIL, OK, WARN, CheckResult
from dflash_queue.storage.config import S3Config
from dflash_queue.storage.s3_errors import CREDENTIALS_HINT, error_code, translate
from dflash_queue.storage.urls import parse_s3_url

log = logging.getLogger(__name__)

SHA256_METADATA = "dfq-sha256"
MiB = 1024 * 1024


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _has_crt() -> bool:
    try:
        import awscrt  # noqa: F401
    except ImportError:
        return False
    return True


def client_config(settings: S3Config) -> BotoConfig:
    checksums = "when_required" if settings.checksum_algorithm == "none" else "when_supported"
    options: dict = {
        "retries": {"mode": settings.retry_mode, "max_attempts": settings.max_attempts},
        "connect_timeout": settings.connect_timeout_s,
        "read_timeout": settings.read_timeout_s,
        # Part uploads of several shards plus the small requests of other task threads.
        "max_pool_connections": settings.max_concurrency + 8,
        "request_checksum_calculation": checksums,
        "response_checksum_validation": checksums,
        "user_agent_extra": f"dflash-queue/{dflash_queue.__version__}",
    }
    if settings.addressing_style != "auto":
        options["s3"] = {"addressing_style": settings.addressing_style}
    return BotoConfig(**options)


def transfer_config(settings: S3Config) -> TransferConfig:
    return TransferConfig(
        multipart_threshold=settings.multipart_threshold_mb * MiB,
        multipart_chunksize=settings.part_size_mb * MiB,
        max_concurrency=settings.max_concurrency,
        use_threads=True,
        preferred_transfer_client="classic",
    )


class S3Storage:
    """Keys live under ``s3://bucket/prefix/``; see the module docstring for the guarantees."""

    def __init__(self, url: str, settings: S3Config | None = None) -> None:
        location = parse_s3_url(url)
        self.bucket, self.prefix, self.url = location.bucket, location.prefix, location.url
        self.settings = settings or S3Config()
        if self.settings.checksum_algorithm == "CRC32C" and not _has_crt():
            raise ConfigError(
                "storage.s3.checksum_algorithm: CRC32C needs the awscrt package (pip install 'botocore[crt]'); "
                "or use CRC32, SHA1 or SHA256"
            )
        try:
            self.session = boto3.session.Session(profile_name=self.settings.profile or None)
            self.client = self.session.client(
                "s3",
                endpoint_url=self.settings.endpoint_url or None,
                region_name=self.settings.region or None,
                config=client_config(self.settings),
            )
        except Exception as exc:
            raise translate(exc, f"open {self.url}") from exc
        self.transfer = create_transfer_manager(self.client, transfer_config(self.settings))
        algorithm = self.settings.checksum_algorithm
        self._upload_args = {} if algorithm == "none" else {"ChecksumAlgorithm": algorithm}
        self._read_args = {} if algorithm == "none" else {"ChecksumMode": "ENABLED"}
        # Multipart uploads this client started and has not seen finish: aborted if their upload fails.
        self._open_uploads: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self.client.meta.events.register("after-call.s3.CreateMultipartUpload", self._remember_upload)

    # -- the Storage protocol -------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def read_bytes(self, key: str) -> bytes:
        full = self._full_key(key)
        for attempt in (1, 2):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=full, **self._read_args)
                data = response["Body"].read()
            except Exception as exc:
                error = translate(exc, f"read {self._url(key)}")
                if isinstance(error, ChecksumMismatch) and attempt == 1:
                    log.warning("%s; reading it again", error)
                    continue
                raise error from exc
            try:
                self._verify(key, response.get("Metadata", {}), hashlib.sha256(data).hexdigest(), len(data))
            except ChecksumMismatch as error:
                if attempt == 2:
                    raise
                log.warning("%s; reading it again", error)
                continue
            return data
        raise AssertionError("unreachable")

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes from byte `start`, in one ranged GET: how shard readers fetch a header and then
        one sample's rows. The recorded sha256 covers the whole object, so a range is not checked against it
        (`inspect` checks whole objects)."""
        if start < 0 or length < 0:
            raise StorageError(f"{self._url(key)}: invalid byte range start={start} length={length}")
        if length == 0:
            return b""
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._full_key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            data = response["Body"].read()
        except Exception as exc:
            raise translate(exc, f"read {self._url(key)} bytes {start}-{start + length - 1}") from exc
        if len(data) != length:
            raise StorageError(f"{self._url(key)}: asked for {length} bytes at {start}, the object holds {len(data)}")
        return data

    def write_bytes(self, key: str, data: bytes) -> None:
        full = self._full_key(key)
        metadata = {SHA256_METADATA: hashlib.sha256(data).hexdigest()}
        if len(data) >= self.settings.multipart_threshold_mb * MiB:
            self._upload(key, BytesIO(data), metadata)
            return
        try:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, Metadata=metadata, **self._upload_args)
        except Exception as exc:
            raise translate(exc, f"write {self._url(key)}") from exc

    def write_file(self, key: str, path: Path) -> None:
        self._upload(key, str(path), {SHA256_METADATA: file_sha256(Path(path))})

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        head = self._head(key)
        with tempfile.TemporaryDirectory(prefix="dfq-s3-") as tmp:
            path = Path(tmp) / key.rsplit("/", 1)[-1]
            try:
                self.transfer.download(self.bucket, self._full_key(key), str(path), extra_args=self._read_args).result()
            except Exception as exc:
                raise translate(exc, f"download {self._url(key)}") from exc
            self._verify(key, head.get("Metadata", {}), file_sha256(path), path.stat().st_size)
            yield path

    def list(self, prefix: str = "") -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.prefix) :]
        except Exception as exc:
            raise translate(exc, f"list {self.url}{prefix}") from exc

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._full_key(key))
        except Exception as exc:
            raise translate(exc, f"delete {self._url(key)}") from exc

    # -- multipart upkeep -----------------------------------------------------------------------------------

    def abort_stale_uploads(self, older_than_s: float | None = None) -> int:
        """Abort incomplete multipart uploads under the prefix started more than `older_than_s` ago.

        Run at worker start-up: uploads that old were left by a killed worker, and keep billing their parts.
        """
        older_than_s = self.settings.abort_stale_uploads_after_s if older_than_s is None else older_than_s
        cutoff = time.time() - older_than_s
        aborted = 0
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() <= cutoff and self._abort(upload["Key"], upload["UploadId"]):
                        aborted += 1
        except Exception as exc:
            raise translate(exc, f"list multipart uploads under {self.url}") from exc
        if aborted:
            log.info("aborted %d incomplete multipart uploads under %s", aborted, self.url)
        return aborted

    def incomplete_uploads(self) -> builtins.list[tuple[str, datetime]]:
        """(key, initiated) of every incomplete multipart upload under the prefix."""
        found: builtins.list[tuple[str, datetime]] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                found.extend((u["Key"][len(self.prefix) :], u["Initiated"]) for u in page.get("Uploads", []))
        except Exception as exc:
            raise translate(exc, f"list multipart uploads under {self.url}") from exc
        return found

    def abort_failed_uploads(self) -> int:
        """Retry aborting the uploads whose own upload failed while the endpoint was away; the number left."""
        with self._lock:
            pending = [(key, upload_id) for key, ids in self._open_uploads.items() for upload_id in ids]
        for key, upload_id in pending:
            if self._abort(key, upload_id):
                self._forget_upload(key, upload_id)
        with self._lock:
            return sum(len(ids) for ids in self._open_uploads.values())

    # -- checks and lifecycle -------------------------------------------------------------------------------

    def describe(self) -> str:
        credentials = self.session.get_credentials()
        source = credentials.method if credentials else "none found"
        return (
            f"{self.url} (endpoint {self.client.meta.endpoint_url}, region {self.client.meta.region_name}, "
            f"addressing {self.settings.addressing_style}, checksum {self.settings.checksum_algorithm}, "
            f"credentials: {source})"
        )

    def preflight_checks(self) -> builtins.list[CheckResult]:
        """Credentials and bucket, before the generic write/read/delete probe."""
        results = []
        try:
            credentials = self.session.get_credentials()
        except Exception as exc:
            results.append(CheckResult("credentials", FAIL, str(translate(exc, "resolve AWS credentials"))))
            return results
        if credentials is None:
            results.append(CheckResult("credentials", FAIL, CREDENTIALS_HINT))
            return results
        results.append(CheckResult("credentials", OK, f"from {credentials.method}"))
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            error = translate(exc, f"bucket {self.bucket} at {self.client.meta.endpoint_url}")
            if isinstance(error, FileNotFoundError):
                error = StorageError(f"bucket {self.bucket!r} does not exist at {self.client.meta.endpoint_url}")
            results.append(CheckResult("bucket", FAIL, str(error)))
            return results
        results.append(CheckResult("bucket", OK, f"{self.bucket} at {self.client.meta.endpoint_url}"))
        try:
            stale = self.incomplete_uploads()
        except StorageError as exc:
            results.append(CheckResult("multipart uploads", WARN, str(exc)))
        else:
            status = WARN if stale else OK
            message = f"{len(stale)} incomplete under {self.url}" + (
                f", oldest started {min(when for _, when in stale):%Y-%m-%d %H:%M}" if stale else ""
            )
            results.append(CheckResult("multipart uploads", status, message))
        return results

    def close(self) -> None:
        self.transfer.shutdown()
        try:
            left = self.abort_failed_uploads()
        except Exception:  # shutting down: the start-up cleanup catches what is left
            log.exception("could not abort failed multipart uploads under %s", self.url)
            return
        if left:
            log.warning("%d failed multipart uploads under %s could not be aborted", left, self.url)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # -- internals ------------------------------------------------------------------------------------------

    def _full_key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StorageError(f"invalid storage key {key!r}")
        return self.prefix + key

    def _url(self, key: str) -> str:
        return f"{self.url}{key}"

    def _head(self, key: str) -> dict:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._full_key(key))
        except Exception as exc:
            raise translate(exc, f"head {self._url(key)}") from exc

    def _verify(self, key: str, metadata: dict, actual: str, size: int) -> None:
        expected = metadata.get(SHA256_METADATA)
        if expected is None:
            raise ChecksumMismatch(
                f"{self._url(key)}: the object has no {SHA256_METADATA} metadata, so its content cannot be "
                "verified; objects must be written through dflash_queue storage"
            )
        if expected != actual:
            raise ChecksumMismatch(
                f"{self._url(key)}: checksum mismatch: stored sha256 {expected}, content ({size} bytes) hashes "
                f"to {actual}; the object is corrupt, delete it so that its task writes it again"
            )

    def _upload(self, key: str, source: str | BytesIO, metadata: dict[str, str]) -> None:
        full = self._full_key(key)
        self.abort_failed_uploads()
        extra_args = {"Metadata": metadata, **self._upload_args}
        try:
            self.transfer.upload(source, self.bucket, full, extra_args=extra_args).result()
        except BaseException as exc:
            self._abort_open_uploads(full)
            raise translate(exc, f"upload {self._url(key)}") from exc
        with self._lock:
            self._open_uploads.pop(full, None)

    def _remember_upload(self, parsed: dict, **_kwargs) -> None:
        if parsed.get("UploadId") and parsed.get("Key"):
            with self._lock:
                self._open_uploads.setdefault(parsed["Key"], set()).add(parsed["UploadId"])

    def _forget_upload(self, full_key: str, upload_id: str) -> None:
        with self._lock:
            ids = self._open_uploads.get(full_key, set())
            ids.discard(upload_id)
            if not ids:
                self._open_uploads.pop(full_key, None)

    def _abort_open_uploads(self, full_key: str) -> None:
        with self._lock:
            ids = list(self._open_uploads.get(full_key, ()))
        for upload_id in ids:
            if self._abort(full_key, upload_id):
                self._forget_upload(full_key, upload_id)

    def _abort(self, full_key: str, upload_id: str) -> bool:
        """Abort one multipart upload; True when it is gone (also when it already was)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
        except ClientError as exc:
            if error_code(exc) == "NoSuchUpload":
                return True
            log.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket, full_key, exc)
            return False
        except Exception as exc:
            log.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket, full_key, exc)
            return False
        return True

