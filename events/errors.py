"""Errors raised when reading a log. Each names the file and, where there is one, the byte offset."""

from __future__ import annotations


class LogError(Exception):
    """A log cannot be read."""


class LogCorrupt(LogError):
    """A damaged frame with data after it (or a damaged header): the log is corrupt, not merely torn."""

    def __init__(self, path: str, offset: int, tick: int | None, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.tick = tick
        self.reason = reason
        where = f"tick {tick}" if tick is not None else "the header"
        super().__init__(f"{path}: corrupt frame at byte offset {offset} ({where}): {reason}")


class LogFrameTooLarge(LogError):
    """A frame declares a payload larger than the reader's limit; logs may come from elsewhere."""

    def __init__(self, path: str, offset: int, size: int, limit: int) -> None:
        self.path = path
        self.offset = offset
        self.size = size
        self.limit = limit
        super().__init__(
            f"{path}: frame at byte offset {offset} declares {size} bytes, over the limit of {limit} bytes"
        )


class LogExists(LogError, FileExistsError):
    """A new log's path is taken (by a file, a directory or a symlink, even a dangling one). tickloom never
    overwrites or follows anything at a log path: an existing log is evidence, and a symlink there could send the
    writes anywhere."""

    def __init__(self, path: str, what: str = "already exists") -> None:
        self.path = path
        super().__init__(
            f"log_path={path!r} {what}; tickloom never overwrites a log: choose a new path or remove it"
        )


class LogIncompatible(LogError):
    """The log was written with a format version or schema this build does not know."""

    def __init__(self, path: str, what: str, found: str, supported: str) -> None:
        self.path = path
        self.offset = 0  # what a log is, its header says: the frame at byte offset 0
        super().__init__(
            f"{path}: log {what} {found} (header frame at byte offset 0) is not readable by this build "
            f"(it reads {supported})"
        )
