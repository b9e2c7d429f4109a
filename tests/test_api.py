"""The Python API: iommulab.run(), results, data frames."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import iommulab
from conftest import MINIMAL

SHORT = {"run.duration_ms": 8, "run.warmup_ms": 4}


def test_default_returns_a_result_set_matching_cli_json():
    res = iommulab.run(**SHORT)
    assert isinstance(res, iommulab.ResultSet)
    assert len(res) == 6
    d = res.to_dict()
    assert set(d) == {"runs"} and len(d["runs"]) == 6
    strict = res["page_pool=false policy=strict"]
    assert strict.policy == "strict" and strict.invalidations["psi"] > 0
    assert json.loads(json.dumps(d)) == d


def test_single_run_and_overrides_by_dotted_or_double_underscore():
    r = iommulab.run(**SHORT, **{"os.policy": "strict"}, workload__nic_rx__page_pool=False)
    assert isinstance(r, iommulab.RunResult)
    assert r.policy == "strict" and r.label == "strict"
    assert r.to_dict()["policy"] == "strict"
    with pytest.raises(AttributeError):
        r.no_such_field


def test_scenario_from_file_and_from_dict(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text(MINIMAL)
    a = iommulab.run(f)
    b = iommulab.run(str(f))
    assert a.to_dict() == b.to_dict()
    sc = {
        "name": "mini",
        "run": {"duration_ms": 5, "warmup_ms": 3, "seed": 7},
        "platform": {"profile": "vtd-server"},
        "os": {"policy": "strict"},
        "workload": {"nic_rx": {"line_rate_gbps": 100, "queues": 4, "flows": 4, "mtu": 4000, "ring_size": 512,
                                "page_pool": False}},
    }
    c = iommulab.run(sc)
    assert c.to_dict() == a.to_dict()


def test_errors_raise_scenario_error_with_one_line():
    with pytest.raises(iommulab.ScenarioError) as e:
        iommulab.run(**{"workload.nic_rx.queues": "many"})
    assert "\n" not in str(e.value) and "workload.nic_rx.queues" in str(e.value)
    with pytest.raises(iommulab.ScenarioError):
        iommulab.run({"run": {"duration_ms": 1}})
    with pytest.raises(iommulab.ScenarioError):
        iommulab.run("/nonexistent.toml")


def test_dataframe_views():
    res = iommulab.run(**SHORT)
    pdf = res.to_pandas()
    assert len(pdf) == 6
    assert {"label", "policy", "throughput_gbps", "invalidations.psi", "inv_per_page"} <= set(pdf.columns)
    pl = res.to_polars()
    assert pl.shape[0] == 6 and "invalidations.total" in pl.columns
    one = res[0].to_pandas()
    assert len(one) == 1


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_callback_reaches_completion(jobs):
    seen = []
    iommulab.run(**SHORT, **{"os.policy": "lazy"}, jobs=jobs, progress=lambda i, n, label, f: seen.append((i, n, f)))
    # The default scenario with the policy pinned compares page_pool off and on: two runs, each reported
    # from its start to its end; one after the other on one thread, interleaved on two.
    if jobs == 1:
        assert [i for i, _, _ in seen] == sorted(i for i, _, _ in seen)
    assert {(i, n) for i, n, _ in seen} == {(0, 2), (1, 2)}
    for run in (0, 1):
        fractions = [f for i, _, f in seen if i == run]
        assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert all(0 < f <= 1.0 for _, _, f in seen)


scenario_st = st.fixed_dictionaries({
    "workload.nic_rx.queues": st.integers(1, 6),
    "workload.nic_rx.flows": st.integers(1, 12),
    "workload.nic_rx.ring_size": st.sampled_from([64, 256, 1024]),
    "workload.nic_rx.mtu": st.sampled_from([1500, 4000, 9000]),
    "workload.nic_rx.line_rate_gbps": st.sampled_from([10, 40, 100, 200]),
    "workload.nic_rx.page_pool": st.booleans(),
    "run.seed": st.integers(0, 2**32),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_st)
def test_invariants_hold_on_random_scenarios(ov):
    res = iommulab.run(**{"run.duration_ms": 4, "run.warmup_ms": 3}, **ov)
    by = {}
    for r in res:
        by.setdefault(r.policy, []).append(r)
        # The device never receives faster than the line rate (goodput may, briefly, while a backlog drains).
        assert r.received_gbps <= ov["workload.nic_rx.line_rate_gbps"] * 1.0001
        assert 0.0 <= r.cpu_busy <= 1.0
        inv = r.invalidations
        assert inv["total"] == inv["psi"] + inv["dsi"] + inv["global"]
    for r in by["passthrough"]:
        assert r.invalidations["total"] == 0 and r.iotlb_misses_per_page == 0
    for r in by["strict"]:
        # One synchronous sync per unmap, each a PSI with its wait descriptor.
        assert r.invalidations["dsi"] == 0
        assert r.invalidations["psi"] == r.syncs
        assert r.invalidations["psi"] == r.iova_pages_unmapped
    for r in by["lazy"]:
        assert r.invalidations["psi"] == 0
        assert r.invalidations["dsi"] <= r.flush_queue_flushes["full"] + r.flush_queue_flushes["timer"]
    # Same overrides, same result.
    again = iommulab.run(**{"run.duration_ms": 4, "run.warmup_ms": 3}, **ov)
    assert again.to_dict() == res.to_dict()


FUZZ_KEYS = [
    "run.seed", "os.policy", "os.kernel", "os.arch", "os.cmdline", "os.hz", "platform.profile",
    "platform.iommu.iotlb_entries", "platform.iommu.iotlb_ways", "platform.iommu.pwc_entries",
    "platform.iommu.ias_bits", "platform.iommu.granule_kb", "platform.iommu.large_pages",
    "platform.iommu.vtd.mamv", "platform.iommu.vtd.caching_mode", "platform.iommu.vtd.rwbf",
    "platform.iommu.vtd.inv_desc_ns", "platform.iommu.smmuv3.stage", "platform.pcie.ats", "platform.pcie.atc_entries",
    "platform.memory.pages", "platform.pcie.translation_slots", "platform.pcie.link_gbps",
    "platform.cpu.cores", "platform.cpu.copy_ns_per_byte", "workload.nic_rx.line_rate_gbps",
    "workload.nic_rx.queues", "workload.nic_rx.flows", "workload.nic_rx.mtu", "workload.nic_rx.ring_size",
    "workload.nic_rx.napi_budget", "workload.nic_rx.page_pool", "workload.nic_rx.pool_size",
    "workload.nic_rx.read_bytes", "workload.nic_rx.rcvbuf_bytes", "workload.nic_rx.bogus", "bogus", "os",
]
fuzz_value = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(0, 70000), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.text(max_size=12), st.lists(st.integers(0, 9), max_size=3),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FUZZ_KEYS), fuzz_value)
def test_any_override_runs_or_raises_scenario_error(key, value):
    """Whatever a user puts in a key, the result is a run or a one-line ScenarioError, never another exception."""
    try:
        iommulab.run(**{"run.duration_ms": 1, "run.warmup_ms": 0.5, "os.policy": "strict", key: value})
    except iommulab.ScenarioError as e:
        assert "\n" not in str(e) and str(e)


def test_only_a_driver_page_cache_reports_its_reuse_slack():
    # C3's mlx5 keeps its own RX page cache: each reuse records how long before it the stack let go of the
    # head page. The drives have no such cache, so the key is absent.
    c3 = iommulab.run("c3", **{"os.policy": "strict", "run.duration_ms": 5, "run.warmup_ms": 5}).to_dict()
    slack = c3["rx_cache_reuse_slack"]
    assert slack["reuses"] == c3["rx_page_cache"]["reuse"] > 0
    assert 0 < slack["min_us"] <= slack["p0.1_us"] <= slack["p1_us"] <= slack["p50_us"]
    assert "rx_cache_reuse_slack" not in iommulab.run("nvme", **{"os.policy": "strict"}).to_dict()


def test_bad_api_arguments_are_scenario_errors():
    # These raised TypeError, or (ats_phases as a string) read it as letters and silently gave nothing.
    import iommulab
    for call in [lambda: iommulab.run(123), lambda: iommulab.replay(123),
                 lambda: iommulab.replay("/dev/null", kernel=6.12),
                 lambda: iommulab.replay("/dev/null", ats_phases="net"),
                 lambda: iommulab.replay("/dev/null", hz=-1)]:
        with pytest.raises(iommulab.ScenarioError):
            call()
