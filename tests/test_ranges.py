"""Ranges: every constant of a built-in profile has one with its reason; a ranged run samples them and reports each
headline figure's median and 90 % interval, and the constants that drive it."""

import json
import pathlib
import tomllib

import pytest
from conftest import SHORT, cli, one_line_error

from iommulab import _core
from iommulab.api import load
from iommulab.ranges import lhs_column, percentiles, ranged
from iommulab.sensitivity import constants

PROFILES = dict(_core.builtin_profiles())
# A short strict run on vtd-server: every RX page mapped and unmapped, so the invalidation and walk costs are on
# its path and the vhost ones (a guest's) are not.
STRICT = {"os.policy": "strict", "workload.nic_rx.page_pool": False, "run.duration_ms": 10, "run.warmup_ms": 5}
KINDS = ("exact:", "sourced:", "calibrated:", "estimate")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_constant_of_a_builtin_profile_has_a_range_and_a_reason(name):
    d = tomllib.loads(PROFILES[name])
    ranges = d.get("ranges") or {}
    keys = {k for k, _ in constants(d)}
    assert keys - set(ranges) == set(), f"{name}: constants without a range"
    assert set(ranges) - keys == set(), f"{name}: ranges for keys that are not its constants"
    for k, r in ranges.items():
        assert r["why"].startswith(KINDS) and len(r["why"]) > 20, (name, k, r["why"])


def test_a_guest_takes_its_hosts_ranges_with_the_hosts_sections():
    v = _core.load("builtin", "guest-x86", [("os.policy", "\"strict\"")], "guest-x86")[0]
    plat = json.loads(v.scenario_json())["platform"]
    host = plat["hypervisor"]["host_profile"]
    taken = [k for k, r in plat["ranges"].items() if r["why"].startswith(f"host {host}: ")]
    assert any(k.startswith("cpu.") for k in taken) and any(k.startswith("kvm.") for k in taken)
    assert all(k.split(".")[0] in ("cpu", "pcie", "kvm", "memory", "iommu") for k in taken)


def test_no_scenario_sets_or_narrows_a_range(write):
    for name, text in _core.builtin_scenarios():
        assert "ranges" not in (tomllib.loads(text).get("platform") or {}), name
    f = write("s.toml", "[run]\nduration_ms = 5\n[platform]\nprofile = \"vtd-server\"\n"
              "[platform.ranges]\n\"cpu.pte_ns\" = { low = 14, high = 16, why = \"mine\" }\n"
              "[os]\npolicy = \"strict\"\n[workload.nic_rx]\nline_rate_gbps = 10\n")
    err = one_line_error(cli("run", str(f)))
    assert "ranges belong to a profile's constants" in err and str(f) in err
    err = one_line_error(cli("run", "--set", "platform.ranges.x=1"))
    assert "--set platform.ranges.x=1" in err and "ranges belong to a profile" in err


def test_a_key_the_scenario_sets_is_exact():
    [v] = _core.load("builtin", "default", [("platform.cpu.pte_ns", "20"), ("os.policy", "\"strict\""),
                                            ("workload.nic_rx.page_pool", "false")], "default")
    ranges = json.loads(v.scenario_json())["platform"]["ranges"]
    assert "cpu.pte_ns" not in ranges and "cpu.lock_ns" in ranges


def test_a_profile_range_that_does_not_hold_its_value_is_one_line_naming_the_line(write):
    text = PROFILES["vtd-server"].replace("[ranges]\n", "[ranges]\n\"cpu.zzz\" = { low = 1, high = 2, why = \"x\" }\n")
    p = write("p.toml", text)
    err = one_line_error(cli("run", "--set", f"platform.profile={p}", *SHORT))
    assert f"{p}:" in err and "cpu.zzz" in err and "not a number the profile sets" in err


def test_the_sample_is_latin_and_each_constants_column_its_own():
    col = lhs_column(1, "cpu.pte_ns", 16)
    assert sorted(int(u * 16) for u in col) == list(range(16))
    assert col == lhs_column(1, "cpu.pte_ns", 16) != lhs_column(1, "cpu.lock_ns", 16) != lhs_column(2, "cpu.pte_ns", 16)


def test_percentiles_are_the_samples_inclusive_quantiles():
    p = percentiles([float(x) for x in range(21)])
    assert (p["p5"], p["p50"], p["p95"]) == (1.0, 10.0, 19.0)


def profile_with(write, ranges):
    """vtd-server with `ranges` (key: TOML inline table) over its own."""
    d = tomllib.loads(PROFILES["vtd-server"])
    lines = [f"\"{k}\" = {v}" for k, v in ranges.items()]
    text = PROFILES["vtd-server"].replace("[ranges]\n", "[ranges]\n" + "\n".join(lines) + "\n")
    for k in ranges:  # the new line goes over the profile's own (TOML would refuse a key twice)
        old = d["ranges"][k]
        text = "\n".join(l for l in text.splitlines() if not (l.startswith(f"\"{k}\" = ") and old["why"] in l))
    return write("p.toml", text + "\n")


def test_a_wide_range_off_the_runs_path_leaves_the_interval_as_it_was(write):
    base = ranged(None, STRICT, n=8, jobs=2)
    p = profile_with(write, {"kvm.vhost_packet_ns": "{ factor = [0.01, 100], why = \"estimate: planted\" }"})
    wide = ranged(None, {**STRICT, "platform.profile": str(p)}, n=8, jobs=2)
    assert [r["ranges"] for r in wide] == [r["ranges"] for r in base]
    assert "kvm.vhost_packet_ns" not in wide[0]["driven_by"]


def test_a_wide_range_on_the_runs_path_is_named_as_its_driver(write):
    p = profile_with(write, {"memory.walk_read_ns": "{ factor = [0.2, 5], why = \"estimate: planted\" }"})
    [r] = ranged(None, {**STRICT, "platform.profile": str(p)}, n=8, jobs=2)
    assert r["driven_by"][0] == "memory.walk_read_ns"
    lo, hi = r["ranges"]["throughput_gbps"]["p5"], r["ranges"]["throughput_gbps"]["p95"]
    assert lo < r["point"]["throughput_gbps"] < hi


def test_ranged_output_is_the_same_for_any_jobs():
    args = ["run", "--ranges", "8", "--set", "os.policy=strict", "--set", "workload.nic_rx.page_pool=false", *SHORT]
    one, two = cli(*args, "--jobs", "1", check_rc=0), cli(*args, "--jobs", "2", check_rc=0)
    assert one.stdout == two.stdout and "driven by" in one.stdout
    doc = json.loads(cli(*args, "--json", check_rc=0).stdout)
    for r in doc.get("runs", [doc]):
        for fig, p in r["ranges"].items():
            assert p["p5"] <= p["p50"] <= p["p95"], (r["label"], fig)
        assert r["range_samples"] == 8 and isinstance(r["driven_by"], list)


@pytest.mark.parametrize("n", ["0", "7", "1001", "x"])
def test_a_sample_size_out_of_bounds_is_one_line(n):
    p = cli("run", "--ranges", n, *SHORT)
    assert p.returncode == 2 and "--ranges" in p.stderr and "Traceback" not in p.stderr


def test_ranges_with_the_invalidation_log_is_refused_in_one_line():
    assert "drop --ranges or --inv-log" in one_line_error(cli("run", "--ranges", "--inv-log", *SHORT))
    assert "--ranges" in one_line_error(cli("advise", "--root", METAL, "--ranges", "3"))


TREES = pathlib.Path(__file__).parent / "data/inspect"
METAL = str(TREES / "edited/vtd-metal-strict.tar.gz")


def advise_json(*args):
    return json.loads(cli("advise", "--root", METAL, "--json", *args, check_rc=0).stdout)


def test_advise_says_a_verdict_that_holds_on_every_sampled_machine_is_robust():
    doc = advise_json("--ranges", "8")
    r = doc["recommendation"]
    assert r["robust"] is True and r["agreement"] >= 0.9 and r["samples"] == 8 and "decided_by" not in r
    for o in doc["options"]:
        for fig, p in o["ranges"].items():
            assert p["p5"] <= p["p50"] <= p["p95"], (o["option"], fig)
        assert {"throughput_gbps", "cpu_busy"} <= set(o["ranges"])
    text = cli("advise", "--root", METAL, "--ranges", "8", check_rc=0).stdout
    assert f"robust: the rule chooses {r['option']} on 8 of 8 sampled machines" in text
    assert "over 8 sampled machines" in text and "  strict: Gbps " in text
    assert advise_json("--no-ranges")["recommendation"]["robust"] is None


def test_advise_names_the_constant_that_decides_a_verdict_that_does_not_hold_and_where_it_flips():
    # Two CPUs and a 9 ms bound: lazy's exposure p99 sits across the bound over the ranges.
    near = ["--set", "platform.cpu.cores=2", "--max-exposure", "9ms"]
    doc = advise_json("--ranges", "24", *near)
    r = doc["recommendation"]
    assert r["robust"] is False and r["agreement"] < 0.9
    d = r["decided_by"]
    assert d["range"][0] <= d["value"] <= d["range"][1] and d["how_to_measure"]
    assert d["flips_to"] in ("passthrough", "lazy", "strict") and d["flips_to"] != r["option"]
    assert d["range"][0] <= d["flips_at"] <= d["range"][1]
    # The value it names flips the verdict: past it (the constant pinned), one point gives the other option.
    past = d["flips_at"] * (1.05 if d["direction"] == "above" else 0.95)
    past = round(past) if isinstance(d["value"], int) else past
    pinned = advise_json("--no-ranges", *near, "--set", f"platform.{d['constant']}={past}")
    assert pinned["recommendation"]["option"] == d["flips_to"]
    text = cli("advise", "--root", METAL, "--ranges", "24", *near, check_rc=0).stdout
    assert "not robust: the rule chooses" in text and f"decided by {d['constant']}" in text
    assert "measure it: " in text


def test_profile_fit_replaces_each_fitted_constants_range_by_the_measurements(tmp_path):
    m = tmp_path / "m.json"
    cli("profile", "measure", "--trace", str(pathlib.Path(__file__).parent / "data/measure/strict-vtd.txt"),
        "-o", str(m), check_rc=0)
    out = tmp_path / "fit.toml"
    cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(out), check_rc=0)
    fitted, base = tomllib.loads(out.read_text()), tomllib.loads(PROFILES["vtd-server"])
    keys = [k for k, s in fitted["sources"].items() if s.startswith("measured on ")]
    assert "iommu.vtd.inv_wait_ns" in keys and "cpu.pte_ns" in keys
    for k in keys:
        r, v = fitted["ranges"][k], dict(constants(fitted))[k]
        assert r["why"].startswith("measured: ") and r["low"] <= v <= r["high"], k
    # The measurement narrows what the profile did not know (here: the invalidation's cost).
    rel = lambda r, v: (r["high"] - r["low"]) / v
    k = "iommu.vtd.inv_wait_ns"
    assert rel(fitted["ranges"][k], fitted["iommu"]["vtd"]["inv_wait_ns"]) < rel(base["ranges"][k], 200) / 10
    # And a ranged run on it samples within the measured range.
    assert cli("run", "--set", f"platform.profile={out}", "--ranges", "8", "--set", "os.policy=strict",
               "--set", "workload.nic_rx.page_pool=false", *SHORT, check_rc=0).stdout.count("ranges: point") == 1


def test_calibrate_writes_what_it_leaves_free_as_the_range(tmp_path):
    out = tmp_path / "k.toml"
    cli("calibrate", "--param", "iommu.smmuv3.cmd_ns", "--profile", "kunpeng920", "--range", "20:300",
        "--out", str(out), check_rc=0)
    prof = tomllib.loads(out.read_text())
    r, v = prof["ranges"]["iommu.smmuv3.cmd_ns"], prof["iommu"]["smmuv3"]["cmd_ns"]
    assert r["why"].startswith("calibrated: ") and "M2.one_thread_1m_unmap_us" in r["why"]
    assert 20 <= r["low"] <= v <= r["high"] <= 300


def test_validate_reports_each_targets_interval_its_coverage_and_its_width():
    args = ["validate", "C1", "M1", "--seeds", "1", "--ranges", "8"]
    doc = json.loads(cli(*args, "--json", check_rc=0).stdout)
    assert len(doc["targets"]) == 4
    for r in doc["targets"]:
        lo, hi = r["interval"]
        assert lo <= r["median"] <= hi and r["range_samples"] == 8
        assert r["in_interval"] == (lo <= r["published"] <= hi)
        assert r["informative"] == (r["interval_width"] is not None and r["interval_width"] / 2 <= 0.5)
    # C1's strict/lazy ratio hangs on the SMMU's unknown costs: an interval that wide checks nothing.
    c1 = next(r for r in doc["targets"] if r["id"] == "C1.strict_lazy_ratio")
    assert not c1["informative"]
    text = cli(*args, "--no-progress", check_rc=0).stdout
    assert "the published figure inside the model's 90 % interval for" in text and " wide" in text


def test_the_python_api_runs_ranged():
    import iommulab

    r = iommulab.run("nvme", ranges=8, jobs=2, **{"os.policy": "strict", "run.duration_ms": 5, "run.warmup_ms": 2})
    p = r.ranges["packets_per_sec"]
    assert p["p5"] <= p["p50"] <= p["p95"] and r.range_samples == 8 and isinstance(r.driven_by, list)
    assert r.to_dict()["ranges"] == r.ranges


def test_a_scenario_whose_runs_name_other_profiles_ranges_each_run_on_its_own():
    # guest-dpdk's [compare] names a setting (its vIOMMU) whose runs take other profiles: a sample's keys are
    # one run's profile's, set on that run alone (and sensitivity's scaled runs likewise).
    short = {"run.duration_ms": 1, "run.warmup_ms": 0.5}
    runs = ranged("guest-dpdk", short, n=8, jobs=2, screen=False)
    labels = [v.label for v in load("guest-dpdk", short)]
    assert [r["label"] for r in runs] == labels and len(set(labels)) > 1
    for r in runs:
        p = r["ranges"]["packets_per_sec"]
        assert p["p5"] <= p["p50"] <= p["p95"]


def test_a_ranged_sweep_writes_each_runs_interval_and_resumes(tmp_path):
    import iommulab

    f = tmp_path / "s.toml"
    f.write_text('scenario = "nvme"\nranges = 8\n[set]\n"run.duration_ms" = 2\n"run.warmup_ms" = 1\n'
                 '[axes]\n"os.policy" = ["strict", "lazy"]\n')
    df = iommulab.sweep(f, out=tmp_path / "o", jobs=2)
    assert df.height == 2
    for row in df.to_dicts():
        assert row["ranges.packets_per_sec.p5"] <= row["ranges.packets_per_sec.p50"] <= row["ranges.packets_per_sec.p95"]
        assert row["range_samples"] == 8 and isinstance(json.loads(row["driven_by"]), list)  # lists as JSON text
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress", check_rc=0)
    assert "2 were already there" in p.stderr
    assert "drop ranges or --ray" in one_line_error(cli("sweep", str(f), "--ray", "--no-progress"))
    f.write_text(f.read_text().replace("ranges = 8", "ranges = 3"))
    assert "ranges: expected a number of samples" in one_line_error(cli("sweep", str(f), "--no-progress"))
