"""`iommulab sweep`: the sweep file, runs on every core, a resumable Parquet dataset, Ray, and the Python API."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import polars as pl
import pytest
from hypothesis import given, strategies as st

import iommulab
from conftest import cli
from iommulab import sweeps

# 5 policies x 8 queue counts x 5 seeds = 200 runs of 1 ms (page_pool pinned: the default scenario compares it).
BIG = """\
scenario = "default"
description = "200 points"
[set]
"run.duration_ms" = 1
"run.warmup_ms" = 0.5
"workload.nic_rx.page_pool" = true
[axes]
"os.policy" = ["strict", "lazy", "passthrough", "fns", "xsmmu"]
"workload.nic_rx.queues" = { from = 1, to = 8, step = 1 }
"run.seed" = { from = 1, to = 5, step = 1 }
[derived]
gbps_per_cpu = "throughput_gbps / cpu_busy"
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 200-run sweep, run once to the end into a dataset."""
    d = tmp_path_factory.mktemp("big")
    f = d / "big.toml"
    f.write_text(BIG)
    out = d / "out"
    df = iommulab.sweep(f, out=out)
    return f, out, df


def same(a, b):
    """Equal frames, whatever order their columns came in (parts written at different times add columns in
    the order they first appeared)."""
    cols = sorted(a.columns)
    return cols == sorted(b.columns) and a.select(cols).equals(b.select(cols))


def _key(df):
    return df.select(["scenario_hash", "overrides"]).rows()


# A sweep in a process of its own that holds still once `{hold}` (over frac, the run's progress, and out) is true
# in a progress callback: it says so on stdout and waits there until the test kills it. Progress is called under
# run_each's lock, so every other run stops at its next step too.
HELD = """
import glob, os, sys, threading
import iommulab
out = sys.argv[2]
def progress(i, n, label, frac):
    if {hold}:
        print("held", flush=True)
        threading.Event().wait()
iommulab.sweep(sys.argv[1], out=out, jobs=int(sys.argv[3]), progress=progress)
"""


def _held_sweep(f, out, jobs: int, hold: str) -> subprocess.Popen:
    """A sweep of `f` into `out`, returned once it holds (see HELD). The 300 s only turn a sweep that never gets
    there into a failure."""
    p = subprocess.Popen([sys.executable, "-c", HELD.format(hold=hold), str(f), str(out), str(jobs)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if select.select([p.stdout], [], [], 300)[0] and p.stdout.readline() == "held\n":
        return p
    p.kill()
    _, err = p.communicate()
    pytest.fail(f"the sweep never held: rc {p.returncode}, {err[-2000:]}")


def test_a_200_point_sweep_writes_every_run_once_with_its_axes(big):
    f, out, df = big
    assert df.height == 200 and len(set(_key(df))) == 200
    assert df["run"].to_list() == list(range(200))
    assert df["os.policy"].unique().sort().to_list() == sorted(["strict", "lazy", "passthrough", "fns", "xsmmu"])
    assert df["workload.nic_rx.queues"].unique().sort().to_list() == list(range(1, 9))
    # The seed axis is the run's seed; every scalar result is a column, nested ones flattened.
    assert df["seed"].to_list() == df["run.seed"].to_list()
    assert {"throughput_gbps", "invalidations.psi", "safety.exposed_share", "iommulab_version", "gbps_per_cpu"} \
        <= set(df.columns)
    assert (df["gbps_per_cpu"] - df["throughput_gbps"] / df["cpu_busy"]).abs().max() < 1e-12
    # Strict invalidates once per unmapped page, passthrough never.
    assert df.filter(pl.col("os.policy") == "strict")["inv_per_page"].min() > 0.99
    assert df.filter(pl.col("os.policy") == "passthrough")["invalidations.total"].max() == 0
    # The dataset reads back the same through the API, and aggregates the seeds on request.
    assert same(iommulab.load(out), df)
    agg = iommulab.load(out, aggregate=True)
    assert agg.height == 40 and set(agg["seeds"].to_list()) == {5}
    row = agg.row(0, named=True)
    assert row["throughput_gbps.min"] <= row["throughput_gbps"] <= row["throughput_gbps.max"]


def test_results_do_not_depend_on_the_number_of_workers(big, tmp_path):
    f, out, df = big
    small = {"scenario": "default", "set": {"run.duration_ms": 1, "run.warmup_ms": 0.5},
             "axes": {"os.policy": ["strict", "lazy"], "workload.nic_rx.queues": [1, 4]}}
    one = iommulab.sweep(small, jobs=1)
    two = iommulab.sweep(small, jobs=2)
    # The default scenario's own [compare] (page_pool) becomes a column too: 2 x 2 x 2 runs.
    assert one.height == 8 and "workload.nic_rx.page_pool" in one.columns
    assert same(one, two)


def test_a_killed_sweep_resumes_and_ends_with_every_run_once(big, tmp_path):
    f, _, full = big
    out = tmp_path / "killed"
    # Killed half-way, whatever the machine's speed: once a part is on disk, a run ending holds the sweep
    # (that run never finishes) until the SIGKILL.
    p = _held_sweep(f, out, 2, "frac == 1.0 and glob.glob(os.path.join(out, 'part-*.parquet'))")
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    first = iommulab.load(out)
    assert 0 < first.height < 200, "the sweep should have been killed half-way"
    p = cli("sweep", str(f), "--out", str(out), "--no-progress", check_rc=0)
    assert f"{first.height} already in" in p.stderr
    df = iommulab.load(out)
    assert df.height == 200 and len(set(_key(df))) == 200
    # Same rows as the sweep that was never interrupted.
    assert same(df, full)
    # A third run has nothing left to do.
    p = cli("sweep", str(f), "--out", str(out), "--no-progress", check_rc=0)
    assert "200 already in" in p.stderr and iommulab.load(out).height == 200


def test_ray_gives_the_local_results(tmp_path):
    ray = pytest.importorskip("ray")
    # BIG's first 20 points (Ray's start, not the runs, is most of the time; the 200 would only add tasks).
    f = tmp_path / "small.toml"
    f.write_text(BIG.replace('"workload.nic_rx.queues" = { from = 1, to = 8, step = 1 }',
                             '"workload.nic_rx.queues" = [1, 8]').replace("to = 5", "to = 2"))
    local = iommulab.sweep(f, jobs=2)
    try:
        df = iommulab.sweep(f, ray=True, jobs=2)
    finally:
        ray.shutdown()
    assert df.height == 20 and same(df, local)


def test_sweep_cli_prints_a_summary_and_writes_the_report(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('scenario = "default"\nseeds = 2\n[set]\n"run.duration_ms" = 1\n"run.warmup_ms" = 0.5\n'
                 '"workload.nic_rx.page_pool" = true\n[axes]\n"os.policy" = ["strict", "lazy"]\n'
                 '"workload.nic_rx.ring_size" = { from = 256, to = 1024, times = 2 }\n')
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--report", str(tmp_path / "r.html"), "--no-progress",
            check_rc=0)
    lines = p.stdout.splitlines()
    assert lines[0].split()[:3] == ["policy", "ring_size", "Gbps"] and "mean over 2 seeds" in p.stdout
    assert len([l for l in lines if l.strip().startswith(("strict", "lazy"))]) == 6
    page = (tmp_path / "r.html").read_text()
    assert page.count("Plotly.newPlot") == 3  # throughput/exposure, goodput and CPU time, metrics against the ring size
    # The report and the CSV from the dataset; nothing the user has is overwritten.
    cli("report", str(tmp_path / "o"), "-o", str(tmp_path / "r.html"), check_rc=2)
    cli("report", str(tmp_path / "o"), "-o", str(tmp_path / "r2.html"), "--csv", str(tmp_path / "r.csv"), check_rc=0)
    csv = pl.read_csv(tmp_path / "r.csv")
    assert csv.height == 12 and "throughput_gbps" in csv.columns


@pytest.mark.parametrize("text, words", [
    ('[axes]\n"os.policy" = ["strict"]\n', ['missing key "scenario"']),
    ('scenario = "nope-not-here"\n', ["nope-not-here", "no such file"]),
    ('scenario = "default"\nbogus = 1\n', ["unknown key 'bogus'"]),
    ('scenario = "default"\n[axes]\n"os.policy" = []\n', ["axes.os.policy", "non-empty list"]),
    ('scenario = "default"\n[axes]\n"os.policy" = ["strict", "strict"]\n', ["axes.os.policy", "twice"]),
    ('scenario = "default"\n[axes]\nq = { from = 4, to = 1, step = 1 }\n', ["axes.q", "from <= to"]),
    ('scenario = "default"\n[axes]\nq = { from = 1, to = 8, times = 1 }\n', ["axes.q", "times > 1"]),
    ('scenario = "default"\n[axes]\nq = { from = 1, to = 1e9, step = 1 }\n', ["axes.q", "at most"]),
    ('scenario = "default"\nseeds = 0\n', ["seeds"]),
    ('scenario = "default"\nseeds = 2\n[axes]\n"run.seed" = [1, 2]\n', ["run.seed"]),
    ('scenario = "default"\n[axes]\n"os.polcy" = ["strict"]\n', ["os.polcy"]),
    ('scenario = "default"\n[derived]\nx = "throughput_gbps +* ("\n', ["derived.x"]),
    ('scenario = "default"\n[axes\n', ["s.toml"]),
])
def test_bad_sweep_files_get_one_line_errors(tmp_path, text, words):
    f = tmp_path / "s.toml"
    f.write_text(text)
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert all(w in p.stderr for w in words), p.stderr
    assert "s.toml" in p.stderr
    assert not list((tmp_path / "o").glob("part-*")) if (tmp_path / "o").exists() else True


def test_a_directory_that_is_not_a_dataset_is_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "sweep.json").write_text("my own notes")
    f = tmp_path / "s.toml"
    f.write_text('scenario = "default"\n[set]\n"run.duration_ms" = 1\n"run.warmup_ms" = 0.5\n')
    p = cli("sweep", str(f), "--out", str(out), "--no-progress")
    assert p.returncode == 2 and "not a sweep dataset" in p.stderr and p.stderr.count("\n") == 1
    assert (out / "sweep.json").read_text() == "my own notes" and len(list(out.iterdir())) == 1


def test_ranges_expand_as_written():
    assert sweeps._axis("s", "k", {"from": 1, "to": 16, "step": 3}) == [1, 4, 7, 10, 13, 16]
    assert sweeps._axis("s", "k", {"from": 64, "to": 4096, "times": 2}) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert sweeps._axis("s", "k", {"from": 0.1, "to": 0.5, "step": 0.1}) == [0.1, 0.2, 0.3, 0.4, 0.5]


def test_a_dataset_of_another_version_is_not_mixed_in(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    pl.DataFrame({"scenario_hash": ["x"], "overrides": ["{}"], "iommulab_version": ["0.0.1"]}).write_parquet(
        out / "part-old-00000.parquet")
    p = cli("sweep", "/dev/null", "--out", str(out))
    assert p.returncode == 2
    f = tmp_path / "s.toml"
    f.write_text('scenario = "default"\n')
    p = cli("sweep", str(f), "--out", str(out), "--no-progress")
    assert p.returncode == 2 and "0.0.1" in p.stderr and p.stderr.count("\n") == 1


# --- a dataset has one writer, and one sweep --------------------------------------------------------------

def _sweep_file(tmp_path, axes, name="s.toml", sets='"os.policy" = "strict"\n', seeds=1, duration_ms=0.2):
    """A sweep of the default scenario with page_pool pinned (and, by default, the policy: one run per point
    and seed)."""
    f = tmp_path / name
    f.write_text(f'scenario = "default"\nseeds = {seeds}\n[set]\n"run.duration_ms" = {duration_ms}\n'
                 f'"run.warmup_ms" = 0.1\n"workload.nic_rx.page_pool" = true\n{sets}[axes]\n{axes}')
    return f


def _one_line_error(p, *words):
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert all(w in p.stderr for w in words), p.stderr


def test_a_second_sweep_into_a_dataset_being_written_is_refused_naming_the_first(tmp_path):
    # issue 6: two sweeps into one --out wrote 288 rows for 144 runs, overwrote a part, or crashed on
    # sweep.json.tmp.
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1, 2, 3]\n')
    out = tmp_path / "o"
    # The first holds at its first run's first step: it has the dataset's lock and is still running.
    first = _held_sweep(f, out, 1, "True")
    try:
        p = cli("sweep", str(f), "--out", str(out), "--no-progress")
        _one_line_error(p, f"another sweep (PID {first.pid}) is writing it")
        assert first.poll() is None, "the first sweep ended before the second was refused: make its runs longer"
    finally:
        first.kill()
        first.wait()
    # A killed sweep's lock goes with it.
    from iommulab import dataset

    with dataset.locked(str(out)):
        pass


def test_values_added_to_an_axis_keep_each_run_its_number_and_give_new_runs_new_ones(tmp_path):
    # issue 8: adding values to a resumed sweep's axis numbered two rows run=2 and none run=4.
    out = tmp_path / "o"
    small = _sweep_file(tmp_path, '"os.policy" = ["strict", "lazy"]\n"workload.nic_rx.queues" = [1, 2]\n',
                        "small.toml", sets="")
    grown = _sweep_file(tmp_path, '"os.policy" = ["strict", "lazy"]\n"workload.nic_rx.queues" = [1, 2, 4]\n',
                        "grown.toml", sets="", seeds=2)
    cols = ["run", "point", "os.policy", "workload.nic_rx.queues", "seed"]
    before = iommulab.sweep(small, out=out).select(cols).rows()
    after = iommulab.sweep(grown, out=out).select(cols)
    assert after.height == 12 and after["run"].n_unique() == 12
    assert set(before) <= set(after.rows()), "a run already in the dataset changed its number"
    # Each point keeps one number over its seeds, and no two points share one.
    by_point = after.group_by(["os.policy", "workload.nic_rx.queues"]).agg(pl.col("point").unique())
    assert all(len(p) == 1 for p in by_point["point"]) and by_point["point"].list.first().n_unique() == 6
    # Numbers are the sweep's, not the order runs happened to finish in: run again elsewhere, the same.
    again = tmp_path / "again"
    iommulab.sweep(small, out=again)
    assert same(iommulab.sweep(grown, out=again).select(cols), after)


QUEUES = '"workload.nic_rx.queues" = [1, 2]\n'


@pytest.mark.parametrize("other", [
    {"axes": QUEUES, "scenario": "c1"},  # another base scenario
    {"axes": QUEUES, "duration_ms": 0.3},  # another [set]
    {"axes": QUEUES + '"workload.nic_rx.ring_size" = [512]\n'},  # other axes
])
def test_a_dataset_of_another_sweep_is_refused_and_left_as_it_was(tmp_path, other):
    # issue 8: a different sweep file into the same --out silently mixed two datasets.
    out = tmp_path / "o"
    f = _sweep_file(tmp_path, QUEUES)
    cli("sweep", str(f), "--out", str(out), "--no-progress", check_rc=0)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    g = _sweep_file(tmp_path, name="other.toml", **{k: v for k, v in other.items() if k != "scenario"})
    g.write_text(g.read_text().replace('"default"', f'"{other.get("scenario", "default")}"'))
    _one_line_error(cli("sweep", str(g), "--out", str(out), "--no-progress"), "holds another sweep",
                    "give another --out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


# --- checked before the first run ---------------------------------------------------------------------------

@pytest.mark.parametrize("derived, words", [
    ('x = "no_such_column * 2"', ["derived.x", "no column 'no_such_column'"]),
    ('x = "0.0 / 0.0"', ["derived.x", "division by zero"]),
    ('x = "(select 1)"', ["derived.x"]),
    ('throughput_gbps = "0"', ["derived.throughput_gbps", "another name"]),
    ('"workload.nic_rx.queues" = "1"', ["derived.workload.nic_rx.queues", "another name"]),
    ('run = "1"', ["derived.run", "another name"]),
    ('x = "\\"invalidations.tlbi_nh_va\\" + 1"', ["derived.x", "invalidations.tlbi_nh_va"]),
])
def test_derived_columns_are_checked_against_the_runs_columns_before_any_run(tmp_path, derived, words):
    # issue 9: these failed only once the whole sweep had run (and then blocked `report`), or silently
    # replaced a result column.
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1, 2]\n')
    f.write_text(f.read_text() + f"[derived]\n{derived}\n")
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress")
    _one_line_error(p, "s.toml", *words)
    assert not (tmp_path / "o").exists()


def test_a_derived_column_of_a_result_no_run_reported_is_null_and_json_has_no_nan(tmp_path):
    # issue 9: --json printed NaN and Infinity (not JSON); a column only some runs report (no page was
    # exposed under strict) made the dataset unreadable.
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1, 2]\n')
    f.write_text(f.read_text() + '[derived]\nwin_ms = "\\"safety.window.p99_us\\" / 1000"\n'
                 'inf = "throughput_gbps / 0"\nnan = "(throughput_gbps - throughput_gbps) / 0"\n')
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress", "--json", check_rc=0)

    def refuse(name):
        raise AssertionError(f"{name} in --json output")

    runs = json.loads(p.stdout, parse_constant=refuse)["runs"]
    assert [(r["win_ms"], r["inf"], r["nan"]) for r in runs] == [(None, None, None)] * 2
    cli("report", str(tmp_path / "o"), check_rc=0)


# --- what a SIGKILL loses -----------------------------------------------------------------------------------

def test_a_finished_run_is_on_disk_while_others_still_run(tmp_path):
    # issue 10: rows waited in memory for 64 more or for the next run to finish after 5 s, so a SIGKILL lost
    # up to 63 finished runs, not only those in flight. Once the short run has ended, the long one holds in its
    # progress callback until the short one's part is on disk (the writer's tick writes it FLUSH_SECONDS after
    # the last part); under the bug it never is, and the safety timeout fails the test.
    out = tmp_path / "o"
    doc = {"scenario": "default", "set": {"os.policy": "strict", "workload.nic_rx.page_pool": True,
                                          "run.warmup_ms": 0.1},
           "axes": {"run.duration_ms": [0.2, 50_000]}}
    seen: dict[str, int] = {}

    class Seen(Exception):
        pass

    def progress(i, n, label, frac):
        if i == 0 and frac == 1.0:
            seen["short"] = 1
        if i == 1 and "short" in seen:
            hang = time.monotonic() + 300  # a hang made a failure, not a bound on speed
            while not list(out.glob("part-*.parquet")):
                assert time.monotonic() < hang, "the short run's row never reached the disk while the long one ran"
                time.sleep(0.05)
            seen["parts"] = len(list(out.glob("part-*.parquet")))
            raise Seen

    with pytest.raises(Seen):
        iommulab.sweep(doc, out=out, jobs=2, progress=progress)
    assert seen["parts"] == 1, "the short run's row was not on disk while the long one ran"


# --- memory does not grow with the sweep --------------------------------------------------------------------

MILLION = {"scenario": "default", "seeds": 1_000_000,
           "set": {"os.policy": "strict", "workload.nic_rx.page_pool": True, "run.duration_ms": 0.01,
                   "run.warmup_ms": 0.01}}


def test_a_million_seeds_start_running_before_their_points_are_built(tmp_path, monkeypatch):
    # issue 7: `seeds = 1000000` built every run in memory before running any (2.4 GB after 60 s).
    loads = []
    real = sweeps._load

    def counted(sw, keys):
        loads.append(1)
        assert len(loads) < 100, "the sweep loads its points before running them"
        return real(sw, keys)

    class Started(Exception):
        pass

    def progress(i, n, label, frac):
        assert n == 1_000_000
        raise Started

    monkeypatch.setattr(sweeps, "_load", counted)
    with pytest.raises(Started):
        iommulab.sweep(MILLION, out=tmp_path / "o", jobs=2, progress=progress)


def test_a_million_seed_sweep_runs_in_bounded_memory(tmp_path):
    # issue 7, measured: the resident set after 500 and after 3000 runs of the million (about 80 MB both here).
    code = f"""
import os, iommulab
done = []
def progress(i, n, label, frac):
    done.append(1) if frac == 1.0 else None
    if frac == 1.0 and len(done) in (500, 3000):
        print(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20, flush=True)
        if len(done) == 3000:
            os._exit(0)
iommulab.sweep({MILLION!r}, out={str(tmp_path / "o")!r}, jobs=2, progress=progress)
"""
    # 3000 runs take about a minute on a busy 2-core machine: the timeout only turns a hang into a failure.
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    early, late = map(int, p.stdout.split())
    assert late - early < 20 and late < 400, f"resident {early} MB after 500 runs, {late} MB after 3000"


# --- one line, not a traceback ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    (b'scenario = "default"\ndescription = "\xff\xfe"\n', ["s.toml:2", "not UTF-8"]),
    (b'scenario = "default"\n[axes]\nx = { from = 0.0, to = 1e308, step = 1e-308 }\n', ["axes.x", "at most"]),
    (b'scenario = "default"\n[axes]\nx = { from = -1e308, to = 1e308, step = 1.0 }\n', ["axes.x", "at most"]),
    (b'scenario = "default"\n[axes]\nx = { from = 1, to = 2, times = 1.0000000000000002 }\n', ["axes.x", "at most"]),
    (b'scenario = "default"\n[axes]\nx = { from = 1, to = 99999999999999999999, step = 1 }\n', ["axes.x", "64 bits"]),
    (b'scenario = "default"\n[axes]\nx = [1979-05-27]\n', ["axes.x", "scalar values"]),
])
def test_hostile_sweep_files_get_one_line_errors_at_once(tmp_path, text, words):
    # issue 11: a traceback (UnicodeDecodeError, OverflowError), or a range that would never end.
    f = tmp_path / "s.toml"
    f.write_bytes(text)
    # A range that would never end hangs: cli's timeout fails it (a hang, not a bound on speed).
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress")
    _one_line_error(p, *words)
    assert not (tmp_path / "o").exists()


def test_an_out_that_cannot_be_a_directory_gets_one_line(tmp_path):
    # issue 11: --out under a regular file was a NotADirectoryError traceback (a path under a file stands for
    # an unwritable parent: the tests may run as root, whom permissions do not stop).
    (tmp_path / "afile").write_text("")
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1]\n')
    _one_line_error(cli("sweep", str(f), "--out", str(tmp_path / "afile" / "out"), "--no-progress"),
                    "afile/out", "cannot create")


def test_ray_missing_is_said_before_out_is_made(tmp_path):
    # issue 11: --ray without Ray created --out first.
    (tmp_path / "noray").mkdir()
    (tmp_path / "noray" / "ray.py").write_text('raise ImportError("no Ray here")\n')
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1]\n')
    path = os.pathsep.join([str(tmp_path / "noray"), *sys.path])
    p = cli("sweep", str(f), "--out", str(tmp_path / "o"), "--ray", "--no-progress", env={"PYTHONPATH": path})
    _one_line_error(p, "--ray needs Ray")
    assert not (tmp_path / "o").exists()


@pytest.fixture
def dataset_dir(tmp_path):
    f = _sweep_file(tmp_path, '"workload.nic_rx.queues" = [1, 2]\n')
    cli("sweep", str(f), "--out", str(tmp_path / "o"), "--no-progress", check_rc=0)
    return f, tmp_path / "o"


def test_a_malformed_sweep_json_is_said_in_one_line_and_kept(dataset_dir, tmp_path):
    # issue 11: report read it as no sweep at all; sweep overwrote it.
    f, out = dataset_dir
    (out / "sweep.json").write_text('{"derived": ')
    for args in (("report", str(out), "-o", str(tmp_path / "r.html")), ("sweep", str(f), "--out", str(out))):
        _one_line_error(cli(*args, "--no-progress") if args[0] == "sweep" else cli(*args), "sweep.json",
                        "not the record of a sweep")
    assert (out / "sweep.json").read_text() == '{"derived": ' and not (tmp_path / "r.html").exists()


def test_report_refuses_parquet_that_is_not_results_in_one_line(dataset_dir, tmp_path):
    # issue 11: an unrelated Parquet file gave an empty report and exit 0; text in throughput_gbps a traceback.
    _, out = dataset_dir
    pl.DataFrame({"a": [1], "b": ["x"]}).write_parquet(tmp_path / "other.parquet")
    _one_line_error(cli("report", str(tmp_path / "other.parquet")), "not sweep results",
                    "no column run, iommulab_version, label, throughput_gbps")
    runs = iommulab.load(out)
    runs.with_columns(pl.lit("fast").alias("throughput_gbps")).write_parquet(tmp_path / "text.parquet")
    _one_line_error(cli("report", str(tmp_path / "text.parquet")), "column throughput_gbps holds String")
    # Nulls (a run without the figure) are drawn as no marker.
    runs.with_columns(pl.lit(None, pl.Float64).alias("throughput_gbps")).write_parquet(tmp_path / "null.parquet")
    cli("report", str(tmp_path / "null.parquet"), "-o", str(tmp_path / "null.html"), check_rc=0)


def test_report_checks_both_outputs_before_writing_either(dataset_dir, tmp_path):
    # issue 11: --csv to a bad path failed after the HTML was written.
    _, out = dataset_dir
    (tmp_path / "afile").write_text("")
    p = cli("report", str(out), "-o", str(tmp_path / "r.html"), "--csv", str(tmp_path / "afile" / "r.csv"))
    _one_line_error(p, "--csv", "cannot write")
    assert not (tmp_path / "r.html").exists()


# --- any TOML document: a sweep or a ScenarioError ----------------------------------------------------------

NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 2**63, 2**63 - 1, 1e308, -1e308, 5e-324, 1e-308, 1.0000000000000002]))
SCALARS = st.one_of(NUMBERS, st.booleans(), st.text(max_size=8), st.dates())
RANGES = st.one_of(st.fixed_dictionaries({"from": NUMBERS, "to": NUMBERS},
                                          optional={"step": NUMBERS, "times": NUMBERS}),
                   st.dictionaries(st.sampled_from(["from", "to", "step", "times", "by"]),
                                   st.one_of(NUMBERS, st.text(max_size=3)), max_size=4))
AXIS = st.one_of(st.lists(st.one_of(SCALARS, st.lists(SCALARS, max_size=2)), max_size=5), RANGES, RANGES, SCALARS)
KEYS = st.one_of(st.sampled_from(["os.policy", "run.seed", "workload.nic_rx.queues", "run", "x"]), st.text(max_size=8))
DERIVED = st.one_of(st.sampled_from(["throughput_gbps / cpu_busy", "(select 1)", "0.0 / 0.0", "sum(", "\"a.b\" + 1",
                                     "x' OR 1=1 --", "CAST(run AS INT)", "*"]), st.text(max_size=20), NUMBERS)
SCENARIOS = st.one_of(st.sampled_from(["default", "nvme", "nope", "", "/", "a\x00b"]), st.text(max_size=8), NUMBERS,
                      st.dictionaries(st.text(max_size=4), SCALARS, max_size=2))
# Mostly tables of the right kind and the built-in default scenario, so the checks after the first are reached.
TABLES = {"description": SCALARS, "seeds": st.integers(1, 3), "set": st.dictionaries(KEYS, SCALARS, max_size=3),
          "axes": st.dictionaries(KEYS, AXIS, max_size=3), "derived": st.dictionaries(KEYS, DERIVED, max_size=3)}
ANYTHING = {"scenario": SCENARIOS, "bogus": SCALARS, "seeds": st.one_of(NUMBERS, st.text(max_size=3)),
            **{k: st.one_of(TABLES[k], SCALARS) for k in ("description", "set", "axes", "derived")}}
GOOD = st.fixed_dictionaries({"scenario": st.just("default")}, optional=TABLES)
DOCS = st.one_of(GOOD, GOOD, GOOD, st.fixed_dictionaries({}, optional=ANYTHING))


@given(doc=DOCS)
def test_any_toml_document_is_a_sweep_or_a_scenario_error(tmp_path_factory, doc):
    import tomli_w

    try:
        text = tomli_w.dumps(doc)
    except (TypeError, ValueError):  # not expressible in TOML (a NUL in a key, a date in a float's place)
        text = None
    for attempt in (lambda: sweeps.parse(doc), lambda: _read_text(tmp_path_factory, text)):
        try:
            attempt()
        except iommulab.ScenarioError as e:
            assert "\n" not in str(e).strip()


def _read_text(tmp_path_factory, text):
    if text is not None:
        f = tmp_path_factory.mktemp("s") / "s.toml"
        f.write_text(text)
        sweeps.read(f)


@given(data=st.binary(max_size=200))
def test_any_bytes_are_a_sweep_or_a_scenario_error(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("s") / "s.toml"
    f.write_bytes(b'scenario = "default"\n' + data)
    try:
        sweeps.read(f)
    except iommulab.ScenarioError as e:
        assert "\n" not in str(e).strip()
