"""`iommulab inspect`: what the running system does with DMA, and why, read from /proc and /sys (or a saved copy
of them with --root) without changing anything.

Per device it reports the DMA mode in effect (the IOMMU group's `type`: DMA = strict, DMA-FQ = lazy, identity =
passthrough) and the reason the kernel's default-domain rules give for it (the same rules as `iommulab explain`),
saying when what sysfs shows disagrees with what those rules predict."""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core
from .api import ScenarioError, newer_than_modelled

# The group types sysfs shows (drivers/iommu/iommu.c iommu_group_show_type) and the DMA mode each means.
GROUP_MODES = {"DMA": "strict", "DMA-FQ": "lazy", "identity": "passthrough", "blocked": "blocked",
               "unmanaged": "owned by a user-space driver (VFIO) or a driver's own domain"}
# VT-d capability register fields (VT-d spec §11.4.2) and extended capability fields (§11.4.3).
CAP_CM, CAP_RWBF, CAP_PSI = 7, 4, 39
ECAP_DT, ECAP_PT = 2, 6
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


@dataclass
class Tree:
    """Files under `root`, each read at most once; `read` remembers what was read, for --save; `captured`
    holds what was read from a device file (the kernel log), saved as a plain file."""
    root: Path
    read: list[str] = field(default_factory=list)
    listed: list[str] = field(default_factory=list)
    captured: dict[str, str] = field(default_factory=dict)

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
        chunks = []
        try:
            while True:
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
        finally:
            os.close(fd)
        text = b"".join(chunks).decode(errors="replace")
        self.captured["dev/kmsg"] = text
        return text

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def text(self, rel: str) -> str | None:
        p = self.path(rel)
        try:
            data = p.read_bytes()
        except OSError:
            return None
        self.read.append(rel)
        if rel.endswith(".gz"):
            try:
                data = gzip.decompress(data)
            except OSError:
                return None
        return data.decode(errors="replace")

    def raw(self, rel: str) -> bytes | None:
        try:
            data = self.path(rel).read_bytes()
        except OSError:
            return None
        self.read.append(rel)
        return data

    def ls(self, rel: str) -> list[str]:
        try:
            names = sorted(os.listdir(self.path(rel)))
        except OSError:
            return []
        self.listed.append(rel)
        return names

    def link(self, rel: str) -> str | None:
        try:
            target = os.readlink(self.path(rel))
        except OSError:
            return None
        self.read.append(rel)
        return target


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


def _bit(v: int, b: int) -> bool:
    return bool((v >> b) & 1)


def _iommus(tree: Tree) -> list[dict[str, Any]]:
    """Every IOMMU in /sys/class/iommu: its vendor and, for VT-d, the capabilities that decide the model."""
    out = []
    for name in tree.ls("sys/class/iommu"):
        d: dict[str, Any] = {"name": name}
        if name.startswith("dmar"):
            d["vendor"] = "vtd"
            cap = tree.text(f"sys/class/iommu/{name}/intel-iommu/cap")
            ecap = tree.text(f"sys/class/iommu/{name}/intel-iommu/ecap")
            if cap:
                c = int(cap.strip(), 16)
                d |= {"cap": cap.strip(), "caching_mode": _bit(c, CAP_CM), "rwbf": _bit(c, CAP_RWBF),
                      "page_selective": _bit(c, CAP_PSI), "mamv": (c >> 48) & 0x3F}
            if ecap:
                e = int(ecap.strip(), 16)
                d |= {"ecap": ecap.strip(), "device_tlb": _bit(e, ECAP_DT), "pass_through": _bit(e, ECAP_PT)}
        elif "smmu" in name:
            d["vendor"] = "smmuv3"
        elif name.startswith("virtio") or "viommu" in name or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", name):
            # virtio-iommu registers under its virtio device's bus name, which for virtio-iommu-pci is the PCI
            # function's (virtio-iommu.c viommu_probe → virtio_bus_name): the only IOMMU named like a device.
            d["vendor"] = "virtio"
        elif name.startswith("ivhd"):
            d["vendor"] = "amd"
        else:
            d["vendor"] = "unknown"
        out.append(d)
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
    cls = tree.text(f"{base}/class")
    if cls:
        c = int(cls.strip(), 16)
        d["class"] = PCI_CLASSES.get(((c >> 16) & 0xFF, (c >> 8) & 0xFF), f"0x{c >> 8:04x}")
    else:
        d["class"] = None
    d["ats"] = _ats(tree.raw(f"{base}/config"))
    d["untrusted"] = (tree.text(f"{base}/untrusted") or "0").strip() == "1"
    return d


def inspect(root: str | os.PathLike = "/") -> tuple[dict[str, Any], Tree]:
    """The system under `root`: kernel, IOMMUs, groups and devices with their DMA mode and its reason."""
    tree = Tree(Path(root))
    if not tree.root.is_dir():
        raise ScenarioError(f"--root {root}: not a directory")
    release = (tree.text("proc/sys/kernel/osrelease") or "").strip()
    if not release and tree.root == Path("/"):
        release = os.uname().release
    arch = _arch(tree)
    cmdline = (tree.text("proc/cmdline") or "").strip()
    res: dict[str, Any] = {"kernel": release or None, "arch": arch, "cmdline": cmdline,
                           "config_default": _config_default(tree, release) if release else None,
                           "iommus": _iommus(tree), "groups": [], "devices": [], "notes": [],
                           "kernel_log_seen": _log_lines(tree.kmsg())}
    groups = [g for g in tree.ls("sys/kernel/iommu_groups") if g.isdigit()]
    for g in sorted(groups, key=int):
        gtype = (tree.text(f"sys/kernel/iommu_groups/{g}/type") or "").strip() or None
        devs = tree.ls(f"sys/kernel/iommu_groups/{g}/devices")
        res["groups"].append({"group": int(g), "type": gtype, "devices": devs})
        for bdf in devs:
            d = _device(tree, bdf) | {"group": int(g), "type": gtype, "mode": GROUP_MODES.get(gtype or "", gtype)}
            res["devices"].append(d)
    vendors = {i["vendor"] for i in res["iommus"]}
    if not res["iommus"] and not groups:
        res["notes"].append("No IOMMU is visible (none in /sys/class/iommu, no IOMMU groups): devices reach memory "
                            "at physical addresses (dma-direct), with no translation and no protection.")
        return res, tree
    vendor = next((v for v in ("vtd", "smmuv3", "virtio") if v in vendors), None)
    kernel = _kernel(release) if release else None
    cm = any(i.get("caching_mode") for i in res["iommus"])
    if cm:
        res["notes"].append("VT-d caching mode is set: this is a virtual IOMMU (only emulated ones set CAP.CM); "
                            "every map is invalidated too.")
    rules = None
    if kernel and newer_than_modelled(kernel):
        res["notes"].append(f"Linux {kernel} is after {_core.KERNEL_NEWEST}, the newest kernel whose changes the model "
                            f"knows: its rules stand in (checked on Linux 7.3 guests).")
    if vendor and kernel and arch in ("x86_64", "arm64"):
        try:
            rules = json.loads(_core.explain(arch, kernel, cmdline, cm, vendor))
        except ScenarioError as e:
            res["notes"].append(f"The default-domain rules cannot be applied: {e}")
    elif not vendor:
        res["notes"].append("The IOMMU's vendor is not one the model knows (" + ", ".join(sorted(vendors)) + ").")
    if rules:
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
    return res, tree


def scenario_skeleton(res: dict[str, Any], cores: int) -> dict[str, Any]:
    """A scenario for this host: the closest built-in profile, its kernel, the policy in effect."""
    vendors = [i["vendor"] for i in res["iommus"]]
    cm = any(i.get("caching_mode") for i in res["iommus"])
    profile = {"vtd": "kvm-vtd-guest" if cm else "vtd-server", "smmuv3": "smmuv3-server",
               "virtio": "virtio-guest" if res["arch"] == "x86_64" else "virtio-guest-arm64"}
    vendor = next((v for v in ("vtd", "smmuv3", "virtio") if v in vendors), None)
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
        "platform": {"profile": profile.get(vendor or "", "vtd-server" if res["arch"] == "x86_64" else
                                            "smmuv3-server")},
        "os": {"kernel": kernel, "arch": res["arch"] if res["arch"] in ("x86_64", "arm64") else "x86_64",
               "policy": policy, "cmdline": res["cmdline"]},
    }
    if cm:
        sc["platform"]["iommu"] = {"vtd": {"caching_mode": True}}
    queues = max(1, min(cores, 8))
    sc["workload"] = {"nic_rx": {"line_rate_gbps": 100, "queues": queues, "flows": queues, "mtu": 1500,
                                 "ring_size": 1024}}
    return sc


def cpu_count(tree: Tree) -> int:
    n = [c for c in tree.ls("sys/devices/system/cpu") if re.fullmatch(r"cpu\d+", c)]
    return len(n) or (os.cpu_count() or 1 if tree.root == Path("/") else 1)


def save(tree: Tree, dest: str | os.PathLike) -> int:
    """Copy exactly the files `tree` read into `dest` (which must not exist, or be empty). Returns how many."""
    d = Path(dest)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ScenarioError(f"--save {dest}: exists and is not an empty directory (nothing is overwritten)")
    n = 0
    # Directories listed keep their entries (as the links or directories they were), so a listing reads back.
    for rel in sorted(set(tree.listed)):
        for name in os.listdir(tree.path(rel)):
            src, dst = tree.path(rel) / name, d / rel.lstrip("/") / name
            if dst.exists() or dst.is_symlink():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            # sysfs links to directories (an IOMMU's class entry) become directories, so the files read
            # under them can be saved; other links stay links.
            if src.is_dir():
                dst.mkdir()
            elif src.is_symlink():
                os.symlink(os.readlink(src), dst)
    for rel, text in tree.captured.items():
        dst = d / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
        n += 1
    for rel in sorted(set(tree.read)):
        src, dst = tree.path(rel), d / rel.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():  # the listing above already made it
            continue
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            try:
                shutil.copyfile(src, dst)
            except OSError:
                continue
        n += 1
    return n


def format_inspect(res: dict[str, Any]) -> str:
    lines = [f"Linux {res['kernel'] or '?'} {res['arch']}" + (f" · command line: {res['cmdline']}" if res['cmdline']
                                                               else "")]
    if res.get("config_default"):
        lines.append(f"kernel config default DMA mode: {res['config_default']}")
    for i in res["iommus"]:
        extra = ""
        if i["vendor"] == "vtd" and "cap" in i:
            extra = (f": caching mode {'on' if i['caching_mode'] else 'off'}, RWBF {'on' if i['rwbf'] else 'off'}, "
                     f"page-selective {'yes' if i['page_selective'] else 'no'}, MAMV {i['mamv']}")
            if "device_tlb" in i:
                extra += f", device-TLB {'yes' if i['device_tlb'] else 'no'}"
        lines.append(f"IOMMU {i['name']} ({i['vendor']}){extra}")
    if res.get("kernel_log_seen"):
        lines.append("kernel log, IOMMU lines:")
        lines += [f"  {line}" for line in res["kernel_log_seen"]]
    elif res.get("kernel_log"):
        lines.append("kernel log not readable (root, or kernel.dmesg_restrict=0); the rules predict it says:")
        lines += [f"  {line}" for line in res["kernel_log"]]
    for n in res["notes"]:
        lines.append(n)
    if res["devices"]:
        lines.append("")
        w = max(len("device"), *(len(d["device"]) for d in res["devices"]))
        wc = max(len("class"), *(len(d["class"] or "-") for d in res["devices"]))
        lines.append(f"{'group':>5}  {'device':<{w}}  {'driver':<14} {'class':<{wc}} {'ATS':<4} {'type':<10} "
                     f"{'mode':<12} why")
        for d in res["devices"]:
            ats = {True: "yes", False: "no", None: "?"}[d["ats"]]
            lines.append(f"{d['group']:>5}  {d['device']:<{w}}  {d['driver'] or '-':<14} {d['class'] or '-':<{wc}} "
                         f"{ats:<4} {d['type'] or '-':<10} {d['mode'] or '-':<12} {d.get('why', '')}")
    return "\n".join(lines) + "\n"
