"""Replay of a kernel after the newest the model knows (6.18): Linux 7.3 (Debian trixie-backports 7.3.4) behind
QEMU's VT-d, virtio-net and virtio-blk one after the other and then at once, lazy, captured on 2026-11-26 by
`iommulab capture` inside the guest (`boot.py --phases net,blk,mix --domains --devices --timer`, with 7.3
unpacked as the testbed unpacks its kernels). 7.3 renamed what the capture hooks: `__iommu_map` is
`iommu_map_nosync`, the DMA API's page events are `dma_map_phys` / `dma_unmap_phys`, and the flush queue's
`fq_domain` sits 48 bytes past its timer (64 before 6.15). And arm64 7.3 behind QEMU's SMMUv3 with an NVMe drive
too, whose driver maps through the DMA API's IOVA interface (6.17+): its `dma_iova_unlink()` invalidates at once,
in a lazy domain too. tests/data/testbed-newer holds the captures and QEMU's counts."""

import json
import lzma
import pathlib
import re

import iommulab
from iommulab.replay import format_replay

from conftest import cli

CAP = pathlib.Path(__file__).parent / "data" / "testbed-newer" / "k7.3-vtd-lazy-smp1-net-blk-mix"
ARM = CAP.parent / "k7.3-smmuv3-lazy-smp1-net-blk-nvme-mix"
SMMU = {"tlbi_nh_va": "SMMU_CMD_TLBI_NH_VA", "tlbi_nh_asid": "SMMU_CMD_TLBI_NH_ASID", "cmd_sync": "SMMU_CMD_SYNC",
        "doorbells": "smmuv3_cmdq_consume_out"}
KPROBE = re.compile(r" tb_(un)?map: ")
DMA_API = re.compile(r" dma_[a-z_]+: |^# iommulab capture: iommu group ")
TIMER = re.compile(r" fq_flush_timeout: | tb_flush_all[a-z_]*: |^# iommulab capture: flush queue timer")


def replay(tmp_path, *drop):
    res = json.loads((CAP / "results.json").read_text())
    trace = CAP / "trace.txt.xz"
    if drop:
        trace = tmp_path / "trace.txt"
        lines = lzma.open(CAP / "trace.txt.xz", "rt").read().splitlines(True)
        trace.write_text("".join(l for l in lines if not any(d.search(l) for d in drop)))
    rep = iommulab.replay(trace, kernel=res["kernel"], cmdline=res["cmdline"])
    for phase, q in res["phases"].items():
        have, want = rep["phases"][phase]["counts"]["iotlb_dsi"], q["qemu"]["vtd_inv_desc_iotlb_domain"]
        assert abs(have - want) <= max(0.10 * want, 1), f"{phase}: model {have} flushes, QEMU {want}"
    return rep


def test_a_7_3_capture_replays_to_qemus_flushes_with_every_label():
    rep = replay(None)
    assert rep["kernel"] == "7.3" and "kernel 7.3 (replayed with 6.18's rules)" in format_replay(rep)
    d = rep["domains"]
    assert d["count"] == 2 and d["inferred_events"] <= 2 and d["labelled_events"] > 30000, d
    # Each firing named its domain through the cookie's fq_domain read at 7.3's offset, and its flush.
    rt = rep["recorded_timer"]
    assert rt["by_domain"] and rt["firings"] > 50 and rt["ignored"] <= 3, rt


def test_7_3s_dma_phys_events_alone_name_every_events_device(tmp_path):
    d = replay(tmp_path, KPROBE, TIMER)["domains"]
    assert d["count"] == 2 and d["inferred_events"] == 0, d


def test_7_3s_iommu_map_nosync_kprobe_alone_names_the_domains(tmp_path):
    d = replay(tmp_path, DMA_API, TIMER)["domains"]
    assert d["count"] == 2 and d["inferred_events"] <= 2, d


def test_a_kernel_after_the_newest_checked_is_refused_in_one_line():
    p = cli("replay", "--kernel", "7.4", str(CAP / "trace.txt.xz"))
    assert p.returncode == 2 and "--kernel" in p.stderr and "7.3" in p.stderr and "\n" not in p.stderr.strip()
    p = cli("run", "--set", "os.kernel=7.3")
    assert p.returncode == 2 and "os.kernel" in p.stderr and "6.18" in p.stderr


def test_7_3s_nvme_unlinks_invalidate_at_once_in_a_lazy_domain(tmp_path):
    # Every phase and command as QEMU counted them: the network's and the disk's unmaps wait for their flush
    # queues (TLBI_NH_ASID), the NVMe drive's each bring a TLBI_NH_VA and a CMD_SYNC (512 in its phase).
    res = json.loads((ARM / "results.json").read_text())
    rep = iommulab.replay(ARM / "trace.txt.xz", iommu="smmuv3", kernel=res["kernel"], cmdline=res["cmdline"])
    assert rep["domains"]["count"] == 3 and rep["recorded_timer"]["by_domain"]
    for phase, q in res["phases"].items():
        for ours, theirs in SMMU.items():
            have, want = rep["phases"][phase]["counts"][ours], q["qemu"].get(theirs, 0)
            assert abs(have - want) <= max(0.10 * want, 1), f"{phase} {ours}: model {have}, QEMU {want}"
    assert rep["phases"]["nvme"]["counts"]["tlbi_nh_va"] == res["phases"]["nvme"]["qemu"]["SMMU_CMD_TLBI_NH_VA"] > 500
    # Without the capture's dma_iova_unlink() kprobe lines the unlinks are queued like any lazy unmap.
    lines = lzma.open(ARM / "trace.txt.xz", "rt").read().splitlines(True)
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(l for l in lines if " tb_iova_unlink: " not in l))
    rep = iommulab.replay(trace, iommu="smmuv3", kernel=res["kernel"], cmdline=res["cmdline"])
    assert rep["phases"]["nvme"]["counts"]["tlbi_nh_va"] == 0


def test_7_3s_flushes_name_the_pointers_tied_to_its_device_named_domains(tmp_path):
    # Without the kprobe labels the events name their device only, and each firing its flush's domain pointer
    # (tb_flush_all_intel): every pointer is tied to a device's domain and every firing drives its timer, each
    # phase within QEMU's flushes (replay() checks them).
    rt = replay(tmp_path, KPROBE)["recorded_timer"]
    assert (rt["tied"], rt["firings"], rt["ignored"], rt["own_timer_domains"]) == (2, 76, 0, 0), rt
