"""Calibration statistics that do not depend on the thread count."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_thread():
    """The observers' ranges come from fp32 forward passes whose sums split differently across
    threads: calibrated with --threads 1 and 2, the digits model's int8 .pte differed in 6383 of
    its 1730984 bytes (same size: the quantization parameters). With one thread for calibration
    the program no longer depends on --threads or the host's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
