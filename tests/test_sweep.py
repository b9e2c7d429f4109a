"""`iommulab sweep`: the sweep file, runs on every core, a resumable Parquet dataset, Ray, and the Python API."""

import os
import signal
import subprocess
import sys
import time

import polars as pl
import pytest

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
    args = [sys.executable, "-m", "iommulab", "sweep", str(f), "--out", str(out), "--no-progress", "--jobs", "2"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
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


def test_ray_gives_the_local_results(big):
    ray = pytest.importorskip("ray")
    f, _, full = big
    try:
        df = iommulab.sweep(f, ray=True, jobs=2)
    finally:
        ray.shutdown()
    assert same(df, full)


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
    assert page.count("Plotly.newPlot") == 2  # throughput/exposure, and metrics against the ring size
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
