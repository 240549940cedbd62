"""Errors the CLI turns into one line and an exit code."""


class UsageError(Exception):
    """Bad input or environment: one line, exit code 2, nothing written."""

    exit_code = 2


class MissingExtraError(UsageError):
    def __init__(self, what: str, extra: str):
        super().__init__(f"{what} needs the '{extra}' extra: pip install 'exporter[{extra}]'")
        self.extra = extra
