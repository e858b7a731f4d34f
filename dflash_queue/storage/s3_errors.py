"""botocore exceptions -> this package's storage errors, each with the object and a hint at the fix.

Three outcomes matter to a worker: the object is missing (FileNotFoundError, like local storage), the store is
unreachable or overloaded after botocore's own retries (StorageUnavailable: the task is retried later), or the
request can never succeed as configured (StorageAccessError: surfaced at start-up, never retried).
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    MissingDependencyException,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from s3transfer.exceptions import RetriesExceededError

from dflash_queue.errors import ChecksumMismatch, StorageAccessError, StorageError, StorageUnavailable

NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# Codes S3 and compatible stores use for "slow down" and for server-side trouble that passes.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationAborted",
        "XMinioServerNotInitialized",
    }
)
HINTS = {
    "NoSuchBucket": "the bucket does not exist at this endpoint; check storage.url and the endpoint "
    "(storage.s3.endpoint_url, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL)",
    "AccessDenied": "the credentials lack permission; they need s3:ListBucket on the bucket and "
    "s3:GetObject, s3:PutObject, s3:DeleteObject, s3:AbortMultipartUpload under the prefix",
    "AllAccessDisabled": "all access to this bucket has been disabled",
    "InvalidAccessKeyId": "the access key id is unknown to this endpoint; check the AWS credentials chain",
    "SignatureDoesNotMatch": "the secret key does not match the access key id; check the AWS credentials chain",
    "ExpiredToken": "the session token has expired; refresh the credentials",
    "InvalidToken": "the session token is invalid; check AWS_SESSION_TOKEN or the profile",
    "PermanentRedirect": "the bucket lives in another region; set storage.s3.region or AWS_REGION",
    "AuthorizationHeaderMalformed": "wrong region for this bucket; set storage.s3.region or AWS_REGION",
    "IllegalLocationConstraintException": "wrong region for this bucket; set storage.s3.region or AWS_REGION",
    "InvalidRequest": "the store rejected the request; if it does not support checksum headers set "
    'storage.s3.checksum_algorithm = "none"',
    "NotImplemented": "the store does not implement this request; if it is about checksums set "
    'storage.s3.checksum_algorithm = "none"',
}
CREDENTIALS_HINT = (
    "no usable AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), "
    "a profile (AWS_PROFILE or storage.s3.profile), or run with an instance/pod role"
)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def translate(exc: BaseException, what: str) -> BaseException:
    """The exception to raise for `exc`, which happened while doing `what` (an operation and an object URL)."""
    if isinstance(exc, (StorageError, FileNotFoundError)):
        return exc
    if isinstance(exc, ClientError):
        code, status = error_code(exc), http_status(exc)
        message = exc.response.get("Error", {}).get("Message", "") or str(exc)
        if code in NOT_FOUND_CODES:
            return FileNotFoundError(f"{what}: no such object")
        if code in TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return StorageUnavailable(f"{what}: {code or status}: {message} (still failing after retries)")
        hint = HINTS.get(code, "")
        return StorageAccessError(f"{what}: {code or status}: {message}" + (f" ({hint})" if hint else ""))
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return StorageAccessError(f"{what}: {exc} ({CREDENTIALS_HINT})")
    if isinstance(exc, ProfileNotFound):
        return StorageAccessError(f"{what}: {exc} (check storage.s3.profile or AWS_PROFILE)")
    if isinstance(exc, MissingDependencyException):
        return StorageAccessError(f"{what}: {exc}")
    if isinstance(exc, FlexibleChecksumError):
        return ChecksumMismatch(f"{what}: the S3 checksum of the received bytes does not match: {exc}")
    if isinstance(exc, RetriesExceededError) and exc.last_exception is not None:
        return translate(exc.last_exception, what)
    if isinstance(exc, (BotoConnectionError, HTTPClientError, ResponseStreamingError, IncompleteReadError)):
        return StorageUnavailable(f"{what}: {exc} (still failing after retries)")
    if isinstance(exc, BotoCoreError):
        return StorageError(f"{what}: {exc}")
    return exc
