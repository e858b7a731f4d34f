"""What a directory holds while a file is being written: for checks that a file appears under its name only whole
(a reader that acts on the name alone must never find it empty or cut short)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class WriteWatch:
    """Wraps files opened for writing (`wrap`, in place of what `open` returned): each write first records the
    sorted listing of `directory` in `listings`; with `fail_with` (an errno) the write raises it instead, as on a
    file system too full for the text."""

    def __init__(self, directory: Path, *, fail_with: int | None = None) -> None:
        self.directory = directory
        self.fail_with = fail_with
        self.listings: list[list[str]] = []

    def wrap(self, file: Any) -> _Watched:
        return _Watched(file, self)


class _Watched:
    def __init__(self, file: Any, watch: WriteWatch) -> None:
        self.file = file
        self.watch = watch

    def __enter__(self) -> _Watched:
        return self

    def __exit__(self, *exc: object) -> Any:
        return self.file.__exit__(*exc)

    def write(self, text: str) -> int:
        self.watch.listings.append(sorted(os.listdir(self.watch.directory)))
        if self.watch.fail_with is not None:
            raise OSError(self.watch.fail_with, os.strerror(self.watch.fail_with))
        return self.file.write(text)
