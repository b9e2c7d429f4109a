"""`iommulab capture`: the shipped POSIX script against a stand-in tracefs (a directory with tracefs's files, its
trace_pipe holding a real guest's events): it records, brackets the phase, counts lost events, restores every
setting it touched, writes a file replay reads, and fails in one line where it cannot run."""

import gzip
import lzma
import os
import pathlib
import shutil
import subprocess
import threading
import time

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
    # Overruns, and events left in the ring buffer when the reader stopped (this stand-in's reader ends at the
    # end of its file with 10 still counted), are reported, in its output and in the trace.
    assert "3 events were lost" in p.stderr and "10 events were recorded but not read" in p.stderr
    text = gzip.open(out, "rt").read()
    assert "# iommulab capture: 3 events lost" in text and "# iommulab capture: 10 events lost" in text
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


def test_a_reader_lagging_behind_the_recording_drains_the_ring_buffer_before_it_stops(tmp_path):
    # A slow reader (a guest formatting events slowly) has read half of what was recorded when recording stops:
    # the capture waits until the ring buffer holds nothing unread, and keeps the rest.
    t = fake_tracefs(tmp_path)
    events = (t / "trace_pipe").read_text().splitlines(True)
    (t / "trace_pipe").unlink()
    os.mkfifo(t / "trace_pipe")
    stats = t / "per_cpu/cpu0/stats"
    stats.write_text(f"entries: {len(events)}\noverrun: 0\n")

    def wait_for(on: str):
        while (t / "tracing_on").read_text().strip() != on:
            time.sleep(0.05)

    def ring_buffer():
        with open(t / "trace_pipe", "w") as pipe:  # blocks until the reader opens it
            wait_for("1")
            pipe.writelines(events[:1000])
            pipe.flush()
            stats.write_text(f"entries: {len(events) - 1000}\noverrun: 0\n")
            wait_for("0")
            time.sleep(2.5)  # longer than the reader was given before
            pipe.writelines(events[1000:])
            pipe.flush()
            stats.write_text("entries: 0\noverrun: 0\n")
            time.sleep(3)  # the pipe stays open, as trace_pipe does: the reader is stopped, not ended

    writer = threading.Thread(target=ring_buffer)
    writer.start()
    out = tmp_path / "t.txt"
    p = run_capture(t, "-o", str(out), "--duration", "1", "--no-timer", "--no-domains")
    writer.join()
    assert p.returncode == 0 and "no events lost" in p.stderr, p.stderr
    assert sum(1 for l in out.read_text().splitlines() if "IOMMU:" in l) == len(events) == 2000


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
