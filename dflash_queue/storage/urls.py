"""Storage URLs: a local path, ``file:///path`` or ``s3://bucket/prefix``. Parsed without importing any backend."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("file", "s3")
# S3 bucket naming rules (general purpose buckets): 3-63 characters of lowercase letters, digits, dots and
# hyphens, starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    # Empty, or ends with "/": keys are stored as prefix + key.
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def scheme_of(url: str) -> str:
    """'' for a plain path, else the URL scheme in lower case."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def parse_s3_url(url: str) -> S3Location:
    """``s3://bucket``, ``s3://bucket/`` or ``s3://bucket/some/prefix[/]``; raises ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3":
        raise ValueError(f"not an s3:// URL: {url!r}")
    if "@" in parts.netloc:
        raise ValueError(
            "credentials must not appear in the storage URL; they come from the AWS chain "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance role)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(
            f"invalid bucket name {bucket!r} in {url!r}: 3-63 lowercase letters, digits, dots or hyphens"
        )
    segments = [s for s in parts.path.split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise ValueError(f"the prefix of {url!r} must not contain '.' or '..' segments")
    prefix = "/".join(segments) + "/" if segments else ""
    return S3Location(bucket=bucket, prefix=prefix)


def check_storage_url(url: str) -> str:
    """The URL unchanged when usable, else ValueError naming what is wrong."""
    scheme = scheme_of(url)
    if scheme and scheme not in SCHEMES:
        raise ValueError(f"unsupported scheme {scheme!r} in {url!r}; use a path, file:///path or s3://bucket/prefix")
    if scheme == "s3":
        parse_s3_url(url)
    return url
