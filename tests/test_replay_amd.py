"""Replay of real x86 kernels behind QEMU's emulated AMD IOMMU (`-device amd-iommu`): the captures in
tests/data/testbed-amd (testbed/boot.py --iommu amd, 2026-11-28, QEMU 7.2, Debian's 6.1 and 6.12) must give, per
phase, the commands QEMU processed (its amdvi_* trace events), in AMD-Vi's own names. QEMU's IOMMU sets NpCache,
so every guest runs strict whatever its command line asks ("Using strict mode due to virtualization"), flushes
after each map and splits a flush into naturally aligned pieces."""

import json
import lzma
import pathlib

import pytest

import iommulab
from conftest import cli

DATA = pathlib.Path(__file__).parent / "data" / "testbed-amd"
CAPTURES = sorted(p for p in DATA.iterdir() if (p / "results.json").exists())
# QEMU's amdvi trace events (hw/i386/trace-events) for each replay count.
QEMU_KEYS = {"inv_iommu_pages": "amdvi_pages_inval", "inv_iotlb_pages": "amdvi_iotlb_inval",
             "inv_iommu_all": "amdvi_all_inval", "completion_wait": "amdvi_completion_wait"}


def replay(cap: pathlib.Path, np_cache: bool = True) -> tuple[dict, dict]:
    """The capture replayed as its guest ran (its kernel and command line, QEMU's NpCache), and QEMU's counts."""
    res = json.loads((cap / "results.json").read_text())
    trace = cap / "trace.txt"
    if not trace.exists():
        trace.write_bytes(lzma.decompress((cap / "trace.txt.xz").read_bytes()))
    return iommulab.replay(trace, iommu="amdvi", kernel=res["kernel"], cmdline=res["cmdline"],
                           caching_mode=np_cache), res


@pytest.fixture(autouse=True)
def _no_unpacked_traces():
    yield
    for cap in CAPTURES:
        (cap / "trace.txt").unlink(missing_ok=True)


def test_the_captures_are_those_the_readme_lists():
    assert [c.name for c in CAPTURES] == ["k6.1-amd-lazy", "k6.1-amd-strict", "k6.12-amd-lazy-mix-domains",
                                          "k6.12-amd-lazy-smp2", "k6.12-amd-strict"]


@pytest.mark.parametrize("cap", CAPTURES, ids=[c.name for c in CAPTURES])
def test_an_amd_guests_capture_replays_to_the_commands_qemu_processed(cap):
    rep, res = replay(cap)
    assert rep["lines"]["bad"] == 0
    # NpCache: strict, whatever the command line asked, and the kernel said why.
    assert rep["policy"] == "strict" and "Using strict mode due to virtualization" in rep["policy_reason"]
    assert "Using strict mode due to virtualization" in (cap / "dmesg-iommu.txt").read_text()
    if "domains" in cap.name:
        assert rep["domains"]["count"] == 2
    for phase, q in res["phases"].items():
        qemu, got = q["qemu"], rep["phases"][phase]["counts"]
        assert got["map_events"] > 100 and got["unmap_events"] > 100, (phase, got)
        assert not any(k in qemu for k in ("amdvi_command_error", "amdvi_unhandled_command",
                                          "amdvi_completion_wait_fail", "amdvi_page_fault")), qemu
        for ours, theirs in QEMU_KEYS.items():
            want, have = qemu.get(theirs, 0), got[ours]
            assert abs(have - want) <= 0.01 * want, f"{cap.name} {phase} {ours}: model {have}, QEMU {want}"
        # Every map and every unmap is flushed and waited for (map_syncs: one per iotlb_sync_map).
        assert got["completion_wait"] == got["map_syncs"] + got["unmap_events"], got
        # The flushes split into naturally aligned pieces: more INVALIDATE_IOMMU_PAGES than waits where
        # multi-page ranges are mapped (the disk's reads); one each for the network's single pages.
        assert got["inv_iommu_pages"] >= got["completion_wait"]


def test_without_np_cache_the_same_trace_would_have_been_lazy_and_sent_far_fewer_commands():
    # What decides QEMU's counts is the capability, not the command line: replayed on an AMD IOMMU without
    # NpCache, the lazy guest's unmaps go to the flush queue and its maps are not flushed.
    cap = DATA / "k6.12-amd-lazy-smp2"
    rep, res = replay(cap, np_cache=False)
    assert rep["policy"] == "lazy"
    got, qemu = rep["phases"]["net"]["counts"], res["phases"]["net"]["qemu"]
    assert got["inv_iommu_pages"] < 0.1 * qemu["amdvi_pages_inval"], (got, qemu)


def test_the_cli_prints_amd_vis_command_names(tmp_path):
    cap = DATA / "k6.1-amd-strict"
    res = json.loads((cap / "results.json").read_text())
    trace = tmp_path / "t.txt"
    trace.write_bytes(lzma.decompress((cap / "trace.txt.xz").read_bytes()))
    out = cli("replay", str(trace), "--iommu", "amdvi", "--caching-mode", "on", "--kernel", "6.1",
              "--cmdline", res["cmdline"], "--no-progress", check_rc=0).stdout
    # The table in blocks that fit 100 columns, each led by the phase.
    heads = [line.split() for line in out.splitlines() if line.startswith("phase")]
    assert all(h[0] == "phase" for h in heads) and [c for h in heads for c in h[1:]] == [
        "map_events", "unmap_events", "map_syncs", "inv_iommu_pages", "inv_iotlb_pages", "inv_iommu_all",
        "completion_wait"]
    flat = " ".join(out.split())
    assert "INVALIDATE_IOMMU_PAGES" in flat and "Using strict mode due to virtualization" in flat


def test_the_amd_profiles_run_and_qemus_amd_iommu_refuses_what_it_cannot_do(tmp_path):
    # The default workload on the EPYC profile; a guest behind QEMU's AMD IOMMU runs strict (NpCache).
    run = json.loads(cli("run", "--set", "platform.profile=amdvi-server", "--set", "os.policy=strict",
                         "--set", "run.duration_ms=5", "--set", "run.warmup_ms=2", "--json", check_rc=0).stdout)
    assert all(r["throughput_gbps"] > 1 for r in run["runs"])
    assert any(r["invalidations"].get("inv_iommu_pages", 0) > 0 for r in run["runs"])
    sc = tmp_path / "guest.toml"
    sc.write_text('[run]\nduration_ms = 5\nwarmup_ms = 2\n[platform]\nprofile = "kvm-amdvi-guest"\n'
                  '[os]\nkernel = "6.12"\npolicy = "auto"\ncmdline = "iommu.strict=0"\n'
                  '[workload.virtio_net]\nline_rate_gbps = 10\ndirection = "rx"\nmtu = 1500\n')
    res = json.loads(cli("run", str(sc), "--json", check_rc=0).stdout)  # one run: the run itself
    assert res["policy"] == "strict" and "virtualization" in res["policy_reason"] and res["throughput_gbps"] > 0.1
    # QEMU 7.2's amd-iommu notifies no device IOTLB of an invalidation: vhost is refused, in one line.
    err = cli("run", str(sc), "--set", "workload.virtio_net.vhost=true", check_rc=2).stderr
    assert "hypervisor.qemu" in err and "vhost" in err and len(err.strip().splitlines()) == 1
