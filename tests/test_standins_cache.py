"""The stand-ins' cache is shared by processes (two trained-tier sweeps, a sweep and the demo): one makes a
stand-in or a held-out set, the others wait for it and read it, and a killed maker blocks no one."""

from __future__ import annotations

import subprocess
import sys
import time

from exporter.standins import one_at_a_time, write_once

# The first process: it says "making" once it holds the lock, then takes its time.
FIRST = """
import sys, time
from pathlib import Path
from exporter.standins import one_at_a_time, write_once
path, mode = Path(sys.argv[1]), sys.argv[2]
def make(path):
    print("making", flush=True)
    time.sleep(600 if mode == "hang" else 1.5)
    if mode == "dir":
        path.mkdir()
        (path / "made by the first").touch()
    else:
        path.write_text("made by the first")
if mode == "dir":
    write_once(path, make)
else:
    with one_at_a_time(path):
        make(path)
"""


def _first(path, mode: str) -> subprocess.Popen:
    first = subprocess.Popen([sys.executable, "-c", FIRST, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "making"  # it holds the lock now
    return first


def test_a_stand_in_another_process_is_making_is_waited_for_and_read(tmp_path):
    record = tmp_path / "digits.json"
    first = _first(record, "record")
    with one_at_a_time(record):
        assert record.read_text() == "made by the first"
    assert first.wait(30) == 0


def test_a_held_out_set_is_written_once_whoever_asks_first(tmp_path):
    data_dir = tmp_path / "digits_val"
    first = _first(data_dir, "dir")
    written = []
    assert write_once(data_dir, written.append) == data_dir
    assert written == [] and [p.name for p in data_dir.iterdir()] == ["made by the first"]
    assert first.wait(30) == 0
    write_once(tmp_path / "other_val", lambda path: (written.append(path), path.mkdir()))
    assert written == [tmp_path / "other_val"]


def test_a_killed_maker_leaves_the_lock_free_and_nothing_made(tmp_path):
    record = tmp_path / "digits.json"
    first = _first(record, "hang")
    first.kill()
    first.wait(30)
    start = time.monotonic()
    with one_at_a_time(record):
        assert not record.exists()
    assert time.monotonic() - start < 5


def test_a_checkpoint_is_named_by_its_state_alone(tmp_path):
    """torch.save records the file's name: saved through a temporary file of another name each time (as the
    segmentation and detection stand-ins were), the same state got another hash, and name, on every save."""
    import torch

    from exporter.standins import save_checkpoint

    state = {"weight": torch.arange(6.0).reshape(2, 3)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = save_checkpoint(state, tmp_path / "a", "lraspp_mobilenet_v3_large")
    second = save_checkpoint(state, tmp_path / "b", "lraspp_mobilenet_v3_large")
    assert first.name == second.name and first.name.startswith("lraspp_mobilenet_v3_large_digits-")
    assert first.read_bytes() == second.read_bytes() and [p.name for p in (tmp_path / "a").iterdir()] == [first.name]
    assert torch.equal(torch.load(first, weights_only=True)["weight"], state["weight"])
