"""`make test` runs the suite on pytest-xdist workers, each test file (or the files sharing the android build) whole
on one of them (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


def test_each_file_runs_whole_on_one_worker(request):
    """A pytest or pytest-xdist that drops the group from the test's id (pytest-xdist#1386, pytest 9.2) would split
    files between workers: every session fixture they share would be built once per worker, on both cores."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("not under make test's workers (pytest -n N --dist loadgroup)")
    assert request.node.nodeid.endswith("@test_workers"), request.node.nodeid
