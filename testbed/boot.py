#!/usr/bin/env python3
"""Boot the testbed's guest once under QEMU (TCG) with an emulated Intel VT-d and collect, per phase, what the
guest's own capture recorded and what QEMU's trace says reached its IOMMU.

    python3 testbed/boot.py DIR --mode strict|lazy [--cm on|off] [--phases net,blk]

DIR is what prepare.sh made. Writes DIR/runs/NAME/: results.json (per phase: QEMU's vtd_inv_desc counts between
the guest's phase markers), trace.txt (the guest's capture), root/ (the files inspect reads), serial.log, cmd.txt.
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
import subprocess
import tarfile
import threading

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """The guest's downloads, without a log line per request (and without changing the library's class)."""

    def log_message(self, *args):
        pass


MODES = {"strict": "iommu.strict=1", "lazy": "iommu.strict=0", "pt": "iommu.passthrough=1"}
MARK_BLOCK = 40000


def qemu_counts(log: str, phases: list[str]) -> dict[str, collections.Counter]:
    """QEMU's IOMMU events (vtd_inv_desc*, virtio_iommu_map/unmap) between each phase's two marker reads."""
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
            out[cur][ev] += 1
    return out


def boot(tb: str, mode: str, cm: str = "off", phases: str = "net,blk", timeout: int = 600,
         iommu: str = "intel", domains: bool = False) -> str:
    """One boot: `iommu` intel (QEMU's VT-d, Debian 12's 6.1 kernel) or virtio (virtio-iommu-pci, the 6.12
    backports kernel: 6.1 has no CONFIG_VIRTIO_IOMMU). Phases: net, blk, and mix (both at once); `domains`:
    the capture records each event's domain (kprobes). Returns the run's directory."""
    name = f"{mode}-cm{cm}" if iommu == "intel" else f"{mode}-virtio"
    name += "-" + phases.replace(",", "-") if phases != "net,blk" else ""
    rd = os.path.join(tb, "runs", name)
    os.makedirs(rd, exist_ok=True)
    out_img = os.path.join(rd, "out.img")
    with open(out_img, "wb") as f:
        f.truncate(256 << 20)
    kroot, initrd = ("kroot", "initrd.cpio.gz") if iommu == "intel" else ("kroot612", "initrd612.cpio.gz")
    kern = sorted(glob.glob(os.path.join(tb, kroot, "boot/vmlinuz-*")))[-1]
    handler = functools.partial(QuietHandler, directory=os.path.join(tb, "www"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = srv.server_address[1]
    append = (f"console=ttyS0 panic=-1 quiet loglevel=4 {'intel_iommu=on ' if iommu == 'intel' else ''}"
              f"{MODES[mode]} tb.phases={phases} tb.port={port}{' tb.domains=1' if domains else ''}")
    ip = "iommu_platform=on,disable-legacy=on"
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "1", "-display", "none",
           "-serial", "stdio", "-monitor", "none", "-no-reboot", "-kernel", kern,
           "-initrd", os.path.join(tb, initrd), "-D", os.path.join(rd, "qemu-trace.log"),
           *(["-machine", "q35,kernel-irqchip=split", "-device", f"intel-iommu,intremap=on,caching-mode={cm}",
              "-trace", "enable=vtd_inv_desc*"] if iommu == "intel" else
             ["-machine", "q35", "-device", "virtio-iommu-pci",
              "-trace", "enable=virtio_iommu_map", "-trace", "enable=virtio_iommu_unmap"]),
           "-trace", "enable=virtio_blk_handle_read",
           "-netdev", "user,id=n0", "-device", f"virtio-net-pci,netdev=n0,{ip},romfile=",
           "-drive", f"file={tb}/data.img,if=none,id=d0,format=raw,readonly=on",
           "-device", f"virtio-blk-pci,drive=d0,serial=tbdata,{ip}",
           "-drive", f"file={out_img},if=none,id=o0,format=raw", "-device", "virtio-blk-pci,drive=o0,serial=tbout",
           "-append", append]
    with open(os.path.join(rd, "cmd.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with open(os.path.join(rd, "serial.log"), "w") as ser:
            subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=ser, stderr=subprocess.STDOUT, timeout=timeout)
    finally:
        srv.shutdown()
    with tarfile.open(out_img) as t:
        t.extractall(rd, filter="fully_trusted")
    q = qemu_counts(os.path.join(rd, "qemu-trace.log"), phases.split(","))
    res = {"mode": mode, "cm": cm, "iommu": iommu, "kernel": "6.1" if iommu == "intel" else "6.12",
           "cmdline": append, "phases": {p: {"qemu": dict(c)} for p, c in q.items()}}
    with open(os.path.join(rd, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    return rd


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--mode", choices=MODES, default="strict")
    ap.add_argument("--cm", choices=["on", "off"], default="off")
    ap.add_argument("--phases", default="net,blk")
    ap.add_argument("--iommu", choices=["intel", "virtio"], default="intel")
    ap.add_argument("--domains", action="store_true", help="record each event's domain (capture -k, kprobes)")
    a = ap.parse_args()
    rd = boot(a.dir, a.mode, a.cm, a.phases, iommu=a.iommu, domains=a.domains)
    print(json.dumps(json.load(open(os.path.join(rd, "results.json"))), indent=1))
