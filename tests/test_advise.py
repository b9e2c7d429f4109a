"""`iommulab advise`: a verdict for every tree a real guest saved (and the bare-metal trees edited from them), the
host's hardware read into the scenario, what the host runs now, and the recommendation following its stated rule
from the runs' own figures."""

import json
import math
import shlex

import pytest
from conftest import cli
from test_inspect import DATA, EDITED, SAVED, add_nic, saved_tree

from iommulab.advise import format_advise

OPTION_KEYS = {"option", "policy", "cmdline", "cpu_busy", "exposure_p99_us", "limited_by", "reach", "protected",
               "seeds"}
TREES = SAVED + EDITED
INSPECT = DATA / "inspect"


def advise(root, *args):
    """advise's JSON, at one point unless `args` ask for ranges (tests/test_ranges.py checks the ranged verdict)."""
    ranges = [] if "--ranges" in args else ["--no-ranges"]
    p = cli("advise", "--root", str(root), "--json", *ranges, *args, check_rc=0)
    return json.loads(p.stdout)


def tree(name, tmp_path):
    tgz = INSPECT / f"{name}.tar.gz"
    return saved_tree(tgz if tgz.exists() else INSPECT / "edited" / f"{name}.tar.gz", tmp_path / name)


def spread(v):
    m = sum(v) / len(v)
    return (max(v) - min(v)) / abs(m) if m else 0.0


def follows_the_rule(doc, bound_us, key="throughput_gbps", higher=True):
    """The recommendation, recomputed from the options' runs: the best measure within the exposure bound, ties
    (the widest spread of an option's measure over its seeds; options at the line rate) to the least CPU busy
    when the line holds the best (within the widest spread of CPU busy), then to the one exposing least."""
    exposed = lambda o: math.inf if o["exposure_p99_us"] is None else o["exposure_p99_us"]
    tie = max(spread(o["seeds"][key]) for o in doc["options"])
    cpu_tie = max(spread(o["seeds"]["cpu_busy"]) for o in doc["options"])
    assert doc["noise"]["tie"] == pytest.approx(tie) and doc["noise"]["cpu_tie"] == pytest.approx(cpu_tie)
    mean = lambda o, k: sum(o["seeds"][k]) / len(o["seeds"][k])
    ok = [o for o in doc["options"] if exposed(o) <= bound_us]
    if not ok:
        return None
    val = (lambda o: mean(o, key)) if higher else (lambda o: -mean(o, key))
    top = max(ok, key=val)
    line = lambda o: o["limited_by"] == "line"
    ties = [o for o in ok if val(o) >= val(top) - abs(val(top)) * tie or line(o) and line(top)]
    if line(top):
        least = min(mean(o, "cpu_busy") for o in ties)
        ties = [o for o in ties if mean(o, "cpu_busy") <= least * (1 + cpu_tie)]
    return min(ties, key=lambda o: (exposed(o), bool(o.get("note"))))["option"]


def fits(text, width=100):
    """Every line advise wraps (all but the table's rows) fits `width` columns."""
    table = False
    for line in text.splitlines():
        table = table or line.startswith("option ")
        if table and not line:
            table = False
        assert table or len(line) <= width, line


@pytest.mark.parametrize("tgz", TREES, ids=[p.name.split(".")[0] for p in TREES])
def test_every_saved_tree_gets_a_verdict(tgz, tmp_path):
    root = saved_tree(tgz, tmp_path)
    doc = advise(root)
    assert {"host", "assumed", "options", "recommendation", "caveats"} <= set(doc)
    assert [o["option"] for o in doc["options"]] == ["passthrough", "lazy", "strict"]
    for o in doc["options"]:
        assert OPTION_KEYS <= set(o) and ("throughput_gbps" in o or "iops" in o), o
        assert len(o["seeds"]["cpu_busy"]) == doc["noise"]["seeds"] == 3
    # Passthrough leaves all memory reachable (null), strict exposes nothing (0).
    assert doc["options"][0]["exposure_p99_us"] is None and doc["options"][2]["exposure_p99_us"] == 0
    rec = doc["recommendation"]
    assert "rule" in rec and rec["option"] == follows_the_rule(doc, 16_000), (rec, doc["options"])
    # Every value not read from the tree is listed with the key that changes it, and the value the run used.
    assert any(a.startswith("CPUs, the profile's: ") and a.endswith(" (platform.cpu.cores)") for a in doc["assumed"])
    text = format_advise(doc)
    assert "recommendation: " in text and "rule: " in text and "limited by" in text
    fits(text)
    name = tgz.name.removesuffix(".tar.gz")
    # Where the host runs now, and every other option against it.
    assert doc["host"]["guest"] is (tgz in SAVED) and doc["host"]["current"]["policy"] in (
        "strict", "lazy", "passthrough")
    assert sum(bool(o.get("now")) for o in doc["options"]) == 1 and f"now: {doc['host']['current']['policy']}" in text
    if name.startswith("no-iommu"):
        assert doc["caveats"][0].startswith("No IOMMU is visible") and doc["host"]["iommus"] == []
    if name.startswith("vtd-caching-mode"):
        # The kernel keeps a virtual VT-d strict: the lazy row runs strict, marked, and strict is recommended.
        lazy = doc["options"][1]
        assert lazy["policy"] == "strict" and "strict" in lazy["note"] and "lazy *" in text
        assert rec["option"] != "lazy"


# --- 1. A guest is a guest -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,profile", [("vtd-strict", "kvm-vtd-guest"), ("smmuv3-strict", "kvm-smmuv3-guest"),
                                          ("amdvi-strict", "kvm-amdvi-guest"), ("virtio-strict", "virtio-guest"),
                                          ("vtd-metal-strict", "vtd-server"),
                                          ("smmuv3-metal-strict", "smmuv3-server")])
def test_a_guest_is_said_to_be_one_and_priced_by_a_guest_profile(name, profile, tmp_path):
    # Issue 64 (item 1): every saved tree is a QEMU guest, and advise priced them as bare-metal servers
    # ("VT-d on bare metal") without saying it was a guest.
    doc = advise(tree(name, tmp_path))
    text = format_advise(doc)
    assert doc["set"]["platform.profile"] == f'"{profile}"'
    if "metal" in name:
        assert doc["host"]["guest"] is False and text.startswith("host: bare metal")
    else:
        assert doc["host"]["guest"] is True and text.startswith("host: a guest of QEMU")
        assert "on bare metal" not in " ".join(doc["from_host"])


def test_a_guest_without_an_iommu_is_told_its_vmm_must_offer_one(tmp_path):
    # Issue 64 (item 1): a QEMU guest without an IOMMU was modelled as a VT-d server and told to enable one "in
    # firmware, and intel_iommu=on".
    doc = advise(tree("no-iommu", tmp_path))
    first = doc["caveats"][0]
    assert "in firmware" not in first and "intel_iommu=on" not in first
    assert "this guest" in first and "VMM (QEMU)" in first and "-device virtio-iommu-pci" in first
    assert doc["set"]["platform.profile"] == '"virtio-guest"'
    metal = advise(tree("no-iommu-metal", tmp_path))
    assert "in firmware, and intel_iommu=on" in metal["caveats"][0]
    assert metal["set"]["platform.profile"] == '"vtd-server"'


# --- 2. The current mode first ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,policy,source", [("vtd-metal-strict", "strict", "iommu.strict=1"),
                                                ("vtd-metal-lazy", "lazy", "iommu.strict=0"),
                                                ("vtd-metal-passthrough", "passthrough", "iommu.passthrough=1"),
                                                ("vtd-caching-mode", "strict", "caching mode")])
def test_the_current_mode_is_read_and_each_option_stated_against_it(name, policy, source, tmp_path):
    # Issue 64 (item 2): the strict, lazy and passthrough trees of one host printed identical tables.
    doc = advise(tree(name, tmp_path))
    now = doc["host"]["current"]
    assert now["policy"] == policy and source in now["from"], now
    text = format_advise(doc)
    assert f"now: {policy}, from " in text and f"{policy} (now)" in text
    cur = next(o for o in doc["options"] if o["now"])
    for o in doc["options"]:
        if o is cur:
            assert "against_now" not in o
            continue
        c = o["against_now"]
        assert c["measure_pct"] == pytest.approx(100 * (o["throughput_gbps"] - cur["throughput_gbps"])
                                                 / cur["throughput_gbps"])
        assert f"  {o['option']}: " in text.split(f"against now ({policy}):")[1]
    if policy == "passthrough":
        lazy = doc["options"][1]["against_now"]
        assert lazy["measure_pct"] < -10 and lazy["exposure"].startswith("all memory -> 15.")


# --- 3. Every --set is used or refused ---------------------------------------------------------------------

@pytest.mark.parametrize("key", ["os.cmdline", "os.policy"])
def test_a_set_advise_would_override_is_refused_in_one_line(key, tmp_path):
    # Issue 64 (item 3): --set os.cmdline=… and os.policy=… were echoed and then ignored.
    p = cli("advise", "--root", str(tree("vtd-strict", tmp_path)), "--set", f"{key}=strict", check_rc=2)
    assert p.stderr.count("\n") == 1 and f"--set {key}: not used here" in p.stderr


def test_a_cpu_count_that_is_not_a_number_is_one_line(tmp_path):
    # Issue 64 (item 14): --set platform.cpu.cores=² passed str.isdigit() and int() raised a traceback.
    p = cli("advise", "--root", str(tree("vtd-metal-strict", tmp_path)), "--set", "platform.cpu.cores=\u00b2",
            check_rc=2)
    assert p.stderr.count("\n") == 1 and "platform.cpu.cores" in p.stderr and "Traceback" not in p.stderr


def test_cpus_beyond_the_nics_queues_are_said_to_stay_idle(tmp_path):
    # Issue 64 (item 3): 8 CPUs on a NIC with 4 queues; and the README's 32 CPUs past the model's 16 queues.
    root = tree("vtd-metal-strict", tmp_path)
    add_nic(root, "100000\n", rx=4, tx=4)
    doc = advise(root, "--set", "platform.cpu.cores=8")
    assert doc["set"]["workload.nic_rx.queues"] == "4"
    assert "4 of the 8 CPUs take no receive queue and stay idle (the NIC has 4 receive queues)" in doc["from_host"]
    doc = advise(tree("vtd-strict", tmp_path), "--max-exposure", "1ms", "--set", "platform.cpu.cores=32")
    assert doc["scenario"] == "guest-x86" and not any("stay idle" in t for t in doc["from_host"])


def test_assumed_shows_the_values_the_run_used(tmp_path):
    # Issue 64 (item 3): after --set of the line rate and the queues, `assumed:` still named the defaults.
    root = tree("vtd-metal-strict", tmp_path)
    doc = advise(root, "--set", "workload.nic_rx.line_rate_gbps=25", "--set", "workload.nic_rx.queues=4")
    assumed = " ".join(doc["assumed"])
    assert "line rate" not in assumed and "queues" not in assumed, assumed
    assert doc["set"]["workload.nic_rx.line_rate_gbps"] == "25" and doc["set"]["workload.nic_rx.queues"] == "4"
    assert "CPUs, the profile's: 16 (platform.cpu.cores)" in doc["assumed"]
    assert all(o["throughput_gbps"] <= 25 for o in doc["options"])
    doc = advise(root)
    assert "the NIC's line rate, the default scenario's (Gbps): 100 (workload.nic_rx.line_rate_gbps)" in doc["assumed"]


def test_a_tx_workload_sizes_to_the_transmit_queues(tmp_path):
    # Issue 64 (item 3): nic-tx took the NIC's receive queues, and said so.
    root = tree("vtd-metal-strict", tmp_path)
    add_nic(root, "100000\n", rx=8, tx=2)
    doc = advise(root, "--workload", "nic-tx", "--set", "platform.cpu.cores=8")
    assert doc["set"]["workload.nic_tx.queues"] == "2"
    said = " ".join(doc["from_host"] + doc["assumed"])
    assert "transmit queues" in said and "receive" not in said, said


# --- 4. The caveat's pointer works as written -----------------------------------------------------------------

@pytest.mark.parametrize("name,flags", [("vtd-caching-mode", "--caching-mode on"),
                                        ("amdvi-caching-mode", "--iommu amdvi --caching-mode on")])
def test_the_caveats_explain_command_gives_the_answer_it_promises(name, flags, tmp_path):
    # Issue 64 (item 4): the caveat printed `iommulab explain --cmdline '…'`, which answers for VT-d without
    # caching mode on Linux 6.12: lazy, not the strict the caveat promised.
    doc = advise(tree(name, tmp_path))
    caveat = next(c for c in doc["caveats"] if "says why" in c)
    command = caveat[caveat.index("(iommulab explain") + 1:caveat.rindex(" says why)")]
    assert flags in command
    args = shlex.split(command)[1:]
    out = json.loads(cli(*args, "--json", check_rc=0).stdout)
    pci = next(d for d in out["devices"] if d["device"] == "PCI device")
    assert pci["policy"] == "strict" and "virtualization" in pci["why"], pci


# --- 5 and 20. The rule weighs what it says ------------------------------------------------------------------

# Two CPUs (cpu.stack bound, not the line) with strict's invalidation nearly free: lazy and strict run within
# the runs' own noise of each other (inv_desc_ns 10: 0.75 of the tie) or just outside it (50 ns: 1.11 of it). A
# tie off by more than those ratios (one fixed number, say) gives the other verdict in one of them. (The gap is
# a few tenths of a percent, so any change to the model's costs moves these ratios: re-pick the two values.)
NEAR_TIE = ["--set", "platform.cpu.cores=2", "--set", "platform.iommu.vtd.inv_wait_ns=0"]


@pytest.mark.parametrize("desc_ns,inside,verdict", [(10, True, "strict"), (50, False, "lazy")])
def test_a_tie_is_the_runs_own_noise_just_inside_and_just_outside(desc_ns, inside, verdict, tmp_path):
    # Issue 64 (items 5 and 20): a 2 % rule passed with any tie value from 0.0002 to 0.44, and broke ties the
    # runs' ±4 % windows could not.
    doc = advise(tree("vtd-metal-strict", tmp_path), *NEAR_TIE, "--set", f"platform.iommu.vtd.inv_desc_ns={desc_ns}")
    lazy, strict = doc["options"][1], doc["options"][2]
    assert lazy["limited_by"] == strict["limited_by"] == "cpu.stack"
    gap = (lazy["throughput_gbps"] - strict["throughput_gbps"]) / lazy["throughput_gbps"]
    ratio = gap / doc["noise"]["tie"]
    assert (0.5 < ratio < 0.8) if inside else (1.05 < ratio < 1.3), ratio
    assert doc["recommendation"]["option"] == follows_the_rule(doc, 16_000) == verdict


def test_cpu_decides_between_options_the_line_rate_holds(tmp_path):
    # Issue 64 (item 5): at the line rate every option ties on throughput, and strict won on exposure whatever
    # its CPU cost; here it costs 3 % more CPU than lazy, past the runs' CPU noise.
    doc = advise(tree("smmuv3-metal-strict", tmp_path))
    assert all(o["limited_by"] == "line" for o in doc["options"])
    assert doc["recommendation"]["option"] == follows_the_rule(doc, 16_000) == "lazy"
    assert "costs less CPU" in doc["recommendation"]["why"] and "than strict" in doc["recommendation"]["why"]


@pytest.mark.parametrize("bound,flagged", [(None, "the kernel's own bound"), ("16.5ms", "tighter --max-exposure"),
                                           ("20ms", None)])
def test_an_exposure_just_under_the_bound_is_flagged(bound, flagged, tmp_path):
    # Issue 64 (item 5): lazy's 15.9 ms p99 qualified silently under a 16 ms bound.
    doc = advise(tree("vtd-metal-lazy", tmp_path), *(["--max-exposure", bound] if bound else []))
    flags = doc["recommendation"]["flags"]
    if flagged:
        assert len(flags) == 1 and flags[0].startswith("lazy: exposure p99 15.9 ms is ") and flagged in flags[0]
        assert "flagged: lazy" in format_advise(doc)
    else:
        assert flags == []


def test_a_swapped_scenario_is_said_in_the_verdict(tmp_path):
    # Issue 64 (item 5): on an AMD guest the verdict spoke of nic-rx while guest-x86's virtio-net ran.
    doc = advise(tree("amdvi-strict", tmp_path))
    rec = doc["recommendation"]
    assert doc["scenario"] == "guest-x86" and rec["swapped"].startswith("run on guest-x86's virtio-net, not default")
    assert rec["swapped"] in rec["why"]


# --- 6. Validation that bears on the verdict -------------------------------------------------------------

@pytest.mark.parametrize("name,target", [("smmuv3-metal-strict", "C1.strict_lazy_ratio"),
                                         ("vtd-metal-strict", "C3.strict_throughput_share")])
def test_the_profiles_missed_targets_are_said_next_to_the_verdict(name, target, tmp_path):
    # Issue 64 (item 6): advise said nothing of validate's misses on the very profile it ran.
    doc = advise(tree(name, tmp_path))
    got = {t["id"]: t for t in doc["recommendation"]["validation"]}
    want = json.loads(cli("validate", target, "--seeds", "1", "--json", check_rc=0).stdout)["targets"][0]
    assert got[target]["ok"] is want["ok"] is False and got[target]["model"] == want["model"]
    assert f"validation: {target} misses: model " in format_advise(doc)
    # A guest's profile has no targets of its own.
    assert advise(tree("vtd-strict", tmp_path))["recommendation"]["validation"] == []


# --- 17. --max-exposure's units ---------------------------------------------------------------------------

# The QEMU VT-d guest: lazy's p99 exposure 0.83 ms (its virtio-net's flush queue fills before the timer), strict
# none, passthrough excluded. Each bound is read in its unit or the verdict flips.
@pytest.mark.parametrize("bound,verdict", [("1ms", "lazy"), ("0.8ms", "strict"), ("900us", "lazy"),
                                           ("900µs", "lazy"), ("800us", "strict"), ("0.001s", "lazy"),
                                           ("0.0008s", "strict"), ("900", "lazy"), ("1", "strict"),
                                           ("0", "strict"), ("any", "passthrough")])
def test_max_exposure_units_give_their_verdicts(bound, verdict, tmp_path):
    # Issue 64 (item 17): `1ms` read as 1 µs passed every test.
    doc = advise(tree("vtd-strict", tmp_path), "--max-exposure", bound)
    assert 800 < doc["options"][1]["exposure_p99_us"] < 900
    assert doc["recommendation"]["option"] == verdict


def test_the_readmes_example_gives_lazy_on_a_guest(tmp_path):
    # README: iommulab advise --root host-tree --max-exposure 1ms --set platform.cpu.cores=32
    doc = advise(tree("vtd-strict", tmp_path), "--max-exposure", "1ms", "--set", "platform.cpu.cores=32")
    assert doc["recommendation"]["option"] == "lazy" and "within 1000 µs (--max-exposure)" in doc["recommendation"]["rule"]
    p = cli("advise", "--root", str(tmp_path / "vtd-strict"), "--max-exposure", "soon", check_rc=2)
    assert p.stderr.count("\n") == 1 and "--max-exposure 'soon'" in p.stderr


# --- 16. An architecture the IOMMU cannot be on ---------------------------------------------------------------

@pytest.mark.parametrize("name,arch,said", [
    ("vtd-metal-strict", "aarch64\n", "architecture arm64: Intel VT-d cannot be on arm64; runs as x86_64"),
    ("no-iommu-metal", "ppc64le\n", "architecture ppc64le: the model has no IOMMU for ppc64le; runs as x86_64")])
def test_an_architecture_the_iommu_cannot_be_on_is_said_and_not_run_as_is(name, arch, said, tmp_path):
    # Issue 64 (item 16): VT-d in an arm64 tree ran as x86 without a note.
    root = tree(name, tmp_path)
    (root / "proc/sys/kernel/arch").write_text(arch)
    doc = advise(root)
    assert said in doc["from_host"] and doc["set"]["os.arch"] == '"x86_64"'
    if name.startswith("vtd"):
        assert doc["host"]["current"] == {"policy": "strict", "from": "iommu.strict=1 (IOMMU groups: DMA)"}
        assert any("Intel VT-d cannot be on arm64" in c for c in doc["caveats"])


# --- the host's hardware and other workloads -------------------------------------------------------------

def test_nvme_is_ranked_by_iops_and_rr_by_latency(tmp_path):
    root = tree("smmuv3-metal-strict", tmp_path)
    nvme = advise(root, "--workload", "nvme")
    assert nvme["measure"] == "iops" and all(o["iops"] > 0 for o in nvme["options"])
    assert nvme["recommendation"]["option"] == follows_the_rule(nvme, 16_000, "iops")
    rr = advise(root, "--workload", "rr", "--set", "platform.cpu.cores=8")
    assert rr["measure"] == "latency_p99_us"
    assert rr["recommendation"]["option"] == follows_the_rule(rr, 16_000, "latency_p99_us", higher=False)


def test_the_hosts_cpus_nics_and_drives_go_into_the_scenario(tmp_path):
    """A tree with what a real server shows: 8 CPUs, a 25 Gbps NIC with 4 queues, two NVMe controllers, a TDX
    guest's kernel log."""
    root = tree("vtd-metal-lazy", tmp_path)
    for i in range(8):
        (root / f"sys/devices/system/cpu/cpu{i}").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\n"
                                       "flags\t\t: fpu hypervisor tdx_guest\n")
    add_nic(root, "25000\n", rx=4, tx=1)
    (root / "sys/class/net/lo").mkdir()
    for n in ("nvme0", "nvme1"):
        (root / "sys/class/nvme" / n).mkdir(parents=True)
    doc = advise(root)
    hw = doc["host"]
    assert hw["cpus"] == 8 and "Gold 6338" in hw["cpu_model"] and hw["confidential"] == "Intel TDX"
    assert hw["nics"] == [{"name": "eth0", "device": "0000:00:03.0", "speed_gbps": 25, "rx_queues": 4,
                           "tx_queues": 1}]
    assert hw["nvme"] == ["nvme0", "nvme1"] and hw["guest"] is True
    s = doc["set"]
    assert s["platform.cpu.cores"] == "8" and s["platform.profile"] == '"kvm-vtd-guest"'
    # A guest's NIC behind QEMU's VT-d without caching mode is its virtio-net, at the NIC's speed.
    assert doc["scenario"] == "guest-x86" and s["workload.virtio_net.line_rate_gbps"] == "25.0"
    # A TDX guest's DMA bounces whatever the IOMMU options say: advise sizes its pool instead (issue 68).
    assert doc["bounce"]["coco"] == "tdx" and doc["recommendation"]["cmdline"].startswith("swiotlb=")
    # Its NVMe drives would be VFIO devices, which QEMU's VT-d without caching mode cannot take: said in a line.
    p = cli("advise", "--root", str(root), "--workload", "nvme", check_rc=2)
    assert p.stderr.count("\n") == 1 and "platform.iommu.vtd.caching_mode=true" in p.stderr
    (root / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu\n")
    assert advise(root, "--workload", "nvme")["set"]["workload.nvme.drives"] == "2"


def test_this_machine_gets_a_verdict():
    p = cli("advise", "--no-ranges", check_rc=0)
    assert "recommendation: " in p.stdout and "rule: " in p.stdout and "now: " in p.stdout


def test_a_scenarios_own_workload_is_sized_to_the_host(tmp_path):
    # c1's 8 flows on a 4-vCPU virtio-iommu guest: one queue and flow per CPU, as for the built-in workloads.
    doc = advise(tree("virtio-strict", tmp_path), "--workload", "c1")
    assert doc["scenario"] == "c1" and doc["set"]["workload.nic_rx.queues"] == "4"
    assert any("the workload of c1" in t for t in doc["from_host"])
