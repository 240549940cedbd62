"""Step-by-step progress with elapsed time, on stderr so stdout stays clean for --json."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console


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
            if self.console.is_terminal:
                status = self.console.status(f"{label} …")
                status.start()
            else:
                self.console.print(f"… {label}")
        try:
            yield
        except BaseException:
            if status:
                status.stop()
            if not self.quiet:
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
