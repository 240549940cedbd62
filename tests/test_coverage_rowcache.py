"""The sweep's row cache (exporter.coverage.rowcache): what keys a row, and which cached rows are built again."""

from __future__ import annotations

from pathlib import Path

import exporter
from exporter.coverage import rowcache


def test_a_change_to_the_exporters_code_keys_its_rows_anew(monkeypatch):
    from exporter.engine import cache

    def row_key(source):
        monkeypatch.setattr(cache, "source_digest", lambda: source)
        return rowcache.key("W.V1", "android", {"calib": 16}, {"torch": "2.14.1"})

    assert row_key("before") == row_key("before") != row_key("after")


def test_a_cached_row_built_at_another_input_size_is_built_again(tmp_path):
    """The row key holds the size the sweep asks for; the size a weight accepts of it can change (R3D-18's frames
    were built at the sweep's 128 before they were kept at the weight's own 112), so a row records it."""
    rowcache.store(tmp_path, {"key": "k", "input_size": [128, 128], "cells": []})
    assert rowcache.fetch(tmp_path, "k", None, [128, 128]) is not None
    assert rowcache.fetch(tmp_path, "k", None, [112, 112]) is None
    assert rowcache.fetch(tmp_path, "k", None, None) is not None  # the trained tier: the digits' own size


def test_a_cached_row_stopped_on_the_wall_clock_alone_is_built_again(tmp_path):
    """Rows from before the limit was CPU time were stopped by the wall clock, which a busy host runs out of:
    built again; a row stopped at the CPU limit is kept unless today's limit is longer."""
    rowcache.store(tmp_path, {"key": "old", "timed_out": True, "time_limit_s": 1800, "cells": []})
    assert rowcache.fetch(tmp_path, "old", 1800) is None
    rowcache.store(tmp_path, {"key": "cpu", "timed_out": True, "stopped_by": "cpu", "time_limit_s": 1800, "cells": []})
    assert rowcache.fetch(tmp_path, "cpu", 1800) is not None
    assert rowcache.fetch(tmp_path, "cpu", 3600) is None
    # the backstop stops a starved or blocked build: that says nothing about the weight either
    rowcache.store(
        tmp_path, {"key": "wall", "timed_out": True, "stopped_by": "wall", "time_limit_s": 1800, "cells": []}
    )
    assert rowcache.fetch(tmp_path, "wall", 1800) is None


def test_a_changed_target_profile_keys_its_rows_anew(tmp_path):
    """A threshold lives in targets/*.toml, not in the exporter's source: a row cached under the old one would
    show a ✅ the new one does not give."""
    profile = tmp_path / "jetson.toml"
    profile.write_text((Path(exporter.__file__).parents[1] / "targets" / "jetson.toml").read_text())
    before = rowcache.key("W.V1", str(profile), {"calib": 16}, {"torch": "2.14.1"})
    profile.write_text(profile.read_text().replace("psnr_db = 60.0", "psnr_db = 200.0", 1))
    assert rowcache.key("W.V1", str(profile), {"calib": 16}, {"torch": "2.14.1"}) != before
