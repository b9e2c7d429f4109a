"""`iommulab capture`: the shipped POSIX script against a stand-in tracefs (a directory with tracefs's files; a new
tracing instance gets its files from a template, as the kernel fills one in, and a live trace_pipe that gives its
reader a real guest's events and, like the kernel's, never ends). It records, brackets the phase, counts lost
events, writes a file replay reads, and leaves the host's tracing byte-identical on every exit: the end of a
recording, every error, and SIGINT, SIGTERM or SIGHUP, under dash and busybox sh and through the CLI. As tracefs
does, the stand-in refuses to remove an instance whose trace_pipe is still open (EBUSY), so the capture must stop
its reader first. Every wait here is on an event (the reader caught up, a marker written, a process ended); a
timeout only turns a hang into a failure."""

import gzip
import lzma
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

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

# tracefs makes a new instance's files itself: here `mkdir` copies them from the template, its trace_pipe and
# its first CPU's stats the stand-in's live ones (TracePipe), and `rmdir` removes them with the instance unless a
# process still reads its trace_pipe: tracefs then refuses (instance_rmdir -> __remove_instance: EBUSY while
# the trace_array's ref is held, as an open trace_pipe holds it). The wrappers stand first on PATH.
MKDIR = """#!/bin/sh
last=; for a; do last=$a; done
case "$last" in "$IOMMULAB_TRACEFS"/instances/*)
  [ -e "$last" ] && { echo "mkdir: $last: File exists" >&2; exit 1; }
  cp -R "$STANDIN_INSTANCE" "$last" || exit 1
  ln -sf "$STANDIN_PIPE" "$last/trace_pipe" && ln -sf "$STANDIN_STATS" "$last/per_cpu/cpu0/stats"
  exit ;;
esac
exec /bin/mkdir "$@"
"""
RMDIR = """#!/bin/sh
case "$1" in "$IOMMULAB_TRACEFS"/instances/*)
  pipe=$(readlink -f "$1/trace_pipe")
  for fd in $(find /proc/[0-9]*/fd -lname "$pipe" 2>/dev/null); do
    # fdinfo's flags are octal: a last digit 0 is O_RDONLY, a reader (the stand-in holds the write end).
    case "$(sed -n 's/^flags:[[:space:]]*//p' "${fd%/fd/*}/fdinfo/${fd##*/}" 2>/dev/null)" in *0)
      echo "$1 (${fd%/fd/*} reads its trace_pipe)" >> "$STANDIN_REFUSED"
      echo "rmdir: failed to remove '$1': Device or resource busy" >&2; exit 1 ;;
    esac
  done
  exec rm -rf "$1" ;;
esac
exec /bin/rmdir "$@"
"""


def _fifo_readers(fifo: pathlib.Path) -> list[int]:
    """The processes that hold `fifo` open for reading (/proc/PID/fd and fdinfo's access mode)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == os.path.realpath(fifo):
                    flags = open(f"/proc/{pid}/fdinfo/{fd}").read().split("flags:")[1].split()[0]
                    if int(flags, 8) & os.O_ACCMODE == os.O_RDONLY:
                        pids.append(int(pid))
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
    return pids


def _written(pid: int) -> int:
    """Bytes process `pid` has written (/proc/PID/io wchar); 0 once it has ended."""
    try:
        return int(open(f"/proc/{pid}/io").read().split("wchar:")[1].split()[0])
    except (OSError, IndexError):
        return 0


def _until(cond, what: str, limit_s: float = 120):
    """Wait for `cond()` to hold: the limit only turns a hang into a failure."""
    hang = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < hang, f"never happened: {what}"
        time.sleep(0.01)


class TracePipe:
    """The capture instance's trace_pipe and per_cpu/cpu0/stats as tracefs serves them, from threads of the test.
    A capture's reader opening trace_pipe is given the template's events (`first` of them, the rest once the
    capture has read the stats `hold_reads` times: a reader lagging behind the recording); its read then waits
    for more and never ends, as the kernel's does, until the reader is killed. A stats read is answered once the
    reader has written out all it was given (or is gone): `entries` counts the events still held back, plus
    `unread` (events the ring buffer keeps unread whatever the reader does), and `overrun` is the template's.
    (The kernel answers at once, counting an event read once read() has returned it; waiting for the reader to
    have written it out too keeps the tests from depending on how fast the reader runs.)"""

    def __init__(self, root: pathlib.Path, template: pathlib.Path, first=None, hold_reads=0, unread=0):
        self.pipe, self.stats, self.template = root / "trace_pipe.fifo", root / "stats", template
        os.mkfifo(self.pipe)
        self._next_stats()
        self.first, self.hold_reads, self.unread = first, hold_reads, unread
        self.lock = threading.Lock()
        self.given, self.held, self.reads, self.release = 0, [], 0, False
        self.giving, self.served, self.stopped = False, 0, False
        self.wake_r, self.wake_w = os.pipe()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._serve_pipe, self._serve_stats)]
        for t in self.threads:
            t.start()

    def settled(self) -> bool:
        """Whether the reader has written out all it was given, nothing being given meanwhile (or none reads the
        pipe)."""
        if self.giving or (self.release and self.held):
            return False
        readers = _fifo_readers(self.pipe)
        return not readers or max(map(_written, readers)) >= self.given

    def _give(self, fd: int, lines: list[bytes]):
        try:
            for i in range(0, len(lines), 100):
                chunk = b"".join(lines[i:i + 100])
                os.write(fd, chunk)
                with self.lock:
                    self.given += len(chunk)
        except BrokenPipeError:
            pass  # the reader was killed

    def _serve_pipe(self):
        while True:
            fd = os.open(self.pipe, os.O_WRONLY)  # until a capture's reader opens it
            if self.stopped:
                return os.close(fd)
            events = self.template.read_bytes().splitlines(True)
            n = len(events) if self.first is None else self.first
            with self.lock:
                self.given, self.held, self.reads, self.release, self.giving = 0, events[n:], 0, False, True
            self._give(fd, events[:n])
            with self.lock:
                self.giving = False
                self.served += 1
            poll = select.poll()
            poll.register(fd, 0)  # POLLERR: the reader closed it
            poll.register(self.wake_r, select.POLLIN)
            while not self.stopped and fd not in dict(poll.poll()):
                os.read(self.wake_r, 1)
                if self.release and self.held:
                    self._give(fd, self.held)
                    with self.lock:
                        self.held = []
            os.close(fd)

    def _next_stats(self):
        """A new FIFO for the next stats read, `stats` pointing at it: a reader still draining the last one
        cannot be handed this one's answer too."""
        fifo = self.stats.with_name(f"stats.{time.monotonic_ns()}")
        os.mkfifo(fifo)
        link = self.stats.with_name("stats.link")
        link.symlink_to(fifo)
        os.replace(link, self.stats)

    def _serve_stats(self):
        while True:
            fd = os.open(self.stats, os.O_WRONLY)  # until a capture reads its stats
            if self.stopped:
                return os.close(fd)
            try:
                _until(self.settled, "the reader caught up")
            except AssertionError:
                pass  # answered as it stands: the test fails on what the capture then does
            overrun = self.template.with_name("per_cpu").joinpath("cpu0/stats").read_text().split("overrun:")[1]
            with self.lock:
                text = f"entries: {len(self.held) + self.unread}\noverrun: {overrun.split()[0]}\n"
                self.reads += 1
                self.release = self.reads >= self.hold_reads and bool(self.held)
            try:
                os.write(fd, text.encode())
            except BrokenPipeError:
                pass
            self._next_stats()
            os.close(fd)
            if self.release:
                os.write(self.wake_w, b"r")

    def stop(self):
        """End the threads: each waits in an open until the other end is opened."""
        self.stopped = True
        os.write(self.wake_w, b"s")
        for f in (self.pipe, self.stats):
            try:
                os.close(os.open(f, os.O_RDONLY | os.O_NONBLOCK))
            except OSError:
                pass  # its directory is gone (at exit): the daemon threads go with the process
        for t in self.threads:
            t.join(10)


class Standin:
    """A stand-in tracefs at `root/tracing` with its instance template, kallsyms and wrappers beside it. With
    `kprobes`, kprobe_events is a link to a log of what was written to it, and the template has the enable files
    of the probes it can enable (all of KPROBES but `unenabled`). The template's trace_pipe file holds the events
    its live trace_pipe gives a capture's reader, and its first CPU's stats the overruns (`overrun`); `pipe`
    (first, hold_reads, unread) goes to TracePipe."""

    def __init__(self, root: pathlib.Path, kprobes=False, unenabled=(), overrun=3, **pipe):
        self.root = root
        self.t = root / "tracing"
        self.inst = root / "instance"
        self.markers = root / "markers.log"
        self.kprobe_log = root / "kprobe_events.log"
        self.refused = root / "rmdir-refused.log"
        top = [("trace_marker", ""), ("trace", "<idle>-0 [000] 1.0: the host's own events\n"),
               ("buffer_size_kb", "1408\n"), ("tracing_on", "1\n"), ("events/iommu/map/enable", "0\n"),
               ("events/iommu/unmap/enable", "0\n"), ("per_cpu/cpu0/stats", "entries: 0\noverrun: 0\n")]
        for rel, text in top:
            self.write(self.t / rel, text)
        (self.t / "instances").mkdir()
        events = [l for l in lzma.open(TRACE, "rt").read().splitlines() if ": map: IOMMU" in l or ": unmap: IOMMU" in l]
        for rel, text in [("tracing_on", "1\n"), ("buffer_size_kb", "1408\n"), ("events/iommu/map/enable", "0\n"),
                          ("events/iommu/unmap/enable", "0\n"), ("trace_pipe", "\n".join(events[:2000]) + "\n"),
                          ("per_cpu/cpu0/stats", f"entries: 0\noverrun: {overrun}\n"),
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
        self.refused.write_text("")
        self.pipe = TracePipe(root, self.inst / "trace_pipe", **pipe)
        weakref.finalize(self, self.pipe.stop)
        self.before = self.snapshot()

    @staticmethod
    def write(p: pathlib.Path, text: str):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def env(self) -> dict:
        return dict(os.environ, IOMMULAB_TRACEFS=str(self.t), IOMMULAB_KALLSYMS=str(self.root / "kallsyms"),
                    STANDIN_INSTANCE=str(self.inst), STANDIN_PIPE=str(self.pipe.pipe),
                    STANDIN_STATS=str(self.pipe.stats), STANDIN_REFUSED=str(self.refused),
                    IOMMULAB_DEBUGFS=str(self.root / "debug"),  # none unless a test makes one
                    PATH=f"{self.root / 'bin'}:{os.environ['PATH']}")

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
        assert self.refused.read_text() == "", f"rmdir refused (EBUSY): {self.refused.read_text()}"
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
    # Overruns are reported, in its output and in the trace; the reader caught up before it was stopped, so
    # nothing was left unread (events left unread are reported too: see the signal tests).
    assert "3 events were lost" in p.stderr and "recorded but not read" not in p.stderr
    text = gzip.open(out, "rt").read()
    assert "# iommulab capture: 3 events lost" in text and "not read before the reader stopped" not in text
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
    # the capture waits until the ring buffer holds nothing unread, and keeps the rest. The stand-in gives its
    # reader the second half only once the capture has found the ring buffer not yet empty twice: a capture
    # that stopped its reader after a fixed time, or at the first look, would lose it.
    s = Standin(tmp_path, overrun=0, first=1000, hold_reads=2)
    out = tmp_path / "t.txt"
    p = s.cli("-o", str(out), "--duration", "1", "--no-timer", "--no-domains")
    assert p.returncode == 0 and "no events lost" in p.stderr, p.stderr
    assert sum(1 for l in out.read_text().splitlines() if "IOMMU:" in l) == 2000
    assert s.pipe.reads > 2
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


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
def test_swiotlbs_bounces_are_recorded_and_its_pool_noted_before_and_after_them(shell, tmp_path):
    # A kernel with swiotlb's tracepoint and its debugfs files (6.12: no io_tlb_transient_nslabs without
    # CONFIG_SWIOTLB_DYNAMIC): swiotlb_bounced is enabled in the instance, and the pool's state is read (only
    # read) into a note before the events and one after them, with its start from the kernel log.
    s = Standin(tmp_path)
    enabled = tmp_path / "swiotlb-enable.log"
    enabled.write_text("")
    s.write(s.t / "events/swiotlb/swiotlb_bounced/enable", "0\n")
    (s.inst / "events/swiotlb/swiotlb_bounced").mkdir(parents=True)
    (s.inst / "events/swiotlb/swiotlb_bounced/enable").symlink_to(enabled)
    sw = tmp_path / "debug/swiotlb"
    for f, v in (("io_tlb_nslabs", 1024), ("io_tlb_used", 384), ("io_tlb_used_hiwater", 512)):
        s.write(sw / f, f"{v}\n")
    dmesg = tmp_path / "bin/dmesg"
    dmesg.write_text("#!/bin/sh\necho '[    0.000000] software IO TLB: area num 1.'\n"
                     "echo '[    0.291000] software IO TLB: mapped [mem 0x000000003bc00000-0x000000003be00000] (2MB)'\n")
    dmesg.chmod(0o755)
    s.before = s.snapshot()
    debug_before = {f.name: f.read_bytes() for f in sw.iterdir()}
    out = tmp_path / "t.txt"
    p = s.script(shell, "-o", str(out), "-p", "blk", "--", "true")
    assert p.returncode == 0, p.stderr
    s.assert_untouched()
    assert {f.name: f.read_bytes() for f in sw.iterdir()} == debug_before
    assert enabled.read_text() == "1\n"
    possible = pathlib.Path("/sys/devices/system/cpu/possible").read_text().strip()
    note = f"nslabs=1024 used=384 hiwater=512 possible={possible} start=0x3bc00000"
    lines = out.read_text().splitlines()
    start = lines.index(f"# iommulab capture: swiotlb at start: {note}")
    end = lines.index(f"# iommulab capture: swiotlb at end: {note}")
    events = [i for i, l in enumerate(lines) if "IOMMU:" in l]
    assert events and start < events[0] and events[-1] < end
    # Without the kernel log (dmesg refused) and without io_tlb_used_hiwater (before 6.4), those keys are left
    # out, and a pool that grows (CONFIG_SWIOTLB_DYNAMIC) says so.
    dmesg.write_text("#!/bin/sh\necho 'dmesg: klogctl: Operation not permitted' >&2; exit 1\n")
    (sw / "io_tlb_used_hiwater").unlink()
    s.write(sw / "io_tlb_transient_nslabs", "0\n")
    p = s.script(shell, "-o", str(tmp_path / "t2.txt"), "--", "true")
    assert p.returncode == 0 and "klogctl" not in p.stderr, p.stderr
    notes = [l for l in (tmp_path / "t2.txt").read_text().splitlines() if "swiotlb at" in l]
    assert notes == [f"# iommulab capture: swiotlb at {w}: nslabs=1024 used=384 possible={possible} transient=0"
                     for w in ("start", "end")]
    # Without debugfs's swiotlb directory (not mounted, or no pool): no note; the event is still recorded.
    shutil.rmtree(sw)
    enabled.write_text("")
    p = s.script(shell, "-o", str(tmp_path / "t3.txt"), "--", "true")
    assert p.returncode == 0 and "swiotlb" not in (tmp_path / "t3.txt").read_text()
    assert enabled.read_text() == "1\n"
    s.assert_untouched()


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


# --- the reader is stopped before its instance is removed, on every exit (issue 64) -----------------------------

def test_the_stand_in_refuses_to_remove_an_instance_whose_trace_pipe_is_read(tmp_path):
    # As tracefs does (EBUSY): the guard the tests below rely on.
    s = Standin(tmp_path)
    inst = s.t / "instances/iommulab"
    env = s.env()
    subprocess.run(["mkdir", str(inst)], env=env, check=True)
    reader = subprocess.Popen(["cat", str(inst / "trace_pipe")], stdout=subprocess.DEVNULL)
    try:
        _until(lambda: s.pipe.served, "the reader given the events")
        p = subprocess.run(["rmdir", str(inst)], env=env, capture_output=True, text=True)
        assert p.returncode == 1 and "Device or resource busy" in p.stderr and inst.is_dir()
        assert f"/proc/{reader.pid} reads its trace_pipe" in s.refused.read_text()
        assert reader.poll() is None, "a trace_pipe never ends: its reader is stopped, not ended"
    finally:
        reader.kill()
        reader.wait()
    s.refused.write_text("")
    subprocess.run(["rmdir", str(inst)], env=env, check=True)
    s.assert_untouched()


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
def test_an_error_with_the_reader_running_stops_it_before_the_instance_goes_and_keeps_nothing(shell, tmp_path):
    # Turning tracing on is the step that can fail once the reader runs. The capture then ends in one line, and
    # its cleanup stops the reader before removing the instance (which tracefs refuses while trace_pipe is
    # open), then the kprobes; tracing never came on, so no .part is left to block the next capture. Here
    # tracing_on is a FIFO: `0 > tracing_on` is read, and `1 > tracing_on`, once the reader has the pipe open,
    # fails (the subshell writing it, waiting for the FIFO's reader, gets the SIGPIPE of a pipe without one).
    s = Standin(tmp_path, kprobes=True)
    on = tmp_path / "on.fifo"
    os.mkfifo(on)
    (s.inst / "tracing_on").unlink()
    (s.inst / "tracing_on").symlink_to(on)
    s.before = s.snapshot()
    got = []
    threading.Thread(target=lambda: got.append(on.read_text()), daemon=True).start()
    out = tmp_path / "t.txt"
    cmd = [BUSYBOX, "sh"] if shell == "busybox" else [shell]
    p = subprocess.Popen([*cmd, str(SCRIPT), "-o", str(out), "-k", "-t", "-p", "net", "--", "true"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env())
    try:
        _until(lambda: got or p.poll() is not None, "0 written to tracing_on")
        assert got == ["0\n"], p.communicate()
        # Past the reader's start, the one subshell of the script is the one writing 1.
        me, writer = _cmdline(p.pid), []

        def writing_one():
            writer[:] = [c for c in _children(p.pid) if _cmdline(c) == me] if s.pipe.served else []
            return writer or p.poll() is not None
        _until(writing_one, "the reader started and 1 being written to tracing_on")
        assert len(writer) == 1, p.communicate()
        os.kill(writer[0], signal.SIGPIPE)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 2 and err.strip() == f"capture: cannot turn tracing on in {s.t}/instances/iommulab", err
    s.assert_untouched()
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def _pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits to be delivered to process `pid` (/proc/PID/status ShdPnd)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("end", ["command", "SIGTERM"])
def test_the_instance_goes_only_once_the_reader_has_ended(shell, end, tmp_path):
    # Killing the reader is not enough: until it has exited it holds trace_pipe open, and tracefs refuses to
    # remove the instance. The reader is held stopped (SIGSTOP) when the capture ends (its command ends, or
    # SIGTERM): the capture's TERM then waits on it, and the capture must wait too. Once the capture waits with
    # the reader its only child, the reader goes on, takes its TERM and ends; a capture that went on without
    # waiting would have tried rmdir meanwhile.
    s = Standin(tmp_path, kprobes=True)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    cmd = [BUSYBOX, "sh"] if shell == "busybox" else [shell]
    p = subprocess.Popen([*cmd, str(SCRIPT), "-o", str(tmp_path / "t.txt"), "-k", "-t", "-p", "net", "--", "cat",
                          str(gate)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env())
    try:
        _until(lambda: p.poll() is not None or (s.pipe.served and s.pipe.settled()), "the reader caught up")
        (reader,) = _fifo_readers(s.pipe.pipe)
        os.kill(reader, signal.SIGSTOP)
        if end == "SIGTERM":
            p.send_signal(signal.SIGTERM)
        else:
            def opened():  # the command, reading the gate, ends when the gate's writer closes it
                try:
                    os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
                    return True
                except OSError:
                    return p.poll() is not None
            _until(opened, "the command reading its gate")

        def waiting() -> bool:
            return (p.poll() is not None or s.refused.read_text() != ""
                    or (_pending(reader, signal.SIGTERM) and _children(p.pid) == [reader]
                        # the wait builtin: dash and busybox sh suspend until SIGCHLD, or block in wait4
                        and any(w in open(f"/proc/{p.pid}/wchan").read() for w in ("sigsuspend", "do_wait"))))
        _until(waiting, "the capture waiting on its reader, or going on")
        os.kill(reader, signal.SIGCONT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == (130 if end == "SIGTERM" else 0), err
    s.assert_untouched()
    assert sum(1 for l in (tmp_path / "t.txt").read_text().splitlines() if "IOMMU:" in l) == 2000


def _terminal_signals():
    """In the child: SIGINT, SIGTERM and SIGHUP as a terminal session has them (whatever ran the tests may
    ignore SIGHUP, as nohup does, and an ignored signal cannot be trapped)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def _signalled(p: subprocess.Popen, sig, group: bool, s: Standin, out: pathlib.Path, read=pathlib.Path.read_text):
    # Once the capture is recording (its phase begun) and its reader has written out every event given to it,
    # signal it. Its command never ends by itself: the capture must stop it, not wait for it (a capture that
    # waited would hang, and the timeout would fail the test).
    _until(lambda: p.poll() is not None or (s.markers.read_text() != "" and s.pipe.served and s.pipe.settled()),
           "the capture recording, its reader caught up")
    assert p.poll() is None, p.communicate()
    os.killpg(p.pid, sig) if group else p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    # It restores everything, its reader stopped before its instance was removed, and keeps what was read,
    # counting the events the ring buffer still held.
    s.assert_untouched()
    assert "interrupted; the events read so far are kept" in err
    assert "10 events were recorded but not read" in err
    assert all(line.startswith("capture: ") for line in err.splitlines()), err  # not the shell's "Terminated"
    text = read(out)
    assert sum(1 for l in text.splitlines() if "IOMMU:" in l) == 2000 and "# iommulab capture: 10 events lost" in text
    assert not list(out.parent.glob("*.part"))


@pytest.mark.skipif(not SHELLS, reason="neither dash nor busybox is installed")
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_to_the_script_restores_everything_and_keeps_the_trace(shell, sig, tmp_path):
    s = Standin(tmp_path, kprobes=True, unread=10)
    out = tmp_path / "t.txt"
    cmd = [BUSYBOX, "sh"] if shell == "busybox" else [shell]
    p = subprocess.Popen([*cmd, str(SCRIPT), "-o", str(out), "-k", "-t", "-p", "net", "--", "sleep", "100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env(),
                         start_new_session=True, preexec_fn=_terminal_signals)
    _signalled(p, getattr(signal, sig), False, s, out)


@pytest.mark.parametrize("sig, group", [("SIGINT", True), ("SIGINT", False), ("SIGTERM", False), ("SIGHUP", True)],
                         ids=["ctrl-c", "sigint", "sigterm", "terminal-closed"])
def test_a_signal_to_iommulab_capture_restores_everything_and_keeps_the_trace(sig, group, tmp_path):
    # Ctrl-C and a closed terminal signal the whole foreground process group; `kill` signals iommulab alone,
    # which passes the signal on. Either way the script restores tracefs before anything exits.
    s = Standin(tmp_path, kprobes=True, unread=10)
    out = tmp_path / "t.txt.gz"
    p = subprocess.Popen([sys.executable, "-m", "iommulab", "capture", "-o", str(out), "--phase", "net", "--",
                          "sleep", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env(),
                         start_new_session=True, preexec_fn=_terminal_signals)
    try:
        _signalled(p, getattr(signal, sig), group, s, out, lambda f: gzip.open(f, "rt").read())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
