"""`iommulab profile measure` and `profile fit`: latencies of the kernel's map/unmap path from kprobe/kretprobe
pairs (the capture script's -M and -L), summarised per function with self times, and a profile fitted to them
whose model is compared with what was measured. The capture side runs against capture tests' stand-in tracefs;
tests/test_testbed.py runs it in a real guest."""

import json
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import iommulab
from conftest import cli
from iommulab import measure
from test_capture import SHELLS, Standin

HEADER = """# iommulab measure: host box
# iommulab measure: kernel 6.12.9-amd64
# iommulab measure: machine x86_64
# iommulab measure: date 2026-11-27T20:00:00Z
# iommulab measure: cmdline ro intel_iommu=on
# iommulab measure: iommu dmar0
# iommulab measure: group 7 type DMA-FQ devices 0000:00:03.0
# iommulab measure: probe iommu_dma_map_page size=$arg4:u64
"""


def ev(pid, cpu, us, fn, ret=False, args=""):
    """One event line as tracefs prints it (`us`: microseconds since boot, printed with six decimals)."""
    site = f"(caller+0x10/0x40 <- {fn})" if ret else f"({fn}+0x0/0x90)"
    return (f"        task-{pid}    [{cpu:03d}] d..1.  {us // 1_000_000}.{us % 1_000_000:06d}: "
            f"lat_{fn}{'_r' if ret else ''}: {site}{' ' + args if args else ''}\n")


def map_call(pid, cpu, t, pages=1):
    """iommu_dma_map_page over `t`..`t`+9 µs: alloc_iova_fast 2 µs and iommu_map 1 + pages µs inside it."""
    size = pages * 4096
    return [ev(pid, cpu, t, "iommu_dma_map_page", args=f"size={size}"),
            ev(pid, cpu, t + 1, "alloc_iova_fast", args=f"pages={pages}"),
            ev(pid, cpu, t + 3, "alloc_iova_fast", ret=True),
            ev(pid, cpu, t + 4, "iommu_map", args=f"size={hex(size)}"),
            ev(pid, cpu, t + 5 + pages, "iommu_map", ret=True),
            ev(pid, cpu, t + 9, "iommu_dma_map_page", ret=True)]


def test_calls_pair_per_task_and_self_time_leaves_out_the_measured_callees(tmp_path):
    lines = [HEADER]
    t = 100_000_000
    for i in range(40):
        # Two tasks interleave on two CPUs; the idle task (pid 0) runs on both at once, paired per CPU.
        a, b = map_call(10, 0, t), map_call(20, 1, t + 1, pages=2)
        lines += [x for pair in zip(a, b) for x in pair]
        lines += [ev(0, 0, t + 20, "free_iova_fast", args="pages=1"), ev(0, 1, t + 21, "free_iova_fast", args="pages=1"),
                  ev(0, 0, t + 22, "free_iova_fast", ret=True), ev(0, 1, t + 25, "free_iova_fast", ret=True)]
        t += 100
    # A return whose entry is not in the trace (the recording began mid-call) is left out, and counted.
    lines.append(ev(30, 2, t, "iommu_map", ret=True))
    p = tmp_path / "t.txt"
    p.write_text("".join(lines))
    m = measure.summarize(p)
    assert m["host"] == "box" and m["kernel"] == "6.12.9-amd64" and m["iommus"] == ["dmar0"]
    assert m["groups"] == [{"group": "7", "type": "DMA-FQ", "devices": ["0000:00:03.0"]}]
    assert measure.policy_of(m) == "lazy" and m["unpaired"] == 1
    f = m["functions"]
    assert f["iommu_dma_map_page"]["calls"] == 80 and f["iommu_dma_map_page"]["mean_ns"] == 9000
    # 9 µs, less 2 in alloc_iova_fast and 2 (or 3) in iommu_map.
    assert f["iommu_dma_map_page"]["by"]["pages=1"]["self_mean_ns"] == 5000
    assert f["iommu_dma_map_page"]["by"]["pages=2"]["self_mean_ns"] == 4000
    assert f["iommu_map"]["by"]["pages=2"]["mean_ns"] == 3000 and f["iommu_map"]["by"]["pages=1"]["mean_ns"] == 2000
    assert f["free_iova_fast"]["calls"] == 80 and f["free_iova_fast"]["mean_ns"] == 3000
    assert f["alloc_iova_fast"]["p50_ns"] == 2000 and f["alloc_iova_fast"]["stddev_ns"] == 0


def test_fit_sets_each_constant_from_its_function_and_predicts_the_rest(tmp_path):
    lines = [HEADER]
    t = 100_000_000
    for i in range(60):
        lines += map_call(10, 0, t, pages=1 + i % 2)
        lines += [ev(10, 0, t + 12, "iommu_dma_unmap_page", args="size=4096"),
                  ev(10, 0, t + 13, "iommu_iova_to_phys"), ev(10, 0, t + 14, "iommu_iova_to_phys", ret=True),
                  ev(10, 0, t + 15, "iommu_unmap_fast", args="size=4096"),
                  ev(10, 0, t + 17, "iommu_unmap_fast", ret=True),
                  ev(10, 0, t + 20, "iommu_dma_unmap_page", ret=True)]
        t += 100
    p = tmp_path / "t.txt"
    p.write_text("".join(lines))
    mfile = tmp_path / "m.json"
    out = cli("profile", "measure", "--trace", str(p), "-o", str(mfile), check_rc=0).stdout
    assert "iommu_dma_map_page" in out and "wrote" in out
    prof = tmp_path / "mine.toml"
    res = json.loads(cli("profile", "fit", str(mfile), "--base", "vtd-server", "-o", str(prof), "--json",
                         check_rc=0).stdout)
    fitted = {k: v["value"] for k, v in res["fitted"].items()}
    # iommu_map is 1 µs + 1 µs a page: the walk and the PTE; alloc_iova_fast 2 µs; iommu_dma_map_page's own 5
    # or 4 µs.
    assert fitted["cpu.pgtable_walk_ns"] == pytest.approx(1000) and fitted["cpu.pte_ns"] == pytest.approx(1000)
    assert fitted["cpu.iova_rcache_ns"] == 2000 and fitted["cpu.dma_iommu_op_ns"] == pytest.approx(4500)
    doc = tomllib.loads(prof.read_text())
    assert doc["cpu"]["pte_ns"] == 1000
    assert doc["sources"]["cpu.pte_ns"].startswith("measured on box, 2026-11-27T20:00:00Z, Linux 6.12.9-amd64")
    rows = {r["function"]: r for r in res["functions"]}
    # What the model composes from them: one walk for iommu_iova_to_phys (measured 1 µs), walk + PTE for the
    # unmap (2 µs), and the whole map and unmap from its map benchmark on the fitted profile, lazy as measured.
    assert rows["iommu_iova_to_phys"]["modelled_ns"] == pytest.approx(1000)
    assert rows["iommu_unmap_fast"]["modelled_ns"] == pytest.approx(2000)
    assert rows["iommu_dma_map_page"]["modelled_ns"] == pytest.approx(9000, rel=0.1)
    assert rows["iommu_dma_unmap_page"]["modelled_ns"] > 4500 + 2000
    assert "lazy" in rows["iommu_dma_map_page"]["role"]
    # The fitted profile is a profile: anything runs on it.
    r = iommulab.run(**{"platform.profile": str(prof), "os.policy": "strict", "workload.nic_rx.page_pool": True,
                        "run.duration_ms": 2,
                        "run.warmup_ms": 1})
    assert r.throughput_gbps > 0
    # Nothing a user wrote is overwritten.
    q = cli("profile", "fit", str(mfile), "--base", "vtd-server", "-o", str(prof))
    assert q.returncode == 2 and "--force" in q.stderr


def test_in_a_guest_the_invalidation_is_not_fitted(tmp_path):
    lines = [HEADER]
    t = 100_000_000
    for _ in range(30):
        lines += [ev(10, 0, t, "qi_submit_sync", args="count=1"), ev(10, 0, t + 50, "qi_submit_sync", ret=True)]
        t += 100
    p = tmp_path / "t.txt"
    p.write_text("".join(lines))
    m = measure.summarize(p)
    base = dict(iommulab._core.builtin_profiles())
    guest = measure.fit(base["kvm-vtd-guest"], m)
    assert "iommu.vtd.inv_wait_ns" not in guest.values and any("guest" in s for s in guest.skipped)
    host = measure.fit(base["vtd-server"], m)
    # 50 µs a call: less two q_lock turns, the two descriptors' writes and inv_desc_ns.
    assert host.values["iommu.vtd.inv_wait_ns"] == pytest.approx(50_000 - 2 * 20 - 2 * 40 - 400)


@pytest.mark.parametrize("text, what", [
    ("", "no measured calls"),
    ("garbage\n" * 3, "no measured calls"),
])
def test_a_trace_without_measurements_is_one_line(tmp_path, text, what):
    p = tmp_path / "t.txt"
    p.write_text(text)
    r = cli("profile", "measure", "--trace", str(p), "-o", str(tmp_path / "m.json"))
    assert r.returncode == 2 and what in r.stderr and "\n" not in r.stderr.strip(), r.stderr
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("content, what", [
    ("{", "not JSON"),
    ('{"format": 9}', "expected a measurement"),
    ('{"format": 1, "functions": {"f": {"calls": "x"}}}', "functions.f"),
])
def test_a_bad_measurement_is_one_line(tmp_path, content, what):
    m = tmp_path / "m.json"
    m.write_text(content)
    r = cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(tmp_path / "p.toml"))
    assert r.returncode == 2 and what in r.stderr and "\n" not in r.stderr.strip(), r.stderr
    assert not (tmp_path / "p.toml").exists()


LAT_SYMS = ["ffffffff81000100 T iommu_dma_map_page", "ffffffff81000110 T alloc_iova_fast",
            "ffffffff81000120 T iommu_map"]


def standin(tmp_path, unenabled=()) -> Standin:
    """The capture tests' stand-in tracefs with kprobes, the map path's functions in kallsyms, and their
    events (entry and return) in the instance template; its trace_pipe holds a recording of them."""
    s = Standin(tmp_path, kprobes=True)
    with open(tmp_path / "kallsyms", "a") as k:
        k.write("\n".join(LAT_SYMS) + "\n")
    for fn in ("iommu_dma_map_page", "alloc_iova_fast", "iommu_map"):
        for name in (f"lat_{fn}", f"lat_{fn}_r"):
            if name not in unenabled:
                s.write(s.inst / "events/iommulab" / name / "enable", "0\n")
    t = 100_000_000
    lines = []
    for _ in range(25):
        lines += map_call(10, 0, t)
        t += 100
    (s.inst / "trace_pipe").write_text("".join(lines))
    s.before = s.snapshot()
    return s


def test_measure_records_through_the_capture_script_and_leaves_the_tracefs_as_it_was(tmp_path):
    s = standin(tmp_path)
    out = tmp_path / "m.json"
    p = s.iommulab("profile", "measure", "-o", str(out), "--duration", "1")
    assert p.returncode == 0, p.stderr
    s.assert_untouched()
    log = s.kprobe_log.read_text()
    assert "p:iommulab/lat_iommu_map iommu_map size=$arg4:u64" in log
    assert "r64:iommulab/lat_iommu_map_r iommu_map" in log and "-:iommulab/lat_iommu_map_r" in log
    # Functions this kernel does not have are named and left out; the iommu tracepoints are not recorded.
    assert "latency of qi_submit_sync: not in kallsyms" in p.stderr
    m = json.loads(out.read_text())
    assert m["functions"]["iommu_dma_map_page"]["calls"] == 25 and m["probes"][0].startswith("iommu_dma_map_page")
    assert "iommu_dma_map_page" in p.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_a_function_whose_return_cannot_be_probed_is_left_out(tmp_path, shell):
    s = standin(tmp_path, unenabled=("lat_iommu_map_r",))
    p = s.script(shell, "-M", "-o", str(tmp_path / "t.txt"), "-d", "1")
    assert p.returncode == 0 and "latency of iommu_map: no return probe" in p.stderr, p.stderr
    s.assert_untouched()
    m = measure.summarize(tmp_path / "t.txt")
    assert not any(x.startswith("iommu_map ") for x in m["probes"]) and "alloc_iova_fast" in m["functions"]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("args, what", [
    (["-L", "9bad"], "-L '9bad': expected a kernel function name"),
    (["-L", "iommu_map", "-k"], "-L cannot be combined with -k"),
    (["-L", "nothere"], "-L: none of the functions could be probed"),
])
def test_capture_latency_errors_are_one_line_and_change_nothing(tmp_path, args, what, shell):
    s = standin(tmp_path)
    p = s.script(shell, "-o", str(tmp_path / "t.txt"), "-d", "1", *args)
    assert p.returncode == 2 and what in p.stderr, p.stderr
    s.assert_untouched()
    assert not (tmp_path / "t.txt").exists()


def test_measure_refuses_a_bad_function_name_before_anything_is_touched(tmp_path):
    s = standin(tmp_path)
    p = s.iommulab("profile", "measure", "-o", str(tmp_path / "m.json"), "--functions", "a b")
    assert p.returncode == 2 and "--functions a b: expected kernel function names" in p.stderr
    s.assert_untouched()



@pytest.mark.parametrize("kernel, args, nosync", [("6.12.9", "a3={cmds} a4={n} a5=1", "a3=99 a4=1 a5=0"),
                                                  ("6.1.0", "a3={n} a4=1 a5=0", "a3=1 a4=0 a5=7")])
def test_smmuv3_command_lists_with_a_sync_give_its_time_and_each_commands(tmp_path, kernel, args, nosync):
    # arm_smmu_cmdq_issue_cmdlist(smmu, [cmdq,] cmds, n, sync): the cmdq argument came in 6.12. Lists of 1 and 3
    # commands with their CMD_SYNC take 8 and 12 µs (a slow SMMU, and the trace's clock has µs steps): 2 µs a
    # command and 6 µs for the rest.
    lines = [HEADER.replace("6.12.9-amd64", kernel)]
    t = 100_000_000_000
    for i in range(60):
        n = 1 + 2 * (i % 2)
        lines.append(ev(10, 0, t // 1000, "arm_smmu_cmdq_issue_cmdlist", args=args.format(cmds=99, n=n)))
        lines.append(ev(10, 0, (t + 6000 + 2000 * n) // 1000, "arm_smmu_cmdq_issue_cmdlist", ret=True))
        # A list without a sync is not a CMD_SYNC's time.
        lines.append(ev(10, 0, (t + 20_000) // 1000, "arm_smmu_cmdq_issue_cmdlist", args=nosync))
        lines.append(ev(10, 0, (t + 29_000) // 1000, "arm_smmu_cmdq_issue_cmdlist", ret=True))
        t += 100_000
    p = tmp_path / "t.txt"
    p.write_text("".join(lines))
    m = measure.summarize(p)
    assert {k for k in m["functions"]["arm_smmu_cmdq_issue_cmdlist"]["by"]} == {"n=1,sync=1", "n=3,sync=1", "n=1,sync=0"}
    base = dict(iommulab._core.builtin_profiles())["kunpeng920"]
    f = measure.fit(base, m)
    # Per command: the 2 µs slope less the 10 ns write; the CMD_SYNC: 6 µs less the writes and the 90 ns signal.
    assert f.values["iommu.smmuv3.cmd_ns"] == pytest.approx(1990)
    assert f.values["iommu.smmuv3.sync_ns"] == pytest.approx(6000 - 10 - 90)


def _map_measurement(walk_ns: float, sizes: dict[int, tuple[float, int]]) -> dict:
    """A summarised measurement: iommu_iova_to_phys at `walk_ns` (when > 0) and iommu_map's self time per size
    ({pages: (mean ns, calls)})."""
    by = {f"pages={x}": {"calls": c, "mean_ns": y, "self_mean_ns": y} for x, (y, c) in sizes.items()}
    n = sum(c for _, c in sizes.values())
    mean = sum(y * c for y, c in sizes.values()) / n
    fns = {"iommu_map": {"calls": n, "mean_ns": mean, "self_mean_ns": mean, "by": by}}
    if walk_ns > 0:
        fns["iommu_iova_to_phys"] = {"calls": 100, "mean_ns": walk_ns, "self_mean_ns": walk_ns, "by": {}}
    return {"functions": fns}


def _fit_rows(m: dict):
    base = dict(iommulab._core.builtin_profiles())["vtd-server"]
    f = measure.fit(base, m)
    return f, {r["function"]: r for r in measure.modelled(f, "unused.toml", None)}


def test_iommu_maps_intercept_beyond_a_walk_is_its_own_per_call_cost():
    # iommu_map: 3 µs + 1 µs a page; a walk (iommu_iova_to_phys) 1 µs. The 2 µs the walk leaves of the
    # intercept are iommu_map's own per call (cpu.pgtable_map_ns), and the row gives back the measured mean.
    f, rows = _fit_rows(_map_measurement(1000, {1: (4000, 50), 2: (5000, 30), 4: (7000, 20)}))
    assert f.values["cpu.pte_ns"] == pytest.approx(1000) and f.values["cpu.pgtable_map_ns"] == pytest.approx(2000)
    assert rows["iommu_map"]["role"].startswith("sets") and abs(rows["iommu_map"]["error"]) < 1e-4
    assert rows["iommu_map"]["measured_ns"] == pytest.approx((4000 * 50 + 5000 * 30 + 7000 * 20) / 100)


def test_an_intercept_below_a_walk_falls_back_to_the_mean_per_page():
    # A walk of 3.5 µs is more than iommu_map's 3 µs intercept: no per-call cost to read; the PTE is what a walk
    # leaves of the mean, per page, and the row still gives the mean back.
    f, rows = _fit_rows(_map_measurement(3500, {1: (4000, 50), 2: (5000, 50)}))
    assert "cpu.pgtable_map_ns" not in f.values
    assert f.values["cpu.pte_ns"] == pytest.approx((4500 - 3500) / 1.5)
    assert rows["iommu_map"]["role"].startswith("sets") and abs(rows["iommu_map"]["error"]) < 1e-4


def test_a_map_faster_than_a_walk_keeps_the_base_and_says_its_row_is_a_prediction():
    f, rows = _fit_rows(_map_measurement(6000, {1: (4000, 50), 2: (5000, 50)}))
    assert "cpu.pte_ns" not in f.values and any(s.startswith("cpu.pte_ns:") for s in f.skipped)
    assert rows["iommu_map"]["role"].startswith("predicted") and rows["iommu_map"]["error"] > 0.3


@settings(max_examples=200, deadline=None)
@given(walk=st.floats(0, 20_000), sizes=st.dictionaries(
    st.integers(1, 512), st.tuples(st.floats(1, 100_000).map(lambda v: round(v, 1)), st.integers(20, 5000)),
    min_size=1, max_size=6))
def test_a_row_that_sets_a_constant_gives_back_what_it_was_set_from(walk, sizes):
    # Whatever the timings (a noisy host, an emulator), a row marked "sets" matches its measurement by
    # construction; one that cannot is marked otherwise.
    f, rows = _fit_rows(_map_measurement(round(walk, 1), sizes))
    for r in rows.values():
        if r["role"].startswith("sets"):
            assert abs(r["modelled_ns"] - r["measured_ns"]) <= 0.1 + 1e-6 * r["measured_ns"], r
        else:
            assert r["role"].startswith(("predicted", "shares")), r
    assert rows["iommu_map"]["role"].startswith("sets") or any(s.startswith("cpu.pte_ns:") for s in f.skipped)


def test_a_line_past_the_bound_is_a_one_line_error_naming_it_and_nothing_is_written(tmp_path):
    # Issue 64 item 21: each trace line is read up to MAX_LINE_BYTES (as replay's), so one without a newline
    # cannot take memory without bound. A line of exactly the bound (its newline counted) is read; one byte
    # more is an error naming the file and the line.
    calls = HEADER + "".join(map_call(10, 0, 100_000_000))
    lineno = calls.count("\n") + 1
    for extra, ok in ((0, True), (1, False)):
        p, out = tmp_path / f"t{extra}.txt", tmp_path / f"m{extra}.json"
        long = "#" + "x" * (measure.MAX_LINE_BYTES - 2 + extra) + "\n"
        p.write_text(calls + long + "".join(map_call(10, 0, 100_000_100)))
        r = cli("profile", "measure", "--trace", str(p), "-o", str(out))
        if ok:
            assert r.returncode == 0 and out.exists(), r.stderr
            continue
        assert r.returncode == 2 and "\n" not in r.stderr.strip(), r.stderr
        assert f"t1.txt:{lineno}: a line longer than {measure.MAX_LINE_BYTES} bytes" in r.stderr, r.stderr
        assert not out.exists()


# --- issue 64: a measurement and a base profile are checked before anything is fitted or written --------------

GOOD_FN = '"iommu_iova_to_phys": {"calls": 100, "mean_ns": 500, "self_mean_ns": 500}'


@pytest.mark.parametrize("content, what", [
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": NaN, "self_mean_ns": 1}}}', "NaN"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": Infinity, "self_mean_ns": 1}}}', "Infinity"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1e400, "self_mean_ns": 1}}}', "1e400"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": 1e308}}}', "functions.f.self_mean_ns"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": -5}}}', "functions.f.self_mean_ns"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": true, "self_mean_ns": 1}}}', "functions.f.mean_ns"),
    ('{"format": 1, "functions": {"f": {"calls": true, "mean_ns": 1, "self_mean_ns": 1}}}', "functions.f.calls"),
    ('{"format": true, "functions": {}}', "format 1"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": 1, "by": 3}}}', "functions.f.by"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": 1, "by": {"pages=1": 3}}}}',
     "functions.f.by.pages=1"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": 1, '
     '"by": {"pages=1": {"calls": "x"}}}}}', "functions.f.by.pages=1.calls"),
    ('{"format": 1, "functions": {"f": {"calls": 10, "mean_ns": 1, "self_mean_ns": 1, '
     '"by": {"pages=' + "9" * 400 + '": {"calls": 1, "mean_ns": 1, "self_mean_ns": 1}}}}}', "NAME=N"),
    ('{"format": 1, "host": [1], "functions": {' + GOOD_FN + '}}', "host"),
    ('{"format": 1, "groups": [1], "functions": {' + GOOD_FN + '}}', "groups"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ('{"format": 1, "functions": {' + GOOD_FN + '}, "x": ' + "[" * 50 + "]" * 50 + "}", "nested deeper"),
])
def test_a_measurement_with_nan_infinity_wrong_types_or_deep_nesting_is_one_line(tmp_path, content, what):
    # issue 64 item 14: each was a traceback (KeyError, TypeError, RecursionError) or went on into the fit.
    m = tmp_path / "m.json"
    m.write_text(content)
    r = cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(tmp_path / "p.toml"))
    assert r.returncode == 2 and what in r.stderr and "\n" not in r.stderr.strip(), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "p.toml").exists()


@pytest.mark.parametrize("base, text, what", [
    ("notes.toml", "x = \n", "notes.toml:1: not TOML"),
    ("passwd", "root:x:0:0:root:/root:/bin/bash\n", "passwd:1: not TOML"),
    ("table.toml", "x = 1\n", "not a platform profile"),
    ("kvm-vtd-guest", None, "--base vtd-server"),
    ("virtio-guest-arm64", None, "--base smmuv3-server"),
])
def test_a_base_that_is_not_a_bare_metal_profile_is_one_line(tmp_path, base, text, what):
    # issue 64 item 14: TOMLDecodeError and KeyError tracebacks. A guest profile's [cpu] holds only the vCPUs'
    # count: the costs a fit sets are its host profile's, and the line names that profile.
    m = tmp_path / "m.json"
    m.write_text('{"format": 1, "functions": {' + GOOD_FN + '}}')
    if text is not None:
        (tmp_path / base).write_text(text)
        base = str(tmp_path / base)
    r = cli("profile", "fit", str(m), "--base", base, "-o", str(tmp_path / "p.toml"))
    assert r.returncode == 2 and what in r.stderr and "\n" not in r.stderr.strip(), r.stderr
    assert not (tmp_path / "p.toml").exists()


@pytest.mark.parametrize("latency", ["1e308", "-1", "NaN", "true"])
def test_fit_refuses_a_latency_no_profile_can_hold_and_run_loads_what_it_writes(tmp_path, latency):
    # issue 64 item 15: 1e308 ns was written as a 309-digit integer `run` could not load; NaN and negatives
    # kept the base's in silence; a boolean was written as 1 ns.
    m = tmp_path / "m.json"
    m.write_text('{"format": 1, "functions": {"iommu_iova_to_phys": {"calls": 100, "mean_ns": 500, '
                 f'"self_mean_ns": {latency}}}}}}}')
    r = cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and "self_mean_ns" in r.stderr and "\n" not in r.stderr.strip(), r.stderr
    assert not (tmp_path / "bad.toml").exists()
    # The longest latency a measurement may hold is written, and the profile runs.
    m.write_text('{"format": 1, "functions": {"iommu_iova_to_phys": {"calls": 100, "mean_ns": 1e9, '
                 '"self_mean_ns": 1e9}}}')
    cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(tmp_path / "p.toml"), check_rc=0)
    assert tomllib.loads((tmp_path / "p.toml").read_text())["cpu"]["pgtable_walk_ns"] == 1_000_000_000
    cli("run", "map-benchmark", "--set", f"platform.profile={tmp_path / 'p.toml'}", "--set", "os.arch=x86_64",
        "--set", "compare={}", "--set", "run.duration_ms=1", "--set", "run.warmup_ms=0.5", "--json", check_rc=0)


def test_a_fitted_value_beyond_any_latency_is_not_written_and_said():
    # issue 64 item 15: a measurement handed to fit() without load()'s checks, or a value fit derives from
    # several, can pass what a profile holds: it is not written, and the fit says so.
    base = dict(iommulab._core.builtin_profiles())["vtd-server"]
    f = measure.fit(base, {"functions": {"iommu_iova_to_phys": {"calls": 100, "mean_ns": 1e308,
                                                                "self_mean_ns": 1e308, "by": {}}}})
    assert "cpu.pgtable_walk_ns" not in f.values
    assert any(s.startswith("cpu.pgtable_walk_ns:") for s in f.skipped), f.skipped
    assert "pgtable_walk_ns = 0\n" in measure.fitted_profile("vtd-server", f)
    for bad in (float("nan"), float("inf"), -1.0, True, measure.MAX_LATENCY_NS * 1.5):
        assert not f.set("cpu.fq_entry_ns", bad, "test") and "cpu.fq_entry_ns" not in f.values


def test_a_host_name_with_a_line_break_or_escapes_stays_in_its_comment(tmp_path):
    # issue 64 item 16: the measurement's host went raw into the profile's first comment line (a line break
    # there starts a TOML line of the host's making) and to the terminal (ESC sequences).
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"format": 1, "host": "box\n[cpu]\x1b[2J", "functions": {
        "iommu_iova_to_phys": {"calls": 100, "mean_ns": 500, "self_mean_ns": 500}}}))
    r = cli("profile", "fit", str(m), "--base", "vtd-server", "-o", str(tmp_path / "p.toml"), check_rc=0)
    assert "\x1b" not in r.stdout
    doc = tomllib.loads((tmp_path / "p.toml").read_text())
    assert doc["cpu"]["pgtable_walk_ns"] == 500
    assert (tmp_path / "p.toml").read_text().splitlines()[0].startswith("# Fitted by iommulab profile fit")


def test_measure_does_not_name_the_temporary_trace_it_deletes(tmp_path):
    # issue 64 item 16: "capture: wrote /tmp/iommulab-measure-…/trace.txt" named a file deleted a moment later.
    s = standin(tmp_path)
    out = tmp_path / "m.json"
    p = s.iommulab("profile", "measure", "-o", str(out), "--duration", "1")
    assert p.returncode == 0, p.stderr
    assert "iommulab-measure-" not in p.stderr + p.stdout, p.stderr
    assert f"wrote the recorded trace (temporary: summarised into {out}, then deleted)" in p.stderr, p.stderr
    assert json.loads(out.read_text())["functions"]["iommu_dma_map_page"]["calls"] == 25
    p = s.iommulab("profile", "measure", "-o", str(tmp_path / "n.json"), "--duration", "1", "--dry-run")
    assert p.returncode == 0 and "iommulab-measure-" not in p.stderr + p.stdout, p.stdout + p.stderr
    # A trace the user keeps is named by its path.
    kept = tmp_path / "kept.txt"
    p = s.iommulab("profile", "measure", "-o", str(tmp_path / "k.json"), "--duration", "1", "--keep-trace", str(kept))
    assert p.returncode == 0 and f"wrote {kept}" in p.stderr and kept.exists(), p.stderr
