"""Replay of concurrent devices named by the DMA API's own events (Linux 6.12+: dma:dma_map_page, dma_map_sg,
dma_unmap_page, dma_unmap_sg, ..., each naming its device), as `iommulab capture` records them where kprobes are
not allowed. tests/data/testbed-devices: two `mix` phases the testbed captured on 2026-11-26 with both kinds of
labels and the flush timer recorded (`boot.py --phases mix --domains --devices --timer`): x86 6.12 behind VT-d
(virtio-net and virtio-blk, 1 vCPU) and arm64 6.12 behind SMMUv3 (virtio-net, virtio-blk and NVMe, 2 vCPUs)."""

import json
import lzma
import pathlib
import re

import pytest

import iommulab
from iommulab.replay import format_replay

DATA = pathlib.Path(__file__).parent / "data" / "testbed-devices"
CAPTURES = sorted(p for p in DATA.iterdir() if (p / "results.json").exists())
KPROBE = re.compile(r" tb_(un)?map: ")
DMA_API = re.compile(r" dma_[a-z_]+: |^# iommulab capture: iommu group ")
TIMER = re.compile(r" fq_flush_timeout: |^# iommulab capture: flush queue timer")


def keep(cap, tmp_path, *drop):
    """The capture without the lines `drop` matches."""
    out = tmp_path / f"{cap.name}.txt"
    lines = lzma.open(cap / "trace.txt.xz", "rt").read().splitlines(True)
    out.write_text("".join(l for l in lines if not any(d.search(l) for d in drop)))
    return out


def replay(cap, trace):
    res = json.loads((cap / "results.json").read_text())
    iommu = {"intel": "vtd", "smmuv3": "smmuv3"}[res["iommu"]]
    rep = iommulab.replay(trace, iommu=iommu, kernel=res["kernel"], cmdline=res["cmdline"])
    key = {"vtd": ("iotlb_dsi", "vtd_inv_desc_iotlb_domain"), "smmuv3": ("tlbi_nh_asid", "SMMU_CMD_TLBI_NH_ASID")}
    ours, theirs = key[iommu]
    return rep, rep["phases"]["mix"]["counts"][ours], res["phases"]["mix"]["qemu"][theirs]


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_the_dma_apis_events_name_every_events_domain(cap, tmp_path):
    # Kprobe labels and recorded timer removed: the device names alone place every map and unmap, one domain
    # per device, and no domain maps over its own live IOVA.
    rep, have, want = replay(cap, keep(cap, tmp_path, KPROBE, TIMER))
    devices = 3 if "smmuv3" in cap.name else 2
    d = rep["domains"]
    assert d["count"] == devices and d["inferred_events"] == 0 and d["labelled_events"] > 20000, d
    assert rep["anomalies"]["maps_over_live"] == 0
    assert abs(have - want) <= 0.10 * want, f"{cap.name}: model {have} flushes, QEMU {want}"
    assert f"domains: {devices} named by the trace's labels" in format_replay(rep)


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_device_names_fill_in_what_the_kprobes_missed(cap, tmp_path):
    # Both kinds of labels: the kprobes name the domain, the device names place the events whose kprobe hit the
    # kernel skipped; the same counts as the device names alone.
    full, have, want = replay(cap, cap / "trace.txt.xz")
    kp, _, _ = replay(cap, keep(cap, tmp_path, DMA_API))
    assert kp["domains"]["inferred_events"] > 10, "the kprobes missed no event: nothing to fill in"
    assert full["domains"]["inferred_events"] <= 2 and full["anomalies"]["maps_over_live"] <= 2
    assert abs(have - want) <= 0.10 * want, f"{cap.name}: model {have} flushes, QEMU {want}"


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_without_labels_the_recorded_timer_still_counts_every_domains_flushes(cap, tmp_path):
    # No labels at all: one domain, but each recorded firing of fq_flush_timeout is some domain's timer
    # flushing its queue, and replay flushes at every one.
    rep, have, want = replay(cap, keep(cap, tmp_path, KPROBE, DMA_API))
    assert rep["domains"]["count"] == 1 and rep["recorded_timer"]["firings"] > 50
    assert rep["anomalies"]["maps_over_live"] > 100
    assert abs(have - want) <= 0.10 * want, f"{cap.name}: model {have} flushes, QEMU {want}"
    text = " ".join(format_replay(rep).split())
    assert "Every recorded firing of their timers flushes that one queue" in text and "too few" not in text
