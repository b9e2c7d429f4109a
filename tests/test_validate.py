"""`iommulab validate` and `iommulab calibrate`: published targets, model vs published, and fitting a profile
parameter with its provenance."""

import json
import pathlib
import tomllib

import pytest

from conftest import cli
from iommulab.validate import Target, Targets, load_targets

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def all_targets():
    """`validate --json`'s rows by target id: every target's full run, made once for the tests below (the model
    is deterministic)."""
    return {r["id"]: r for r in json.loads(cli("validate", "--json", check_rc=0).stdout)["targets"]}


def test_validate_json_lists_every_target_with_model_and_error(all_targets):
    rows = all_targets
    assert {t.id for t in load_targets().targets} == set(rows)
    for r in rows.values():
        assert set(r) >= {"id", "published", "model", "error", "ok"}
        # model has 7 significant digits, error 6 decimals: a large error carries the model's rounding.
        assert r["error"] == pytest.approx((r["model"] - r["published"]) / r["published"], rel=1e-6, abs=1e-5)
        assert r["ok"] == (abs(r["error"]) <= r["tolerance"])
    # C1: lazy at the 40 Gbps line rate (strict's ratio is a known miss since it is no longer fitted).
    assert rows["C1.lazy_line_rate_share"]["ok"]
    text = cli("validate", "C1.strict_lazy_ratio", check_rc=0).stdout
    assert "C1.strict_lazy_ratio" in text and "C3." not in text
    # docs/validation.md's table shows these figures (to its rounding) and the count within tolerance.
    doc = (ROOT / "docs/validation.md").read_text()
    shown = _doc_models(doc)
    assert set(shown) == set(rows), set(shown) ^ set(rows)
    for tid, v in shown.items():
        assert v == pytest.approx(rows[tid]["model"], rel=0.02, abs=1e-4), f"docs/validation.md {tid}: {v}"
    n_ok = sum(r["ok"] for r in rows.values())
    assert f"{n_ok} of {len(rows)} are within tolerance" in doc


def _doc_models(doc: str) -> dict[str, float]:
    """The model column of docs/validation.md's target table: "0.042 / 0.042" for a row of two targets
    (`l{1,2}`), "1.42 M" for millions, "523 K" for thousands, "0.12 %" for a share."""
    import re

    out = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 3 or not re.match(r"[CM]\d\.", cells[0]):
            continue
        m = re.match(r"(.*)\{(.*)\}(.*)", cells[0])
        ids = [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [cells[0]]
        for tid, v in zip(ids, cells[2].split(" / ")):
            num = float(re.match(r"[-+]?[0-9.]+", v.strip()).group(0))
            scale = {"M": 1e6, "K": 1e3, "%": 0.01}.get(v.strip()[-1:], 1)
            out[tid] = num * scale
    return out


def test_validate_compares_the_mean_over_seeds():
    def row(*args):
        return json.loads(cli("validate", "C3.strict_pwc_l3_misses_per_page", "--json", *args,
                              check_rc=0).stdout)["targets"][0]
    one = [row("--seeds", "1", "--set", f"run.seed={s}")["model"] for s in (1, 2, 3)]
    three = row("--seeds", "3")
    # Seeds 1, 2, 3 (the scenario's and the next two), each a different sample, and their mean.
    assert three["seeds"] == 3 and len(set(one)) == 3
    assert three["spread"] == [min(one), max(one)]
    assert three["model"] == pytest.approx(sum(one) / 3, rel=1e-6)
    assert row("--seeds", "1")["model"] == one[0]


def test_validate_overrides_move_the_model():
    base = json.loads(cli("validate", "C1.strict_lazy_ratio", "--json", check_rc=0).stdout)["targets"][0]
    slow = json.loads(cli("validate", "C1.strict_lazy_ratio", "--json",
                          "--set", "platform.iommu.smmuv3.sync_ns=3000", check_rc=0).stdout)["targets"][0]
    assert slow["model"] > base["model"] * 1.5, "a slower CMD_SYNC makes strict slower, lazy unchanged"


@pytest.mark.parametrize("args, what", [
    (["validate", "C9.nothing"], "no such target"),
    (["validate", "--set", "platform.iommu.smmuv3.sync_ns=x"], "sync_ns"),
    (["validate", "--seeds", "0"], "from 1 to"),
    (["calibrate", "--param", "iommu.nope", "--target", "M2.one_thread_1m_unmap_us", "--profile", "kunpeng920",
      "--range", "1:2"], "iommu.nope"),
    # Micro-measurements in, macro predictions out: a throughput is never a constant's source.
    (["calibrate", "--param", "iommu.smmuv3.sync_ns", "--target", "C1.strict_lazy_ratio", "--profile",
      "smmuv3-server", "--range", "100:3000"], "C1.strict_lazy_ratio is a macro target"),
    (["calibrate", "--range", "5:1"], "LOW < HIGH"),
    (["calibrate", "--range", "1:2"], "not between"),
])
def test_bad_input_gets_one_line(args, what):
    p = cli(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "\n" not in err and "Traceback" not in p.stderr and what in err, err


def test_calibrate_fits_the_declared_parameter_and_writes_provenance(tmp_path):
    out = tmp_path / "smmu.toml"
    p = cli("calibrate", "--param", "iommu.smmuv3.cmd_ns", "--profile", "kunpeng920", "--range", "20:300",
            "--out", str(out), check_rc=0)
    assert "iommu.smmuv3.cmd_ns" in p.stdout and out.exists()
    prof = tomllib.loads(out.read_text())
    value = prof["iommu"]["smmuv3"]["cmd_ns"]
    assert isinstance(value, int) and 20 < value < 300
    assert prof["sources"]["iommu.smmuv3.cmd_ns"].startswith("calibrated on M2.one_thread_1m_unmap_us")
    # The written profile meets the target it was fitted to.
    doc = json.loads(cli("validate", "M2.one_thread_1m_unmap_us", "--json", "--set", f"platform.profile={out}",
                         check_rc=0).stdout)
    assert abs(doc["targets"][0]["error"]) < 0.01
    # Nothing a user wrote is overwritten without asking.
    out.write_text("mine\n")
    q = cli("calibrate", "--param", "iommu.smmuv3.cmd_ns", "--profile", "kunpeng920", "--out", str(out))
    assert q.returncode == 2 and "--force" in q.stderr and out.read_text() == "mine\n"


def test_calibrate_lists_each_fitted_constant_with_its_target_and_kind():
    rows = json.loads(cli("calibrate", "--list", "--json", check_rc=0).stdout)["calibrations"]
    by = {(r["profile"], r["param"]): r for r in rows}
    # No constant is fitted on a throughput: every declared calibration's target is a micro-target.
    assert rows and all(r["kind"] == "micro" for r in rows)
    k = by[("kunpeng920", "iommu.smmuv3.cmd_ns")]
    assert k["kind"] == "micro" and k["target"] == "M2.one_thread_1m_unmap_us" and k["value"] == 69
    text = cli("calibrate", "--list", check_rc=0).stdout
    assert "kunpeng920: iommu.smmuv3.cmd_ns = 69  fitted on M2.one_thread_1m_unmap_us" in text
    # Every micro-target is marked as one, and validate's rows carry the kind.
    ts = load_targets()
    assert {t.id for t in ts.targets if t.kind == "micro"} == {t.id for t in ts.targets if t.id.startswith("M")}


def test_targets_file_errors_name_the_key(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text('[[target]]\nid = "X.y"\npublished = 1\ntolerance = 0.1\nscenario = "c1"\nvalue = "a.cpu_busy"\n'
                   'runs.a = {}\nkind = "tiny"\n')
    with pytest.raises(Exception, match=r"target X.y.kind: expected"):
        load_targets(bad)
    bad.write_text('[[target]]\nid = "X.y"\npublished = "high"\nruns.a = {}\n')
    with pytest.raises(Exception, match=r"target X.y.published: expected"):
        load_targets(bad)
    bad.write_text('[[target]]\nid = "X.y"\npublished = 1\ntolerance = 0.1\nscenario = "c1"\n'
                   'value = "a.throughput_gbps / b.throughput_gbps"\nruns.a = {}\n')
    with pytest.raises(Exception, match=r"run 'b' is not in runs"):
        load_targets(bad)
    # A declared calibration on a throughput is refused where it is declared.
    bad.write_text('[[target]]\nid = "X.y"\npublished = 1\ntolerance = 0.1\nscenario = "c1"\nvalue = "a.cpu_busy"\n'
                   'runs.a = {}\n[[calibration]]\nparam = "cpu.lock_ns"\nprofile = "smmuv3-server"\n'
                   'target = "X.y"\nrange = [1, 2]\n')
    with pytest.raises(Exception, match=r"calibration\[0\].target: X.y is a macro target"):
        load_targets(bad)


def test_the_locality_target_is_the_median_of_fs_figure_3e():
    """C3.strict_iova_reuse_distance_p50 is computed from the bars of F&S Figure 3e kept in docs/data and read
    against the model's allocation trace (`iova_locality`), and the walk-cache figures docs/fs-figure-3e.md
    draws from them hold."""
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "docs/data/fs_figure_3e.json").read_text())
    rings = {k: sorted(v - 1 for v in data[f"ring_{k}"]) for k in (256, 2048)}  # less the entry itself
    assert all(len(d) == 502 and d[0] == 0 for d in rings.values())
    target = next(t for t in load_targets().targets if t.id == "C3.strict_iova_reuse_distance_p50")
    assert target.published == rings[256][len(rings[256]) // 2] == 14
    # Figure 3e's x axis is IOVA allocations (F&S §2.2), so the model's measure is of allocations too.
    assert target.value == "strict.iova_locality.reuse_distance_p50"

    def beyond(d, n):
        return sum(x >= n for x in d) / len(d)
    # LRU capacity misses of a 32-entry PDE cache plus the invalidations' ~0.05: Figure 3d's L3 0.36 / 0.86.
    assert beyond(rings[256], 32) + 0.05 == pytest.approx(0.36, abs=0.01)
    assert beyond(rings[2048], 32) + 0.05 == pytest.approx(0.86, abs=0.01)
    # Emptied by each of one PSI per 23 accesses, the cache would miss every first use after it: 0.61 or more.
    assert sum(beyond(rings[256], i) for i in range(23)) / 23 > 0.6


# Targets the model misses today, with why (docs/validation.md). A miss that starts to pass
# fails the run too (strict xfail), so an improvement is seen and this list updated; every other target must
# stay within its tolerance.
KNOWN_MISSES = {
    "C1.strict_lazy_ratio": "with Hi1620's CMD_SYNC times strict reaches the line rate; Graviton4's SMMU "
                            "timings are unpublished (docs/validation.md, C1 without the fit)",
    "C3.strict_pwc_l3_misses_per_page": "the rings' IOVA layout does not age as F&S's Figure 3d needs",
    "C3.strict_pwc_l1_misses_per_page": "at the tolerance's edge, inside the seeds' spread (0.031 to 0.043 over five "
                                        "seeds; the tolerance starts at 0.040): 0.041 before the page-table lines' "
                                        "transfers (docs/contention.md) shifted the rings' timing, 0.038 after",
    "C3.strict_pwc_l2_misses_per_page": "as C3.strict_pwc_l1_misses_per_page: 0.041 before the page-table lines' "
                                        "transfers, 0.038 after, seeds 0.031 to 0.043",
    "C3.strict_throughput_share": "fewer walk reads than measured leave the DMA engine less held back",
    "C3.strict_drop_rate": "DCTCP senders back off on fewer losses than F&S measured",
    "C3.strict_iova_reuse_distance_p50": "the model's allocations are ACK heads the rcache hands back at once",
    "C2.strict_inv_per_page": "every strict RX unmap is one page with its own PSI",
    "C2.fands_inv_per_page": "one PSI per 64-page block plus one per ACK head",
    "C2.xsmmu_inv_per_page": "more churned pages than published",
    "M1.one_thread_4k_unmap_us": "the lone TLBI and CMD_SYNC cost less than measured: the poll's and the "
                                 "owner's CPU-side work are not all modelled",
    "M3.ten_threads_4k_unmap_us": "CPUs contending for the command queue's lines cost less than measured",
    "M3.ten_threads_1m_unmap_us": "the threads' fills overlap the SMMU's work; chenxiang's -d is not stated",
    "M4.cmdq_8_cpus_per_cpu_rate": "the SMMU binds before CPUs meet at llq: the CPU side of an unmap costs less than measured",
    "M4.cmdq_16_cpus_per_cpu_rate": "the SMMU binds before CPUs meet at llq: the CPU side of an unmap costs less than measured",
    "M4.cmdq_32_cpus_per_cpu_rate": "the SMMU binds before CPUs meet at llq: the CPU side of an unmap costs less than measured",
    "M4.cmdq_64_cpus_per_cpu_rate": "the SMMU binds before CPUs meet at llq: the CPU side of an unmap costs less than measured",
    "M4.cmdq_64_cpus_cas_attempts": "the SMMU binds before CPUs meet at llq: the CPU side of an unmap costs less than measured",
    "M5.morello_four_threads_1m_unmap_us": "how much of a CMD_SYNC holds the queue is not published",
    "M6.snapdragon_one_thread_1m_map_us": "page-table costs borrowed from an i7",
    "M6.snapdragon_eight_threads_4k_unmap_us": "how much of a CMD_SYNC holds the queue is not published (2.6 to 11.9)",
}


@pytest.mark.parametrize("target", [t.id for t in load_targets().targets])
def test_every_target_holds_its_current_standing(all_targets, target):
    r = all_targets[target]
    if target in KNOWN_MISSES:
        if r["ok"]:
            pytest.fail(f"{target} now within tolerance ({r['error']:+.1%}): remove it from KNOWN_MISSES")
        pytest.xfail(f"{target} {r['error']:+.1%}: {KNOWN_MISSES[target]}")
    assert r["ok"], f"{target}: model {r['model']} against {r['published']} ({r['error']:+.1%}, tolerance {r['tolerance']:.0%})"


def test_validate_marks_targets_run_under_assumed_settings():
    from iommulab.validate import Runner
    ts = load_targets()
    c2 = ts.get("C2.strict_unmapped_pages_per_sec")
    assert "platform.pcie.translation_slots" in Runner().assumed(c2)
    # Setting the key replaces the assumed value with the user's own: the mark goes with it.
    pinned = Runner({"platform.pcie.translation_slots": 1}).assumed(c2)
    assert "platform.pcie.translation_slots" not in pinned and "workload.nic_rx.flows" in pinned
    assert "workload.nic_rx.channels" in Runner().assumed(ts.get("C3.strict_drop_rate"))
    row = json.loads(cli("validate", "C2.strict_unmapped_pages_per_sec", "--json", "--seeds", "1",
                         check_rc=0).stdout)["targets"][0]
    assert "platform.pcie.translation_slots" in row["assumed"]
    text = cli("validate", "C2.strict_unmapped_pages_per_sec", "--seeds", "1", check_rc=0).stdout
    assert "assumed: " in text and "translation_slots" in text


def test_fail_on_miss_exits_1_on_a_miss_and_0_when_every_target_holds():
    # For CI: the table first, then the misses in one line and exit 1.
    miss = cli("validate", "C1.strict_lazy_ratio", "--seeds", "1", "--fail-on-miss")
    assert miss.returncode == 1 and "C1.strict_lazy_ratio" in miss.stdout
    assert miss.stderr.strip() == "iommulab: 1 of 1 targets outside their tolerance: C1.strict_lazy_ratio"
    ok = cli("validate", "C1.lazy_line_rate_share", "--seeds", "1", "--fail-on-miss")
    assert ok.returncode == 0 and ok.stderr == ""


def test_a_target_is_named_by_its_id_or_the_start_of_ids_in_any_case():
    # Issue 64 (item 8): `validate C1` selected nothing (exact ids only), where `run c1` runs the c1 scenario.
    ts = load_targets()
    ids = lambda *words: [t.id for t in ts.select(list(words))]
    assert ids("C1") == ids("c1") == ["C1.strict_lazy_ratio", "C1.lazy_line_rate_share"]
    assert ids("m5.morello_one_thread") == [t.id for t in ts.targets if t.id.startswith("M5.morello_one_thread")]
    assert ids("C1.strict_lazy_ratio") == ["C1.strict_lazy_ratio"]
    # A word ends at a `.` or `_`: C1 is not the start of a C10, nor `M5.morello_one_t` of a word.
    two = Targets([Target(id=i, source="", published=1.0, tolerance=0.1, scenario="c1", value="", runs={})
                   for i in ("C1.a", "C10.b")])
    assert [t.id for t in two.select(["C1"])] == ["C1.a"] and [t.id for t in two.select(["c10"])] == ["C10.b"]
    for word in ("M5.morello_one_t", "C", "M", "C1.strict_lazy_rati"):
        with pytest.raises(Exception, match="no such target"):
            ts.select([word])
    # Each target once, in the order the words name them.
    assert ids("C1.lazy_line_rate_share", "C1") == ["C1.lazy_line_rate_share", "C1.strict_lazy_ratio"]
    listed = json.loads(cli("validate", "c1", "--list", "--json", check_rc=0).stdout)["targets"]
    assert [t["id"] for t in listed] == ids("C1")


def test_an_unknown_target_is_one_short_line_naming_the_groups():
    # Issue 64 (item 7): the error listed every id, 820 characters.
    p = cli("validate", "C9")
    err = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in err and len(err) <= 120, err
    assert "C1, C2, C3, M1" in err and "validate --list" in err
    lines = cli("validate", "--list", check_rc=0).stdout.splitlines()
    assert len(lines) == 2 + len(load_targets().targets) and all(len(l) <= 100 for l in lines)
