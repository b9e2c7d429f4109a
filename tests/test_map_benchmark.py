"""The kernel's DMA map benchmark (kernel/dma/map_benchmark.c) as a workload: what the tool prints, what each
timed call holds, and the micro-targets it is checked against."""

import json
import re

import pytest

import iommulab
from conftest import cli

MB = "workload.dma_map_benchmark"


def one(**keys):
    """One run of the built-in map-benchmark scenario (1 thread, 4 KiB unless `keys` say otherwise)."""
    base = {f"{MB}.threads": 1, f"{MB}.granule": 1}
    return iommulab.run("map-benchmark", **{**base, **keys}).to_dict()


def test_the_run_prints_the_tools_lines_for_every_run():
    out = cli("run", "map-benchmark", check_rc=0).stdout
    heads = re.findall(r"dma mapping benchmark: threads:(\d+) seconds:0.002 node:-1 dir:BIDIRECTIONAL "
                       r"granule: (\d+)\n", out)
    assert heads == [(t, g) for t in ("1", "8", "16", "32", "64") for g in ("1", "256")]
    assert len(re.findall(r"average map latency\(us\):\d+\.\d standard deviation:\d+\.\d\n", out)) == 10
    assert len(re.findall(r"average unmap latency\(us\):\d+\.\d standard deviation:\d+\.\d\n", out)) == 10


def test_the_json_has_the_tools_figures_in_whole_tenths_and_its_options():
    r = json.loads(cli("run", "map-benchmark", "--set", f"{MB}.threads=4", "--set", f"{MB}.granule=16",
                       "--set", f"{MB}.dma_dir=to_device", "--json", check_rc=0).stdout)
    for key in ("map_latency_us", "unmap_latency_us"):
        assert set(r[key]) == {"avg", "stddev"}
        assert all(round(v * 10) == pytest.approx(v * 10) for v in r[key].values()), r[key]
    o = r["map_benchmark"]
    assert (o["threads"], o["granule"], o["dma_dir"], o["node"]) == (4, 16, "TO_DEVICE", -1)
    assert o["loops"] > 100 and o["map_failures"] == 0
    # Every loop maps and unmaps once: the counts agree with the loop rate.
    assert o["loops_per_sec_per_thread"] == pytest.approx(o["loops"] / o["seconds"] / 4, rel=1e-4)
    assert r["syncs"] == pytest.approx(o["loops"], abs=4 * 2)


def test_a_strict_unmap_holds_one_tlbi_per_page_and_a_map_none():
    # The SMMU consumes the unmap's TLBIs one per page (no range invalidation on this SMMU): doubling the
    # per-command time nearly doubles a 1 MiB unmap and leaves the map alone.
    slow = {"platform.iommu.smmuv3.cmd_ns": 144}
    big, big_slow = one(**{f"{MB}.granule": 256}), one(**{f"{MB}.granule": 256}, **slow)
    assert big["invalidations"]["tlbi_nh_va"] == 256 * big["map_benchmark"]["loops"]
    assert big_slow["unmap_latency_us"]["avg"] / big["unmap_latency_us"]["avg"] == pytest.approx(1.9, abs=0.1)
    assert big_slow["map_latency_us"] == big["map_latency_us"]
    # With range invalidation the same unmap is a few commands.
    ril = one(**{f"{MB}.granule": 256, "platform.iommu.smmuv3.ril": True})
    assert ril["unmap_latency_us"]["avg"] < big["unmap_latency_us"]["avg"] / 10


def test_lazy_leaves_the_sync_to_the_flush_queue_and_passthrough_maps_nothing():
    strict, lazy, pt = (one(**{"os.policy": p}) for p in ("strict", "lazy", "passthrough"))
    assert strict["syncs"] > 1000 and lazy["syncs"] < strict["syncs"] / 50
    assert lazy["unmap_latency_us"]["avg"] < strict["unmap_latency_us"]["avg"] / 2
    assert pt["invalidations"]["total"] == 0
    assert pt["map_latency_us"]["avg"] <= lazy["map_latency_us"]["avg"]


def test_the_fill_and_the_delay_are_outside_the_timed_calls():
    # The buffer fill (all but from_device) and ndelay() between map and unmap take the thread's time, not
    # the calls': the loop rate falls, the latencies stay.
    g = {f"{MB}.granule": 256}
    fill, nofill = one(**g), one(**g, **{f"{MB}.dma_dir": "from_device"})
    delayed = one(**g, **{f"{MB}.dma_dir": "from_device", f"{MB}.dma_trans_ns": 100_000})
    rate = lambda r: r["map_benchmark"]["loops_per_sec_per_thread"]
    assert rate(nofill) > rate(fill) * 1.5 and rate(delayed) < rate(nofill) * 0.3
    for r in (fill, delayed):
        assert r["unmap_latency_us"] == nofill["unmap_latency_us"]
        assert r["map_latency_us"] == nofill["map_latency_us"]


def test_more_threads_than_the_smmu_serves_wait_on_its_queue():
    # Eight threads each unmap 1 MiB: 2048 TLBIs between a thread's command and its CMD_SYNC.
    one_t = one(**{f"{MB}.granule": 256})
    eight = one(**{f"{MB}.granule": 256, f"{MB}.threads": 8})
    assert eight["unmap_latency_us"]["avg"] > 4 * one_t["unmap_latency_us"]["avg"]
    assert eight["cpu_inv_wait_share"] > one_t["cpu_inv_wait_share"]


def test_a_dma_mask_too_small_for_the_buffers_fails_maps_as_the_kernel_does():
    # -b 20: 1 MiB of IOVA space below the mask; two threads of 1 MiB buffers cannot both map.
    r = one(**{f"{MB}.granule": 256, f"{MB}.threads": 2, f"{MB}.dma_bits": 20})
    assert r["map_benchmark"]["map_failures"] >= 1
    out = cli("run", "map-benchmark", "--set", f"{MB}.granule=256", "--set", f"{MB}.threads=2", "--set",
              f"{MB}.dma_bits=20", check_rc=0).stdout
    assert "ioctl: Cannot allocate memory" in out and "average map latency" not in out
    ok = one(**{f"{MB}.granule": 256, f"{MB}.threads": 2})
    assert ok["map_benchmark"]["map_failures"] == 0


@pytest.mark.parametrize("key, value, want", [
    ("threads", "0", "workload.dma_map_benchmark.threads"),
    ("threads", "97", "workload.dma_map_benchmark.threads"),
    ("node", "4", "workload.dma_map_benchmark.node"),
    ("granule", "1025", "workload.dma_map_benchmark.granule"),
    ("seconds", "61", "workload.dma_map_benchmark.seconds"),
    ("dma_bits", "12", "workload.dma_map_benchmark.dma_bits"),
    ("dma_trans_ns", "20000000", "workload.dma_map_benchmark.dma_trans_ns"),
    ("dma_dir", "sideways", "dma_dir"),
])
def test_bad_options_get_one_line_naming_the_key(key, value, want):
    p = cli("run", "map-benchmark", "--set", f"{MB}.{key}={value}")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_threads_on_a_node_run_on_its_cpus():
    # -n 1: the node's 24 CPUs; 25 threads do not fit on it.
    r = one(**{f"{MB}.node": 1, f"{MB}.threads": 24})
    assert r["map_benchmark"]["node"] == 1 and r["map_benchmark"]["loops"] > 0
    p = cli("run", "map-benchmark", "--set", f"{MB}.node=1", "--set", f"{MB}.threads=25")
    assert p.returncode == 2 and "the node's CPUs" in p.stderr


def test_the_micro_targets_run_on_the_benchmark():
    rows = {r["id"]: r for r in json.loads(cli("validate", "M1.one_thread_4k_map_us", "M2.one_thread_1m_unmap_us",
                                               "--json", "--seeds", "1", check_rc=0).stdout)["targets"]}
    assert rows["M1.one_thread_4k_map_us"]["model"] == pytest.approx(0.1)
    assert rows["M2.one_thread_1m_unmap_us"]["ok"]
