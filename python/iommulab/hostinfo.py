"""`iommulab inspect`: what the running system does with DMA, and why, read from /proc and /sys (or a saved copy
of them with --root) without changing anything.

Per device it reports the DMA mode in effect (the IOMMU group's `type`: DMA = strict, DMA-FQ = lazy, identity =
passthrough) and the reason the kernel's default-domain rules give for it (the same rules as `iommulab explain`),
saying when what sysfs shows disagrees with what those rules predict."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core, vendors
from .api import ScenarioError, newer_than_modelled
from .inputs import file_kind, shown

# The group types sysfs shows (drivers/iommu/iommu.c iommu_group_show_type) and the DMA mode each means.
GROUP_MODES = {"DMA": "strict", "DMA-FQ": "lazy", "identity": "passthrough", "blocked": "blocked",
               "unmanaged": "owned by a user-space driver (VFIO) or a driver's own domain"}
# PCI Express extended capability ID of Address Translation Services (PCIe Base Spec §7.8.2).
PCI_EXT_CAP_ID_ATS = 0x0F
# PCI class codes (base class, subclass) named for the table.
PCI_CLASSES = {(0x02, 0x00): "ethernet", (0x02, 0x80): "network", (0x01, 0x08): "nvme", (0x01, 0x00): "scsi",
               (0x01, 0x06): "sata", (0x03, 0x00): "vga", (0x06, 0x00): "host bridge", (0x06, 0x01): "isa bridge",
               (0x06, 0x04): "pci bridge", (0x0c, 0x03): "usb", (0x0c, 0x05): "smbus", (0x01, 0x80): "storage",
               (0x00, 0xff): "virtio"}


# Kernel log lines about IOMMUs and DMA domains (the prefixes drivers/iommu/ prints under), but not the one
# "Adding to iommu group" line per device (the groups are listed anyway).
IOMMU_LOG = re.compile(r"(\b(DMAR|DMAR-IR|iommu|IOMMU|AMD-Vi|PCI-DMA|virtio_iommu|virtio-iommu)\b|arm-smmu)")
IOMMU_LOG_SKIP = re.compile(r"Adding to iommu group|Kernel command line|Command line:")
KERNEL_LOG_MAX = 60
# The kernel's own statement of its default domain (drivers/iommu/iommu.c iommu_subsys_init).
DOMAIN_LOG = ("iommu: Default domain type:", "iommu: DMA domain TLB invalidation policy:")


# Bounds on what inspect reads, each far above what the kernel writes there (reading bounds, not kernel constants),
# so that a broken or hostile tree (a link to /dev/zero, a huge file) cannot fill memory.
# A sysfs attribute is at most a page (fs/sysfs/file.c sysfs_kf_seq_show fills one PAGE_SIZE buffer); the ones
# read here are one short line, and a PCIe function's configuration space, read whole, is 4096 bytes
# (PCI_CFG_SPACE_EXP_SIZE).
SYSFS_FILE_BYTES = 4096
# /proc/cmdline is the command line (COMMAND_LINE_SIZE: 2048 bytes on x86 and arm64) with what bootconfig adds
# (XBC_DATA_MAX: 32 KiB); osrelease and arch are one line.
PROC_FILE_BYTES = 64 << 10
# A distribution kernel's .config is about 300 KiB, as /boot/config-* or decompressed from /proc/config.gz.
KERNEL_CONFIG_BYTES = 4 << 20
# The printk ring is at most 32 MiB (CONFIG_LOG_BUF_SHIFT <= 25); its records as /dev/kmsg or dmesg print them
# add a prefix to each.
KERNEL_LOG_BYTES = 64 << 20
# /proc/cpuinfo prints about 1.5 KiB per CPU on x86 (flags are most of it): 4 MiB covers 2048 CPUs.
CPUINFO_BYTES = 4 << 20
# Each file inspect reads: its bound and what it should be (for the note when it is not).
BOUNDS = [("sys/", SYSFS_FILE_BYTES, "a sysfs attribute"), ("dev/kmsg", KERNEL_LOG_BYTES, "the kernel log"),
          ("boot/config-", KERNEL_CONFIG_BYTES, "a kernel config"),
          ("proc/config.gz", KERNEL_CONFIG_BYTES, "a kernel config"), ("proc/cpuinfo", CPUINFO_BYTES, "/proc/cpuinfo"),
          ("proc/", PROC_FILE_BYTES, "a /proc file")]

# A saved tree as a `.tar.gz` (inspect --save's directory archived, or a guest's: tests/data/inspect) is unpacked
# to a temporary directory first. Bounds on what it may hold (reading bounds, not kernel constants): no member
# larger than the largest file inspect reads, a whole far above the trees saved here (about 100 KiB), and a
# count far above their few hundred entries.
ARCHIVE_MEMBER_BYTES = KERNEL_LOG_BYTES
ARCHIVE_BYTES = 128 << 20
ARCHIVE_MEMBERS = 100_000
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


class _Unreadable(Exception):
    """Why a path of the tree is not read (one line)."""


def _inside(real: str, top: str) -> bool:
    return top == "/" or real == top or real.startswith(top + os.sep)


def _read_at_most(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = os.read(fd, min(n - len(out), 1 << 16))
        if not b:
            break
        out += b
    return bytes(out)


def _gunzip(data: bytes, bound: int) -> bytes:
    """gzip data decompressed, at most `bound` bytes of it."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, bound + 1)
    except zlib.error as e:
        raise _Unreadable(f"not gzip data ({e})") from None
    if len(out) > bound:
        raise _Unreadable(f"larger than {bound} bytes decompressed; expected a kernel config")
    if not d.eof:
        raise _Unreadable("gzip data cut short")
    return out


@dataclass
class Tree:
    """Files under `root`, read as a tree: links are followed only where they stay inside it (as sysfs's own
    do: a group's devices/X → ../../../devices/pci…), only regular files are read, each to its bound (BOUNDS),
    and each at most once. What could not be read, other than a file that is absent, is in `problems` (one
    line each); what was read is kept for --save: `files` (a live kernel log too), `links`, and `listed`
    (each listed directory's entries: "dir" for a directory, a link's target, or None)."""
    root: Path
    top: str = ""
    files: dict[str, bytes] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    listed: dict[str, dict[str, str | None]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.top = os.path.realpath(self.root)

    def kmsg(self) -> str | None:
        """The kernel log: /dev/kmsg's records on a live system (readable by root, or by anyone when
        kernel.dmesg_restrict is 0), read without blocking; a saved tree's dev/kmsg file (records, or the
        lines `dmesg` prints)."""
        if self.root != Path("/"):
            return self.text("dev/kmsg")
        try:
            fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        chunks, size = [], 0
        try:
            while size < KERNEL_LOG_BYTES:
                try:
                    rec = os.read(fd, 16384)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno == errno.EPIPE:  # the ring overwrote the record: go on with the next
                        continue
                    break
                if not rec:
                    break
                chunks.append(rec)
                size += len(rec)
        finally:
            os.close(fd)
        self.files["dev/kmsg"] = b"".join(chunks)
        return self.files["dev/kmsg"].decode(errors="replace")

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def reach(self, rel: str) -> str:
        """The real path `rel` names, when it stays inside the tree."""
        try:
            real = os.path.realpath(self.path(rel))
        except (OSError, ValueError) as e:
            raise _Unreadable(f"not a path ({e})") from None
        if not _inside(real, self.top):
            raise _Unreadable(f"leads out of the tree (to {shown(real)}); not followed")
        return real

    def note(self, rel: str, why: str) -> None:
        self.problems.append(f"{shown(rel)}: {why}")

    def raw(self, rel: str) -> bytes | None:
        """The bytes of regular file `rel`, at most its bound; None when it is absent or not read (noted)."""
        bound, what = next(((b, w) for prefix, b, w in BOUNDS if rel.startswith(prefix)), (PROC_FILE_BYTES, "a file"))
        try:
            data = self._read(self.reach(rel), bound, what)
        except _Unreadable as e:
            self.note(rel, str(e))
            return None
        if data is not None:
            self.files[rel] = data
        return data

    @staticmethod
    def _read(real: str, bound: int, what: str) -> bytes | None:
        """A regular file's bytes (None: absent). Anything else is refused before it is opened: opening a FIFO
        blocks, and a device may do anything."""
        try:
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                raise _Unreadable(f"{file_kind(st.st_mode)}; expected {what}")
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _Unreadable(f"cannot read: {e.strerror or e}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
                raise _Unreadable(f"not a regular file; expected {what}")
            data = _read_at_most(fd, bound + 1)
        except OSError as e:
            raise _Unreadable(f"cannot read: {e.strerror or e}") from None
        finally:
            os.close(fd)
        if len(data) > bound:
            raise _Unreadable(f"larger than {bound} bytes; expected {what}")
        return data

    def text(self, rel: str) -> str | None:
        data = self.raw(rel)
        if data is not None and rel.endswith(".gz"):
            try:
                data = _gunzip(data, KERNEL_CONFIG_BYTES)
            except _Unreadable as e:
                self.note(rel, str(e))
                return None
        return None if data is None else data.decode(errors="replace")

    def hex(self, rel: str) -> int | None:
        """A register or class code sysfs prints in hex (with or without 0x); anything else is noted."""
        text = self.text(rel)
        if text is None:
            return None
        v = text.strip()
        if not re.fullmatch(r"(0x)?[0-9a-fA-F]{1,16}", v):
            self.note(rel, f"{v[:40]!r} is not a hexadecimal number")
            return None
        return int(v, 16)

    def ls(self, rel: str, lost: str = "") -> list[str] | None:
        """The entries of directory `rel` ([] when it is absent); None when it cannot be read, noted with
        `lost`, what the report then lacks."""
        try:
            return self._listdir(rel)
        except _Unreadable as e:
            self.note(rel, f"{e}{'; ' + lost if lost else ''}")
            return None

    def must_ls(self, rel: str) -> list[str]:
        """The entries of a directory the report depends on ([] when absent): one that cannot be read is an
        error, not an empty directory."""
        try:
            return self._listdir(rel)
        except _Unreadable as e:
            raise ScenarioError(f"{shown(self.path(rel))}: {e}") from None

    def _listdir(self, rel: str) -> list[str]:
        try:
            real = self.reach(rel)
            names = sorted(os.listdir(real))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _Unreadable(f"cannot read: {e.strerror or e}") from None
        good = [n for n in names if n == shown(n)]
        for n in names:
            if n != shown(n):
                self.note(f"{rel}/{n}", "a name that is not UTF-8")
        self.listed[rel] = {n: self._kind(os.path.join(real, n)) for n in good}
        return good

    def _kind(self, p: str) -> str | None:
        """What --save makes of a listed entry: "dir" for a directory of the tree (a link to one too, so that
        the files read under it can be saved), a link's target, or None (a file: saved if read)."""
        if os.path.isdir(p) and _inside(os.path.realpath(p), self.top):
            return "dir"
        try:
            return os.readlink(p)
        except OSError:
            return None

    def link(self, rel: str) -> str | None:
        """The target of link `rel` (its text: it is not followed)."""
        head, name = os.path.split(rel)
        try:
            target = os.readlink(os.path.join(self.reach(head), name))
        except _Unreadable as e:
            self.note(rel, str(e))
            return None
        except OSError:
            return None  # absent (no driver bound), or not a link
        self.links[rel] = target
        return shown(target)


def _log_lines(text: str | None) -> list[str] | None:
    """The IOMMU lines of a kernel log (kmsg records `pri,seq,usec,flags;message` or dmesg's `[  t] message`)."""
    if text is None:
        return None
    out = []
    for line in text.splitlines():
        m = re.match(r"^\d+,\d+,\d+,[^;]*;(.*)$", line) or re.match(r"^(?:<\d+>)?\[\s*[\d.]+\]\s?(.*)$", line)
        if not m:
            continue  # a record's continuation (" SUBSYSTEM=pci") or not a log line
        msg = m.group(1).rstrip()
        if IOMMU_LOG.search(msg) and not IOMMU_LOG_SKIP.search(msg):
            out.append(msg)
    return out[:KERNEL_LOG_MAX]


def _kernel(release: str) -> str | None:
    m = re.match(r"(\d+)\.(\d+)", release)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _arch(tree: Tree) -> str:
    a = (tree.text("proc/sys/kernel/arch") or "").strip()
    if not a and tree.root == Path("/"):
        a = os.uname().machine
    return {"aarch64": "arm64", "amd64": "x86_64"}.get(a, a or "unknown")


def _config_default(tree: Tree, release: str) -> str | None:
    """CONFIG_IOMMU_DEFAULT_{DMA_STRICT,DMA_LAZY,PASSTHROUGH} from /boot/config-RELEASE or /proc/config.gz."""
    text = tree.text(f"boot/config-{release}") or tree.text("proc/config.gz")
    if not text:
        return None
    for opt, mode in (("DMA_STRICT", "strict"), ("DMA_LAZY", "lazy"), ("PASSTHROUGH", "passthrough")):
        if re.search(rf"^CONFIG_IOMMU_DEFAULT_{opt}=y$", text, re.M):
            return mode
    return None


def _iommus(tree: Tree) -> list[dict[str, Any]]:
    """Every IOMMU in /sys/class/iommu: its vendor and what the vendor's module reads of it."""
    out = []
    for name in tree.must_ls("sys/class/iommu"):
        vendor = vendors.identify(name)
        out.append({"name": name, "vendor": vendor} | vendors.read(tree, vendor, name))
    return out


def _ats(config: bytes | None) -> bool | None:
    """Whether the device's PCIe extended configuration space lists ATS (None: not readable, e.g. not root)."""
    if not config or len(config) < 0x104:
        return None
    off = 0x100
    for _ in range(64):
        if off < 0x100 or off + 4 > len(config):
            return False
        hdr = int.from_bytes(config[off:off + 4], "little")
        if hdr in (0, 0xFFFFFFFF):
            return False
        if hdr & 0xFFFF == PCI_EXT_CAP_ID_ATS:
            return True
        off = (hdr >> 20) & 0xFFC
        if not off:
            return False
    return False


def _device(tree: Tree, bdf: str) -> dict[str, Any]:
    base = f"sys/bus/pci/devices/{bdf}"
    d: dict[str, Any] = {"device": bdf}
    drv = tree.link(f"{base}/driver")
    d["driver"] = os.path.basename(drv) if drv else None
    c = tree.hex(f"{base}/class")
    d["class"] = None if c is None else PCI_CLASSES.get(((c >> 16) & 0xFF, (c >> 8) & 0xFF), f"0x{c >> 8:04x}")
    d["ats"] = _ats(tree.raw(f"{base}/config"))
    d["untrusted"] = (tree.text(f"{base}/untrusted") or "0").strip() == "1"
    return d


@contextlib.contextmanager
def _unpacked(root: str | os.PathLike) -> Iterator[str | os.PathLike]:
    """`root` itself, or, for a `.tar.gz` tree, a temporary directory it is unpacked to and that is removed on
    every way out (an error, Ctrl-C, SIGTERM, SIGHUP)."""
    if not os.fspath(root).endswith(ARCHIVE_SUFFIXES) or os.path.isdir(root):
        yield root
        return
    with _signals_raise(), tempfile.TemporaryDirectory(prefix="iommulab-root-") as d:
        try:
            _unpack(root, d)
        except (OSError, tarfile.TarError, EOFError, zlib.error) as e:
            raise ScenarioError(f"--root {shown(root)}: cannot unpack: {getattr(e, 'strerror', None) or e}") from None
        yield d


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while the block runs (so its cleanup runs), where they would end the
    process at once; only in the main thread, and only where the signal's action is the default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    sigs = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_DFL]
    old = {s: signal.signal(s, leave) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _unpack(archive: str | os.PathLike, dest: str) -> None:
    """Unpack `archive` into the empty directory `dest`: directories, regular files and relative links that stay
    inside it. Anything else is refused, naming the member: an absolute path or one with `..`, a link leading
    out, a hard link, a device or FIFO, a name given twice, a member over ARCHIVE_MEMBER_BYTES, more than
    ARCHIVE_BYTES or ARCHIVE_MEMBERS in all."""
    top = os.path.realpath(dest)
    total = 0
    with tarfile.open(archive, "r:gz") as tar:
        for n, m in enumerate(tar):
            name = os.path.normpath(m.name)
            what = f"--root {shown(archive)}: member {shown(m.name)}"
            if n >= ARCHIVE_MEMBERS:
                raise ScenarioError(f"--root {shown(archive)}: more than {ARCHIVE_MEMBERS} members")
            if os.path.isabs(m.name) or name == ".." or name.startswith("../"):
                raise ScenarioError(f"{what}: a path outside the tree")
            if name == "." and m.isdir():
                continue
            dst = os.path.join(top, name)
            if os.path.lexists(dst) or not _inside(os.path.realpath(os.path.dirname(dst)), top):
                raise ScenarioError(f"{what}: given twice, or under a link")
            if m.isdir():
                os.makedirs(dst)
            elif m.issym():
                goes = os.path.normpath(os.path.join(os.path.dirname(name), m.linkname))
                if os.path.isabs(m.linkname) or goes == ".." or goes.startswith("../"):
                    raise ScenarioError(f"{what}: a link leading out of the tree (to {shown(m.linkname)})")
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.symlink(m.linkname, dst)
            elif m.isreg():
                total += m.size
                if m.size > ARCHIVE_MEMBER_BYTES or total > ARCHIVE_BYTES:
                    raise ScenarioError(f"{what}: {m.size} bytes; expected at most {ARCHIVE_MEMBER_BYTES} a file "
                                        f"and {ARCHIVE_BYTES} in all")
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                src = tar.extractfile(m)
                with src, open(dst, "xb") as f:
                    shutil.copyfileobj(src, f)
            else:
                raise ScenarioError(f"{what}: a {'hard link' if m.islnk() else 'device or FIFO'}; expected files, "
                                    "directories and links")


def _tree(root: str | os.PathLike) -> Tree:
    """The tree under `root`, which must be a directory that can be read (a saved one: with proc/ or sys/)."""
    tree = Tree(Path(root))
    try:
        names = os.listdir(tree.root)
    except OSError as e:
        raise ScenarioError(f"--root {shown(root)}: "
                            + ("not a directory" if e.errno == errno.ENOTDIR else f"cannot read: {e.strerror or e}"))
    if tree.root != Path("/") and not {"proc", "sys"} & set(names):
        raise ScenarioError(f"--root {shown(root)}: no proc/ or sys/ in it; expected a tree inspect --save wrote")
    return tree


def _groups(tree: Tree, res: dict[str, Any]) -> None:
    """Each IOMMU group's type and devices, and each device with the DMA mode its group's type means."""
    names = tree.must_ls("sys/kernel/iommu_groups")
    for g in names:
        if not re.fullmatch(r"[0-9]{1,9}", g):
            tree.note(f"sys/kernel/iommu_groups/{g}", "not an IOMMU group number")
    for g in sorted((g for g in names if re.fullmatch(r"[0-9]{1,9}", g)), key=int):
        gtype = (tree.text(f"sys/kernel/iommu_groups/{g}/type") or "").strip() or None
        devs = tree.ls(f"sys/kernel/iommu_groups/{g}/devices", lost=f"the devices of IOMMU group {g} are not shown")
        res["groups"].append({"group": int(g), "type": gtype, "devices": devs or []})
        for bdf in devs or []:
            d = _device(tree, bdf) | {"group": int(g), "type": gtype, "mode": GROUP_MODES.get(gtype or "", gtype)}
            res["devices"].append(d)


# What says a kernel runs in a virtual machine, and which VMM made it: the x86 CPUID hypervisor bit (/proc/cpuinfo's
# `hypervisor` flag), arch/x86/kernel/cpu/hypervisor.c's "Hypervisor detected: NAME", and the firmware the VMM
# provides as the kernel logs it: the DMI system name, ACPI tables' OEM and table ids (QEMU's are BOCHS and
# BXPC, hw/acpi/aml-build.c ACPI_BUILD_APPNAME6/4), and the device tree of QEMU's arm `virt` board.
GUEST_LOG = [
    (re.compile(r"ACPI: \w{4} .*\((?:v\d+ +)?(?:BOCHS|BXPC)\b"), "QEMU", "the kernel log's ACPI tables are QEMU's "
     "(BOCHS, BXPC)"),
    (re.compile(r"Machine model: linux,dummy-virt"), "QEMU", "the kernel log's machine is QEMU's arm virt board"),
    (re.compile(r"DMI: QEMU\b"), "QEMU", "the kernel log's DMI names QEMU"),
    (re.compile(r"Hypervisor detected: *(\S.{0,30})"), None, "the kernel log: Hypervisor detected"),
    (re.compile(r"DMI: .*\b(VMware|VirtualBox|Xen|Google Compute Engine)\b"), None, "the kernel log's DMI"),
    (re.compile(r"DMI: .*\bAmazon EC2 (?!\S*metal)"), "Amazon EC2 (Nitro)", "the kernel log's DMI"),
    (re.compile(r"DMI: Microsoft Corporation Virtual Machine"), "Hyper-V", "the kernel log's DMI"),
    (re.compile(r"Booting paravirtualized kernel on (?!bare hardware)(\S+)"), None, "the kernel log: paravirt"),
]


def _guest(flags: set[str], log: str) -> tuple[bool, str | None, str | None]:
    """(a guest, its VMM when the log names it, the evidence in a few words)."""
    for pat, vmm, what in GUEST_LOG:
        m = pat.search(log)
        if m:
            name = vmm or shown(m.group(1).strip())
            return True, name, what if vmm else f"{what} {name}"
    if "hypervisor" in flags:
        return True, None, "the CPU's hypervisor flag (/proc/cpuinfo)"
    return False, None, None


def _speed_gbps(tree: Tree, n: str) -> float | None:
    """A NIC's link speed (sysfs `speed`, Mb/s; -1 or absent when the link is down or the driver does not say);
    anything but a whole number is noted."""
    speed = (tree.text(f"sys/class/net/{n}/speed") or "").strip()
    if not speed or speed == "-1":
        return None
    if not re.fullmatch(r"[0-9]{1,9}", speed):
        tree.note(f"sys/class/net/{n}/speed", f"{shown(speed[:40])!r} is not a speed in Mb/s")
        return None
    return int(speed) / 1000 if int(speed) > 0 else None


def hardware(tree: Tree) -> dict[str, Any]:
    """What `inspect` does not read but a scenario needs: the CPUs (count, model), whether this is a guest (and of
    which VMM) and a confidential one, the PCI NICs (speed, receive and transmit queues) and the NVMe
    controllers. Absent files give None."""
    cpus = [c for c in tree.ls("sys/devices/system/cpu") or [] if re.fullmatch(r"cpu\d+", c)]
    info = tree.text("proc/cpuinfo") or ""
    field = lambda name: next((m.group(1).strip() for m in re.finditer(rf"^{name}\s*:(.*)$", info, re.M)), None)
    flags = set((field("flags") or field("Features") or "").split())
    model = field("model name") or (f"Arm implementer {field('CPU implementer')} part {field('CPU part')}"
                                    if field("CPU part") else None)
    log = tree.kmsg() or ""
    cc = re.search(r"Memory Encryption Features active: *(.+)", log)
    nics = []
    for n in tree.ls("sys/class/net") or []:
        dev = tree.link(f"sys/class/net/{n}/device")
        if not dev:
            continue  # not a device's port (lo, bridges, tunnels, ifb)
        queues = tree.ls(f"sys/class/net/{n}/queues") or []
        nics.append({"name": n, "device": os.path.basename(dev), "speed_gbps": _speed_gbps(tree, n),
                     "rx_queues": sum(q.startswith("rx-") for q in queues) or None,
                     "tx_queues": sum(q.startswith("tx-") for q in queues) or None})
    guest, vmm, evidence = _guest(flags, log)
    return {
        "cpus": len(cpus) or None,
        "cpu_model": model,
        "guest": guest, "vmm": vmm, "guest_evidence": evidence,
        "confidential": cc.group(1).strip() if cc else ("Intel TDX" if "tdx_guest" in flags else None),
        "nics": nics,
        "nvme": [n for n in tree.ls("sys/class/nvme") or [] if re.fullmatch(r"nvme\d+", n)],
    }


def inspect(root: str | os.PathLike = "/") -> tuple[dict[str, Any], Tree]:
    """The system under `root`: kernel, IOMMUs, groups and devices with their DMA mode and its reason; each
    file of the tree that could not be used is named in the notes. `root` may be a `.tar.gz` of a saved tree:
    it is unpacked to a temporary directory, read, and removed before this returns (the tree keeps what it
    read)."""
    with _unpacked(root) as d:
        return _inspect(d)


def _inspect(root: str | os.PathLike) -> tuple[dict[str, Any], Tree]:
    tree = _tree(root)
    release = (tree.text("proc/sys/kernel/osrelease") or "").strip()
    if not release and tree.root == Path("/"):
        release = os.uname().release
    arch = _arch(tree)
    cmdline = (tree.text("proc/cmdline") or "").strip()
    res: dict[str, Any] = {"kernel": release or None, "arch": arch, "cmdline": cmdline,
                           "config_default": _config_default(tree, release) if release else None,
                           "iommus": _iommus(tree), "groups": [], "devices": [], "notes": [],
                           "kernel_log_seen": _log_lines(tree.kmsg())}
    _groups(tree, res)
    res["hardware"] = hardware(tree)
    if not res["iommus"] and not res["groups"]:
        res["notes"].append("No IOMMU is visible (none in /sys/class/iommu, no IOMMU groups): devices reach memory "
                            "at physical addresses (dma-direct), with no translation and no protection.")
    else:
        _apply_rules(res, release)
    res["notes"] += [f"Not used: {p}" for p in tree.problems]
    return res, tree


def _apply_rules(res: dict[str, Any], release: str) -> None:
    """Notes on the IOMMUs, and per device the mode the default-domain rules predict and why."""
    arch = res["arch"]
    seen = {i["vendor"] for i in res["iommus"]}
    vendor = vendors.first(seen)
    kernel = _kernel(release) if release else None
    cm_iommu = vendors.with_caching_mode(res["iommus"])
    cm = cm_iommu is not None
    if cm_iommu:
        d = vendors.DRIVERS[cm_iommu["vendor"]]
        res["notes"].append(f"{d['title']} caching mode is set: this is a virtual IOMMU (only emulated ones set "
                            f"{d['caching_mode_cap']}); every map is invalidated too.")
    rules = None
    if kernel and newer_than_modelled(kernel):
        res["notes"].append(f"Linux {kernel} is after {_core.KERNEL_NEWEST}, the newest kernel whose changes the model "
                            f"knows: its rules stand in (checked on Linux 7.3 guests).")
    if vendor and kernel and arch in vendors.DRIVERS[vendor]["archs"]:
        try:
            rules = json.loads(_core.explain(arch, kernel, res["cmdline"], cm, vendor))
        except ScenarioError as e:
            res["notes"].append(f"The default-domain rules cannot be applied: {e}")
    elif not vendor:
        res["notes"].append("The IOMMU's vendor is not one the model knows (" + ", ".join(sorted(seen)) + ").")
    elif arch not in vendors.DRIVERS[vendor]["archs"]:
        d = vendors.DRIVERS[vendor]
        res["notes"].append(f"{d['title']} cannot be on {shown(arch)} (its driver is built for "
                            f"{', '.join(d['archs'])} only): the tree is not one kernel's; the default-domain "
                            "rules are not applied.")
    if rules:
        _compare(res, rules)


def _compare(res: dict[str, Any], rules: dict[str, Any]) -> None:
    """What the rules predict, set beside what the kernel log and each group's type show."""
    res["kernel_log"] = rules["kernel_log"]
    seen = res["kernel_log_seen"] or []
    for prefix in DOMAIN_LOG:
        want = next((l for l in rules["kernel_log"] if l.startswith(prefix)), None)
        got = next((l for l in seen if l.startswith(prefix)), None)
        if want and got and want != got:
            res["notes"].append(f"The kernel log says \"{got}\"; the default-domain rules predict \"{want}\".")
    by = {r["device"]: r for r in rules["devices"]}
    for d in res["devices"]:
        want = by.get("untrusted PCI device" if d["untrusted"] else "PCI device")
        if not want:
            continue
        d["predicted"] = want["policy"]
        d["why"] = want["why"]
        if d["type"] in ("DMA", "DMA-FQ", "identity") and want["sysfs"] != d["type"]:
            d["why"] = (f"the rules predict {want['sysfs']} ({want['policy']}: {want['why']}); sysfs shows "
                        f"{d['type']}: a driver, a quirk or a write to the group's type changed it")


def profile_for(res: dict[str, Any], as_guest: bool = True) -> tuple[str, str]:
    """The built-in platform profile closest to the inspected host, and why. A guest's IOMMU is its VMM's
    emulation, priced by a guest profile; a guest without one gets the profile of the vIOMMU every VMM can offer
    (virtio-iommu), standing in for the one its VMM would."""
    seen = [i["vendor"] for i in res["iommus"]]
    vendor = vendors.first(seen)
    guest = as_guest and (res.get("hardware") or {}).get("guest")
    arch = res["arch"] if vendors.names(modelled=True, arch=res["arch"]) else "x86_64"
    if vendor:
        iommu = next(i for i in res["iommus"] if i["vendor"] == vendor)
        p = vendors.guest_profile(iommu, arch) if guest else None
        if guest and not p:
            p, title = vendors.profile(iommu, arch)
            return p, f"a guest's {title}: the model has no guest profile for it, the bare-metal one stands in"
        return p or vendors.profile(iommu, arch)
    other = f"its IOMMU ({', '.join(sorted(set(seen)))}) is not one the model has" if seen else "no IOMMU"
    if guest:
        pv = next(n for n in vendors.names(modelled=True, arch=arch) if vendors.DRIVERS[n].get("paravirtual"))
        profile, _ = vendors.profile({"vendor": pv}, arch)
        return profile, f"a guest with {other}: {profile} stands in for a vIOMMU its VMM could offer"
    profile, title = vendors.stand_in(arch)
    return profile, f"{other}: the {arch} server profile ({title}) stands in"


def scenario_skeleton(res: dict[str, Any], cores: int) -> dict[str, Any]:
    """A scenario for this host: the closest built-in profile, its kernel, the policy in effect."""
    modes = [d["mode"] for d in res["devices"] if d.get("mode") in ("strict", "lazy", "passthrough")]
    policy = max(set(modes), key=modes.count) if modes else "passthrough"
    kernel = _kernel(res["kernel"] or "") or "6.12"
    described = f"this host: Linux {res['kernel']} {res['arch']}, written by iommulab inspect"
    if newer_than_modelled(kernel):
        # Scenarios stop at the newest kernel whose changes the model knows; it stands in for a newer one.
        described += f" (the model's newest kernel, {_core.KERNEL_NEWEST}, stands in for {kernel})"
        kernel = _core.KERNEL_NEWEST
    sc: dict[str, Any] = {
        "name": "inspected",
        "description": described,
        "run": {"duration_ms": 50, "warmup_ms": 10, "seed": 1},
        # The host's own profile, a guest's too: the skeleton's workload is a NIC the host drives itself, which
        # an emulated IOMMU without caching mode cannot take (advise swaps in the guest's virtio-net).
        "platform": {"profile": profile_for(res, as_guest=False)[0]},
        "os": {"kernel": kernel, "arch": res["arch"] if vendors.names(modelled=True, arch=res["arch"]) else "x86_64",
               "policy": policy, "cmdline": res["cmdline"]},
    }
    cm_iommu = vendors.with_caching_mode(res["iommus"])
    if cm_iommu:
        sc["platform"]["iommu"] = vendors.scenario_iommu(cm_iommu)
    queues = max(1, min(cores, 8))
    sc["workload"] = {"nic_rx": {"line_rate_gbps": 100, "queues": queues, "flows": queues, "mtu": 1500,
                                 "ring_size": 1024}}
    return sc


def cpu_count(tree: Tree) -> int:
    """The CPUs the tree lists (as inspect listed them: an unpacked archive is gone once inspect returns)."""
    cpus = tree.listed.get("sys/devices/system/cpu")
    n = [c for c in (tree.ls("sys/devices/system/cpu") if cpus is None else cpus) or []
         if re.fullmatch(r"cpu\d+", c)]
    return len(n) or (os.cpu_count() or 1 if tree.root == Path("/") else 1)


def check_save(dest: str | os.PathLike) -> None:
    """That --save DEST can be written without overwriting anything: DEST is absent, in a directory that can
    be written, or an empty directory (checked before anything is read or written)."""
    d = Path(dest)
    if d.is_symlink() and not d.exists():
        raise ScenarioError(f"--save {shown(dest)}: a link to {shown(os.readlink(d))}, which does not exist "
                            "(nothing is written through it)")
    try:
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise ScenarioError(f"--save {shown(dest)}: exists and is not an empty directory (nothing is overwritten)")
    except OSError as e:
        raise ScenarioError(f"--save {shown(dest)}: cannot read: {e.strerror or e}") from None
    where = d if d.exists() else d.parent
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise ScenarioError(f"--save {shown(dest)}: cannot write in {shown(where)}: "
                            + ("not a directory" if not where.is_dir() else "permission denied"))


def save(tree: Tree, dest: str | os.PathLike) -> int:
    """Write exactly what `tree` read into `dest` (see check_save): the bytes read, not the files as they are
    now. Returns how many files and links."""
    check_save(dest)
    try:
        return _write_tree(tree, Path(dest))
    except OSError as e:
        raise ScenarioError(f"--save {shown(dest)}: cannot write: {e.strerror or e}") from None


def _write_tree(tree: Tree, d: Path) -> int:
    d.mkdir(exist_ok=True)
    top = os.path.realpath(d)

    def place(rel: str) -> Path | None:
        """Where `rel` goes (its directory made): None when something is there already (the listing made it),
        or when its directory leads out of `dest` through a link a listing kept."""
        dst = d / rel
        if os.path.lexists(dst) or not _inside(os.path.realpath(dst.parent), top):
            return None
        dst.parent.mkdir(parents=True, exist_ok=True)
        return dst

    # Directories listed keep their entries (as the links or directories they were), so a listing reads back;
    # sysfs links to directories (an IOMMU's class entry) become directories, so the files read under them can
    # be saved.
    for rel, entries in sorted(tree.listed.items()):
        if (here := place(rel)) is not None:
            here.mkdir()
        for name, kind in entries.items():
            if kind is not None and (dst := place(f"{rel}/{name}")) is not None:
                dst.mkdir() if kind == "dir" else os.symlink(kind, dst)
    n = 0
    for rel, target in sorted(tree.links.items()):
        if (dst := place(rel)) is not None:
            os.symlink(target, dst)
            n += 1
    for rel, data in sorted(tree.files.items()):
        if (dst := place(rel)) is not None:
            dst.write_bytes(data)
            n += 1
    return n


def format_inspect(res: dict[str, Any]) -> str:
    from .report import fit, left, right, wrap

    lines = wrap(f"Linux {res['kernel'] or '?'} {res['arch']}"
                 + (f" · command line: {res['cmdline']}" if res['cmdline'] else ""))
    if res.get("config_default"):
        lines += wrap(f"kernel config default DMA mode: {res['config_default']}")
    hw = res.get("hardware") or {}
    if hw.get("cpus") or hw.get("nics") or hw.get("nvme"):
        nics = ", ".join(f"{n['name']} ({n['device']}" + (f", {n['speed_gbps']:g} Gbps" if n["speed_gbps"] else "")
                         + (f", {n['rx_queues']} RX queues" if n["rx_queues"] else "") + ")" for n in hw["nics"])
        lines += wrap(f"CPUs {hw.get('cpus') or '?'}" + (f" ({hw['cpu_model']})" if hw.get("cpu_model") else "")
                      + (f" · a guest{' of ' + hw['vmm'] if hw.get('vmm') else ''}" if hw.get("guest") else "")
                      + (f" · confidential: {hw['confidential']}" if hw.get("confidential") else "")
                      + f" · NICs {nics or 'none'} · NVMe {', '.join(hw['nvme']) or 'none'}")
    for i in res["iommus"]:
        lines += wrap(f"IOMMU {i['name']} ({i['vendor']}){vendors.describe(i)}")
    if res.get("kernel_log_seen"):
        lines.append("kernel log, IOMMU lines:")
        lines += [x for line in res["kernel_log_seen"] for x in wrap(line, "    ", "  ")]
    elif res.get("kernel_log"):
        lines += wrap("kernel log not readable (root, or kernel.dmesg_restrict=0); the rules predict it says:")
        lines += [x for line in res["kernel_log"] for x in wrap(line, "    ", "  ")]
    for n in res["notes"]:
        lines += wrap(n)
    devs = res["devices"]
    if devs:
        group = right("group", [str(d["group"]) for d in devs], 0)
        device = left("device", [d["device"] for d in devs])
        lines += [""] + fit([g + d for g, d in zip(group, device)],
                            [left("driver", [d["driver"] or "-" for d in devs]),
                             left("class", [d["class"] or "-" for d in devs]),
                             left("ATS", [{True: "yes", False: "no", None: "?"}[d["ats"]] for d in devs]),
                             left("type", [d["type"] or "-" for d in devs]),
                             left("mode", [d["mode"] or "-" for d in devs])],
                            text=("why", [d.get("why", "") for d in devs]))
    return "\n".join(lines) + "\n"
