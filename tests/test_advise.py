"""`iommulab advise`: a verdict for every tree a real guest saved, the host's hardware read into the scenario, and
the recommendation following its stated rule from the runs' own figures."""

import json
import math

import pytest
from conftest import cli
from test_inspect import SAVED, saved_tree

OPTION_KEYS = {"option", "policy", "cmdline", "cpu_busy", "exposure_p99_us", "limited_by", "reach", "protected"}


def advise(root, *args):
    p = cli("advise", "--root", str(root), "--json", *args, check_rc=0)
    return json.loads(p.stdout)


def follows_the_rule(doc, bound_us, key="throughput_gbps", higher=True):
    """The recommendation, recomputed from the options: the best measure within the exposure bound, ties (2 %)
    to the one exposing least."""
    exposed = lambda o: math.inf if o["exposure_p99_us"] is None else o["exposure_p99_us"]
    ok = [o for o in doc["options"] if exposed(o) <= bound_us]
    if not ok:
        return None
    val = (lambda o: o[key]) if higher else (lambda o: -o[key])
    best = max(val(o) for o in ok)
    ties = [o for o in ok if val(o) >= best - abs(best) * 0.02]
    return min(ties, key=lambda o: (exposed(o), bool(o.get("note"))))["option"]


@pytest.mark.parametrize("tgz", SAVED, ids=[p.name.split(".")[0] for p in SAVED])
def test_every_saved_tree_gets_a_verdict(tgz, tmp_path):
    root = saved_tree(tgz, tmp_path)
    doc = advise(root)
    assert {"host", "assumed", "options", "recommendation", "caveats"} <= set(doc)
    assert [o["option"] for o in doc["options"]] == ["passthrough", "lazy", "strict"]
    for o in doc["options"]:
        assert OPTION_KEYS <= set(o) and ("throughput_gbps" in o or "iops" in o), o
    # Passthrough leaves all memory reachable (null), strict exposes nothing (0).
    assert doc["options"][0]["exposure_p99_us"] is None and doc["options"][2]["exposure_p99_us"] == 0
    rec = doc["recommendation"]
    assert "rule" in rec and rec["option"] == follows_the_rule(doc, 16_000), (rec, doc["options"])
    # Every value not read from the tree is listed with the key that changes it.
    assert any("platform.cpu.cores" in a for a in doc["assumed"])
    text = cli("advise", "--root", str(root), check_rc=0).stdout
    assert "recommendation: " in text and "rule: " in text and "limited by" in text
    name = tgz.name.removesuffix(".tar.gz")
    if name == "no-iommu":
        assert doc["caveats"][0].startswith("No IOMMU is visible") and doc["host"]["iommus"] == []
    if name.startswith("vtd-caching-mode"):
        # The kernel keeps a virtual VT-d strict: the lazy row runs strict, marked, and strict is recommended.
        lazy = doc["options"][1]
        assert lazy["policy"] == "strict" and "strict" in lazy["note"] and "lazy *" in text
        assert rec["option"] != "lazy"


def test_the_exposure_bound_moves_the_recommendation(tmp_path):
    root = saved_tree(SAVED[0].parent / "vtd-strict.tar.gz", tmp_path)
    assert advise(root, "--max-exposure", "0")["recommendation"]["option"] == "strict"
    anything = advise(root, "--max-exposure", "any")
    assert anything["recommendation"]["option"] == follows_the_rule(anything, math.inf) == "passthrough"
    p = cli("advise", "--root", str(root), "--max-exposure", "soon", check_rc=2)
    assert p.stderr.count("\n") == 1 and "--max-exposure 'soon'" in p.stderr


def test_nvme_is_ranked_by_iops_and_rr_by_latency(tmp_path):
    root = saved_tree(SAVED[0].parent / "smmuv3-lazy.tar.gz", tmp_path)
    nvme = advise(root, "--workload", "nvme")
    assert nvme["measure"] == "iops" and all(o["iops"] > 0 for o in nvme["options"])
    assert nvme["recommendation"]["option"] == follows_the_rule(nvme, 16_000, "iops")
    rr = advise(root, "--workload", "rr", "--set", "platform.cpu.cores=8")
    assert rr["measure"] == "latency_p99_us"
    assert rr["recommendation"]["option"] == follows_the_rule(rr, 16_000, "latency_p99_us", higher=False)


def test_the_hosts_cpus_nics_and_drives_go_into_the_scenario(tmp_path):
    """A tree with what a real server shows: 8 CPUs, a 25 Gbps NIC with 4 queues, two NVMe controllers, a TDX
    guest's kernel log."""
    root = saved_tree(SAVED[0].parent / "vtd-lazy.tar.gz", tmp_path)
    for i in range(8):
        (root / f"sys/devices/system/cpu/cpu{i}").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\n"
                                       "flags\t\t: fpu hypervisor tdx_guest\n")
    net = root / "sys/class/net/eth0"
    (net / "queues").mkdir(parents=True)
    for q in ("rx-0", "rx-1", "rx-2", "rx-3", "tx-0"):
        (net / "queues" / q).mkdir()
    (net / "speed").write_text("25000\n")
    (net / "device").symlink_to("../../../devices/pci0000:00/0000:00:03.0")
    (root / "sys/class/net/lo").mkdir()
    for n in ("nvme0", "nvme1"):
        (root / "sys/class/nvme" / n).mkdir(parents=True)
    doc = advise(root)
    hw = doc["host"]
    assert hw["cpus"] == 8 and "Gold 6338" in hw["cpu_model"] and hw["confidential"] == "Intel TDX"
    assert hw["nics"] == [{"name": "eth0", "device": "0000:00:03.0", "speed_gbps": 25, "rx_queues": 4}]
    assert hw["nvme"] == ["nvme0", "nvme1"]
    s = doc["set"]
    assert s["platform.cpu.cores"] == "8" and s["workload.nic_rx.line_rate_gbps"] == "25.0"
    assert s["workload.nic_rx.queues"] == "4" and not any("cpu.cores" in a for a in doc["assumed"])
    assert any("swiotlb" in c for c in doc["caveats"])
    assert all(o["throughput_gbps"] <= 25 for o in doc["options"])
    assert advise(root, "--workload", "nvme")["set"]["workload.nvme.drives"] == "2"


def test_this_machine_gets_a_verdict():
    p = cli("advise", check_rc=0)
    assert "recommendation: " in p.stdout and "rule: " in p.stdout


def test_a_scenarios_own_workload_is_sized_to_the_host(tmp_path):
    # c1's 8 flows on a 4-vCPU virtio-iommu guest: one queue and flow per CPU, as for the built-in workloads.
    root = saved_tree(SAVED[0].parent / "virtio-strict.tar.gz", tmp_path)
    doc = advise(root, "--workload", "c1")
    assert doc["scenario"] == "c1" and doc["set"]["workload.nic_rx.queues"] == "4"
    assert any("the workload of c1" in t for t in doc["from_host"])
