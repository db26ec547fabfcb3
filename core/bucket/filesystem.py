"""The bucket's filesystems and what their errors mean: one fsspec filesystem per URL, `file://` or `s3://`.

The stores (`core.bucket.store`) build on this: it parses and checks bucket URLs, makes the
filesystem (s3fs with its own and botocore's retries off, since `app.retry` is the one retry
policy), and sorts errors into transient (worth a retry), lost create-only races, and absent
objects. Messages go through `app.auth.redact`, so they cannot carry credentials.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from contracts.auth import redact

# Codes that S3 and S3-compatible stores answer when a retry is the right move; AWS answers concurrent
# conditional writes with ConditionalRequestConflict, and a retry then learns who won.
_TRANSIENT_CODES = frozenset(
    "SlowDown Throttling ThrottlingException RequestThrottled RequestLimitExceeded TooManyRequests RequestTimeout "
    "RequestTimeoutException InternalError ServiceUnavailable OperationAborted ConditionalRequestConflict".split()
)


class BucketError(RuntimeError):
    """A bucket operation failed (after retries, where retrying made sense); names the URL and operation."""


class VersionExists(BucketError):
    """The version (or step) is already committed: a racing publisher won, or it was published before."""


class VersionNotFound(BucketError, LookupError):
    """No committed manifest for that version (or step): never published, still uploading, or collected."""


class IntegrityError(BucketError):
    """A fetched file does not match the size or sha256 its manifest promises."""


class NotSigned(IntegrityError):
    """A version whose manifest is not signed by its lineage's key: not this lineage's, whoever wrote it there."""


class InvalidName(BucketError, ValueError):
    """A version name, URL or path that is not ours: wrong spelling, outside the prefix, or traversal."""


def describe_error(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}")[:500]


def error_chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def s3_error_code(exc: BaseException) -> tuple[str | None, int | None]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    return response.get("Error", {}).get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_precondition_failed(exc: BaseException) -> bool:
    """A create-only write lost: FileExistsError (local, AWS) or PreconditionFailed/412 (SeaweedFS: EINVAL)."""
    for e in error_chain(exc):
        code, status = s3_error_code(e)
        if isinstance(e, FileExistsError) or code == "PreconditionFailed" or status == 412:
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: the store was unreachable, slow, overloaded or failing, not the request wrong."""
    network: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
    with contextlib.suppress(ImportError):
        import botocore.exceptions as bex

        network += (bex.ConnectionError, bex.HTTPClientError)
    with contextlib.suppress(ImportError):
        import aiohttp

        network += (aiohttp.ClientError,)
    if is_precondition_failed(exc):
        return False
    for e in error_chain(exc):
        code, status = s3_error_code(e)
        if code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
            return True
        if isinstance(e, network):
            return True
    return False


def is_missing(exc: BaseException) -> bool:
    """The object is absent; a missing bucket is a configuration error, never 'absent'."""
    if any(s3_error_code(e)[0] == "NoSuchBucket" for e in error_chain(exc)):
        return False
    return any(isinstance(e, FileNotFoundError) for e in error_chain(exc))


def parse_url(url: str) -> tuple[str, str]:
    """(scheme, root) where root is the fs path of the prefix: an absolute local path or 'bucket/prefix'."""
    if not isinstance(url, str) or not url or "\x00" in url or "\\" in url:
        raise InvalidName(f"bucket URL {redact(str(url))!r}: not a file:// or s3:// URL")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url  # a bare local path
    if scheme == "file":
        if not rest:
            raise InvalidName(f"bucket URL {url!r}: empty path")
        # file://runs/x is relative to the working directory, file:///tmp/x is absolute.
        return "file", os.path.abspath(rest)
    if scheme == "s3":
        parts = rest.rstrip("/").split("/")
        if not parts[0] or any(p in ("", ".", "..") for p in parts):
            raise InvalidName(f"bucket URL {redact(url)!r}: expected s3://bucket[/prefix] without empty, . or .. parts")
        return "s3", "/".join(parts)
    raise InvalidName(f"bucket URL {redact(url)!r}: unsupported scheme {scheme!r} (use file:// or s3://)")


def make_filesystem(url: str, *, endpoint_url: str | None = None, region: str | None = None):
    """(fsspec filesystem, root path) for a bucket URL; credentials come from the AWS chain, never from here."""
    scheme, root = parse_url(url)
    if scheme == "file":
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(auto_mkdir=True), root
    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint_url,
        client_kwargs={"region_name": region} if region else {},
        # One retry policy (ours), and timeouts short enough that a dead server is noticed.
        config_kwargs={
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": 5,
            "read_timeout": 60,
        },
        skip_instance_cache=True,
        use_listings_cache=False,  # another process may have committed a version a moment ago
    )
    fs.retries = 1
    return fs, root


def absolute_bucket_url(url: str) -> str:
    """`file://runs/x` means runs/x under this process's working directory; say so explicitly."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"file://{os.path.abspath(url)}"
    if scheme == "file" and not rest.startswith("/"):
        return f"file://{os.path.abspath(rest)}"
    return url
