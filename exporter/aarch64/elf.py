"""Just enough ELF to slim the aarch64 torch wheel: read a shared library's needed libraries and dynamic
symbols, and write a stub library that stands in for a CUDA one.

PyPI's aarch64 torch is the CUDA build: libtorch.so and libtorch_python.so need libtorch_cuda.so (460 MB),
which needs the nvidia-* wheels (3.3 GB). Nothing in the runner uses a GPU. Python loads extension
modules with RTLD_NOW, so every symbol the kept libraries reference must resolve, with its version
(cuptiFinalize@libcupti.so.13): a stub with the right file name that defines each referenced symbol,
under the referenced version, lets torch and ExecuTorch load with CUDA off. Data symbols are zeroed objects
(type_info objects get a name string); a function returns a pointer to zeroed scratch memory, which is
what the few called while loading need (libtorch_python's start-up assigns through the reference
c10d::get_gil_checker() returns). torch then sees no CUDA device; no CUDA function runs otherwise.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

EM_AARCH64 = 183
R_AARCH64_RELATIVE = 1027
DT_NEEDED, DT_SONAME = 1, 14
SHT_RELA, SHT_DYNAMIC, SHT_DYNSYM = 4, 6, 11
SHT_GNU_VERNEED, SHT_GNU_VERSYM = 0x6FFFFFFE, 0x6FFFFFFF
DATA_SECTION = 5  # the stub's .data, in its section headers


class Library:
    """The dynamic section of one ELF64 little-endian shared object: needed libraries, defined symbols,
    and the undefined (non-weak) ones with the library file and version they are required from (None,
    None when unversioned)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.needed: list[str] = []
        self.defined: set[str] = set()
        self.objects: dict[str, int] = {}  # defined data symbols -> size
        self.undefined: dict[str, tuple[str | None, str | None]] = {}
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
                raise ValueError(f"{self.path}: not an ELF64 little-endian file")
            self.machine = struct.unpack_from("<H", m, 18)[0]
            (shoff,) = struct.unpack_from("<Q", m, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
            sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
            dynsym = next((i for i, s in enumerate(sections) if s[1] == SHT_DYNSYM), None)
            if dynsym is None:
                return
            _, _, _, _, symoff, symsize, strndx, _, _, _ = sections[dynsym]
            stroff = sections[strndx][4]

            def name(offset: int) -> str:
                end = m.find(b"\0", stroff + offset)
                return m[stroff + offset : end].decode()

            required = {}  # version index -> (file, version name)
            for s in sections:
                if s[1] == SHT_GNU_VERNEED:
                    off = s[4]
                    while True:
                        _, cnt, file, aux, nxt = struct.unpack_from("<HHIII", m, off)
                        a = off + aux
                        for _ in range(cnt):
                            _, _, other, vname, anext = struct.unpack_from("<IHHII", m, a)
                            required[other] = (name(file), name(vname))
                            a += anext
                        if not nxt:
                            break
                        off += nxt
            versym = next((s[4] for s in sections if s[1] == SHT_GNU_VERSYM), None)
            for i in range(1, symsize // 24):
                st_name, info, _other, shndx = struct.unpack_from("<IBBH", m, symoff + i * 24)
                if shndx != 0:
                    self.defined.add(name(st_name))
                    if info & 0xF == 1:  # STT_OBJECT
                        self.objects[name(st_name)] = struct.unpack_from("<Q", m, symoff + i * 24 + 16)[0]
                elif info >> 4 != 2:  # not STB_WEAK: must resolve
                    ver = struct.unpack_from("<H", m, versym + 2 * i)[0] & 0x7FFF if versym else 0
                    self.undefined[name(st_name)] = required.get(ver, (None, None))
            for s in sections:
                if s[1] == SHT_DYNAMIC:
                    for off in range(s[4], s[4] + s[5], 16):
                        tag, val = struct.unpack_from("<qQ", m, off)
                        if tag == 0:
                            break
                        if tag == DT_NEEDED:
                            self.needed.append(name(val))


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


def write_stub(path: Path, soname: str, symbols: dict[str, str | None], objects: dict[str, int] | None = None) -> None:
    """An aarch64 shared library named `soname` defining each symbol (under its version, when given).
    Those in `objects` (name -> size) and `_ZTI…` (type_info, with a pointer to its type's name, as
    std::type_info::name() reads it) are zeroed data; every other symbol is a function that returns a
    pointer to 32 zeroed bytes of its own. No dependencies."""
    objects = objects or {}
    names = sorted(symbols)
    slot = {n: max(64, (objects.get(n, 0) + 15) & ~15) for n in names}
    where, at = {}, 0
    for n in names:
        where[n], at = at, at + slot[n]
    versions = sorted({v for v in symbols.values() if v})
    page, header, phnum = 0x10000, 64, 3
    strtab = bytearray(b"\0")
    offsets: dict[str, int] = {}

    def string(text: str) -> int:
        if text not in offsets:
            offsets[text] = len(strtab)
            strtab.extend(text.encode() + b"\0")
        return offsets[text]

    string(soname)
    for text in [*names, *versions]:
        string(text)
    nsyms, nbucket = len(names) + 1, max(1, len(names) // 2 + 1)
    hash_at = header + 56 * phnum
    sym_at = (hash_at + 4 * (2 + nbucket + nsyms) + 7) & ~7
    versym_at = sym_at + 24 * nsyms
    verdef_at = (versym_at + 2 * nsyms + 3) & ~3
    str_at = verdef_at + (28 * (len(versions) + 1) if versions else 0)
    data_at = (str_at + len(strtab) + 15) & ~15
    blob_at = data_at + at
    blob, relocs = bytearray(), []
    for sym in names:
        if sym.startswith("_ZTI"):
            relocs.append((data_at + where[sym] + 8, blob_at + len(blob)))
            blob.extend(sym[4:].encode() + b"\0")
    rela_at = (blob_at + len(blob) + 7) & ~7
    dyn_at = rela_at + 24 * len(relocs)
    dynamic = [(4, hash_at), (5, str_at), (6, sym_at), (10, len(strtab)), (11, 24), (DT_SONAME, string(soname))]
    if relocs:
        dynamic += [(7, rela_at), (8, 24 * len(relocs)), (9, 24)]
    if versions:
        dynamic += [(0x6FFFFFF0, versym_at), (0x6FFFFFFC, verdef_at), (0x6FFFFFFD, len(versions) + 1)]
    dynamic.append((0, 0))
    end = dyn_at + 16 * len(dynamic)

    out = bytearray(end)
    struct.pack_into(
        "<4sBBBB8xHHIQQQIHHHHHH",
        out,
        0,
        b"\x7fELF",
        2,
        1,
        1,
        0,
        3,
        EM_AARCH64,
        1,
        0,
        header,
        0,
        0,
        64,
        56,
        phnum,
        64,
        0,
        0,
    )
    # PT_LOAD (everything, read-write-execute), PT_DYNAMIC, PT_GNU_STACK (no executable stack)
    struct.pack_into("<IIQQQQQQ", out, header, 1, 7, 0, 0, 0, end, end, page)
    struct.pack_into(
        "<IIQQQQQQ", out, header + 56, 2, 6, dyn_at, dyn_at, dyn_at, 16 * len(dynamic), 16 * len(dynamic), 8
    )
    struct.pack_into("<IIQQQQQQ", out, header + 112, 0x6474E551, 6, 0, 0, 0, 0, 0, 16)
    buckets, chains = [0] * nbucket, [0] * nsyms
    for i, sym in enumerate(names, 1):
        b = _elf_hash(sym.encode()) % nbucket
        chains[i], buckets[b] = buckets[b], i
    struct.pack_into(f"<II{nbucket}I{nsyms}I", out, hash_at, nbucket, nsyms, *buckets, *chains)
    index = {v: i for i, v in enumerate(versions, 2)}
    for i, sym in enumerate(names, 1):
        function = sym not in objects and not sym.startswith("_ZTI")
        # STB_GLOBAL | STT_FUNC or STT_OBJECT, default visibility, an ordinary section index (not UNDEF/ABS)
        struct.pack_into(
            "<IBBHQQ",
            out,
            sym_at + 24 * i,
            offsets[sym],
            0x12 if function else 0x11,
            0,
            DATA_SECTION,
            data_at + where[sym],
            slot[sym],
        )
        struct.pack_into("<H", out, versym_at + 2 * i, index.get(symbols[sym], 1))
        if function:  # adr x0, .+32; ret
            struct.pack_into("<II", out, data_at + where[sym], 0x10000100, 0xD65F03C0)
    if versions:
        for n, (flags, ndx, text) in enumerate([(1, 1, soname)] + [(0, index[v], v) for v in versions]):
            at = verdef_at + 28 * n
            last = n == len(versions)
            struct.pack_into("<HHHHIII", out, at, 1, flags, ndx, 1, _elf_hash(text.encode()), 20, 0 if last else 28)
            struct.pack_into("<II", out, at + 20, offsets[text], 0)
    out[str_at : str_at + len(strtab)] = strtab
    out[blob_at : blob_at + len(blob)] = blob
    for i, (where, target) in enumerate(relocs):
        struct.pack_into("<QQq", out, rela_at + 24 * i, where, R_AARCH64_RELATIVE, target)
    for i, (tag, val) in enumerate(dynamic):
        struct.pack_into("<qQ", out, dyn_at + 16 * i, tag, val)
    # section headers, for tools (readelf, this module's reader); the loader needs none
    sections = [
        (".hash", 5, 2, hash_at, 4 * (2 + nbucket + nsyms), 2, 0, 4, 4),
        (".dynsym", 11, 2, sym_at, 24 * nsyms, 3, 1, 8, 24),
        (".dynstr", 3, 2, str_at, len(strtab), 0, 0, 1, 0),
        (".gnu.version", 0x6FFFFFFF, 2, versym_at, 2 * nsyms, 2, 0, 2, 2),
        (".data", 1, 7, data_at, at, 0, 0, 16, 0),  # DATA_SECTION
        (".dynamic", 6, 3, dyn_at, 16 * len(dynamic), 3, 0, 8, 16),
    ]
    if versions:
        sections.append(
            (".gnu.version_d", 0x6FFFFFFD, 2, verdef_at, 28 * (len(versions) + 1), 3, len(versions) + 1, 4, 0)
        )
    if relocs:
        sections.append((".rela.dyn", 4, 2, rela_at, 24 * len(relocs), 2, 0, 8, 24))
    shstrtab = b"\0" + b"".join(name.encode() + b"\0" for name, *_ in sections) + b".shstrtab\0"
    names_at, cursor = [], 1
    for name, *_ in sections:
        names_at.append(cursor)
        cursor += len(name) + 1
    shstr_at = len(out)
    out += shstrtab
    shoff = (len(out) + 7) & ~7
    out += bytes(shoff - len(out) + 64 * (len(sections) + 2))
    for i, ((_, kind, flags, addr, size, link, info, align, entsize), name_at) in enumerate(zip(sections, names_at), 1):
        struct.pack_into(
            "<IIQQQQIIQQ", out, shoff + 64 * i, name_at, kind, flags, addr, addr, size, link, info, align, entsize
        )
    struct.pack_into(
        "<IIQQQQIIQQ", out, shoff + 64 * (len(sections) + 1), cursor, 3, 0, 0, shstr_at, len(shstrtab), 0, 0, 1, 0
    )
    struct.pack_into("<QIHHHHHH", out, 0x28, shoff, 0, 64, 56, phnum, 64, len(sections) + 2, len(sections) + 1)
    Path(path).write_bytes(bytes(out))
