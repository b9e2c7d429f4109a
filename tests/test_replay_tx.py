"""Replay of the testbed's transmit phase (issue 67): tests/data/testbed-tx holds three captures of a guest
uploading 16 MiB over virtio-net (README.md there), each replayed to the invalidations QEMU processed in the same
window, as the receive phase's captures are (tests/test_testbed.py)."""

import json
import pathlib

import pytest

import iommulab

DATA = pathlib.Path(__file__).parent / "data" / "testbed-tx"
CAPTURES = sorted(p for p in DATA.iterdir() if (p / "results.json").exists())
# Replay's column and QEMU's trace event, per vIOMMU.
KEYS = {"intel": {"iotlb_psi": "vtd_inv_desc_iotlb_pages", "wait": "vtd_inv_desc_wait_sw"},
        "smmuv3": {"tlbi_nh_va": "SMMU_CMD_TLBI_NH_VA", "cmd_sync": "SMMU_CMD_SYNC",
                   "doorbells": "smmuv3_cmdq_consume_out"}}


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_a_transmit_capture_replays_to_qemus_invalidations(cap):
    res = json.loads((cap / "results.json").read_text())
    iommu = {"intel": "vtd", "smmuv3": "smmuv3"}[res["iommu"]]
    rep = iommulab.replay(cap / "trace.txt.xz", iommu=iommu, kernel=res["kernel"], cmdline=res["cmdline"])
    got, qemu = rep["phases"]["tx"]["counts"], res["phases"]["tx"]["qemu"]
    assert res["phases"]["tx"]["bytes"] == 16 << 20
    # One frame per mapping and one ACK's RX buffer per frame: about 90 maps per 64 KiB sent (16 MiB / 1448 B
    # per frame, twice).
    assert 85 * 256 <= got["map_events"] <= 95 * 256, got
    for ours, theirs in KEYS[res["iommu"]].items():
        want = qemu.get(theirs, 0)
        assert want > 20000 and abs(got[ours] - want) <= 0.01 * want, f"{cap.name} {ours}: {got[ours]}, QEMU {want}"
