"""Step-by-step progress with elapsed time, on stderr so stdout stays clean for --json."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.markup import escape

from .errors import UsageError


class Progress:
    """One line per finished step, never wrapped (soft_wrap): a log keeps each whole, for grep and for the
    coverage sweep, which relays its workers' lines by their first characters."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.console = Console(stderr=True, highlight=False)
        self.timings: dict[str, float] = {}
        self._status = None  # the live spinner of the running step, on a terminal

    @contextlib.contextmanager
    def step(self, label: str, unavailable: type[BaseException] | tuple[type[BaseException], ...] = ()):
        """A step that did not fail although it did not do its work: what it needs is missing on this host (no
        GPU, no macOS) is shown so, with the reason, both when the step raises one of `unavailable` and when it
        says so itself (`with progress.step(...) as step: ... step.unavailable(reason)`)."""
        start = time.perf_counter()
        shown = _Step()
        status = None
        if not self.quiet:
            # a log (CI) gets one line per finished step; a terminal also gets a live spinner
            if self.console.is_terminal:
                status = self._status = self.console.status(f"{label} …")
                status.start()
        try:
            yield shown
        except BaseException as e:
            self._status = None
            if status:
                status.stop()
            if self.quiet or isinstance(e, (UsageError, SystemExit)):
                pass
            elif isinstance(e, unavailable):
                self._unavailable(label, str(e))
            else:
                self.console.print(f"[red]✗[/red] {label} ({time.perf_counter() - start:.1f} s)", soft_wrap=True)
            raise
        elapsed = time.perf_counter() - start
        self.timings[label] = round(elapsed, 3)
        self._status = None
        if status:
            status.stop()
        if self.quiet:
            return
        if shown.reason is not None:
            self._unavailable(f"{label} ({elapsed:.1f} s)", shown.reason)
        else:
            self.console.print(f"[green]✓[/green] {label} ({elapsed:.1f} s)", soft_wrap=True)

    def _unavailable(self, label: str, reason: str) -> None:
        self.console.print(f"[yellow]–[/yellow] {label}: unavailable on this host ({escape(reason)})", soft_wrap=True)

    def note(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, soft_wrap=True)

    @contextlib.contextmanager
    def transfer(self, label: str, total_bytes: int | None):
        """A byte-count bar for a download; yields advance(n). A log (not a terminal) gets one line when
        it completes, as steps do."""
        if self.quiet:
            yield lambda n: None
            return
        start, received = time.perf_counter(), [0]
        if not self.console.is_terminal:
            yield lambda n: received.__setitem__(0, received[0] + n)
        else:
            from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
            from rich.progress import Progress as Bar

            paused = self._status  # rich shows one live display at a time
            if paused:
                paused.stop()
            try:
                with Bar(
                    TextColumn(label),
                    BarColumn(),
                    DownloadColumn(),
                    TransferSpeedColumn(),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=True,
                ) as bar:
                    task = bar.add_task(label, total=total_bytes)

                    def advance(n: int) -> None:
                        received[0] += n
                        bar.advance(task, n)

                    yield advance
            finally:
                if paused:
                    paused.start()
        self.console.print(
            f"[green]✓[/green] {label} ({received[0] / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
        )


class _Step:
    """What a running step can say about itself."""

    reason: str | None = None

    def unavailable(self, reason: str) -> None:
        self.reason = reason
