#!/usr/bin/env python3
"""Boot the testbed's guest once under QEMU (TCG) with an emulated IOMMU (Intel VT-d, virtio-iommu or, on an
arm64 guest, Arm SMMUv3) and collect, per phase, what the guest's own capture recorded and what QEMU's trace says
reached its IOMMU.

    python3 testbed/boot.py DIR --mode strict|lazy|pt [--iommu intel|virtio|smmuv3|none] [--cm on|off]
                            [--kernel 6.1|6.12] [--smp N] [--phases net,blk,nvme,mix,tx] [--domains] [--devices]
                            [--timer] [--probes SYM,SYM] [--measure] [--swiotlb SLABS] [--blk-max-kb KB]

DIR is what prepare.sh made (`prepare.sh DIR arm64` for smmuv3). Writes DIR/runs/NAME/: results.json (per phase:
QEMU's invalidation descriptors, requests or commands between the guest's phase markers), trace.txt (the guest's
capture), root/ (the files inspect reads), serial.log, cmd.txt.
Phase windows on QEMU's clock come from QEMU itself: the guest reads 4 KiB block 40000 + 2i (40001 + 2i) of the
results disk, which has no IOMMU, before (after) phase i, and QEMU traces that read."""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """The guest's downloads, without a log line per request (and without changing the library's class), and
    its uploads: a POST to /upload/PHASE (the tx phase) is read to its Content-Length in chunks and discarded,
    answered 200 with an empty body, and the bytes received are added to the server's `uploads[PHASE]`."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        if not self.path.startswith("/upload"):
            self.send_error(404)
            return
        phase = self.path[len("/upload"):].strip("/") or "tx"
        left = int(self.headers.get("Content-Length") or 0)
        got = 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            got += len(chunk)
            left -= len(chunk)
        with self.server.uploads_lock:
            self.server.uploads[phase] += got
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True


MODES = {"strict": "iommu.strict=1", "lazy": "iommu.strict=0", "pt": "iommu.passthrough=1"}
MARK_BLOCK = 40000


# What QEMU traces of each IOMMU's work. SMMUv3 (hw/arm/smmuv3.c, smmuv3_cmdq_consume): one smmuv3_cmdq_opcode
# per command consumed, one smmuv3_cmdq_consume_out per CMDQ_PROD write (a doorbell), and its errors and events.
# AMD-Vi (hw/i386/amd_iommu.c, amdvi_cmdbuf_exec): one event per command by type, and the tail-register writes.
TRACE = {"intel": ["vtd_inv_desc*"], "virtio": ["virtio_iommu_map", "virtio_iommu_unmap"],
         "amd": ["amdvi_pages_inval", "amdvi_iotlb_inval", "amdvi_all_inval", "amdvi_completion_wait",
                 "amdvi_devtab_inval", "amdvi_command_exec", "amdvi_command_error", "amdvi_unhandled_command",
                 "amdvi_completion_wait_fail", "amdvi_page_fault"],
         "smmuv3": ["smmuv3_cmdq_opcode", "smmuv3_cmdq_consume_out", "smmuv3_cmdq_consume_error",
                    "smmuv3_record_event", "smmuv3_unhandled_cmd"],
         "none": []}
# Kernels: Debian 12's (6.1) and bookworm-backports' (6.12), as prepare.sh unpacked them; trixie-backports' 7.3
# where `prepare.sh DIR ARCH 7.3` added it.
KERNELS = {"6.1": ("kroot", "initrd.cpio.gz"), "6.12": ("kroot612", "initrd612.cpio.gz"),
           "7.3": ("kroot73", "initrd73.cpio.gz")}
# With --emulator-counts, the emulator's own work as QEMU 7.2 traces it, by the names iommulab reports (`emulator`
# in `run --json`): each translation a device's DMA asked of the vIOMMU (vtd_iommu_translate, smmuv3_translate,
# virtio_iommu_translate; virtio-iommu's translate_out leaves out the MSI writes its reserved region lets through
# untranslated), its IOTLB lookups that hit or missed and walked the guest's table (VT-d's vtd_iotlb_page_update
# follows each walk; virtio-iommu keeps no IOTLB), an IOTLB emptied when full, the invalidation descriptors,
# commands or requests processed (as qemu_counts names them: `NAME*` sums every count whose name starts so), and
# each guest access to the IOMMU's registers (an MMIO exit).
EMULATOR_KEYS = {
    "intel": {"translations": ["vtd_dmar_translate"], "iotlb_hits": ["vtd_iotlb_page_hit"],
              "iotlb_misses": ["vtd_iotlb_page_update"], "walks": ["vtd_iotlb_page_update"],
              "iotlb_resets": ["vtd_iotlb_reset"], "inv_processed": ["vtd_inv_desc[*"],
              "mmio_exits": ["vtd_reg_read", "vtd_reg_write"]},
    "smmuv3": {"translations": ["smmuv3_translate_success"], "iotlb_hits": ["smmu_iotlb_lookup_hit"],
               "iotlb_misses": ["smmu_iotlb_lookup_miss"], "walks": ["smmu_ptw_page_pte", "smmu_ptw_block_pte"],
               "iotlb_resets": ["smmu_iotlb_inv_all"], "inv_processed": ["SMMU_CMD_*"],
               "mmio_exits": ["smmuv3_read_mmio", "smmuv3_write_mmio"]},
    "virtio": {"translations": ["virtio_iommu_translate_out"],
               "inv_processed": ["virtio_iommu_map", "virtio_iommu_unmap"]},
    "amd": {"translations": ["amdvi_translation_result"], "iotlb_hits": ["amdvi_iotlb_hit"],
            "iotlb_misses": ["amdvi_cache_update"], "walks": ["amdvi_cache_update"],
            "iotlb_resets": ["amdvi_iotlb_reset"],
            "inv_processed": ["amdvi_command_exec"],
            "mmio_exits": ["amdvi_mmio_read", "amdvi_mmio_write"]},
    "none": {},
}
# The events --emulator-counts adds to TRACE's.
EMULATOR_TRACE = {iommu: sorted({ev for evs in keys.values() for ev in evs if not ev.endswith("*")}
                                - set(TRACE[iommu]))
                  for iommu, keys in EMULATOR_KEYS.items()}


def emulator_summary(iommu: str, counts: collections.Counter) -> dict[str, int]:
    """A phase's counts (qemu_counts) as the emulator's (EMULATOR_KEYS)."""
    def count(ev: str) -> int:
        if ev.endswith("*"):
            return sum(n for name, n in counts.items() if name.startswith(ev[:-1]))
        return counts.get(ev, 0)
    return {k: sum(count(ev) for ev in evs) for k, evs in EMULATOR_KEYS[iommu].items()}


def qemu_counts(log: str, phases: list[str]) -> dict[str, collections.Counter]:
    """QEMU's IOMMU events between each phase's two marker reads; a VT-d descriptor is counted by its type
    (vtd_inv_desc[type]), an SMMUv3 command by its opcode as QEMU names it (SMMU_CMD_TLBI_NH_ASID, ...)."""
    out = {p: collections.Counter() for p in phases}
    cur = None
    for line in open(log, errors="replace"):
        m = re.match(r"(?:\d+@[\d.]+:)?(\w+) ?(.*)", line)
        if not m:
            continue
        ev, args = m.groups()
        if ev == "virtio_blk_handle_read":
            s = re.search(r"sector (\d+)", args)
            if s and int(s.group(1)) % 8 == 0 and int(s.group(1)) // 8 >= MARK_BLOCK:
                k = int(s.group(1)) // 8 - MARK_BLOCK
                if k // 2 < len(phases):
                    cur = phases[k // 2] if k % 2 == 0 else None
            continue
        if cur:
            if ev == "vtd_inv_desc":
                t = re.search(r"type (\S+)", args)
                ev = f"vtd_inv_desc[{t.group(1) if t else '?'}]"
            elif ev == "smmuv3_cmdq_opcode":
                ev = args.replace("<---", "").strip()
            out[cur][ev] += 1
    return out


def boot(tb: str, mode: str, cm: str = "off", phases: str = "net,blk", timeout: int = 600,
         iommu: str = "intel", domains: bool = False, kernel: str | None = None, smp: int = 1,
         probes: str = "", timer: bool = False, devices: bool = False, measure: bool = False,
         emulator_counts: bool = False, swiotlb: int = 0, blk_max_kb: int = 0) -> str:
    """One boot: `iommu` intel (QEMU's VT-d, Debian 12's 6.1 kernel by default), virtio (virtio-iommu-pci, the
    6.12 backports kernel: 6.1 has no CONFIG_VIRTIO_IOMMU), smmuv3 (an arm64 guest on `virt,iommu=smmuv3`,
    6.12 by default) or none (an x86 machine without an IOMMU). Phases: net, blk, nvme (arm64's machine has an
    NVMe drive), mix (all of them at once) and tx (the guest uploads 16 MiB over virtio-net: results.json gives
    the body bytes the host received as the phase's `bytes`). `domains`: the capture records each event's
    domain (kprobes); `devices`: and the DMA API's events, which name each mapping's device (6.12); `timer`:
    and when the flush queue's timer fires; `probes`: comma-separated kernel functions whose calls the trace
    records too (diagnostics); `measure`: the capture records the latencies of the DMA map/unmap path
    instead (capture -M, for `iommulab profile measure --trace`); `emulator_counts`: QEMU also traces its
    translations, IOTLB hits and misses, walks and register accesses (EMULATOR_TRACE); `swiotlb` > 0: every
    streaming DMA mapping bounces through a swiotlb pool of that many 2 KiB slots (`swiotlb=SLABS,force`), and
    the guest captures its drivers' probe as a phase of its own (`probe`, tb.probe=1): only where the DMA API
    does not translate (mode pt, or iommu none), where dma-direct maps; `blk_max_kb` > 0: the data disk's
    largest request in KiB (its max_sectors_kb). Returns the run's directory."""
    if swiotlb > 0 and mode != "pt" and iommu != "none":
        sys.exit("boot.py: --swiotlb needs DMA without translation: --mode pt (identity domains) or --iommu none")
    kernel = kernel or ("6.1" if iommu == "intel" else "6.12")
    arm = iommu == "smmuv3"
    name = {"intel": f"{mode}-cm{cm}", "virtio": f"{mode}-virtio", "smmuv3": f"{mode}-smmuv3-k{kernel}",
            "amd": f"{mode}-amd-k{kernel}", "none": "noiommu"}[iommu]
    name += f"-k{kernel}" if kernel == "7.3" and not arm else ""
    name += f"-smp{smp}" if smp != 1 else ""
    name += "-" + phases.replace(",", "-") if phases != "net,blk" else ""
    name += "-measure" if measure else ""
    name += "-emul" if emulator_counts else ""
    name += f"-swiotlb{swiotlb}" if swiotlb > 0 else ""
    name += f"-blkmax{blk_max_kb}" if blk_max_kb > 0 else ""
    rd = os.path.join(tb, "runs", name)
    shutil.rmtree(rd, ignore_errors=True)  # the last boot of this configuration: nothing of it may linger
    os.makedirs(rd)
    out_img = os.path.join(rd, "out.img")
    kroot, initrd = (os.path.join(tb, "arm64" if arm else "", k) for k in KERNELS[kernel])
    kerns = sorted(glob.glob(os.path.join(kroot, "boot/vmlinuz-*")))
    if not kerns or not os.path.exists(initrd):
        sys.exit(f"boot.py: kernel {kernel} is not prepared in {tb}: run testbed/prepare.sh "
                 f"{tb} {'arm64' if arm else 'x86'}{' 7.3' if kernel == '7.3' else ''}")
    kern = kerns[-1]
    handler = functools.partial(QuietHandler, directory=os.path.join(tb, "www"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.uploads, srv.uploads_lock = collections.Counter(), threading.Lock()  # the tx phases' bytes received
    port = srv.server_address[1]
    # x86: no_timer_check skips the boot's check that the IO-APIC timer ticks within a few jiffies of TSC time
    # (io_apic.c timer_irq_works()). A TCG vCPU that waits for a busy host (other boots, other tests) fails it, and
    # behind an interrupt-remapping IOMMU the kernel then panics ("timer doesn't work through Interrupt-remapped
    # IO-APIC"): on 2026-11-29 two of three test_testbed.py runs on a loaded host lost a boot to it.
    # swiotlb: the kernel rounds SLABS up to a power of two (and to 128 per area, an area per possible CPU).
    # x86 logs the pool's range ("software IO TLB: mapped [mem START-END]", which the capture's notes give) only
    # where the pool was wanted for itself (x86_swiotlb_enable: above 4 GiB of RAM, or iommu=soft), not for a
    # 1 GiB guest's `force`; iommu=soft sets just that (the forced pool is the same, the IOMMU still attaches).
    sw = f" swiotlb={swiotlb},force{'' if arm else ' iommu=soft'} tb.probe=1" if swiotlb > 0 else ""
    append = (f"console={'ttyAMA0' if arm else 'ttyS0'} panic=-1 quiet loglevel=4 "
              f"{'' if arm else 'no_timer_check '}{'intel_iommu=on ' if iommu == 'intel' else ''}"
              f"{MODES[mode]} tb.phases={phases} tb.port={port}{' tb.domains=1' if domains else ''}"
              f"{' tb.probes=' + probes if probes else ''}{' tb.timer=1' if timer else ''}"
              f"{' tb.devices=1' if devices else ''}{' tb.measure=1' if measure else ''}"
              f"{sw}{f' tb.blkmaxkb={blk_max_kb}' if blk_max_kb > 0 else ''}")
    ip = "iommu_platform=on,disable-legacy=on"
    machine = {"intel": ["-machine", "q35,kernel-irqchip=split", "-device",
                         f"intel-iommu,intremap=on,caching-mode={cm}"],
               "virtio": ["-machine", "q35", "-device", "virtio-iommu-pci"],
               # QEMU's AMD IOMMU (AMDVI-PCI on q35) translates the virtio devices' DMA (iommu_platform).
               "amd": ["-machine", "q35", "-device", "amd-iommu"],
               "none": ["-machine", "q35"],
               # Every PCI device on virt's pcie.0 sits behind the SMMU (stream ID = requester ID).
               "smmuv3": ["-machine", "virt,gic-version=3,iommu=smmuv3", "-cpu", "cortex-a57", "-nodefaults"]}[iommu]
    cmd = [f"qemu-system-{'aarch64' if arm else 'x86_64'}", "-accel", "tcg", *(["-cpu", "max"] if not arm else []),
           "-m", "2048" if arm else "1024", "-smp", str(smp), "-display", "none",
           "-serial", "stdio", "-monitor", "none", "-no-reboot", "-kernel", kern,
           "-initrd", initrd, "-D", os.path.join(rd, "qemu-trace.log"), *machine,
           *(a for ev in TRACE[iommu] + (EMULATOR_TRACE[iommu] if emulator_counts else [])
             for a in ("-trace", f"enable={ev}")),
           "-trace", "enable=virtio_blk_handle_read",
           "-netdev", "user,id=n0", "-device", f"virtio-net-pci,netdev=n0,{ip},romfile=",
           "-drive", f"file={tb}/data.img,if=none,id=d0,format=raw,readonly=on",
           "-device", f"virtio-blk-pci,drive=d0,serial=tbdata,{ip}",
           *(["-drive", f"file={tb}/data.img,if=none,id=d1,format=raw,readonly=on",
              "-device", "nvme,drive=d1,serial=tbnvme"] if arm else []),
           # The results disk has no iommu_platform: its DMA never goes through the IOMMU.
           "-drive", f"file={out_img},if=none,id=o0,format=raw",
           "-device", "virtio-blk-pci,drive=o0,serial=tbout" + (",disable-legacy=on" if arm else ""),
           "-append", append]
    with open(os.path.join(rd, "cmd.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    # A guest whose kernel dies before its init runs has measured nothing: it boots once more, and results.json
    # names the panic. (On a loaded host a TCG guest of 6.12 took a double fault in early kmalloc at 1.2 s of
    # boot once, 2026-11-29; no phase had begun.)
    early_panic = None
    try:
        for attempt in range(2):
            with open(out_img, "wb") as f:
                f.truncate(256 << 20)
            with open(os.path.join(rd, "serial.log"), "w") as ser:
                subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=ser, stderr=subprocess.STDOUT, timeout=timeout)
            with open(os.path.join(rd, "serial.log"), errors="replace") as f:
                log = f.read()
            if "Kernel panic" not in log or "TB: " in log:
                break
            panic = next(line.strip() for line in log.splitlines() if "Kernel panic" in line)
            if early_panic is not None:
                sys.exit(f"boot.py: {rd}: the guest's kernel panicked before its init twice ({panic}): see serial.log")
            early_panic = panic
    finally:
        srv.shutdown()
    with tarfile.open(out_img) as t:
        t.extractall(rd, filter="fully_trusted")
    q = qemu_counts(os.path.join(rd, "qemu-trace.log"), phases.split(","))
    res = {"mode": mode, "cm": cm, "iommu": iommu, "kernel": kernel, "smp": smp, "cmdline": append,
           "phases": {p: {"qemu": dict(c)} for p, c in q.items()}}
    if early_panic:
        res["early_panic_retried"] = early_panic
    if emulator_counts:
        for p, c in q.items():
            res["phases"][p]["emulator"] = emulator_summary(iommu, c)
    for p in q:
        if p == "tx":  # the body bytes the host received from the guest's upload (per-byte figures divide by it)
            res["phases"][p]["bytes"] = srv.uploads.get(p, 0)
    if swiotlb > 0:
        # The kernel's own "swiotlb buffer is full" lines (dev_warn_ratelimited: at most 10 in 5 s, so a floor of
        # the failed maps the capture counts exactly).
        with open(os.path.join(rd, "dmesg.txt"), errors="replace") as f:
            res["swiotlb_full_messages"] = sum("swiotlb buffer is full" in line for line in f)
    with open(os.path.join(rd, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    return rd


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--mode", choices=MODES, default="strict")
    ap.add_argument("--cm", choices=["on", "off"], default="off")
    ap.add_argument("--phases", default="net,blk")
    ap.add_argument("--iommu", choices=list(TRACE), default="intel")
    ap.add_argument("--kernel", choices=list(KERNELS), help="6.1 (intel's default), 6.12 (virtio's, smmuv3's) "
                    "or 7.3 (after `prepare.sh DIR ARCH 7.3`)")
    ap.add_argument("--smp", type=int, default=1, help="vCPUs")
    ap.add_argument("--probes", default="", metavar="SYM,SYM", help="also trace calls of these kernel functions "
                    "(kprobes, a diagnostic; --timer already records fq_flush_timeout)")
    ap.add_argument("--domains", action="store_true", help="record each event's domain (capture -k, kprobes)")
    ap.add_argument("--devices", action="store_true", help="record the DMA API's events, which name each mapping's "
                    "device (capture -D, Linux 6.12+)")
    ap.add_argument("--timer", action="store_true", help="record when the flush queue's timer fires (capture -t)")
    ap.add_argument("--measure", action="store_true", help="record the map/unmap path's latencies (capture -M)")
    ap.add_argument("--emulator-counts", action="store_true", help="QEMU also counts its translations, IOTLB "
                    "hits, misses and walks, and register accesses")
    ap.add_argument("--swiotlb", type=int, default=0, metavar="SLABS", help="bounce every streaming DMA mapping "
                    "through a swiotlb pool of SLABS 2 KiB slots (swiotlb=SLABS,force; the kernel rounds SLABS up "
                    "to a power of two) and capture the drivers' probe as phase probe; needs --mode pt or --iommu none")
    ap.add_argument("--blk-max-kb", type=int, default=0, metavar="KB", help="the data disk's largest request "
                    "(max_sectors_kb in the guest)")
    a = ap.parse_args()
    rd = boot(a.dir, a.mode, a.cm, a.phases, iommu=a.iommu, domains=a.domains, kernel=a.kernel, smp=a.smp,
              probes=a.probes, timer=a.timer, devices=a.devices, measure=a.measure,
              emulator_counts=a.emulator_counts, swiotlb=a.swiotlb, blk_max_kb=a.blk_max_kb)
    print(json.dumps(json.load(open(os.path.join(rd, "results.json"))), indent=1))
