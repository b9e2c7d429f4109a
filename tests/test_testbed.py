"""The testbed end to end (testbed/): a real Debian kernel boots under QEMU with an emulated VT-d, AMD IOMMU,
virtio-iommu or (an arm64 guest) SMMUv3; inside it
iommulab's own capture script records each traffic phase and the guest saves what `inspect` reads; on the host
`replay` of that capture must give QEMU's own counts (1 % strict, 10 % lazy) and `inspect` the mode the guest
reports. It needs root, network to the Debian archive and a few minutes, so it runs when IOMMULAB_TESTBED=1
(.ci/run sets it) and QEMU is installable."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import iommulab
from conftest import cli

ROOT = pathlib.Path(__file__).parent.parent
TB = pathlib.Path(os.environ.get("IOMMULAB_TESTBED_DIR", "/tmp/iommulab-testbed"))

pytestmark = pytest.mark.skipif(os.environ.get("IOMMULAB_TESTBED") != "1" or os.geteuid() != 0,
                                reason="the testbed boots real kernels: set IOMMULAB_TESTBED=1 (as root)")


def prepare(arch: str, qemu: str) -> pathlib.Path | str:
    """testbed/prepare.sh for `arch` (x86 or arm64): its directory, or why it cannot boot (its QEMU is not
    installable here)."""
    p = subprocess.run(["bash", str(ROOT / "testbed/prepare.sh"), str(TB), arch], capture_output=True, text=True)
    if not shutil.which(qemu):
        return f"{qemu} is not installable here: {p.stderr.strip()[-300:]}"
    assert p.returncode == 0, p.stderr[-2000:]
    return TB


# Every boot the tests below check: its architecture and boot.boot()'s arguments, longest first. A TCG guest
# keeps one core busy, so they run BOOTS_AT_ONCE at a time, all started when the first is asked for.
BOOTS = {
    "virtio-lazy": ("x86", dict(mode="lazy", iommu="virtio", phases="net,blk,mix", domains=True, devices=True,
                                timer=True)),
    "arm64-lazy-6.12": ("arm64", dict(mode="lazy", phases="net,blk,nvme", iommu="smmuv3", kernel="6.12", timer=True)),
    "arm64-lazy-6.1-2vcpus": ("arm64", dict(mode="lazy", phases="net,blk,nvme", iommu="smmuv3", kernel="6.1", smp=2,
                                            timer=True)),
    "arm64-strict-6.1": ("arm64", dict(mode="strict", phases="net,blk,nvme", iommu="smmuv3", kernel="6.1",
                                       timer=True, emulator_counts=True)),
    "arm64-mix": ("arm64", dict(mode="lazy", phases="mix", iommu="smmuv3", domains=True, timer=True, devices=True)),
    "mix": ("x86", dict(mode="lazy", phases="mix", domains=True, timer=True)),
    # Passthrough with every streaming map bounced through a 1 MiB pool (swiotlb=512,force), the data disk's
    # requests cut to 128 KiB so that the pool fills now and then and every phase still ends.
    "pt": ("x86", dict(mode="pt", kernel="6.12", devices=True, swiotlb=512, blk_max_kb=128)),
    "lazy-caching-mode": ("x86", dict(mode="lazy", cm="on", emulator_counts=True)),
    "strict": ("x86", dict(mode="strict", cm="off", emulator_counts=True)),
    # The flush timer recorded (capture -t), as on every lazy boot: a TCG guest's timer runs late when its vCPU
    # waits for a host the other boots and tests keep busy, and the replay then flushes when the guest did.
    "lazy": ("x86", dict(mode="lazy", cm="off", timer=True)),
    "virtio-strict": ("x86", dict(mode="strict", iommu="virtio", emulator_counts=True)),
    "amd-lazy": ("x86", dict(mode="lazy", iommu="amd")),
    "measure": ("x86", dict(mode="lazy", cm="off", phases="net", measure=True)),
}
BOOTS_AT_ONCE = max(1, min(4, os.cpu_count() or 1))


class Boots:
    """The boots of BOOTS, each running or done: `run(name)` waits for its directory (or skips where its
    architecture cannot boot here)."""

    def __init__(self):
        sys.path.insert(0, str(ROOT / "testbed"))
        import boot

        self.dirs = {arch: prepare(arch, qemu) for arch, qemu in (("x86", "qemu-system-x86_64"),
                                                                   ("arm64", "qemu-system-aarch64"))}
        self.pool = ThreadPoolExecutor(BOOTS_AT_ONCE, thread_name_prefix="testbed-boot")
        self.runs = {name: self.pool.submit(boot.boot, str(self.dirs[arch]), **kw)
                     for name, (arch, kw) in BOOTS.items() if isinstance(self.dirs[arch], pathlib.Path)}

    def run(self, name: str) -> pathlib.Path:
        arch = BOOTS[name][0]
        if name not in self.runs:
            pytest.skip(self.dirs[arch])
        return pathlib.Path(self.runs[name].result())


@pytest.fixture(scope="module")
def boots():
    b = Boots()
    yield b
    b.pool.shutdown(cancel_futures=True)


# SMMUv3's command names in replay, and QEMU's (hw/arm/smmuv3.c smmuv3_cmdq_consume: one smmuv3_cmdq_opcode per
# command, one smmuv3_cmdq_consume_out per CMDQ_PROD write).
SMMUV3_KEYS = {"tlbi_nh_va": "SMMU_CMD_TLBI_NH_VA", "tlbi_nh_asid": "SMMU_CMD_TLBI_NH_ASID",
               "cmd_sync": "SMMU_CMD_SYNC", "doorbells": "smmuv3_cmdq_consume_out"}


@pytest.mark.parametrize("mode, kernel, smp", [("strict", "6.1", 1), ("lazy", "6.12", 1), ("lazy", "6.1", 2)],
                         ids=["strict-6.1", "lazy-6.12", "lazy-6.1-2vcpus"])
def test_an_arm64_guests_capture_replays_to_the_smmuv3_commands_qemu_consumed(boots, mode, kernel, smp):
    # An arm64 Debian kernel behind QEMU's SMMUv3 (virt,iommu=smmuv3), with a network, a virtio disk and an NVMe
    # drive, each in its own domain; the capture is iommulab's own script, run by the guest's busybox.
    # The capture also records when the flush queue's timer fires (capture -t) and replay of lazy guests runs
    # the timer from it: a TCG guest's timer runs late whenever its vCPU waits for the host
    # (tests/test_replay_timer.py).
    rd = boots.run(f"arm64-{mode}-{kernel}" + ("-2vcpus" if smp == 2 else ""))
    res = json.loads((rd / "results.json").read_text())
    assert (rd / "trace.txt").read_text().startswith("# iommulab capture: flush queue timer recorded")
    rep = iommulab.replay(rd / "trace.txt", iommu="smmuv3", kernel=kernel, cmdline=res["cmdline"])
    assert rep["lines"]["bad"] == 0
    assert (rep.get("recorded_timer", {}).get("firings", 0) > 0) == (mode == "lazy")
    tol = (lambda want: max(0.10 * want, 1)) if mode == "lazy" else (lambda want: 0.01 * want)
    for phase in ("net", "blk", "nvme"):
        got, qemu = rep["phases"][phase]["counts"], res["phases"][phase]["qemu"]
        assert got["unmap_events"] > 100, f"{phase}: the capture recorded {got['unmap_events']} unmaps"
        assert not any(k.startswith(("smmuv3_cmdq_consume_error", "smmuv3_record_event", "smmuv3_unhandled"))
                       for k in qemu), qemu
        for ours, theirs in SMMUV3_KEYS.items():
            want, have = qemu.get(theirs, 0), got[ours]
            assert abs(have - want) <= tol(want), f"{mode} {kernel} {phase} {ours}: model {have}, QEMU {want}"
        # Strict sends TLBIs by address and no ASID flush; lazy the reverse.
        by_va, by_asid = qemu.get("SMMU_CMD_TLBI_NH_VA", 0), qemu.get("SMMU_CMD_TLBI_NH_ASID", 0)
        assert (by_va > 0, by_asid > 0) == ((True, False) if mode == "strict" else (False, True)), qemu
    ins = json.loads(cli("inspect", "--root", str(rd / "root"), "--json", check_rc=0).stdout)
    assert [i["vendor"] for i in ins["iommus"]] == ["smmuv3"]
    assert len(ins["devices"]) == 4 and all(d["mode"] == mode == d["predicted"] for d in ins["devices"])


def test_three_devices_at_once_on_arm64_replay_to_the_asid_flushes_qemu_consumed(boots):
    # virtio-net, virtio-blk and NVMe at once behind the SMMUv3, each its own domain (ASID), flush queue and
    # timer; the capture names each event's domain (capture -k) and, through the DMA API's events, its device
    # (capture -D, Linux 6.12).
    rd = boots.run("arm64-mix")
    res = json.loads((rd / "results.json").read_text())
    trace = (rd / "trace.txt").read_text()
    # The device names alone (kprobe lines left out) place every event too.
    (rd / "devices.txt").write_text("".join(l for l in trace.splitlines(True) if " tb_map: " not in l
                                            and " tb_unmap: " not in l))
    for t in ("trace.txt", "devices.txt"):
        rep = iommulab.replay(rd / t, iommu="smmuv3", kernel=res["kernel"], cmdline=res["cmdline"])
        assert rep["lines"]["bad"] == 0 and rep["domains"]["count"] == 3
        # (The capture may stop between a map and the DMA API event after it: its last event or two.)
        assert t == "trace.txt" or rep["domains"]["inferred_events"] <= 2, rep["domains"]
        # The capture also recorded the flush timer, each firing with its domain (the cookie's fq_domain): with
        # the kprobe labels every firing flushes its own domain; with the device names alone each pointer is
        # tied to the device domain whose unmaps armed its timer (issue 49: they were all dropped).
        assert trace.startswith("# iommulab capture: flush queue timer recorded")
        rt = rep["recorded_timer"]
        # (A firing of a domain whose unmaps all came before tracing began names nothing known.)
        assert rt["by_domain"] and rt["firings"] > 10 and rt["ignored"] <= 3, rt
        assert rt["tied"] == (0 if t == "trace.txt" else 3) and rt["own_timer_domains"] == 0, rt
        got, qemu = rep["phases"]["mix"]["counts"], res["phases"]["mix"]["qemu"]
        for ours, theirs in (("tlbi_nh_asid", "SMMU_CMD_TLBI_NH_ASID"), ("cmd_sync", "SMMU_CMD_SYNC")):
            want, have = qemu.get(theirs, 0), got[ours]
            assert want > 0 and abs(have - want) <= max(0.10 * want, 1), f"{t} mix {ours}: model {have}, QEMU {want}"


@pytest.mark.parametrize("mode, cm, dsi", [("strict", "off", False), ("lazy", "off", True), ("lazy", "on", False)],
                         ids=["strict", "lazy", "lazy-caching-mode"])
def test_a_real_guests_capture_replays_to_qemus_counts(boots, mode, cm, dsi):
    rd = boots.run("lazy-caching-mode" if cm == "on" else mode)
    res = json.loads((rd / "results.json").read_text())
    rep = iommulab.replay(rd / "trace.txt", kernel="6.1", cmdline=res["cmdline"], caching_mode=cm == "on")
    assert rep["lines"]["bad"] == 0
    if dsi:
        # Lazy replays flush when the guest's timer fired (capture -t).
        assert rep["recorded_timer"]["firings"] > 0, rep["recorded_timer"]
    # Lazy: 10 %, and at least one flush (a timer's flush can land on either side of a phase edge).
    tol = (lambda want: max(0.10 * want, 1)) if dsi else (lambda want: 0.01 * want)
    for phase in ("net", "blk"):
        got, qemu = rep["phases"][phase]["counts"], res["phases"][phase]["qemu"]
        assert got["map_events"] > 100 and got["unmap_events"] > 100
        pairs = [("iotlb_dsi", "vtd_inv_desc_iotlb_domain")] if dsi else [("iotlb_psi", "vtd_inv_desc_iotlb_pages")]
        for ours, theirs in pairs + [("wait", "vtd_inv_desc_wait_sw")]:
            want, have = qemu.get(theirs, 0), got[ours]
            assert want > 0 and abs(have - want) <= tol(want), f"{mode} {phase} {ours}: model {have}, QEMU {want}"
    # inspect, on what the guest saved, names the mode the guest's groups report: with caching mode the
    # kernel keeps strict whatever the command line asks ("IOMMU batching disallowed due to virtualization").
    ins = json.loads(cli("inspect", "--root", str(rd / "root"), "--json", check_rc=0).stdout)
    assert [i["vendor"] for i in ins["iommus"]] == ["vtd"] and ins["iommus"][0]["caching_mode"] == (cm == "on")
    want = "strict" if cm == "on" else mode
    assert ins["devices"] and all(d["mode"] == want and d["predicted"] == want for d in ins["devices"])


def test_two_devices_at_once_captured_with_their_domains_replay_to_qemus_flushes(boots):
    # The mix phase runs the download and the disk reads together, each device in its own domain with its own
    # flush queue and timer; capture -k records each event's domain through kprobes on __iommu_map/unmap, and
    # capture -t each timer firing with its domain (the cookie's fq_domain, and VT-d's flush_iotlb_all), so
    # every domain's timer runs as the guest's did, early or late.
    rd = boots.run("mix")
    res = json.loads((rd / "results.json").read_text())
    trace = (rd / "trace.txt").read_text()
    assert " tb_map: " in trace and " tb_unmap: " in trace, "the capture recorded no domains"
    rep = iommulab.replay(rd / "trace.txt", kernel="6.1", cmdline=res["cmdline"])
    assert rep["lines"]["bad"] == 0 and rep["domains"]["count"] == 2
    rt = rep["recorded_timer"]
    assert rt["by_domain"] and rt["firings"] > 10 and rt["ignored"] <= 3, rt
    got, qemu = rep["phases"]["mix"]["counts"], res["phases"]["mix"]["qemu"]
    assert got["map_events"] > 1000 and got["unmap_events"] > 1000
    for ours, theirs in (("iotlb_dsi", "vtd_inv_desc_iotlb_domain"), ("wait", "vtd_inv_desc_wait_sw")):
        want, have = qemu.get(theirs, 0), got[ours]
        assert want > 0 and abs(have - want) <= max(0.10 * want, 1), f"mix {ours}: model {have}, QEMU {want}"


@pytest.mark.parametrize("mode", ["strict", "lazy"])
def test_a_virtio_iommu_guest_replays_to_qemus_requests(boots, mode):
    # virtio-iommu (the 6.12 kernel): every unmap is an UNMAP request; 6.12 queues MAPs and syncs them in
    # iotlb_sync_map, one request per iommu_pgsize() chunk.
    # Lazy also runs both devices at once and records the timer: each firing's flush is virtio-iommu's
    # viommu_flush_iotlb_all, which the capture finds among the drivers an x86 kernel has built in.
    lazy = mode == "lazy"
    phases = ("net", "blk", "mix") if lazy else ("net", "blk")
    rd = boots.run(f"virtio-{mode}")
    res = json.loads((rd / "results.json").read_text())
    rep = iommulab.replay(rd / "trace.txt", iommu="virtio", kernel="6.12", cmdline=res["cmdline"])
    if lazy:
        rt = rep["recorded_timer"]
        assert rt["by_domain"] and rt["firings"] > 10 and rt["ignored"] <= 3, rt
        assert rep["domains"]["count"] == 2 and rep["domains"]["inferred_events"] <= 2, rep["domains"]
    for phase in phases:
        got, qemu = rep["phases"][phase]["counts"], res["phases"][phase]["qemu"]
        for ours, theirs in (("virtio_map", "virtio_iommu_map"), ("virtio_unmap", "virtio_iommu_unmap")):
            want, have = qemu.get(theirs, 0), got[ours]
            assert want > 0 and abs(have - want) <= 0.01 * want, f"{mode} {phase} {ours}: model {have}, QEMU {want}"
    ins = json.loads(cli("inspect", "--root", str(rd / "root"), "--json", check_rc=0).stdout)
    assert [i["vendor"] for i in ins["iommus"]] == ["virtio"]
    assert ins["devices"] and all(d["mode"] == mode == d["predicted"] for d in ins["devices"])


@pytest.mark.parametrize("name", ["strict", "lazy-caching-mode", "virtio-strict", "arm64-strict-6.1"])
def test_the_emulators_counts_for_the_net_phase_match_qemus(boots, name):
    # QEMU traced its own translations, IOTLB hits, misses and walks, invalidations and register accesses
    # (boot.py --emulator-counts); the model runs the same phase (test_emulator.py) behind the same vIOMMU.
    from test_emulator import held_to_qemu, model_counts
    rd = boots.run(name)
    res = json.loads((rd / "results.json").read_text())
    qemu = res["phases"]["net"]["emulator"]
    assert qemu["translations"] > 50000, qemu
    model = model_counts(res["iommu"], res["kernel"], res["cmdline"], res["cm"] == "on")
    held_to_qemu(model, qemu, False, name)


def test_passthrough_guest_sends_nothing_and_inspect_says_identity(boots):
    rd = boots.run("pt")
    res = json.loads((rd / "results.json").read_text())
    rep = iommulab.replay(rd / "trace.txt", kernel=res["kernel"], cmdline=res["cmdline"]) \
        if (rd / "trace.txt").stat().st_size else None
    for phase in ("net", "blk"):
        assert not any(k.startswith("vtd_inv_desc_iotlb") for k in res["phases"][phase]["qemu"])
    assert rep is None or rep["policy"] == "passthrough"
    ins = json.loads(cli("inspect", "--root", str(rd / "root"), "--json", check_rc=0).stdout)
    assert ins["devices"] and all(d["mode"] == "passthrough" == d["predicted"] for d in ins["devices"])


def test_a_forced_bounce_guest_replays_to_its_own_bounces_slots_and_high_water(boots):
    # The same boot: the capture recorded the DMA API's events, the kernel's swiotlb_bounced tracepoint and
    # debugfs's used and high-water counts (reset before each capture); replay drives the model's pool from the
    # DMA API's events and is held to the rest (tests/test_replay_swiotlb.py holds three such captures).
    rd = boots.run("pt")
    res = json.loads((rd / "results.json").read_text())
    rep = iommulab.replay(rd / "trace.txt", kernel=res["kernel"], cmdline=res["cmdline"])
    assert rep["swiotlb"]["pool_slots"] == rep["swiotlb"]["kernel_pool_slots"] == 512
    for phase in ("probe", "net", "blk"):
        b = rep["phases"][phase]["swiotlb"]
        model, guest = b["model"], b["guest"]
        assert guest["swiotlb_bounced"] > 200, f"{phase}: {guest['swiotlb_bounced']} bounces"
        assert abs(model["bounces"] - guest["swiotlb_bounced"]) <= 0.01 * guest["swiotlb_bounced"], (phase, b)
        assert abs(model["full_events"] - guest["map_errors"]) <= max(1, 0.01 * guest["map_errors"]), (phase, b)
        assert b["slots_same"] >= 0.99 * b["slots_compared"], (phase, b)
        assert model["used_slots"] == guest["used_slots"], (phase, b)
        if guest["high_water_at_start"] == 0:
            assert abs(model["high_water_slots"] - guest["high_water_slots"]) <= 2, (phase, b)
    # The kernel's log: its "buffer is full" lines are rate-limited, a floor of the failed maps.
    failed = sum(d["swiotlb"]["guest"]["map_errors"] for d in rep["phases"].values() if "swiotlb" in d)
    assert res["swiotlb_full_messages"] <= failed and (failed == 0 or res["swiotlb_full_messages"] > 0)


def test_profile_measure_and_fit_on_a_guests_own_latencies(boots, tmp_path):
    # The guest's capture (-M) timed its own map/unmap path under TCG: an emulator's timings, which vary from run
    # to run and machine to machine, so nothing here bounds a latency or a prediction's error. It checks the
    # plumbing: the probes pair into calls, the fit writes a profile the model runs on, and every row that says
    # it set a constant gives back what it was set from (by construction, whatever the timings).
    from iommulab import measure

    rd = boots.run("measure")
    m = tmp_path / "m.json"
    cli("profile", "measure", "--trace", str(rd / "trace.txt"), "-o", str(m), check_rc=0)
    doc = json.loads(m.read_text())
    assert doc["kernel"].startswith("6.1.") and doc["iommus"] == ["dmar0"] and measure.policy_of(doc) == "lazy"
    fns = doc["functions"]
    for fn in ("iommu_dma_map_page", "iommu_dma_unmap_page", "alloc_iova_fast", "free_iova_fast",
               "iommu_map_atomic", "iommu_unmap_fast", "iommu_iova_to_phys"):
        assert fns[fn]["calls"] > 1000, (fn, fns[fn]["calls"])
    prof = tmp_path / "guest.toml"
    res = json.loads(cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(prof), "--json",
                         check_rc=0).stdout)
    # Each constant the measurement covers is written, or named with why it was not.
    for key in ("cpu.iova_rcache_ns", "cpu.pgtable_walk_ns", "cpu.pte_ns", "cpu.dma_iommu_op_ns"):
        assert key in res["fitted"] or any(s.startswith(key + ":") for s in res["not_fitted"]), key
    rows = {r["function"]: r for r in res["functions"]}
    assert rows["iommu_iova_to_phys"]["role"].startswith("sets")
    sets = [r for r in res["functions"] if r["role"].startswith("sets")]
    for r in sets:
        assert abs(r["error"]) < 0.01, r
    # The map benchmark on the fitted profile composes the whole map and unmap.
    for fn in ("iommu_dma_map_page", "iommu_dma_unmap_page"):
        assert rows[fn]["role"].startswith("predicted") and rows[fn]["modelled_ns"] > 0, rows[fn]
    r = iommulab.run(**{"platform.profile": str(prof), "os.policy": "strict", "workload.nic_rx.page_pool": True,
                        "run.duration_ms": 2,
                        "run.warmup_ms": 1})
    assert r.throughput_gbps > 0


def test_an_amd_guest_asked_for_lazy_runs_strict_and_replays_to_qemus_commands(boots):
    # QEMU's amd-iommu sets NpCache: the 6.12 guest keeps strict ("Using strict mode due to virtualization"),
    # flushes after every map and splits each flush into naturally aligned INVALIDATE_IOMMU_PAGES.
    rd = boots.run("amd-lazy")
    res = json.loads((rd / "results.json").read_text())
    assert "iommu.strict=0" in res["cmdline"]
    rep = iommulab.replay(rd / "trace.txt", iommu="amdvi", kernel="6.12", cmdline=res["cmdline"],
                          caching_mode=True)
    assert rep["lines"]["bad"] == 0 and rep["policy"] == "strict"
    for phase in ("net", "blk"):
        got, qemu = rep["phases"][phase]["counts"], res["phases"][phase]["qemu"]
        assert got["unmap_events"] > 100
        for ours, theirs in (("inv_iommu_pages", "amdvi_pages_inval"), ("completion_wait", "amdvi_completion_wait")):
            want, have = qemu.get(theirs, 0), got[ours]
            assert want > 0 and abs(have - want) <= 0.01 * want, f"amd {phase} {ours}: model {have}, QEMU {want}"
    ins = json.loads(cli("inspect", "--root", str(rd / "root"), "--json", check_rc=0).stdout)
    assert [i["vendor"] for i in ins["iommus"]] == ["amdvi"] and ins["iommus"][0]["caching_mode"]
    assert ins["devices"] and all(d["mode"] == "strict" == d["predicted"] for d in ins["devices"])
