"""What the aarch64 runner installs, and the key of its directory.

The packages are those the x86 side validates with: each at the version `pyproject.toml` pins (`==`), or,
where it is not pinned (numpy, onnxruntime), at the version installed here, so the aarch64 rows compare
like with like. The key hashes those versions, the Debian suite and Python of the arm64 root, the qemu
package version and the runner's layout; any change gives a new runner directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# the packages validated on aarch64 (import name -> distribution)
PACKAGES = ("torch", "executorch", "onnxruntime", "ai-edge-litert", "numpy")
# what those need to import (pure Python, or small wheels), at the host's versions where installed
SUPPORT = (
    "typing_extensions",
    "sympy",
    "mpmath",
    "filelock",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "flatbuffers",
    "packaging",
    "protobuf",
)
SUITE, PYTHON = "bookworm", "3.11"
LAYOUT = 1  # bump when the runner's layout or set-up changes


def _requirements(text: str) -> list[str]:
    """Every quoted requirement string in pyproject's dependency lists (a TOML subset; no tomllib on 3.10)."""
    found = []
    for block in re.findall(r"(?ms)^\s*(?:dependencies|[\w-]+)\s*=\s*\[(.*?)\]", text):
        found += re.findall(r'"([^"]+)"', block)
    return found


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for requirement in _requirements(text):
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*==\s*([A-Za-z0-9_.+-]+)\s*(?:;.*)?$", requirement)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wanted(pyproject_text: str | None = None) -> dict[str, str]:
    """package -> version for PACKAGES: pinned in pyproject.toml, else installed here; a package neither
    pinned nor installed is left out (the runner then cannot run that format)."""
    if pyproject_text is None:
        pyproject_text = PYPROJECT.read_text(encoding="utf-8") if PYPROJECT.exists() else ""
    pins = _pins(pyproject_text)
    versions = {}
    for name in PACKAGES:
        version = pins.get(name) or _installed(name)
        if version:
            versions[name] = version.split("+")[0]  # a local tag (+cpu) names the host's build, not the release
    return versions


def support() -> dict[str, str | None]:
    """The support packages at the host's versions (None: the newest with an aarch64 or pure wheel)."""
    return {name: _installed(name) for name in SUPPORT}


def key(versions: dict[str, str], qemu: str) -> str:
    text = json.dumps(
        {"packages": versions, "qemu": qemu, "suite": SUITE, "python": PYTHON, "layout": LAYOUT}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
