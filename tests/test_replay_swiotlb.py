"""Bounce buffering against a real kernel's own record (issue 68): tests/data/testbed-swiotlb holds captures of an
x86 Debian 6.12 guest the testbed booted with `swiotlb=512,force` behind VT-d in passthrough (dma-direct), its
data disk's requests cut to 128 or 256 KiB so that the 16 MiB download and the 64 MiB of direct reads fill the
1 MiB pool now and then (`boot.py --mode pt --kernel 6.12 --devices --swiotlb 512 --blk-max-kb N`, 2026-11-29;
one vCPU, and two with 128 KiB).
The capture recorded the DMA API's events, the `swiotlb_bounced` tracepoint and debugfs's used and high-water
counts; replay drives the model's pool (dma/swiotlb.rs) from the DMA API's events alone and is held to the rest."""

import json
import lzma
import pathlib
import re

import pytest

import iommulab
from iommulab.replay import format_replay

DATA = pathlib.Path(__file__).parent / "data" / "testbed-swiotlb"
CAPTURES = sorted(p for p in DATA.iterdir() if (p / "results.json").exists())


def replay(cap, trace=None):
    res = json.loads((cap / "results.json").read_text())
    return iommulab.replay(trace or cap / "trace.txt.xz", iommu="vtd", kernel=res["kernel"], cmdline=res["cmdline"])


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_a_forced_guests_bounces_replay_to_its_own_counts(cap):
    rep = replay(cap)
    assert rep["policy"] == "passthrough" and rep["warnings"] == []
    # The pool as the kernel sized it from swiotlb=512, and as the guest reported it: an area per possible CPU.
    smp = json.loads((cap / "results.json").read_text())["smp"]
    assert rep["swiotlb"]["pool_slots"] == rep["swiotlb"]["kernel_pool_slots"] == 512
    assert rep["swiotlb"]["areas"] == smp and rep["swiotlb"]["force"]
    full = 0
    for phase in ("probe", "net", "blk"):
        b = rep["phases"][phase]["swiotlb"]
        model, guest = b["model"], b["guest"]
        # Which maps bounce is the model's (every streaming map under force, no coherent ring): 1 %.
        assert abs(model["bounces"] - guest["swiotlb_bounced"]) <= 0.01 * guest["swiotlb_bounced"], (phase, b)
        # The slots each bounce gets, and whether it gets any: the kernel's area search, alignment and free
        # runs, bounce by bounce.
        assert abs(model["full_events"] - guest["map_errors"]) <= max(1, 0.01 * guest["map_errors"]), (phase, b)
        assert b["slots_same"] >= 0.99 * b["slots_compared"] and b["slots_compared"] > 200, (phase, b)
        assert b["model_full_kernel_mapped"] + b["model_mapped_kernel_full"] <= 0.01 * model["bounces"], (phase, b)
        # debugfs's io_tlb_used at the capture's end, and io_tlb_used_hiwater since its reset before it.
        assert model["used_slots"] == guest["used_slots"], (phase, b)
        assert guest["high_water_at_start"] == 0
        assert abs(model["high_water_slots"] - guest["high_water_slots"]) <= 2, (phase, b)
        full += guest["map_errors"]
    assert full > 0, "the pool never filled: nothing checks the model's failures"
    assert rep["phases"]["blk"]["swiotlb"]["model"]["high_water_slots"] > 400
    text = format_replay(rep)
    assert f"swiotlb: a pool of 512 slots in {smp} area" in text and "(the kernel reported 512)" in text
    assert "same_slot" in text


def test_the_slot_check_tells_a_wrong_area_count():
    # The two-vCPU guest's pool had two areas, each CPU searching its own first. Replayed as one area, the
    # bounces and failures still add up (the model follows the kernel's slots), but the slots do not.
    cap = DATA / "k6.12-pt-smp2-swiotlb512-blkmax128"
    res = json.loads((cap / "results.json").read_text())
    one = res["cmdline"].replace("swiotlb=512,force", "swiotlb=512,1,force")
    rep = iommulab.replay(cap / "trace.txt.xz", iommu="vtd", kernel="6.12", cmdline=one)
    assert rep["swiotlb"]["areas"] == 1
    b = rep["phases"]["blk"]["swiotlb"]
    assert b["slots_same"] < 0.9 * b["slots_compared"]


def test_without_the_dma_apis_events_nothing_is_predicted_and_the_replay_says_so(tmp_path):
    # The swiotlb_bounced events alone: the kernel's count is read, but no map drives the model's pool.
    cap = CAPTURES[0]
    trace = tmp_path / "bounced-only.txt"
    dma_api = re.compile(r" dma_[a-z_]+: ")
    trace.write_text("".join(l for l in lzma.open(cap / "trace.txt.xz", "rt") if not dma_api.search(l)))
    rep = replay(cap, trace)
    b = rep["phases"]["net"]["swiotlb"]
    assert b["model"]["bounces"] == 0 and b["guest"]["swiotlb_bounced"] > 10000
    assert any("bounces no traced map shows" in w for w in rep["warnings"])


def test_a_replay_without_the_command_line_takes_the_pool_from_the_captures_note():
    # No swiotlb= given: the pool's slots from the capture's note, and only the devices the kernel's
    # swiotlb_bounced events name bounce (the replay warns it took them from the trace).
    cap = CAPTURES[0]
    rep = iommulab.replay(cap / "trace.txt.xz", iommu="vtd", kernel="6.12", cmdline="iommu.passthrough=1")
    s = rep["swiotlb"]
    assert s["pool_slots"] == 512 and not s["force"] and "slots from the capture's note" in s["from"]
    assert any("swiotlb_bounced events name is taken to bounce" in w for w in rep["warnings"])
    blk = rep["phases"]["blk"]["swiotlb"]
    assert blk["model"]["full_events"] == blk["guest"]["map_errors"] > 0
