"""The fio/NVMe workload: one dma_map_sg per I/O at submission, one unmap at completion, drives in one domain."""

import pytest

import iommulab
from conftest import cli

BASE = {"workload.nvme.jobs": 1, "workload.nvme.iodepth": 1, "workload.nvme.drives": 1}


def test_one_io_in_flight_runs_at_the_latency_of_its_path():
    r = iommulab.run("nvme", **BASE, **{"os.policy": "passthrough"})
    # Submission 1.5 µs + media 80 µs + one 4 KiB transfer + completion 1 µs (the scenario's estimates).
    per_io_ns = 1e9 / r.packets_per_sec
    assert 82_500 < per_io_ns < 84_500, per_io_ns


def test_the_drives_data_accesses_feed_dma_locality_when_translated():
    # Each I/O's pages are read or written by the drive through the IOMMU: dma_locality measures them.
    strict = iommulab.run("nvme", **{"os.policy": "strict"}).to_dict()["dma_locality"]
    assert strict["accesses"] > 1000
    off = iommulab.run("nvme", **{"os.policy": "passthrough"}).to_dict()["dma_locality"]
    assert off["accesses"] == 0


@pytest.mark.parametrize("bs_kb", [4, 16, 128])
def test_strict_invalidates_each_io_once_over_its_whole_buffer(bs_kb):
    r = iommulab.run("nvme", **{"os.policy": "strict", "workload.nvme.bs_kb": bs_kb}).to_dict()
    inv = r["invalidations"]
    assert inv["total"] == inv["psi"] > 0
    # One PSI per I/O covering bs_kb / 4 pages (a power of two here: one aligned mask).
    assert r["inv_per_page"] == pytest.approx(4 / bs_kb, rel=0.02)


def test_small_ios_are_cpu_bound_and_strict_costs_iops_large_ones_are_drive_bound():
    small = {p: iommulab.run("nvme", **{"os.policy": p}) for p in ("passthrough", "lazy", "strict")}
    assert small["strict"].throughput_gbps < small["lazy"].throughput_gbps < small["passthrough"].throughput_gbps
    assert small["strict"].cpu_inv_wait_share > 0.1
    big = {p: iommulab.run("nvme", **{"os.policy": p, "workload.nvme.bs_kb": 128, "workload.nvme.iodepth": 8})
           for p in ("passthrough", "strict")}
    assert big["strict"].throughput_gbps == pytest.approx(big["passthrough"].throughput_gbps, rel=0.02)
    assert big["passthrough"].throughput_gbps == pytest.approx(0.95 * big["passthrough"].line_rate_gbps, rel=0.06)
    assert big["strict"].cpu_busy > big["passthrough"].cpu_busy


def test_more_io_in_flight_raises_iops_until_the_cpu_saturates():
    iops = [iommulab.run("nvme", **{**BASE, "os.policy": "lazy", "workload.nvme.iodepth": d}).packets_per_sec
            for d in (1, 4, 16)]
    assert iops[0] * 3 < iops[1] < iops[2]


@pytest.mark.parametrize("sets, what", [
    (["workload.nvme.jobs=99"], "workload.nvme.jobs"),
    (["workload.nvme.bs_kb=6"], "workload.nvme.bs_kb"),
    (["workload.nvme.rw=\"trim\""], "workload.nvme.rw"),
])
def test_bad_nvme_keys_get_one_line(sets, what):
    p = cli("run", "nvme", *sum((["--set", s] for s in sets), []))
    assert p.returncode == 2, (p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "\n" not in err and "Traceback" not in p.stderr and what in err, err


def test_one_workload_per_scenario(tmp_path):
    nvme = cli("scenarios", "nvme", check_rc=0).stdout
    nic = cli("scenarios", "default", check_rc=0).stdout
    both = nvme.split("[compare]")[0] + "[workload.nic_rx]" + nic.split("[workload.nic_rx]")[1].split("[compare]")[0]
    f = tmp_path / "both.toml"
    f.write_text(both)
    p = cli("run", str(f))
    assert p.returncode == 2 and "exactly one workload section" in p.stderr and "\n" not in p.stderr.strip(), p.stderr
