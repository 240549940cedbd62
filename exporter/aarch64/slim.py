"""Take CUDA out of the aarch64 torch wheel installed in the runner, so it needs none of the nvidia-* wheels.

torch's CUDA libraries (libtorch_cuda.so and friends) are deleted; every library the remaining torch and
ExecuTorch libraries need but that is absent (those, and the nvidia ones: libcudart, libcupti, libcudnn,
libnccl, libcufile …) is replaced by a stub (elf.write_stub) that defines exactly the symbols the kept
libraries reference from it, under the versions they ask for. CUDA then is simply not available.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import elf

CUDA_LIBRARY = re.compile(r"cuda|nvrtc|nvshmem")


def slim(root: Path, site: Path) -> dict:
    """Stub out CUDA under `site` (torch/ and executorch/ inside the arm64 `root`). Returns what was done:
    the libraries removed, stubs written (name -> symbol count), bytes saved."""
    torch_lib = site / "torch" / "lib"
    removed = sorted(p for p in torch_lib.iterdir() if CUDA_LIBRARY.search(p.name) and p.is_file())
    real = {p.name: elf.Library(p) for p in removed}
    search = [torch_lib, site / "executorch" / "lib", root / "usr" / "lib" / "aarch64-linux-gnu", root / "usr" / "lib"]
    roots = [
        p
        for p in sorted((site / "torch").rglob("*.so*")) + sorted((site / "executorch").rglob("*.so*"))
        if p.name not in real and p.is_file() and not p.is_symlink()
    ]
    kept: dict[str, elf.Library] = {}
    missing: set[str] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if str(path) in kept:
            continue
        try:
            library = kept[str(path)] = elf.Library(path)
        except ValueError:
            continue
        for name in library.needed:
            places = [path.parent, *search]  # $ORIGIN first, as their run paths say
            found = None if name in real else next((d / name for d in places if (d / name).exists()), None)
            if found is None:
                missing.add(name)
            elif str(found) not in kept:
                todo.append(found)
    defined = set().union(*(lib.defined for lib in kept.values()))
    wanted: dict[str, dict[str, str | None]] = {name: {} for name in missing}
    for library in kept.values():
        for symbol, (file, version) in library.undefined.items():
            if file in wanted:
                wanted[file][symbol] = version
            elif file is None and symbol not in defined:
                # unversioned: into the removed library that defined it, else into every stub this
                # library needs (a symbol defined twice is harmless: the first found is taken)
                owners = [n for n, lib in real.items() if symbol in lib.defined and n in wanted]
                for owner in owners or [n for n in library.needed if n in wanted]:
                    wanted[owner][symbol] = None
    saved = sum(p.stat().st_size for p in removed)
    for path in removed:
        path.unlink()
    for name, symbols in sorted(wanted.items()):
        elf.write_stub(torch_lib / name, name, symbols, real[name].objects if name in real else None)
    return {
        "removed": [p.name for p in removed],
        "stubs": {n: len(s) for n, s in sorted(wanted.items())},
        "saved_bytes": saved,
    }
