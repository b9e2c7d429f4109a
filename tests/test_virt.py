"""Guests behind emulated IOMMUs (issue 33): seed 001's setups, their labels and outputs, the combinations no
hypervisor offers, VFIO devices, and the seed's qualitative findings as directions. The guest runs do not
depend on the seed (see test_guest_runs_do_not_depend_on_the_seed): each direction is checked at one."""

import functools
import json
import re

import iommulab
import pytest

from conftest import cli, one_line_error

X86 = {"noiommu", "lazy", "strict", "strict-cm", "virtio-iommu"}
ARM = {"noiommu", "smmuv3", "smmuv3-cm", "virtio-iommu"}


def set_args(*sets):
    """`--set` before each of `sets`."""
    return [a for s in sets for a in ("--set", s)]


@functools.cache
def runs_of(name, *sets):
    """`iommulab run NAME --json` with `--set` of each of `sets`: its runs by label (one run prints itself,
    a comparison {"runs": [...]})."""
    out = json.loads(cli("run", name, *set_args(*sets), "--json", check_rc=0).stdout)
    return {r["label"]: r for r in out.get("runs", [out])}


@pytest.mark.parametrize("name, configs", [("guest-x86", X86), ("guest-arm", ARM)])
def test_seed001_labels_read_config_direction_vhost_tool(name, configs):
    runs = list(runs_of(name).values())
    labels = [r["label"] for r in runs]
    assert len(labels) == len(configs) * 8
    for label in labels:
        m = re.fullmatch(r"(\S+) (rx|tx) vhost=(on|off) (netperf|iperf3)", label)
        assert m and m.group(1) in configs, label
    assert {l.split()[0] for l in labels} == configs
    # Every run of a guest reports its exits; only the emulated IOMMUs' doorbells trap.
    for r in runs:
        vm = r["vm_exits"]
        causes = {c["cause"]: c["count"] for c in vm["by_cause"]}
        doorbell = causes["qi_tail"] + causes["cmdq_prod"]
        if r["label"].startswith(("noiommu", "virtio-iommu")):
            assert doorbell == 0, r["label"]
        else:
            assert doorbell > 0, r["label"]
    text = cli("run", name, check_rc=0).stdout
    assert "guest exits to the hypervisor:" in text and "device thread busy" in text


@pytest.mark.parametrize("name", ["guest-x86", "guest-arm"])
def test_guest_runs_do_not_depend_on_the_seed(name):
    # The model draws one thing from the seed: which flow each slot of a NIC's wire goes to
    # (workload.nic_rx). A guest's virtio-net carries one stream, so nothing in it is drawn.
    other = runs_of(name, "run.seed=2")
    for label, r in runs_of(name).items():
        assert {**other[label], "seed": 1} == r, label


@pytest.mark.parametrize("sets, key", [
    (["--set", "platform.profile=vtd-server"], "platform.hypervisor"),
    (["--set", "platform.profile=kvm-smmuv3-guest"], "os.arch"),
    (["--set", "platform.iommu.smmuv3.ecmdq=true"], "platform.iommu.smmuv3.ecmdq"),
])
def test_combinations_no_hypervisor_offers_are_refused_in_one_line(sets, key):
    name = "guest-arm" if "ecmdq" in key else "guest-x86"
    p = cli("run", name, *sets, check_rc=2)
    assert key in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


# The default NIC receive, small, one run, VFIO-assigned to a guest.
VFIO_NIC = ("workload.nic_rx.queues=2", "workload.nic_rx.flows=2", "workload.nic_rx.page_pool=false",
            "os.policy=strict", "run.warmup_ms=2", "run.duration_ms=10")


def vfio_nic(*sets):
    [r] = runs_of("default", *VFIO_NIC, *sets).values()
    return r


@pytest.mark.parametrize("guest, caching_mode", [
    (("platform.profile=kvm-vtd-guest",), "platform.iommu.vtd.caching_mode"),
    (("platform.profile=kvm-smmuv3-guest", "os.arch=arm64"), "platform.iommu.smmuv3.caching_mode"),
])
def test_a_vfio_nic_behind_an_emulated_iommu_needs_caching_mode_or_nesting(guest, caching_mode):
    # QEMU refuses vfio-pci behind intel-iommu without caching-mode=on: without an invalidation after each
    # map it could not shadow the guest's mappings into the host IOMMU.
    p = cli("run", "default", *set_args(*VFIO_NIC, *guest), check_rc=2)
    assert caching_mode.removeprefix("platform.") in p.stderr and "VFIO" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    # Shadowed: QEMU maps every page the guest maps into the host with VFIO, pinning it, and (strict)
    # unpins every page the guest unmaps, one VFIO call per page its walk finds.
    r = vfio_nic(*guest, f"{caching_mode}=true")
    vm = r["vm_exits"]
    assert (vm["pages_pinned"], vm["pages_unpinned"]) == (r["iova_pages_mapped"], r["iova_pages_unmapped"])
    assert vm["vfio_maps"] == vm["pages_pinned"] > 0 and vm["pages_unpinned"] > 0
    # Nested: the guest's table is the hardware's stage 1; nothing is shadowed, but invalidations trap.
    vm = vfio_nic(*guest, "platform.hypervisor.nested=true")["vm_exits"]
    assert (vm["pages_pinned"], vm["vfio_maps"]) == (0, 0) and vm["total"] > 0


def test_a_vfio_nic_behind_virtio_iommu_is_pinned_per_map_and_unpinned_per_unmap():
    # Every MAP and UNMAP request reaches QEMU, whose virtio_iommu_map/unmap call VFIO for it: strict, each
    # page mapped in the window is pinned and each unmapped is unpinned, one VFIO call per request. (Issue
    # 33's VFIO model never shadowed a device behind virtio-iommu: nothing was pinned.)
    r = vfio_nic("platform.profile=virtio-guest")
    vm, inv = r["vm_exits"], r["invalidations"]
    assert (vm["pages_pinned"], vm["pages_unpinned"]) == (r["iova_pages_mapped"], r["iova_pages_unmapped"])
    assert (vm["vfio_maps"], vm["vfio_unmaps"]) == (inv["map"], inv["unmap"]) and vm["vfio_maps"] > 0


def test_smmuv3_caching_mode_exists_only_in_an_emulated_smmu():
    p = cli("run", "c1", "--set", "platform.iommu.smmuv3.caching_mode=true", check_rc=2)
    assert "platform.iommu.smmuv3.caching_mode" in p.stderr


def run_of(name, config, direction, vhost, tool="netperf"):
    return runs_of(name)[f"{config} {direction} vhost={'on' if vhost else 'off'} {tool}"]


def gbps(name, config, direction, vhost, tool="netperf"):
    return run_of(name, config, direction, vhost, tool)["throughput_gbps"]


def test_dynamic_mappings_cost_a_guest_far_more_than_no_viommu():
    # Seed 001: with dynamic mappings every buffer's unmap (and, with caching mode, its map) traps.
    for name, config in (("guest-x86", "strict"), ("guest-arm", "smmuv3")):
        assert gbps(name, config, "rx", False) < 0.85 * gbps(name, "noiommu", "rx", False), name


def test_deferred_beats_strict_which_beats_strict_with_caching_mode():
    for vhost in (False, True):
        lazy, strict, cm = (gbps("guest-x86", c, "rx", vhost) for c in ("lazy", "strict", "strict-cm"))
        assert lazy > strict > cm, (vhost, lazy, strict, cm)
    assert gbps("guest-arm", "smmuv3", "rx", False) > gbps("guest-arm", "smmuv3-cm", "rx", False)


@pytest.mark.xfail(strict=True, reason="the model puts vSMMUv3's vhost RX on the seed's ThunderX just below "
                   "virtio-iommu's (0.86 against 0.87 Gbps; 0.91 against 0.93 with vhost's ring cache): vhost's IOTLB "
                   "misses wait for QEMU's answer under the BQL, which the 4.19 guest's per-command SMMUv3 exits hold "
                   "too. The seed's exact QEMU, kernels and host costs, which could decide a 2-4 % gap, are unknown")
def test_virtio_iommus_explicit_requests_cost_most_in_the_vhost_case_on_arm():
    # Every MAP is a request the guest waits for (before 6.8), and with vhost every UNMAP is forwarded too;
    # the emulated SMMUv3 traps only its invalidations.
    assert gbps("guest-arm", "virtio-iommu", "rx", True) < gbps("guest-arm", "smmuv3", "rx", True)


def test_rx_and_tx_differ_off_the_wire():
    # RX maps one page-sized mergeable buffer per 4 KiB; TX (iperf3's 128 KiB sends) maps a TSO skb's head
    # and its frags, pieces of 32 KiB page_frag chunks. At 100 Gbps neither direction sits at the wire, and
    # strict's exit per invalidation caps RX (one per 4 KiB) far below TX: about six per 19-20 pages, a
    # 64 KiB skb's head page, the three chunks it mostly spans, the indirect descriptor table
    # virtqueue_add_split maps for them, and the RX buffer of the peer's ACK.
    runs = runs_of("guest-x86", "workload.virtio_net.line_rate_gbps=100", "workload.virtio_net.vhost=false",
                   "workload.virtio_net.tool=iperf3")
    rx, tx = runs["strict rx"], runs["strict tx"]
    for r in (rx, tx):
        assert r["throughput_gbps"] < 0.5 * r["line_rate_gbps"], r["label"]
    assert rx["inv_per_page"] == 1.0 and 5 / 19 < tx["inv_per_page"] < 7 / 19, tx["inv_per_page"]
    assert tx["throughput_gbps"] > 2 * rx["throughput_gbps"], (rx["throughput_gbps"], tx["throughput_gbps"])


def host_kvm(name):
    return json.loads(iommulab.load(name, {})[0].scenario_json())["platform"]["kvm"]


def test_vhosts_iotlb_misses_hold_its_thread_and_cap_the_stream():
    # Lazy with vhost: every fresh buffer IOVA misses vhost's device IOTLB, and the vhost thread waits for
    # QEMU's answer (vhost_iotlb_miss_ns) each time. Those waits are most of its time, and one page per
    # round trip caps the stream.
    r = run_of("guest-x86", "lazy", "rx", True)
    miss_ns = host_kvm("guest-x86")["vhost_iotlb_miss_ns"]
    misses = r["caches"]["atc"]["misses"]
    assert misses > 0.9 * r["dma_pages"], (misses, r["dma_pages"])
    busy_ns = r["vm_exits"]["device_busy"] * r["sim_seconds"] * 1e9
    assert 0.6 * busy_ns < misses * miss_ns <= busy_ns, (misses * miss_ns, busy_ns)
    assert r["throughput_gbps"] < 4096 * 8 / miss_ns
    # Without a vIOMMU vhost translates through its memory table: no misses, the wire.
    none = run_of("guest-x86", "noiommu", "rx", True)
    assert none["caches"]["atc"]["misses"] == 0 and none["throughput_gbps"] > 0.9 * none["line_rate_gbps"]


# TX NAPI on the 4.19 guest (virtio_net.napi_tx=1, 5.3's default): its TX interrupt's NAPI unmaps on vCPU 0
# while the sender maps on vCPU 1. 4.19's default reaps in start_xmit, on the sending vCPU (issue 67).
NAPI_TX = "workload.virtio_net.napi_tx=true"


def test_a_trapped_vcpu_holds_q_lock_through_its_exit():
    # Strict TX with caching mode and TX NAPI: vCPU 1 maps (a PSI per map) while vCPU 0 unmaps, two
    # submitters. The one in qi_submit_sync exits at its tail write with q_lock held; the other waits for
    # that whole exit.
    r = runs_of("guest-x86", NAPI_TX)["strict-cm tx vhost=off netperf"]
    q_lock = next(c for c in r["contention"] if c["name"] == "vt-d qi q_lock")
    exit_ns = next(c for c in r["vm_exits"]["by_cause"] if c["cause"] == "qi_tail")["mean_us"] * 1000
    assert q_lock["contended_share"] > 0.05 and q_lock["wait_p99_ns"] >= exit_ns, (q_lock, exit_ns)
    # A sync then waits for its own exit and part of another's: longer than with one submitter (RX), 1.09x.
    # (1.12x before the page-table lines: each skb's entry, written by the mapping vCPU and cleared by the
    # unmapping one, now moves between them, which spaces their submissions out a little.)
    alone = run_of("guest-x86", "strict", "rx", False)["sync_wait_mean_us"]
    assert r["sync_wait_mean_us"] > 1.05 * alone, (r["sync_wait_mean_us"], alone)


def test_nested_vcmdq_avoids_the_trap_and_trapped_syncs_queue_in_the_vmm():
    runs = runs_of("nested")
    vcpus = ["2vcpu", "4vcpu", "8vcpu", "16vcpu"]
    assert set(runs) == {f"{v} {q}" for v in vcpus for q in ("trapped", "vcmdq")}
    for v in vcpus:
        trapped, vcmdq = runs[f"{v} trapped"], runs[f"{v} vcmdq"]
        assert vcmdq["vm_exits"]["total"] == 0 and trapped["vm_exits"]["total"] > 0
        assert vcmdq["sync_wait_mean_us"] < trapped["sync_wait_mean_us"], v
        # Nested: nothing is shadowed, nothing pinned per map.
        assert trapped["vm_exits"]["pages_pinned"] == 0
    # Every trapped batch goes through one VMM handler: with more vCPUs they queue there.
    waits = [runs[f"{v} trapped"]["sync_wait_mean_us"] for v in vcpus]
    assert waits == sorted(waits) and waits[-1] > 3 * waits[0]


def test_a_long_invalidation_batch_delays_qemus_device_through_the_bql():
    # QEMU's virtio-net runs in its main loop under the BQL, and a vCPU's trapped invalidations are processed
    # under it too: the device waits for the handlers. Ten times dearer descriptors make it wait longer per
    # packet and cost TX throughput. A guest without a vIOMMU never waits. vhost's worker is a kernel thread
    # and takes no BQL for its own work, but its IOTLB misses wait for QEMU's answer, which its main loop
    # gives under the BQL: behind the handlers too.
    # On today's host (on the seed's Haswell-EP, TX is bound by the vCPUs' q_lock first and the device's wait
    # per packet grows by 2 % only).
    # With TX NAPI (NAPI_TX): the handlers of two vCPUs.
    sets = ("workload.virtio_net.direction=tx", "workload.virtio_net.tool=iperf3",
            "platform.hypervisor.host_profile=vtd-server", NAPI_TX)
    cheap = runs_of("guest-x86", *sets, "workload.virtio_net.vhost=false")
    dear = runs_of("guest-x86", *sets, "workload.virtio_net.vhost=false", "platform.iommu.vtd.inv_desc_ns=5000")
    wait = lambda r: r["vm_exits"]["device_bql_wait"] / r["throughput_gbps"]
    for config in ("strict", "strict-cm"):
        a, b = cheap[config], dear[config]
        assert a["vm_exits"]["device_bql_wait"] > 0.05, a["vm_exits"]
        assert wait(b) > 1.05 * wait(a) and b["throughput_gbps"] < 0.9 * a["throughput_gbps"], (a["vm_exits"], b["vm_exits"])
    assert cheap["noiommu"]["vm_exits"]["device_bql_wait"] == 0
    vhost = runs_of("guest-x86", *sets, "workload.virtio_net.vhost=true")
    dear_vhost = runs_of("guest-x86", *sets, "workload.virtio_net.vhost=true", "platform.iommu.vtd.inv_desc_ns=5000")
    assert vhost["noiommu"]["vm_exits"]["device_bql_wait"] == 0
    for config in ("strict", "strict-cm"):
        a, b = vhost[config], dear_vhost[config]
        assert 0 < a["vm_exits"]["device_bql_wait"] < b["vm_exits"]["device_bql_wait"], config
        assert b["throughput_gbps"] < 0.95 * a["throughput_gbps"], config


@pytest.mark.parametrize("key, value, expected", [
    ("message_bytes", "0", "expected 1 byte to 1 GiB per send"),
    ("tool", "ttcp", "expected `netperf` or `iperf3`"),
    ("tso", "1", "expected a boolean"),
    ("mergeable", "yes", "expected a boolean"),
])
def test_the_senders_keys_refuse_what_they_cannot_mean(key, value, expected):
    err = one_line_error(cli("run", "guest-x86", "--set", f"workload.virtio_net.{key}={value}"))
    assert f"workload.virtio_net.{key}" in err and expected in err, err


def test_tool_sets_the_write_size_unless_message_bytes_does():
    # iperf3 writes 128 KiB; message_bytes = 16384 makes its run netperf's, to the bit.
    sets = ("workload.virtio_net.direction=tx", "workload.virtio_net.vhost=false", "run.duration_ms=10")
    netperf = runs_of("guest-x86", *sets, "workload.virtio_net.tool=netperf")["strict"]
    iperf3 = runs_of("guest-x86", *sets, "workload.virtio_net.tool=iperf3")["strict"]
    small = runs_of("guest-x86", *sets, "workload.virtio_net.tool=iperf3", "workload.virtio_net.message_bytes=16384")
    assert small["strict"]["tx_packets"] == netperf["tx_packets"] != iperf3["tx_packets"]


def test_the_seeds_hosts_price_the_guest_and_one_without_a_modelled_iommu_hosts_only():
    # A guest's vCPUs are its host's cores and its exits its host's KVM: the same guest runs slower on the
    # seed's ThunderX than on today's Arm host, and the seed's Haswell-EP slower than a Cascade Lake.
    arm = "platform.hypervisor.host_profile=smmuv3-server"
    x86 = "platform.hypervisor.host_profile=vtd-server"
    for name, today in (("guest-arm", arm), ("guest-x86", x86)):
        config = "smmuv3" if name == "guest-arm" else "strict"
        label = f"{config} rx vhost=off netperf"
        assert runs_of(name)[label]["throughput_gbps"] < runs_of(name, today)[label]["throughput_gbps"], name
    kvm = host_kvm("guest-arm")
    assert kvm["mmio_exit_ns"] > 4 * 1609, kvm
    # ThunderX's SMMU is an SMMUv2: it runs no bare-metal scenario and takes no VFIO device.
    err = one_line_error(cli("run", "c1", "--set", "platform.profile=thunderx"))
    assert "platform.profile" in err and "SMMUv2" in err, err
    err = one_line_error(cli("run", "default", *set_args(*VFIO_NIC, "platform.profile=kvm-smmuv3-guest",
                                                         "os.arch=arm64", "platform.iommu.smmuv3.caching_mode=true",
                                                         "platform.hypervisor.host_profile=thunderx")))
    assert "platform.hypervisor.host_profile" in err and "VFIO" in err, err


def test_before_5_4_an_smmuv3_guest_traps_for_every_command():
    # arm_smmu_cmdq_issue_cmd() wrote CMDQ_PROD for each command under cmdq.lock: a strict unmap's TLBI and
    # its CMD_SYNC are two exits, where from 5.4 one batch rings PROD once.
    old = run_of("guest-arm", "smmuv3", "rx", False)
    new = runs_of("guest-arm", "os.kernel=5.4")["smmuv3 rx vhost=off netperf"]
    prod = lambda r: next(c for c in r["vm_exits"]["by_cause"] if c["cause"] == "cmdq_prod")["count"]
    unmaps = lambda r: r["invalidations"]["tlbi_nh_va"]
    assert prod(old) / unmaps(old) > 1.9 and prod(new) / unmaps(new) < 1.1, (prod(old), prod(new))
    assert old["throughput_gbps"] < 0.9 * new["throughput_gbps"]
    assert any(c["name"] == "smmu cmdq.lock" for c in old["contention"])


@pytest.mark.parametrize("sets, key, expected", [
    (("platform.hypervisor.mmio_exit_ns=3000",), "platform.hypervisor.mmio_exit_ns", "platform.kvm.mmio_exit_ns"),
    (("os.kernel=4.19", "os.policy=auto"), "os.policy", "start at 5.15"),
    (("os.kernel=5.10", "platform.profile=virtio-guest"), "os.kernel", "5.14 or later on x86"),
    (("os.kernel=4.14",), "os.kernel", "4.19 to 6.18"),
])
def test_older_guests_and_moved_keys_are_refused_in_one_line(sets, key, expected):
    err = one_line_error(cli("run", "guest-x86", *set_args(*sets)))
    assert key in err and expected in err, err


@pytest.mark.parametrize("key, section", [("walk_read_ns", "memory"), ("iotlb_entries", "iommu"),
                                          ("pwc_entries", "iommu")])
def test_only_virtio_iommu_may_leave_out_the_iotlb_and_the_walk(tmp_path, key, section):
    # virtio-iommu keeps no IOTLB and walks no table: its profiles have neither. A VT-d profile without them
    # is refused in one line naming the key (not a silent zero).
    from iommulab import _core
    text = dict(_core.builtin_profiles())["vtd-server"]
    mine = tmp_path / "mine.toml"
    mine.write_text("\n".join(line for line in text.splitlines()
                              if not line.startswith((f"{key} =", f'"{section}.{key}"'))))
    err = one_line_error(cli("run", "default", "--set", f"platform.profile={mine}"))
    assert f"platform.{section}.{key}" in err, err
    assert "iotlb_entries" not in dict(_core.builtin_profiles())["virtio-guest"]


def test_a_dpdk_guest_reports_mpps_and_static_mappings_cost_only_lookups():
    # guest-dpdk: PVP through a vhost-user backend. With 2 MiB hugepages the emulated VT-d costs only the
    # backend's IOTLB lookups (no miss after warm-up, no invalidation); 4 KiB translations (--no-huge, or
    # virtio-iommu's) make its IOTLB a list of hundreds, walked on every lookup.
    runs = runs_of("guest-dpdk")
    assert {re.fullmatch(r"(\S+) hugepage_kb=(2048|4)", l).group(1) for l in runs} == {
        "noiommu", "vtd", "vtd-cm", "virtio-iommu"}
    mpps = {l: r["packets_per_sec"] / 1e6 for l, r in runs.items()}
    assert mpps["noiommu hugepage_kb=2048"] > mpps["vtd hugepage_kb=2048"] > 2 * mpps["vtd hugepage_kb=4"]
    assert mpps["virtio-iommu hugepage_kb=2048"] < 0.5 * mpps["vtd hugepage_kb=2048"]
    for r in runs.values():
        assert r["invalidations"]["total"] == 0 and r["caches"]["atc"]["misses"] == 0, r["label"]
        assert r["limited_by"] == "device_thread", r["label"]
    text = cli("run", "guest-dpdk", check_rc=0).stdout
    assert re.search(r"^run +Mpps +Gbps", text, re.M) and "Mpps: frames forwarded per second" in text


@pytest.mark.parametrize("sets, key, expected", [
    (("workload.l2fwd.hugepage_kb=3",), "workload.l2fwd.hugepage_kb", "expected 4 (--no-huge)"),
    (("workload.l2fwd.offered_mpps=20",), "workload.l2fwd.offered_mpps", "at most the line rate's 14.881 Mpps"),
    (("workload.l2fwd.backend=ovs",), "workload.l2fwd.backend", "expected `vhost-user` or `vhost`"),
    (("workload.l2fwd.mbufs=100",), "workload.l2fwd.mbufs", "expected enough for both rings and a burst"),
    (("platform.profile=vtd-server",), "workload.l2fwd", "expected a guest platform"),
])
def test_the_dpdk_guests_keys_refuse_what_they_cannot_mean(sets, key, expected):
    err = one_line_error(cli("run", "guest-dpdk", *set_args(*sets)))
    assert key in err and expected in err, err
