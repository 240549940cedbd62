"""Step-by-step progress with elapsed time, on stderr so stdout stays clean for --json."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console

from .errors import UsageError


class Progress:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.console = Console(stderr=True, highlight=False)
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, label: str):
        start = time.perf_counter()
        status = None
        if not self.quiet:
            # a log (CI) gets one line per finished step; a terminal also gets a live spinner
            if self.console.is_terminal:
                status = self.console.status(f"{label} …")
                status.start()
        try:
            yield
        except BaseException as e:
            if status:
                status.stop()
            if not self.quiet and not isinstance(e, (UsageError, SystemExit)):
                self.console.print(f"[red]✗[/red] {label} ({time.perf_counter() - start:.1f} s)")
            raise
        elapsed = time.perf_counter() - start
        self.timings[label] = round(elapsed, 3)
        if status:
            status.stop()
        if not self.quiet:
            self.console.print(f"[green]✓[/green] {label} ({elapsed:.1f} s)")

    def note(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)
