"""Errors a user can act on.

`UserError` is bad input or usage: the CLI prints its one-line message and exits 2, with no
traceback. Everything else is a bug in alpac and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: one line naming the file, the place and what was expected (exit code 2)."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 col: int | None = None):
        self.path, self.line, self.col = path, line, col
        where = path or ""
        if path is not None and line is not None:
            where += f":{line}" + (f":{col}" if col is not None else "")
        super().__init__(f"{where}: {message}" if where else message)


class CheckFailed(Exception):
    """A check ran and failed (e.g. a numerical comparison): exit code 1."""

    exit_code = 1
