"""What binds a run (`limited_by`), where its CPUs' time went and its warnings: each value arises in a scenario
built to be bound by it, and the resource it names is the one the model's accounting shows saturated."""

import pytest

from iommulab.api import load, run_variants

MAP = "workload.dma_map_benchmark"
# The map benchmark without its buffer fill: nothing but the DMA API runs on its CPUs.
BARE_MAP = {f"{MAP}.dma_dir": "from_device", "compare": {}}


def bound(scenario, label=None, **sets):
    """The run of `scenario` labelled `label` (the only run when None), with `sets` applied."""
    runs = run_variants(load(scenario, {k.replace("__", "."): v for k, v in sets.items()}))
    if label is None:
        assert len(runs) == 1, [r.label for r in runs]
        return runs[0]
    (r,) = [r for r in runs if r.label == label]
    return r


CASES = [
    # limited_by, utilisation key that must be saturated, scenario, label, sets
    ("line", "line", "default", "page_pool=false policy=passthrough", {}),
    ("link", "link", "default", "page_pool=false policy=passthrough", {"platform.pcie.link_gbps": 60}),
    ("iommu.translation", "translation_slots", "default", "page_pool=true policy=lazy", {}),
    ("lock:vt-d domain cache_lock", "lock", "default", "page_pool=false policy=strict", {}),
    ("iommu.queue", "iommu_queue", "map-benchmark", "threads=8 granule=1", {}),
    ("emulator", "emulator", "nested", "16vcpu trapped", {}),
    ("device_thread", "device_thread", "guest-x86", "lazy rx vhost=on netperf", {}),
    # QEMU's virtio-net and the vCPUs' trapped invalidations, neither alone filling the BQL they share.
    ("bql", "bql", "guest-x86", "strict netperf",
     {"workload.virtio_net.direction": "tx", "workload.virtio_net.vhost": False,
      "workload.virtio_net.line_rate_gbps": 100, "platform.kvm.mmio_exit_ns": 500,
      "platform.iommu.vtd.inv_desc_ns": 3000}),
    ("cpu.dma_api", "cpu", "map-benchmark", "threads=1 granule=1", {}),
    ("cpu.inv_wait", "cpu", "guest-x86", "virtio-iommu rx vhost=off netperf", {}),
    # An SMMU that consumes a TLBI and its CMD_SYNC faster than the CPUs can move the queue's lines between
    # them: 32 CPUs race for llq, whose line saturates with the shared lock's and valid_map's.
    ("cpu.cmdq_insert", "cpu", "map-benchmark", None,
     {**BARE_MAP, f"{MAP}.threads": 32, f"{MAP}.granule": 1, "platform.iommu.smmuv3.cmd_ns": 5,
      "platform.iommu.smmuv3.sync_ns": 10, "platform.iommu.smmuv3.sync_signal_ns": 0}),
    ("cpu.lock_spin", "cpu", "map-benchmark", None,
     {**BARE_MAP, "os.policy": "lazy", f"{MAP}.threads": 24, f"{MAP}.granule": 1}),
    ("lock:iova_rbtree_lock", "lock", "map-benchmark", None,
     {**BARE_MAP, "os.policy": "lazy", f"{MAP}.threads": 32, f"{MAP}.granule": 1}),
    ("cpu.stack", "cpu", "nvme", "passthrough", {}),
    ("senders", None, "default", "page_pool=true policy=passthrough",
     {"workload.nic_rx.sender": "dctcp", "workload.nic_rx.rtt_us": 100, "workload.nic_rx.rcvbuf_bytes": 65536}),
    ("offered_load", None, "rr", "lazy", {}),
    ("queue_depth", None, "nvme", "passthrough", {"workload.nvme.iodepth": 1}),
]


@pytest.mark.parametrize("want,resource,scenario,label,sets", CASES, ids=[c[0] for c in CASES])
def test_each_bound_arises_where_built_for(want, resource, scenario, label, sets):
    r = bound(scenario, label, **sets)
    assert r.limited_by == want, (r.limited_by, r.utilisation, r.cpu_breakdown)
    u = r.utilisation
    if resource:
        assert u[resource] >= (0.95 if resource in ("line", "link") else 0.9), u
    else:
        # The workload's own bound: nothing the model accounts is saturated.
        assert max(v for k, v in u.items() if k != "lock_name") < 0.9, u
    if want.startswith("cpu."):
        b = r.cpu_breakdown
        assert max(b["dma_api"], b["cmdq_insert"], b["inv_wait"], b["lock_spin"], b["stack"]) == b[want[4:]], b
    if want.startswith("lock:"):
        assert u["lock_name"] == want[5:]


def test_cpu_breakdown_sums_to_one_and_matches_cpu_busy():
    for r in run_variants(load("default")):
        b = r.cpu_breakdown
        assert sum(b.values()) == pytest.approx(1.0, abs=1e-4), b
        assert 1 - b["idle"] == pytest.approx(r.cpu_busy, abs=1e-4)
        # Under passthrough the DMA API waits for nothing.
        if r.policy == "passthrough":
            assert b["inv_wait"] == 0


def test_busy_shares_never_exceed_one():
    for r in run_variants(load("map-benchmark")):
        assert all(0 <= v <= 1 for k, v in r.utilisation.items() if k != "lock_name"), r.utilisation
        assert all(0 <= c["busy_share"] <= 1 for c in r.contention)


def test_a_short_window_warns_and_the_default_does_not():
    (long,) = [r for r in run_variants(load("default", {"os.policy": "lazy", "compare": {}}))]
    assert long.warnings == []
    (short,) = run_variants(load("default", {"os.policy": "lazy", "compare": {}, "run.duration_ms": 2}))
    assert any("per CPU" in w for w in short.warnings), short.warnings
    assert any("flush-queue timer" in w and "run.duration_ms" in w for w in short.warnings), short.warnings


# --- issue 64 item 13: every count a user gives is bounded, and refused in one line before any run ---------------

import iommulab  # noqa: E402
from conftest import cli, one_line_error  # noqa: E402
from iommulab import sweeps  # noqa: E402
from iommulab._core import ScenarioError  # noqa: E402


def test_validate_and_calibrate_seeds_past_the_cap_are_one_line():
    # --seeds 1000000 was taken: every seed's runs kept in memory, which climbed without a word.
    from iommulab.validate import MAX_SEEDS, Runner

    err = one_line_error(cli("validate", "NOSUCH", "--seeds", "1000000"))
    assert "--seeds" in err and f"from 1 to {MAX_SEEDS}" in err, err
    err = one_line_error(cli("calibrate", "--list", "--seeds", str(MAX_SEEDS + 1)))
    assert "--seeds" in err and f"from 1 to {MAX_SEEDS}" in err, err
    for bad in (MAX_SEEDS + 1, 0, True):
        with pytest.raises(ScenarioError, match="seeds"):
            Runner(seeds=bad)
    assert Runner(seeds=MAX_SEEDS).seeds == MAX_SEEDS


def test_a_sweep_whose_compare_variants_pass_the_cap_is_refused_before_a_run(tmp_path):
    # A million points of the default scenario are six million runs (its [compare] has six variants): they were
    # accepted, the dataset made, and the runs begun, with nothing said for most of a minute.
    doc = {"scenario": "default", "set": {"run.warmup_ms": 0.01},
           "axes": {"run.seed": {"from": 1, "to": 1000, "step": 1},
                    "run.duration_ms": {"from": 0.01, "to": 10.0, "step": 0.01}}}

    def progress(*_):
        raise AssertionError("a run started")

    with pytest.raises(ScenarioError, match=f"6000000 runs; expected at most {sweeps.MAX_POINTS}"):
        iommulab.sweep(doc, out=tmp_path / "o", progress=progress)
    assert not (tmp_path / "o").exists()


def test_sensitivity_factors_and_calibrate_ranges_must_be_finite_and_bounded():
    # --factor 1e308 scaled an integer constant to infinity (OverflowError); --range 0:inf bisected from
    # infinity (OverflowError).
    for f in ("1e308", "1e-308", "inf", "nan"):
        err = one_line_error(cli("sensitivity", "--factor", f))
        assert "--factor" in err and "1e+06" in err, err
    for r in ("0:inf", "-inf:5", "nan:5"):
        err = one_line_error(cli("calibrate", "--param", "nosuch", f"--range={r}"))
        assert "--range" in err and "finite" in err, err
    # A finite range past what TOML's 64-bit integers hold, for an integer constant: said before any probe runs.
    err = one_line_error(cli("calibrate", "--param", "iommu.smmuv3.cmd_ns", "--range", "0:1e300", "--seeds", "1"))
    assert "--range" in err and "whole number" in err and len(err) < 200, err
    assert sensitivity_scaled_past_a_double_is_invalid()


def sensitivity_scaled_past_a_double_is_invalid() -> bool:
    """A profile constant near a double's largest, scaled by an accepted factor, is not a number: refused as
    `scaled` is, never a traceback."""
    from iommulab.sensitivity import scaled

    with pytest.raises(OverflowError):
        scaled(1e305, 1e6)
    with pytest.raises(OverflowError):
        scaled(10 ** 305, 1e6)
    return scaled(3, 2.0) == 6 and scaled([1.5], 2.0) == [3.0]
