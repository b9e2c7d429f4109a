#!/usr/bin/env python3
"""Which fields of the DMA path's shared structures share a cache line, read from a kernel's own BTF (the
`.BTF` blob CONFIG_DEBUG_INFO_BTF builds into the kernel image), not written by hand.

    python tools/struct_layouts.py VMLINUZ [VMLINUZ...] [--json OUT]

A VMLINUZ is an x86 bzImage (its xz, zstd or gzip payload is unpacked; zstd needs the `zstd` program) or an
arm64 Image (raw or gzip). For each structure in STRUCTS it prints, per 64-byte line, the fields in it (nested
structures one level down), with the fields the model prices as shared lines marked.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import struct
import subprocess
import sys
from pathlib import Path

LINE = 64
# The structures whose lines the model prices (docs/contention.md), and the fields it names in each.
STRUCTS = {
    "arm_smmu_cmdq": ["q.llq", "valid_map", "owner_prod", "lock"],
    "dmar_domain": ["cache_lock", "cache_tags", "iommu_array", "lock", "devices"],
    "q_inval": ["q_lock", "free_head", "free_tail", "free_cnt"],
    "iova_domain": ["iova_rbtree_lock", "cached_node", "cached32_node", "rcaches"],
    "iova_rcache": ["lock", "depot_size", "depot", "cpu_rcaches"],
    "iova_cpu_rcache": ["lock", "loaded", "prev"],
    "iommu_dma_cookie": ["fq_flush_start_cnt", "fq_flush_finish_cnt", "fq_timer", "fq_timer_on", "fq_domain"],
}
SIZED = {1: 4, 3: 12, 14: 4, 17: 4}  # kind -> bytes after the header, regardless of vlen
PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # kind -> bytes per vlen entry
HAS_SIZE = {1, 4, 5, 6, 15, 16, 19}


def kernel_image(path: Path) -> bytes:
    """The uncompressed kernel of a bzImage or an arm64 Image."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[0x202:0x206] != b"HdrS":
        return data  # an uncompressed arm64 Image
    for magic, unpack in ((b"\xfd7zXZ\x00", _xz), (b"\x28\xb5\x2f\xfd", _zstd), (b"\x1f\x8b\x08\x00", _gz)):
        at = data.find(magic)
        while at >= 0:
            try:
                out = unpack(data[at:])
                if b"\x9f\xeb\x01\x00" in out:
                    return out
            except (lzma.LZMAError, OSError, EOFError, subprocess.CalledProcessError):
                pass
            at = data.find(magic, at + 1)
    raise SystemExit(f"{path}: no xz, zstd or gzip payload with BTF in it")


def _xz(b: bytes) -> bytes:
    return lzma.LZMADecompressor().decompress(b)


def _gz(b: bytes) -> bytes:
    return gzip.GzipFile(fileobj=io.BytesIO(b)).read()


def _zstd(b: bytes) -> bytes:
    return subprocess.run(["zstd", "-dc"], input=b, capture_output=True).stdout


class Btf:
    """The types of one BTF blob: id -> (kind, name, size or referenced type, members)."""

    def __init__(self, blob: bytes):
        magic, ver, flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", blob)
        assert magic == 0xEB9F and ver == 1
        base = hdr_len
        self.strings = blob[base + str_off: base + str_off + str_len]
        self.types: list = [None]
        p, end = base + type_off, base + type_off + type_len
        while p < end:
            name_off, info, size_type = struct.unpack_from("<III", blob, p)
            p += 12
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            members = []
            if kind in (4, 5):
                for i in range(vlen):
                    mn, mt, mo = struct.unpack_from("<III", blob, p + 12 * i)
                    members.append((self.name(mn), mt, (mo & 0xFFFFFF) if kflag else mo))
            elif kind == 3:
                members = list(struct.unpack_from("<III", blob, p))  # type, index type, nelems
            p += SIZED.get(kind, 0) + PER_VLEN.get(kind, 0) * vlen
            self.types.append((kind, self.name(name_off), size_type, members))

    def name(self, off: int) -> str:
        return self.strings[off:self.strings.index(b"\0", off)].decode()

    def size(self, tid: int) -> int:
        kind, _, st, members = self.types[tid]
        if kind in HAS_SIZE:
            return st
        if kind == 2:
            return 8
        if kind == 3:
            return members[2] * self.size(members[0])
        return self.size(st)  # typedef, volatile, const, restrict, type tag

    def resolved(self, tid: int) -> int:
        while self.types[tid][0] in (8, 9, 10, 11, 18):
            tid = self.types[tid][2]
        return tid

    def struct(self, name: str) -> int | None:
        return next((i for i, t in enumerate(self.types) if t and t[0] == 4 and t[1] == name and t[3]), None)

    def fields(self, tid: int, prefix: str = "", at: int = 0, depth: int = 0):
        """(path, byte offset, size) of each member, nested structures and unions one level down."""
        for name, mt, bits in self.types[tid][3]:
            off = at + bits // 8
            r = self.resolved(mt)
            path = prefix + (name or "")
            if self.types[r][0] in (4, 5) and (depth < 1 or not name):
                # Named nested structures one level down; anonymous ones (their fields are the parent's) always.
                yield from self.fields(r, path + "." if name else prefix, off, depth + (1 if name else 0))
            else:
                yield path or "(anon)", off, self.size(mt)


def layouts(btf: Btf) -> dict:
    out = {}
    for s, named in STRUCTS.items():
        tid = btf.struct(s)
        if tid is None:
            continue
        lines: dict[int, list[str]] = {}
        for path, off, size in btf.fields(tid):
            for line in range(off // LINE, (off + max(size, 1) - 1) // LINE + 1):
                lines.setdefault(line, []).append(path)
        fields = {path: [off, size] for path, off, size in btf.fields(tid)}
        where = {}
        for n in named:
            hit = next((p for p in fields if p == n or p.startswith(n + ".")), None)
            if hit:
                where[n] = {"offset": fields[hit][0], "line": fields[hit][0] // LINE}
        out[s] = {"size": btf.size(tid), "named": where, "lines": {str(k): v for k, v in sorted(lines.items())}}
    return out


def blob_of(image: bytes) -> bytes:
    at = image.find(b"\x9f\xeb\x01\x00\x18\x00\x00\x00")
    if at < 0:
        raise SystemExit("no BTF in this kernel (CONFIG_DEBUG_INFO_BTF)")
    _, _, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", image, at)
    return image[at: at + hdr_len + max(type_off + type_len, str_off + str_len)]


def main(argv: list[str]) -> int:
    out_json = None
    if "--json" in argv:
        i = argv.index("--json")
        out_json = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    res = {}
    for v in argv:
        name = Path(v).name.removeprefix("vmlinuz-")
        res[name] = layouts(Btf(blob_of(kernel_image(Path(v)))))
        for s, lay in res[name].items():
            print(f"{name} struct {s} ({lay['size']} bytes):")
            for line, fields in lay["lines"].items():
                marks = [f for f in fields if any(f == n or f.startswith(n + ".") for n in lay["named"])]
                print(f"  line {line}: {', '.join(fields)}" + (f"   <- {', '.join(marks)}" if marks else ""))
    if out_json:
        Path(out_json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
