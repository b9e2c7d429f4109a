"""`iommulab capture`: the shipped POSIX script against a stand-in tracefs (a directory with tracefs's files, its
trace_pipe holding a real guest's events): it records, brackets the phase, counts lost events, restores every
setting it touched, writes a file replay reads, and fails in one line where it cannot run."""

import gzip
import lzma
import os
import pathlib
import shutil
import subprocess

import pytest

import iommulab
from conftest import cli

TRACE = pathlib.Path(__file__).parent / "data" / "testbed" / "k6.12-intel-cmoff-strict" / "guest-trace.txt.xz"


def fake_tracefs(root: pathlib.Path) -> pathlib.Path:
    t = root / "tracing"
    for rel, text in [("trace_marker", ""), ("trace", ""), ("buffer_size_kb", "1408\n"), ("tracing_on", "1\n"),
                      ("events/iommu/map/enable", "0\n"), ("events/iommu/unmap/enable", "0\n"),
                      ("per_cpu/cpu0/stats", "entries: 10\noverrun: 3\n"), ("per_cpu/cpu1/stats", "overrun: 0\n")]:
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        (t / rel).write_text(text)
    events = [l for l in lzma.open(TRACE, "rt").read().splitlines() if ": map: IOMMU" in l or ": unmap: IOMMU" in l]
    (t / "trace_pipe").write_text("\n".join(events[:2000]) + "\n")
    return t


def run_capture(t, *args):
    env = dict(os.environ, IOMMULAB_TRACEFS=str(t))
    return subprocess.run(["iommulab", "capture", *args], capture_output=True, text=True, env=env)


def test_capture_records_restores_and_replays(tmp_path):
    t = fake_tracefs(tmp_path)
    out = tmp_path / "trace.txt.gz"
    p = run_capture(t, "-o", str(out), "--duration", "1", "--phase", "net")
    assert p.returncode == 0, p.stderr
    # Everything it touched is as it was.
    assert (t / "buffer_size_kb").read_text().strip() == "1408"
    assert (t / "tracing_on").read_text().strip() == "1"
    assert (t / "events/iommu/map/enable").read_text().strip() == "0"
    assert "TB_END net" in (t / "trace_marker").read_text()
    # Overruns are reported, in its output and in the trace.
    assert "3 events were lost" in p.stderr
    text = gzip.open(out, "rt").read()
    assert "# iommulab capture: 3 events lost" in text
    res = iommulab.replay(out, kernel="6.12", cmdline="iommu.strict=1")
    counts = res["phases"]["_outside"]["counts"]
    assert counts["map_events"] + counts["unmap_events"] == 2000
    # Domains are recorded by default where kprobes are allowed; this stand-in has no kprobe_events, and the
    # capture says so (and not when told to leave them out).
    assert "no kprobes here" in p.stderr and "no kprobe on fq_flush_timeout" in p.stderr
    p = run_capture(t, "-o", str(tmp_path / "again.txt"), "--duration", "1", "--no-domains")
    assert p.returncode == 0 and "no kprobes here" not in p.stderr and "fq_flush_timeout" in p.stderr
    p = run_capture(t, "-o", str(tmp_path / "again2.txt"), "--duration", "1", "--no-domains", "--no-timer")
    assert p.returncode == 0 and "kprobe" not in p.stderr


def test_a_ring_buffer_not_used_since_boot_gets_its_size_back(tmp_path):
    # Until first used, buffer_size_kb reads "7 (expanded: 1408)": the size to restore is 1408.
    t = fake_tracefs(tmp_path)
    (t / "buffer_size_kb").write_text("7 (expanded: 1408)\n")
    p = run_capture(t, "-o", str(tmp_path / "t.txt"), "--duration", "1")
    assert p.returncode == 0 and "syntax error" not in p.stderr, p.stderr
    assert (t / "buffer_size_kb").read_text().strip() == "1408"


def test_without_kprobes_the_dma_apis_events_name_the_devices(tmp_path):
    # A kernel with the DMA API's events (6.12+) and no kprobes: the capture records those instead, says so,
    # and leaves them as it found them.
    t = fake_tracefs(tmp_path)
    for e in ("dma_map_page", "dma_unmap_page", "dma_map_sg", "dma_unmap_sg"):
        (t / "events/dma" / e).mkdir(parents=True)
        (t / "events/dma" / e / "enable").write_text("0\n")
    p = run_capture(t, "-o", str(tmp_path / "t.txt"), "--duration", "1", "--no-timer")
    assert p.returncode == 0, p.stderr
    assert "the DMA API's events name each mapping's device instead" in p.stderr
    assert all((t / "events/dma" / e / "enable").read_text().strip() == "0"
               for e in ("dma_map_page", "dma_unmap_page", "dma_map_sg", "dma_unmap_sg"))
    p = run_capture(t, "-o", str(tmp_path / "t2.txt"), "--dry-run", "--no-timer")
    assert "would: echo 1 > " + str(t / "events/dma/dma_map_sg/enable") in p.stdout


def test_nothing_is_overwritten_and_dry_run_changes_nothing(tmp_path):
    t = fake_tracefs(tmp_path)
    out = tmp_path / "t.txt"
    out.write_text("mine")
    p = run_capture(t, "-o", str(out), "--duration", "1")
    assert p.returncode == 2 and "exists" in p.stderr and out.read_text() == "mine"
    before = {f: f.read_text() for f in t.rglob("*") if f.is_file()}
    p = run_capture(t, "-o", str(tmp_path / "new.txt"), "--dry-run")
    assert p.returncode == 0 and "would" in p.stdout
    assert {f: f.read_text() for f in t.rglob("*") if f.is_file()} == before
    assert not (tmp_path / "new.txt").exists()


def test_without_tracefs_it_fails_in_one_line(tmp_path):
    p = run_capture(tmp_path / "nowhere", "-o", str(tmp_path / "t.txt"), "--duration", "1")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "tracefs" in p.stderr


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_the_script_is_posix_sh(shell, tmp_path):
    if not shutil.which(shell):
        pytest.skip(f"{shell} not installed")
    script = tmp_path / "capture.sh"
    script.write_text(cli("capture", "--print-script", check_rc=0).stdout)
    cmd = [shell, "-n", str(script)] if shell == "dash" else ["busybox", "sh", "-n", str(script)]
    assert subprocess.run(cmd).returncode == 0
