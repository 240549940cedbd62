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
PAGE, ELF_HEADER, PROGRAM_HEADERS = 0x10000, 64, 3  # the stub's alignment, header size, program header count


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
    Path(path).write_bytes(_Stub(soname, symbols, objects or {}).image())


class _Stub:
    """Where each part of one stub library sits, in file order: the ELF and program headers, .hash, .dynsym,
    .gnu.version, .gnu.version_d, .dynstr, .data (a slot per symbol), the type names, .rela.dyn, .dynamic;
    then .shstrtab and the section headers, which only tools read."""

    def __init__(self, soname: str, symbols: dict[str, str | None], objects: dict[str, int]):
        self.soname, self.symbols, self.objects = soname, symbols, objects
        self.names = sorted(symbols)
        self.versions = sorted({v for v in symbols.values() if v})
        self.slot = {n: max(64, (objects.get(n, 0) + 15) & ~15) for n in self.names}
        self.where, self.data_size = {}, 0
        for n in self.names:
            self.where[n], self.data_size = self.data_size, self.data_size + self.slot[n]
        self.strtab, self.offsets = bytearray(b"\0"), {}
        for text in [soname, *self.names, *self.versions]:
            self._string(text)
        self.nsyms, self.nbucket = len(self.names) + 1, max(1, len(self.names) // 2 + 1)
        self.hash_at = ELF_HEADER + 56 * PROGRAM_HEADERS
        self.sym_at = (self.hash_at + 4 * (2 + self.nbucket + self.nsyms) + 7) & ~7
        self.versym_at = self.sym_at + 24 * self.nsyms
        self.verdef_at = (self.versym_at + 2 * self.nsyms + 3) & ~3
        self.str_at = self.verdef_at + (28 * (len(self.versions) + 1) if self.versions else 0)
        self.data_at = (self.str_at + len(self.strtab) + 15) & ~15
        self.blob_at = self.data_at + self.data_size
        self.blob, self.relocs = self._type_names()
        self.rela_at = (self.blob_at + len(self.blob) + 7) & ~7
        self.dyn_at = self.rela_at + 24 * len(self.relocs)
        self.dynamic = self._dynamic()
        self.end = self.dyn_at + 16 * len(self.dynamic)

    def _string(self, text: str) -> int:
        if text not in self.offsets:
            self.offsets[text] = len(self.strtab)
            self.strtab.extend(text.encode() + b"\0")
        return self.offsets[text]

    def _type_names(self) -> tuple[bytearray, list[tuple[int, int]]]:
        """Each type_info's name string, and the relocation that points its second word at it."""
        blob, relocs = bytearray(), []
        for sym in self.names:
            if sym.startswith("_ZTI"):
                relocs.append((self.data_at + self.where[sym] + 8, self.blob_at + len(blob)))
                blob.extend(sym[4:].encode() + b"\0")
        return blob, relocs

    def _dynamic(self) -> list[tuple[int, int]]:
        dynamic = [(4, self.hash_at), (5, self.str_at), (6, self.sym_at), (10, len(self.strtab)), (11, 24)]
        dynamic.append((DT_SONAME, self._string(self.soname)))
        if self.relocs:
            dynamic += [(7, self.rela_at), (8, 24 * len(self.relocs)), (9, 24)]
        if self.versions:
            dynamic += [
                (0x6FFFFFF0, self.versym_at),
                (0x6FFFFFFC, self.verdef_at),
                (0x6FFFFFFD, len(self.versions) + 1),
            ]
        return [*dynamic, (0, 0)]

    def image(self) -> bytes:
        out = bytearray(self.end)
        self._write_program_headers(out)
        self._write_hash(out)
        self._write_symbols(out)
        if self.versions:
            self._write_version_definitions(out)
        out[self.str_at : self.str_at + len(self.strtab)] = self.strtab
        out[self.blob_at : self.blob_at + len(self.blob)] = self.blob
        for i, (where, target) in enumerate(self.relocs):
            struct.pack_into("<QQq", out, self.rela_at + 24 * i, where, R_AARCH64_RELATIVE, target)
        for i, (tag, val) in enumerate(self.dynamic):
            struct.pack_into("<qQ", out, self.dyn_at + 16 * i, tag, val)
        sections = self._sections()
        shoff = self._append_section_headers(out, sections)
        header = (b"\x7fELF", 2, 1, 1, 0, 3, EM_AARCH64, 1, 0, ELF_HEADER, shoff, 0, 64, 56, PROGRAM_HEADERS, 64)
        struct.pack_into("<4sBBBB8xHHIQQQIHHHHHH", out, 0, *header, len(sections) + 2, len(sections) + 1)
        return bytes(out)

    def _write_program_headers(self, out: bytearray) -> None:
        """PT_LOAD (everything, read-write-execute), PT_DYNAMIC, PT_GNU_STACK (no executable stack)."""
        dyn_size = 16 * len(self.dynamic)
        struct.pack_into("<IIQQQQQQ", out, ELF_HEADER, 1, 7, 0, 0, 0, self.end, self.end, PAGE)
        struct.pack_into("<IIQQQQQQ", out, ELF_HEADER + 56, 2, 6, *[self.dyn_at] * 3, dyn_size, dyn_size, 8)
        struct.pack_into("<IIQQQQQQ", out, ELF_HEADER + 112, 0x6474E551, 6, 0, 0, 0, 0, 0, 16)

    def _write_hash(self, out: bytearray) -> None:
        buckets, chains = [0] * self.nbucket, [0] * self.nsyms
        for i, sym in enumerate(self.names, 1):
            b = _elf_hash(sym.encode()) % self.nbucket
            chains[i], buckets[b] = buckets[b], i
        layout = f"<II{self.nbucket}I{self.nsyms}I"
        struct.pack_into(layout, out, self.hash_at, self.nbucket, self.nsyms, *buckets, *chains)

    def _write_symbols(self, out: bytearray) -> None:
        index = {v: i for i, v in enumerate(self.versions, 2)}
        for i, sym in enumerate(self.names, 1):
            function = sym not in self.objects and not sym.startswith("_ZTI")
            at = self.data_at + self.where[sym]
            # STB_GLOBAL | STT_FUNC or STT_OBJECT, default visibility, an ordinary section index (not UNDEF/ABS)
            kind = 0x12 if function else 0x11
            struct.pack_into(
                "<IBBHQQ", out, self.sym_at + 24 * i, self.offsets[sym], kind, 0, DATA_SECTION, at, self.slot[sym]
            )
            struct.pack_into("<H", out, self.versym_at + 2 * i, index.get(self.symbols[sym], 1))
            if function:  # adr x0, .+32; ret
                struct.pack_into("<II", out, at, 0x10000100, 0xD65F03C0)

    def _write_version_definitions(self, out: bytearray) -> None:
        """The library's own name (index 1), then each version (index 2 on)."""
        entries = [(1, 1, self.soname)] + [(0, i, v) for i, v in enumerate(self.versions, 2)]
        for n, (flags, ndx, text) in enumerate(entries):
            at = self.verdef_at + 28 * n
            following = 0 if n == len(self.versions) else 28
            struct.pack_into("<HHHHIII", out, at, 1, flags, ndx, 1, _elf_hash(text.encode()), 20, following)
            struct.pack_into("<II", out, at + 20, self.offsets[text], 0)

    def _sections(self) -> list[tuple]:
        """(name, type, flags, address, size, link, info, alignment, entry size) of each section header."""
        # sic: with versions, .data's size reads the last version definition's offset (the writer once reused a
        # variable); only tools read it, and it stays so that stubs stay byte for byte what they were
        data_size = self.verdef_at + 28 * len(self.versions) if self.versions else self.data_size
        sections = [
            (".hash", 5, 2, self.hash_at, 4 * (2 + self.nbucket + self.nsyms), 2, 0, 4, 4),
            (".dynsym", 11, 2, self.sym_at, 24 * self.nsyms, 3, 1, 8, 24),
            (".dynstr", 3, 2, self.str_at, len(self.strtab), 0, 0, 1, 0),
            (".gnu.version", 0x6FFFFFFF, 2, self.versym_at, 2 * self.nsyms, 2, 0, 2, 2),
            (".data", 1, 7, self.data_at, data_size, 0, 0, 16, 0),  # DATA_SECTION
            (".dynamic", 6, 3, self.dyn_at, 16 * len(self.dynamic), 3, 0, 8, 16),
        ]
        if self.versions:
            count = len(self.versions) + 1
            sections.append((".gnu.version_d", 0x6FFFFFFD, 2, self.verdef_at, 28 * count, 3, count, 4, 0))
        if self.relocs:
            sections.append((".rela.dyn", 4, 2, self.rela_at, 24 * len(self.relocs), 2, 0, 8, 24))
        return sections

    @staticmethod
    def _append_section_headers(out: bytearray, sections: list[tuple]) -> int:
        """Appends .shstrtab and the section headers (null first, .shstrtab last); returns where they start."""
        shstrtab = b"\0" + b"".join(name.encode() + b"\0" for name, *_ in sections) + b".shstrtab\0"
        names_at, cursor = [], 1
        for name, *_ in sections:
            names_at.append(cursor)
            cursor += len(name) + 1
        shstr_at = len(out)
        out += shstrtab
        shoff = (len(out) + 7) & ~7
        out += bytes(shoff - len(out) + 64 * (len(sections) + 2))
        for i, ((_, kind, flags, addr, size, link, info, align, entsize), name_at) in enumerate(
            zip(sections, names_at), 1
        ):
            header = (name_at, kind, flags, addr, addr, size, link, info, align, entsize)
            struct.pack_into("<IIQQQQIIQQ", out, shoff + 64 * i, *header)
        shstrtab_header = (cursor, 3, 0, 0, shstr_at, len(shstrtab), 0, 0, 1, 0)
        struct.pack_into("<IIQQQQIIQQ", out, shoff + 64 * (len(sections) + 1), *shstrtab_header)
        return shoff
