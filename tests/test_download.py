"""Downloading a missing checkpoint, from an HTTP server on 127.0.0.1 that stands in for the internet."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from torchvision.models import get_weight

from exporter import files

from .helpers import FAST, assert_clean_refusal, run_cli


class CheckpointServer:
    """Serves one file at its name, or fails the way networks do (`mode`); counts connections."""

    def __init__(self, name: str, body: bytes):
        self.name, self.body, self.mode, self.requests = name, body, "good", 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests += 1
                if server.mode == "missing" or self.path != f"/{server.name}":
                    self.send_error(404)
                    return
                body = server.body
                if server.mode == "corrupt":
                    body = body[:1000] + bytes(b ^ 0xFF for b in body[1000:1100]) + body[1100:]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.mode == "drop":  # half the bytes, then the connection goes away
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/{name}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(digits_model, monkeypatch):
    """The digits checkpoint served under its own hash-carrying name; the named weight's URL points at it."""
    served = CheckpointServer(digits_model.checkpoint.name, digits_model.checkpoint.read_bytes())
    monkeypatch.setattr(get_weight(digits_model.weight).value, "url", served.url)
    monkeypatch.delenv("EXPORTER_OFFLINE", raising=False)  # the suite runs offline; these tests go online
    yield served
    served.close()


@pytest.fixture
def hub(tmp_path):
    home = tmp_path / "torch_home"
    return home, home / "hub" / "checkpoints"


def _build(model, out, home, *extra):
    return run_cli(
        "build",
        model.weight,
        "--data",
        model.data_dir,
        "--labels",
        model.labels_file,
        "--out",
        out,
        "--format",
        "torchscript_lite",
        *FAST,
        *extra,
        env={"TORCH_HOME": str(home)},
    )


def test_good_download_lands_verified_and_is_reused_offline(tmp_path, digits_model, server, hub):
    home, checkpoints = hub
    result = _build(digits_model, tmp_path / "first", home)
    assert result.exit_code == 0, result.output
    landed = checkpoints / digits_model.checkpoint.name
    assert [p.name for p in checkpoints.iterdir()] == [landed.name]  # no temporary file left beside it
    assert files.sha256(landed) == files.sha256(digits_model.checkpoint)
    doc = json.loads((tmp_path / "first" / "manifest.json").read_text())
    assert doc["checkpoint"] == {
        "path": str(landed),
        "sha256": files.sha256(landed),
        "source": "download",
        "verified": True,
    }
    assert f"✓ download {landed.name}" in result.stderr  # the bar's line in a log
    assert server.requests == 1

    # the cached file now answers, offline: no connection, neither from the whole-build record nor a fresh build
    again = _build(digits_model, tmp_path / "again", home, "--offline", "--quiet")
    fresh = _build(digits_model, tmp_path / "fresh", home, "--offline", "--quiet", "--no-cache")
    assert again.exit_code == 0 and fresh.exit_code == 0, again.output + fresh.output
    assert json.loads((tmp_path / "fresh" / "manifest.json").read_text())["checkpoint"]["source"] == "torch-hub-cache"
    assert server.requests == 1


def test_quiet_download_prints_nothing(tmp_path, digits_model, server, hub):
    home, checkpoints = hub
    result = _build(digits_model, tmp_path / "out", home, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and (checkpoints / digits_model.checkpoint.name).is_file()


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("corrupt", "fails its hash check"),
        ("drop", "nothing was kept"),
        ("missing", "HTTP 404"),
    ],
)
def test_failed_download_leaves_nothing(tmp_path, digits_model, server, hub, mode, needle):
    home, _ = hub
    server.mode = mode
    out = tmp_path / "out"
    result = _build(digits_model, out, home)
    assert_clean_refusal(result, out, needle, server.url)
    assert server.requests == 1
    assert not home.exists()  # nor the folders made for it


def test_cut_connection_is_caught_without_a_hash_in_the_name(tmp_path, digits_model, server, hub, monkeypatch):
    """torchvision's quantized weights carry no hash prefix torch.hub recognises: the length check alone
    must keep a truncated file out of the cache."""
    home, _ = hub
    server.name, server.mode = "mobilenet_v3_small_digits.pth", "drop"
    url = server.url.rsplit("/", 1)[0] + "/" + server.name
    monkeypatch.setattr(get_weight(digits_model.weight).value, "url", url)
    out = tmp_path / "out"
    result = _build(digits_model, out, home)
    assert_clean_refusal(result, out, url, "stopped after")
    assert not home.exists()  # nor the folders made for it


def test_no_network_is_one_line(tmp_path, digits_model, server, hub):
    home, checkpoints = hub
    server.close()  # nothing listens on that port any more
    out = tmp_path / "out"
    result = _build(digits_model, out, home)
    assert_clean_refusal(result, out, "download of", "failed", "--checkpoint")
    assert not home.exists()  # nor the folders made for it


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_offline_never_connects(tmp_path, digits_model, server, hub, how):
    home, checkpoints = hub
    out = tmp_path / "out"
    if how == "flag":
        result = _build(digits_model, out, home, "--offline")
    else:
        result = run_cli(
            "build",
            digits_model.weight,
            "--out",
            out,
            "--format",
            "torchscript_lite",
            env={"TORCH_HOME": str(home), "EXPORTER_OFFLINE": "1"},
        )
    assert_clean_refusal(
        result, out, "downloads are off", str(checkpoints / digits_model.checkpoint.name), "--checkpoint"
    )
    assert server.requests == 0


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--input-size", "64", "48"], "a classifier's crop is square"),
        (["--data", "/nonexistent/digits"], "--data /nonexistent/digits is not a directory"),
        (["--format", "onnx"], "--format onnx matches nothing in target android"),
    ],
)
def test_a_bad_request_is_refused_before_the_checkpoint_is_downloaded(
    tmp_path, digits_model, server, hub, extra, needle
):
    home, checkpoints = hub
    out = tmp_path / "out"
    result = run_cli("build", digits_model.weight, "--out", out, *extra, env={"TORCH_HOME": str(home)})
    assert_clean_refusal(result, out, needle)
    assert server.requests == 0 and not checkpoints.exists()


def test_unwritable_cache_is_one_line(tmp_path, digits_model, server):
    out = tmp_path / "out"
    result = _build(digits_model, out, Path("/proc/exporter-torch-home"))
    assert_clean_refusal(result, out, "cannot write to the checkpoint cache")
    assert server.requests == 0


def test_inspect_says_cached_where_and_size(tmp_path, digits_model, server, hub):
    home, checkpoints = hub
    before = json.loads(run_cli("inspect", digits_model.weight, "--json", env={"TORCH_HOME": str(home)}).stdout)
    assert before["checkpoint_cached"] is False and before["checkpoint_size_bytes"] is None
    assert before["checkpoint_path"] == str(checkpoints / digits_model.checkpoint.name)
    assert server.requests == 0  # inspect never downloads
    checkpoints.mkdir(parents=True)
    (checkpoints / digits_model.checkpoint.name).write_bytes(digits_model.checkpoint.read_bytes())
    after = json.loads(run_cli("inspect", digits_model.weight, "--json", env={"TORCH_HOME": str(home)}).stdout)
    assert after["checkpoint_cached"] is True
    assert after["checkpoint_size_bytes"] == digits_model.checkpoint.stat().st_size


def test_disk_full_midway_leaves_nothing(tmp_path, digits_model, server, hub):
    """Writes fail part way (a file-size limit stands in for a full disk): one line, nothing kept."""
    home, _ = hub
    out = tmp_path / "out"
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(server.body) // 3}, {len(server.body) // 3}))\n"
        "from torchvision.models import get_weight\n"
        f"get_weight({digits_model.weight!r}).value.url = {server.url!r}\n"
        "from exporter.cli import main\n"
        f"sys.argv = ['exporter', 'build', {digits_model.weight!r}, '--out', {str(out)!r}, '--format', 'torchscript_lite']\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "EXPORTER_OFFLINE"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, "TORCH_HOME": str(home)}
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: download of") and "nothing was kept" in line, line
    assert server.requests == 1 and not home.exists() and not out.exists()
