"""The `[storage]` section: where prompts, completions and training shards are stored, how S3 is reached, and
the extract lane's background uploader."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dflash_queue.config.sections import PositiveFloat, Section
from dflash_queue.storage.urls import check_storage_url


class S3Config(Section):
    """How to reach an S3-compatible store. Credentials never live here: they come from the AWS chain
    (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, a profile, an instance or pod role)."""

    endpoint_url: str = ""
    """Empty: the AWS chain decides (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile; else AWS itself)."""
    region: str = ""
    """Empty: AWS_REGION / AWS_DEFAULT_REGION / the profile."""
    profile: str = ""
    """A profile name in ~/.aws/config; empty: AWS_PROFILE or the default chain."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """MinIO and Ceph usually need "path"; "auto" lets botocore (and the profile) choose."""
    checksum_algorithm: Literal["CRC32", "CRC32C", "SHA1", "SHA256", "none"] = "CRC32"
    """The S3 checksum sent with every upload (checked by the store) and checked by botocore on whole-object
    reads. "none" for stores that reject checksum headers. A sha256 of the content is stored in the object's
    metadata and verified on every read whatever this says."""
    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore retries throttling, 5xx and connection errors with backoff; "adaptive" also rate-limits the
    client."""
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 10
    """botocore's attempts per request, the first included."""
    connect_timeout_s: PositiveFloat = 10.0
    """Seconds to open a connection to the store."""
    read_timeout_s: PositiveFloat = 120.0
    """Seconds to wait for data on an open connection."""
    multipart_threshold_mb: Annotated[int, Field(ge=5, le=5120)] = 64
    """Objects at least this large are uploaded in parts of part_size_mb (S3's minimum part is 5 MiB)."""
    part_size_mb: Annotated[int, Field(ge=5, le=5120)] = 64
    """Part size of multipart uploads and of ranged downloads, MiB."""
    max_concurrency: Annotated[int, Field(ge=1, le=256)] = 10
    """Part uploads (and ranged downloads) in flight per worker process, over all shards."""
    abort_stale_uploads_after_s: Annotated[int, Field(ge=0)] = 24 * 3600
    """At worker start-up, incomplete multipart uploads under the prefix older than this are aborted (left by
    killed workers; S3 bills their parts). 0 disables. Keep it longer than any single upload takes."""

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_http(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value


class UploaderConfig(Section):
    """The extract lane's background uploader: finished shards wait in a local staging directory."""

    staging_dir: str = ""
    """Empty: {run.state_dir}/staging. Use a local disk with room for max_pending shards."""
    max_pending: Annotated[int, Field(ge=1, le=64)] = 2
    """Shards finished by the engine but not yet stored, per worker process. When reached, the next finished shard
    waits (back-pressure) instead of filling the disk. The extract worker runs 1 + max_pending task slots by
    default: one computing, the others waiting for their shard's upload."""
    parallel_uploads: Annotated[int, Field(ge=1, le=64)] = 2
    """Shards uploading at once (each in parallel parts, see storage.s3.max_concurrency)."""

    @model_validator(mode="after")
    def _parallel_within_pending(self) -> UploaderConfig:
        if self.parallel_uploads > self.max_pending:
            raise ValueError(
                f"parallel_uploads ({self.parallel_uploads}) cannot exceed max_pending ({self.max_pending})"
            )
        return self


class StorageConfig(Section):
    url: Annotated[str, Field(min_length=1)]
    """A local directory (relative paths resolve against the config file), file:///path or s3://bucket/prefix."""
    unavailable_task_retries: Annotated[int, Field(ge=0)] = 30
    """A task whose storage is unreachable (after botocore's own retries) is retried this many times, with backoff
    up to two minutes, before its shard is marked failed."""
    retention: Literal["keep", "until-consumed"] = "keep"
    """What becomes of a training shard once every consumer of its epoch has acknowledged it (the live dataset,
    `dflash_queue.live.LiveShards`): "keep" it, or delete its file ("until-consumed"), leaving under
    `consumed/{epoch}/` a record of the samples it held, so that `verify` and `enqueue` still count them done. With
    extract.max_unconsumed_shards it bounds the states in storage to a window while training reads them.
    Completions are always kept (a later epoch is extracted from them again: `dflash-queue epoch`)."""
    s3: S3Config = S3Config()
    uploader: UploaderConfig = UploaderConfig()

    @field_validator("url")
    @classmethod
    def _url_is_usable(cls, value: str) -> str:
        return check_storage_url(value)
