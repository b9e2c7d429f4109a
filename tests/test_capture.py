"""`iommulab capture`: the shipped POSIX script against a stand-in tracefs (a directory with tracefs's files; a new
tracing instance gets its files, and a trace_pipe holding a real guest's events, from a template, as the kernel
fills one in). It records, brackets the phase, counts lost events, writes a file replay reads, and leaves the
host's tracing byte-identical on every exit: the end of a recording, every error, and SIGINT, SIGTERM or SIGHUP,
under dash and busybox sh and through the CLI."""

import gzip
import lzma
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import iommulab
from conftest import cli

TRACE = pathlib.Path(__file__).parent / "data" / "testbed" / "k6.12-intel-cmoff-strict" / "guest-trace.txt.xz"
SCRIPT = pathlib.Path(iommulab.__file__).parent / "capture.sh"


def _busybox() -> str | None:
    """A busybox whose sh finds mkdir and rmdir on PATH (the stand-in's wrappers): IOMMULAB_TEST_BUSYBOX
    (.ci/run unpacks Debian's), or the one installed, unless it is busybox-static, whose shell runs its own
    applets whatever PATH says."""
    for b in (os.environ.get("IOMMULAB_TEST_BUSYBOX"), shutil.which("busybox")):
        if b and os.access(b, os.X_OK):
            probe = subprocess.run([b, "sh", "-c", "PATH=/nonexistent; mkdir /nonexistent/x 2>&1"],
                                   capture_output=True, text=True)
            if "not found" in probe.stdout + probe.stderr:
                return b
    return None


BUSYBOX = _busybox()
SHELLS = [s for s, ok in (("dash", shutil.which("dash")), ("busybox", BUSYBOX)) if ok]
KPROBES = ("tb_map", "tb_unmap", "fq_flush_timeout", "tb_flush_all_intel")

# tracefs makes a new instance's files itself: here `mkdir` copies them from the template, and `rmdir` removes
# them with the instance (the wrappers stand first on PATH).
MKDIR = """#!/bin/sh
last=; for a; do last=$a; done
case "$last" in "$IOMMULAB_TRACEFS"/instances/*)
  [ -e "$last" ] && { echo "mkdir: $last: File exists" >&2; exit 1; }
  exec cp -R "$STANDIN_INSTANCE" "$last" ;;
esac
exec /bin/mkdir "$@"
"""
RMDIR = """#!/bin/sh
case "$1" in "$IOMMULAB_TRACEFS"/instances/*) exec rm -rf "$1" ;; esac
exec /bin/rmdir "$@"
"""


class Standin:
    """A stand-in tracefs at `root/tracing` with its instance template, kallsyms and wrappers beside it. With
    `kprobes`, kprobe_events is a link to a log of what was written to it, and the template has the enable files
    of the probes it can enable (all of KPROBES but `unenabled`)."""

    def __init__(self, root: pathlib.Path, kprobes=False, unenabled=(), entries=10):
        self.root = root
        self.t = root / "tracing"
        self.inst = root / "instance"
        self.markers = root / "markers.log"
        self.kprobe_log = root / "kprobe_events.log"
        top = [("trace_marker", ""), ("trace", "<idle>-0 [000] 1.0: the host's own events\n"),
               ("buffer_size_kb", "1408\n"), ("tracing_on", "1\n"), ("events/iommu/map/enable", "0\n"),
               ("events/iommu/unmap/enable", "0\n"), ("per_cpu/cpu0/stats", "entries: 0\noverrun: 0\n")]
        for rel, text in top:
            self.write(self.t / rel, text)
        (self.t / "instances").mkdir()
        events = [l for l in lzma.open(TRACE, "rt").read().splitlines() if ": map: IOMMU" in l or ": unmap: IOMMU" in l]
        for rel, text in [("tracing_on", "1\n"), ("buffer_size_kb", "1408\n"), ("events/iommu/map/enable", "0\n"),
                          ("events/iommu/unmap/enable", "0\n"), ("trace_pipe", "\n".join(events[:2000]) + "\n"),
                          ("per_cpu/cpu0/stats", f"entries: {entries}\noverrun: 3\n"),
                          ("per_cpu/cpu1/stats", "overrun: 0\n")]:
            self.write(self.inst / rel, text)
        self.markers.write_text("")
        (self.inst / "trace_marker").symlink_to(self.markers)
        syms = ["ffffffff81000000 T iommu_map"]
        if kprobes:
            self.kprobe_log.write_text("")
            (self.t / "kprobe_events").symlink_to(self.kprobe_log)
            syms += ["ffffffff81000010 T __iommu_map", "ffffffff81000020 T __iommu_unmap",
                     "ffffffff81000030 t fq_flush_timeout", "ffffffff81000040 t intel_flush_iotlb_all"]
            for k in KPROBES:
                if k not in unenabled:
                    self.write(self.inst / "events/iommulab" / k / "enable", "0\n")
        (root / "kallsyms").write_text("\n".join(syms) + "\n")
        bin_ = root / "bin"
        bin_.mkdir()
        for name, text in (("mkdir", MKDIR), ("rmdir", RMDIR)):
            (bin_ / name).write_text(text)
            (bin_ / name).chmod(0o755)
        self.before = self.snapshot()

    @staticmethod
    def write(p: pathlib.Path, text: str):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def env(self) -> dict:
        return dict(os.environ, IOMMULAB_TRACEFS=str(self.t), IOMMULAB_KALLSYMS=str(self.root / "kallsyms"),
                    STANDIN_INSTANCE=str(self.inst), PATH=f"{self.root / 'bin'}:{os.environ['PATH']}")

    def snapshot(self) -> dict:
        """Every file's bytes, directory and link (its target) under the tracefs."""
        out = {}
        for p in sorted(self.t.rglob("*")):
            rel = str(p.relative_to(self.t))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
        return out

    def registered(self) -> set:
        """The kprobe events registered now: what was written to kprobe_events, taken as the kernel does."""
        probes = set()
        for line in self.kprobe_log.read_text().splitlines() if self.kprobe_log.exists() else []:
            name = line.split()[0].split(":", 1)[1]
            (probes.discard if line.startswith("-:") else probes.add)(name)
        return probes

    def assert_untouched(self):
        assert self.snapshot() == self.before, "the tracefs changed"
        assert self.registered() == set(), f"kprobes left registered: {self.registered()}"

    def script(self, shell: str, *args, **kw) -> subprocess.CompletedProcess:
        cmd = [BUSYBOX, "sh"] if shell == "busybox" else [shell]
        return subprocess.run([*cmd, str(SCRIPT), *args], capture_output=True, text=True, env=self.env(),
                              timeout=120, **kw)

    def iommulab(self, *args) -> subprocess.CompletedProcess:
        """The CLI against this stand-in."""
        return subprocess.run(["iommulab", *args], capture_output=True, text=True, env=self.env(), timeout=120)

    def cli(self, *args) -> subprocess.CompletedProcess:
        return self.iommulab("capture", *args)


def test_capture_records_restores_and_replays(tmp_path):
    s = Standin(tmp_path)
    out = tmp_path / "trace.txt.gz"
    p = s.cli("-o", str(out), "--duration", "1", "--phase", "net")
    assert p.returncode == 0, p.stderr
    # The host's tracing is as it was (its buffer's events and its settings too); the phase markers went to the
    # capture's own instance.
    s.assert_untouched()
    assert s.markers.read_text() == "TB_BEGIN net\nTB_END net\n"
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
    p = s.cli("-o", str(tmp_path / "again.txt"), "--duration", "1", "--no-domains")
    assert p.returncode == 0 and "no kprobes here" not in p.stderr and "fq_flush_timeout" in p.stderr
    p = s.cli("-o", str(tmp_path / "again2.txt"), "--duration", "1", "--no-domains", "--no-timer")
    assert p.returncode == 0 and "kprobe" not in p.stderr
    s.assert_untouched()


def test_kprobes_are_recorded_in_the_instance_and_removed(tmp_path):
    s = Standin(tmp_path, kprobes=True)
    p = s.cli("-o", str(tmp_path / "t.txt"), "--duration", "1")
    assert p.returncode == 0 and "kprobe on" not in p.stderr and "no kprobe" not in p.stderr, p.stderr
    log = s.kprobe_log.read_text()
    assert "p:iommulab/tb_map __iommu_map dom=$arg1:x64" in log and "-:iommulab/tb_map" in log
    text = (tmp_path / "t.txt").read_text()
    assert text.startswith("# iommulab capture: flush queue timer recorded (kprobe fq_flush_timeout)\n"
                           "# iommulab capture: flush queue timer's domain recorded (kprobes tb_flush_all_intel)")
    s.assert_untouched()


def test_a_reader_lagging_behind_the_recording_drains_the_ring_buffer_before_it_stops(tmp_path):
    # A slow reader (a guest formatting events slowly) has read half of what was recorded when recording stops:
    # the capture waits until the ring buffer holds nothing unread, and keeps the rest. The stand-in's instance
    # is made from its template when the capture starts: its trace_pipe, a FIFO there, is the template's.
    s = Standin(tmp_path)
    events = (s.inst / "trace_pipe").read_text().splitlines(True)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (s.inst / "trace_pipe").unlink()
    (s.inst / "trace_pipe").symlink_to(fifo)
    stats = tmp_path / "stats"
    stats.write_text(f"entries: {len(events)}\noverrun: 0\n")
    (s.inst / "per_cpu/cpu0/stats").unlink()
    (s.inst / "per_cpu/cpu0/stats").symlink_to(stats)
    (s.inst / "tracing_on").unlink()
    on = tmp_path / "on"
    on.write_text("0\n")
    (s.inst / "tracing_on").symlink_to(on)

    def wait_for(v: str):
        while on.read_text().strip() != v:
            time.sleep(0.05)

    def ring_buffer():
        with open(fifo, "w") as pipe:  # blocks until the reader opens it
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
    p = s.cli("-o", str(out), "--duration", "1", "--no-timer", "--no-domains")
    writer.join()
    assert p.returncode == 0 and "no events lost" in p.stderr, p.stderr
    assert sum(1 for l in out.read_text().splitlines() if "IOMMU:" in l) == len(events) == 2000
    s.assert_untouched()


def test_the_host_buffers_size_is_left_alone(tmp_path):
    # Until first used, buffer_size_kb reads "7 (expanded: 1408)"; the capture sets only its own instance's size.
    s = Standin(tmp_path)
    s.write(s.t / "buffer_size_kb", "7 (expanded: 1408)\n")
    s.before = s.snapshot()
    p = s.cli("-o", str(tmp_path / "t.txt"), "--duration", "1", "--buffer-kb", "4096")
    assert p.returncode == 0 and "syntax error" not in p.stderr, p.stderr
    s.assert_untouched()


def test_without_kprobes_the_dma_apis_events_name_the_devices(tmp_path):
    # A kernel with the DMA API's events (6.12+) and no kprobes: the capture records those instead, says so,
    # and enables them in its instance only.
    s = Standin(tmp_path)
    dma = ("dma_map_page", "dma_unmap_page", "dma_map_sg", "dma_unmap_sg")
    for e in dma:
        s.write(s.t / "events/dma" / e / "enable", "0\n")
        s.write(s.inst / "events/dma" / e / "enable", "0\n")
    s.before = s.snapshot()
    p = s.cli("-o", str(tmp_path / "t.txt"), "--duration", "1", "--no-timer")
    assert p.returncode == 0, p.stderr
    assert "the DMA API's events name each mapping's device instead" in p.stderr
    s.assert_untouched()
    p = s.cli("-o", str(tmp_path / "t2.txt"), "--dry-run", "--no-timer")
    assert "would: echo 1 > " + str(s.t / "instances/iommulab/events/dma/dma_map_sg/enable") in p.stdout


def test_nothing_is_overwritten_and_dry_run_changes_nothing(tmp_path):
    s = Standin(tmp_path, kprobes=True)
    out = tmp_path / "t.txt"
    out.write_text("mine")
    p = s.cli("-o", str(out), "--duration", "1")
    assert p.returncode == 2 and "exists" in p.stderr and out.read_text() == "mine"
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "nowhere")
    p = s.cli("-o", str(tmp_path / "dangling.txt"), "--duration", "1")
    assert p.returncode == 2 and "exists" in p.stderr and not (tmp_path / "nowhere").exists()
    p = s.cli("-o", str(tmp_path / "new.txt"), "--dry-run")
    assert p.returncode == 0 and "would: mkdir" in p.stdout and "would: rmdir" in p.stdout
    assert "would: echo '-:iommulab/tb_map' >> " in p.stdout
    assert not (tmp_path / "new.txt").exists() and not (tmp_path / "new.txt.part").exists()
    s.assert_untouched()
    assert s.kprobe_log.read_text() == ""


def test_without_tracefs_it_fails_in_one_line(tmp_path):
    env = dict(os.environ, IOMMULAB_TRACEFS=str(tmp_path / "nowhere"))
    p = subprocess.run(["iommulab", "capture", "-o", str(tmp_path / "t.txt"), "--duration", "1"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "tracefs" in p.stderr


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_the_script_is_posix_sh(shell, tmp_path):
    if not shutil.which(shell):
        pytest.skip(f"{shell} not installed")
    script = tmp_path / "capture.sh"
    script.write_text(cli("capture", "--print-script", check_rc=0).stdout)
    cmd = [shell, "-n", str(script)] if shell == "dash" else ["busybox", "sh", "-n", str(script)]
    assert subprocess.run(cmd).returncode == 0


# --- every error path leaves the tracefs as it was (issue 49) --------------------------------------------------

def _break(s: Standin, rel: str):
    """A file of the instance the kernel would refuse a write to (a directory in its place here)."""
    p = s.inst / rel
    if p.exists():
        p.unlink()
    p.mkdir(parents=True)


ERRORS = {
    # what goes wrong: (set-up, the capture's arguments past -o, what its one line says)
    "output directory missing": (None, "missing-dir", [], "no such directory"),
    "output exists": ("exists", None, [], "exists (nothing is overwritten)"),
    "a .part left over": ("part", None, [], ".part exists"),
    "another capture's instance": ("instance", None, [], "another capture is running"),
    "kprobes left by a killed capture": ("stale-kprobes", None, [], "kprobe events iommulab/* are registered"),
    "buffer size refused": ("buffer_size_kb", None, [], "refused this buffer size"),
    "an event cannot be enabled": ("events/iommu/unmap/enable", None, [], "cannot enable iommu/unmap"),
    "bad duration": (None, None, ["-d", "1x"], "-d 1x: expected seconds"),
}


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("case", list(ERRORS))
def test_every_error_leaves_the_tracefs_as_it_was(shell, case, tmp_path):
    # Under dash and busybox a failed redirection of a special built-in ends the script at once: nothing may be
    # changed before the output is known to be writable, and whatever was changed is undone on any exit.
    s = Standin(tmp_path, kprobes=True)
    setup, where, extra, says = ERRORS[case]
    out = tmp_path / (where or ".") / "t.txt"
    if setup == "exists":
        out.write_text("mine")
    elif setup == "part":
        (tmp_path / "t.txt.part").write_text("mine")
    elif setup == "instance":
        (s.t / "instances/iommulab").mkdir()
    elif setup == "stale-kprobes":
        (s.t / "events/iommulab/tb_map").mkdir(parents=True)
    elif setup:
        _break(s, setup)
    s.before = s.snapshot()
    p = s.script(shell, "-o", str(out), "-k", "-t", "-p", "net", *extra, "--", "true")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and says in p.stderr, p.stderr
    s.assert_untouched()
    assert not (tmp_path / "t.txt").exists() or setup == "exists"
    assert not (tmp_path / "t.txt.part").exists() or setup == "part"
    assert s.markers.read_text() == ""


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
def test_a_probe_that_cannot_be_enabled_is_removed_and_not_claimed(shell, tmp_path):
    # The kernel registers a probe but refuses to enable it (as arm64's did once per phase): it is removed at
    # once, the capture says so in one line, and the trace does not claim what it did not record.
    s = Standin(tmp_path, kprobes=True, unenabled=("tb_unmap", "tb_flush_all_intel"))
    out = tmp_path / "t.txt"
    p = s.script(shell, "-o", str(out), "-k", "-t", "--", "true")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("registered but could not be enabled: removed") == 2
    s.assert_untouched()
    text = out.read_text()
    assert text.startswith("# iommulab capture: flush queue timer recorded")
    assert "timer's domain recorded" not in text
    # and one the kernel refuses to register is left out the same way
    s = Standin(tmp_path / "again", kprobes=True)
    s.kprobe_log.unlink()
    s.kprobe_log.mkdir()  # kprobe_events refuses every definition
    p = s.script(shell, "-o", str(tmp_path / "again/t.txt"), "-k", "--", "true")
    assert p.returncode == 0 and p.stderr.count("refused by the kernel") == 2, p.stderr
    assert s.snapshot() == s.before


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
def test_a_tracefs_path_with_a_space_is_written_where_it_names(shell, tmp_path):
    s = Standin(tmp_path / "a dir", kprobes=True)
    out = tmp_path / "a dir" / "t.txt"
    p = s.script(shell, "-o", str(out), "-k", "-t", "-p", "net", "--", "true")
    assert p.returncode == 0, p.stderr
    s.assert_untouched()
    assert s.markers.read_text() == "TB_BEGIN net\nTB_END net\n"
    assert not (tmp_path / "a").exists()


def _terminal_signals():
    """In the child: SIGINT, SIGTERM and SIGHUP as a terminal session has them (whatever ran the tests may
    ignore SIGHUP, as nohup does, and an ignored signal cannot be trapped)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def _signalled(p: subprocess.Popen, sig, group: bool, s: Standin, out: pathlib.Path, read=pathlib.Path.read_text):
    # Wait until the capture is recording (its instance is there and tracing is on), then signal it.
    deadline = time.monotonic() + 30
    while not (s.t / "instances/iommulab/events/iommulab/tb_map/enable").exists() or \
            s.markers.read_text() == "":
        assert time.monotonic() < deadline and p.poll() is None, "the capture never started recording"
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(p.pid, sig) if group else p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 130, err
    # It stops at once, not at the end of its command (60 s), and restores everything.
    assert took < 10, f"took {took:.1f} s to stop"
    s.assert_untouched()
    assert "interrupted; the events read so far are kept" in err
    assert sum(1 for l in read(out).splitlines() if "IOMMU:" in l) == 2000
    assert not list(out.parent.glob("*.part"))


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_to_the_script_restores_everything_and_keeps_the_trace(shell, sig, tmp_path):
    s = Standin(tmp_path, kprobes=True)
    out = tmp_path / "t.txt"
    cmd = [BUSYBOX, "sh"] if shell == "busybox" else [shell]
    p = subprocess.Popen([*cmd, str(SCRIPT), "-o", str(out), "-k", "-t", "-p", "net", "--", "sleep", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env(),
                         start_new_session=True, preexec_fn=_terminal_signals)
    _signalled(p, getattr(signal, sig), False, s, out)


@pytest.mark.parametrize("sig, group", [("SIGINT", True), ("SIGINT", False), ("SIGTERM", False), ("SIGHUP", True)],
                         ids=["ctrl-c", "sigint", "sigterm", "terminal-closed"])
def test_a_signal_to_iommulab_capture_restores_everything_and_keeps_the_trace(sig, group, tmp_path):
    # Ctrl-C and a closed terminal signal the whole foreground process group; `kill` signals iommulab alone,
    # which passes the signal on. Either way the script restores tracefs before anything exits.
    s = Standin(tmp_path, kprobes=True)
    out = tmp_path / "t.txt.gz"
    p = subprocess.Popen([sys.executable, "-m", "iommulab", "capture", "-o", str(out), "--phase", "net", "--",
                          "sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env(),
                         start_new_session=True, preexec_fn=_terminal_signals)
    try:
        _signalled(p, getattr(signal, sig), group, s, out, lambda f: gzip.open(f, "rt").read())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
