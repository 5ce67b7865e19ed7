"""Errors a user can cause, shared by the driver, workers and the CLI.

Holds: ``ClassgradError`` (the base the CLI turns into one line and exit code 2) and its
subclasses, one per kind of problem, and ``first_line`` (the one line of a library's error that
a message quotes). Nothing here imports torch or Ray, so every part of the
project (and readers of the store) can raise and catch them.
"""

from __future__ import annotations


class ClassgradError(Exception):
    """A problem the user can fix; its message is one clear line.

    ``retryable``: the problem may pass by itself (the store was unreachable for a while), so the
    driver retries the shard that raised it (``sharding.max_attempts``) instead of failing the job
    at once, as it does for every other ``ClassgradError``.
    """

    exit_code = 2
    retryable = False


class ConfigError(ClassgradError):
    """The job config is invalid; the message names the field (``section.key``)."""


class InputError(ClassgradError):
    """The model, data or loss do not fit together (wrong output width, labels out of range,
    non-finite loss, parameter patterns that select nothing, ...)."""


class NonFiniteError(InputError):
    """A loss or gradient that is NaN or infinite (NaN/Inf inputs or weights, or an overflow in a
    low-precision forward): a training step skips it as ``GradScaler`` would; a job refuses it."""


class StoreError(ClassgradError):
    """The store cannot be created, opened or written as asked."""


class StoreUnavailableError(StoreError):
    """Store I/O kept failing for a reason that may pass (throttling, connections refused or
    reset, timeouts) after the store's own retries; the message names the request and the
    last error. Retryable: the driver retries the shard."""

    retryable = True


class StoreMismatchError(StoreError):
    """An existing store was made by another config (different fingerprint)."""


class ConfigMismatchError(StoreMismatchError):
    """The existing store's fingerprint is another config's (the driver names the keys that differ)."""


class StoreIncompleteError(StoreError):
    """Rows that were asked for belong to shards that are not marked done."""


class CorruptChunkError(StoreError):
    """A chunk failed its checksum; the message names the array and chunk."""


class LeaseHeldError(StoreError):
    """Another driver holds the store's lease; the message names that run."""


class ResourceError(ClassgradError):
    """A job that cannot fit the memory, GPU memory or disk it would run on (the resource preflight);
    the message names the numbers and the key to change."""


class RowOverflowError(ClassgradError):
    """A row stayed non-finite at the smallest fp16 loss scale; the message names the class."""


class ShardFailedError(ClassgradError):
    """A shard failed more times than allowed; the message names the shard and its error."""


def first_line(error: BaseException | str, *, with_type: bool = False, limit: int = 300) -> str:
    """The first non-empty line of an error's message (or of a text), for one-line errors.

    Library exceptions (botocore, Ray, zarr) often carry several lines; a classgrad message
    quotes only the first, cut to ``limit`` characters. ``with_type`` puts the exception's type
    in front (``NoCredentialsError: Unable to locate credentials``), where the type says what
    the message does not; an exception with no message gives its type's name.
    """
    text = error if isinstance(error, str) else str(error)
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if isinstance(error, BaseException) and (with_type or not line):
        line = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
