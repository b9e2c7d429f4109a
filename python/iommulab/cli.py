"""The ``iommulab`` command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import tomllib
from typing import Any, Callable

from . import __version__, _core, vendors
from .api import ScenarioError, as_result, load, run_variants, stderr_progress
from .compare import POLICIES, compare, format_compare
from .inputs import shown, terminal, utf8
from .invlog import inv_log
from .replay import default_kernel, format_replay, replay
from .profiles import format_profile
from .ranges import DEFAULT_SAMPLES, format_ranges, ranged, with_ranges
from .report import fit, format_table, left, wrap
from .sensitivity import MAX_FACTOR
from .validate import (DEFAULT_SEEDS, MAX_SEEDS, Calibration, calibrate, declared_calibrations, format_validate,
                       load_targets, validate)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def _set_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. os.policy=strict, got {text!r}")
    return key.strip(), value


def _phase_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected phase names separated by commas, e.g. net,blk, got {text!r}")
    return names


def _at_least_one(what: str, most: int | None = None):
    """An argparse type: a whole number of `what`, at least 1 (and at most `most`)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1 or (most is not None and n > most):
            bound = f"from 1 to {most}" if most is not None else "at least 1"
            raise argparse.ArgumentTypeError(f"expected a whole number of {what}, {bound}, got {shown(text)!r}")
        return n
    return parse


_seeds = _at_least_one("seeds", MAX_SEEDS)
_jobs = _at_least_one("parallel runs")


def _range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi)
    except ValueError:
        a = b = math.nan
    if not sep or not a < b or not (math.isfinite(a) and math.isfinite(b)):
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH, finite numbers with LOW < HIGH, e.g. 200:5000, "
                                         f"got {shown(text)!r}")
    return a, b


def _toml_or_str(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _jobs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-j", "--jobs", type=_jobs, default=None, metavar="N",
                   help="run up to N simulations at once (default: every CPU); results do not depend on it")


def _runner_args(p: argparse.ArgumentParser) -> None:
    """What every command that runs simulations takes: --jobs, --no-progress and --quiet."""
    _jobs_arg(p)
    p.add_argument("--no-progress", action="store_true", help="never draw the progress bar")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing on stderr but errors (no progress bar, no sweep notes)")


def _scenario_args(p: argparse.ArgumentParser, set_help: str) -> None:
    """What every command that runs a scenario takes: the scenario, --set, --json, --jobs, --no-progress."""
    p.add_argument("scenario", nargs="?", metavar="SCENARIO.toml", help="scenario file or built-in name")
    p.add_argument("--set", dest="sets", action="append", default=[], type=_set_pair, metavar="KEY=VALUE",
                   help=set_help)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _runner_args(p)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="iommulab", description="A laboratory for IOMMU protection: simulate IOMMU hardware, the Linux "
                "DMA-mapping layer and I/O workloads, and report throughput and invalidation behaviour per policy.")
    p.add_argument("--version", action="version", version=f"iommulab {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    r = sub.add_parser("run", help="run a scenario (default: the built-in comparison)",
                       description="Run a scenario file, a built-in scenario name, or (no argument) the built-in "
                       "default, which compares passthrough, lazy and strict.")
    _scenario_args(r, "override a scenario key, e.g. --set os.policy=strict --set workload.nic_rx.queues=4 "
                   "(repeatable; pins a compared key)")
    r.add_argument("--parquet", metavar="FILE", help="also write the runs as a Parquet file (`report` reads it)")
    r.add_argument("--csv", metavar="FILE", help="also write the runs as CSV, one row per run (nested results as "
                   "dotted columns)")
    r.add_argument("--force", action="store_true", help="overwrite an existing --parquet or --csv file")
    _ranges_arg(r)
    r.add_argument("--inv-log", nargs="?", const=10.0, type=float, metavar="WINDOW_MS", default=None,
                   help="print the instrumented dmar.c counters' summary lines (seed 002) every WINDOW_MS of "
                   "simulated time after warm-up (default 10, the 10 s of the original scaled to short runs)")

    c = sub.add_parser("compare", help="every DMA policy on one scenario: throughput against exposure, with a plot",
                       description="Run a scenario (a file, a built-in name, or the built-in default) once per DMA "
                       "policy, print a table of goodput, invalidation work and exposure windows, and write an SVG "
                       "plot of throughput against exposure.")
    _scenario_args(c, "override a scenario key (repeatable); os.policy is set per run")
    c.add_argument("--policies", type=_policy_list, default=None, metavar="P,P,...",
                   help=f"policies to run (default: {','.join(POLICIES)})")
    c.add_argument("--plot", metavar="FILE.html", default=None,
                   help="where to write the HTML report with the plot (default: compare-<scenario>.html; never "
                   "overwritten without --force)")
    c.add_argument("--parquet", metavar="FILE", help="also write the runs as a Parquet file (`report` reads it)")
    c.add_argument("--csv", metavar="FILE", help="also write the runs as CSV, one row per run (nested results as "
                   "dotted columns)")
    c.add_argument("--no-plot", action="store_true", help="do not write a plot")
    _ranges_arg(c)
    c.add_argument("--force", action="store_true", help="overwrite an existing plot file")

    se = sub.add_parser("sensitivity", help="each profile constant scaled alone: what it changes in each run",
                        description="Run a scenario (a file, a built-in name, or the built-in default), then again "
                        "with each constant of its platform profile scaled alone by each factor, and print, per "
                        "run, the constants that move its goodput, CPU busy or exposure most, with how the profile "
                        "knows each (sourced, fitted or estimate): the constants to measure first.")
    _scenario_args(se, "override a scenario key (repeatable; pins a compared key)")
    se.add_argument("--factor", type=_factor_list, default=None, metavar="F,F,...",
                    help="factors each constant is scaled by (default: 0.5,2)")
    se.add_argument("--top", type=int, default=15, metavar="N",
                    help="constants shown per run (default 15; --json lists every one)")

    s = sub.add_parser("scenarios", help="list the built-in scenarios, or print one",
                       description="List built-in scenarios; with a NAME, print its TOML (a starting point for your own).")
    s.add_argument("name", nargs="?", help="built-in scenario to print")
    s.add_argument("--json", action="store_true", help="as JSON: every built-in's name and description, or the "
                   "named one as a JSON object")

    rp = sub.add_parser("replay", help="replay a real kernel's DMA trace and count what reached the IOMMU per phase",
                        description="Replay ftrace text with iommu:map / iommu:unmap events (as "
                        "/sys/kernel/tracing/trace, trace-cmd report or perf script print them; .xz/.gz/.bz2 or - "
                        "for stdin) through the DMA layer "
                        "and an IOMMU model, and count per phase (TB_BEGIN/TB_END trace markers) the invalidations, "
                        "wait descriptors and requests that reached the IOMMU.")
    rp.add_argument("trace", metavar="TRACE", help="ftrace text file, or - for standard input")
    modelled = vendors.names(modelled=True)
    rp.add_argument("--iommu", choices=modelled, default=modelled[0], help=f"IOMMU model (default {modelled[0]})")
    rp.add_argument("--caching-mode", choices=["on", "off"], default="off",
                    help=f"caching mode (a virtual IOMMU's {_caching_mode_caps()}; default off)")
    rp.add_argument("--ats", action="store_true",
                    help="the traced devices use ATS (device-TLB invalidations); the trace does not name devices")
    rp.add_argument("--ats-phases", type=_phase_list, metavar="PHASE[,PHASE...]",
                    help="only the device(s) whose traffic fills these phases use ATS (implies --ats)")
    rp.add_argument("--kernel", metavar="V", help="traced kernel version, MAJOR.MINOR (default 6.12, or the first "
                    "kernel after it with the IOMMU's driver: 6.13 for riscv)")
    g = rp.add_mutually_exclusive_group()
    g.add_argument("--cmdline", default="", help="traced kernel's command line (decides the default domain)")
    g.add_argument("--mode", choices=["strict", "lazy", "passthrough"], help="the DMA domain's mode, outright")
    rp.add_argument("--hz", type=int, default=250, help="traced kernel's CONFIG_HZ (default 250, as Debian's)")
    rp.add_argument("--tick-phase-us", type=float, metavar="US",
                    help="where the traced kernel's tick falls in each jiffy on the trace clock (lazy mode; "
                    "default: inferred per phase from the trace)")
    rp.add_argument("--json", action="store_true", help='print {"phases": {NAME: {"counts": {...}}}, ...}')
    rp.add_argument("--no-progress", action="store_true", help="never draw the progress bar")
    rp.add_argument("--quiet", action="store_true", help="print nothing on stderr but errors")

    e = sub.add_parser("explain", help="which DMA domain a kernel gives its devices, and why",
                       description="Resolve the default DMA domain as the kernel does (arch Kconfig default, "
                       "iommu.passthrough=, iommu=pt, iommu.strict=, caching mode, untrusted devices, driver "
                       "capabilities) and print it per device type with the kernel's own log lines.")
    archs = list(dict.fromkeys(a for d in vendors.DRIVERS.values() for a in d["archs"]))
    e.add_argument("--arch", choices=archs, default=archs[0], help=f"default {archs[0]}")
    e.add_argument("--kernel", metavar="V", help="kernel version, MAJOR.MINOR (default 6.12, or the first kernel "
                   "after it with the IOMMU's driver: 6.13 for riscv)")
    e.add_argument("--cmdline", default="", help="kernel command line")
    e.add_argument("--caching-mode", choices=["on", "off"], default="off",
                   help=f"caching mode (a virtual IOMMU's {_caching_mode_caps()})")
    e.add_argument("--iommu", choices=vendors.names(),
                   help="IOMMU driver (default: " + ", ".join(f"{_default_driver(a)} on {a}" for a in archs) + ")")
    e.add_argument("--json", action="store_true", help='print {"kernel_log": [...], "devices": [...]}')

    i = sub.add_parser("inspect", help="this machine's IOMMUs, groups and devices: the DMA mode in effect and why",
                       description="Read /proc and /sys (never changing them) and print, per device, the DMA mode "
                       "in effect (its IOMMU group's type) and why, by the same default-domain rules as explain, "
                       "saying when what sysfs shows disagrees with them.")
    i.add_argument("--root", default="/", metavar="DIR", help="read a saved tree (from --save) instead of /")
    i.add_argument("--save", metavar="DIR", help="copy exactly the files read into DIR (for bug reports, tests)")
    i.add_argument("--scenario", metavar="FILE", help="write a scenario skeleton for this host to FILE (not "
                   "overwritten if it exists, unless --force)")
    i.add_argument("--force", action="store_true", help="overwrite the --scenario file if it exists")
    i.add_argument("--json", action="store_true", help="print what was found as JSON")

    sh = sub.add_parser("completion", help="print a shell completion script (from this parser)",
                        description="Print the completion script for SHELL, e.g. `iommulab completion bash > "
                        "~/.local/share/bash-completion/completions/iommulab`, or `eval \"$(iommulab completion "
                        "bash)\"` in a shell's rc file.")
    sh.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell")

    ad = sub.add_parser("advise", help="strict, lazy or passthrough on this host: what each costs, exposes and what "
                        "binds it, and which to run", description="Read this host as inspect does (or a saved tree), "
                        "build the scenario for a workload on the closest built-in profile, run every DMA option the "
                        "kernel offers (passthrough, lazy, strict) with its command-line switch, and recommend one "
                        "by a stated rule.")
    ad.add_argument("--root", default="/", metavar="DIR", help="read a saved tree (from inspect --save) instead of /")
    ad.add_argument("--workload", default="nic-rx", metavar="W",
                    help="nic-rx (default), nic-tx, nvme, rr, or a scenario file or built-in name whose workload to run")
    ad.add_argument("--max-exposure", metavar="TIME", help="the longest exposure p99 to accept (10ms, 500us, 0, "
                    "any); default: the kernel's own bound on lazy exposure (the flush-queue timer)")
    ad.add_argument("--set", dest="sets", action="append", default=[], type=_set_pair, metavar="KEY=VALUE",
                    help="override a scenario key (the CPUs, the line rate, …); repeatable")
    ad.add_argument("--json", action="store_true",
                    help="print {host, assumed, options: [...], recommendation, caveats} as JSON")
    ad.add_argument("--ranges", type=int, default=DEFAULT_SAMPLES, metavar="N",
                    help=f"sample the profile's ranged constants N times (default {DEFAULT_SAMPLES}) and say whether "
                    "the verdict holds over them, and where not what decides it (docs/ranges.md)")
    ad.add_argument("--no-ranges", dest="ranges", action="store_const", const=None,
                    help="one point: the profile's values only")
    _jobs_arg(ad)

    cp = sub.add_parser("capture", help="record the kernel's iommu:map/unmap tracepoints into a trace replay reads",
                        description="Record iommu:map / iommu:unmap (and iommu:io_page_fault) through tracefs, with "
                        "TB_BEGIN/TB_END phase markers, into a file `iommulab replay` reads as it is. Needs root; "
                        "records into a tracing instance of its own, so the host's tracing is left as it was, and "
                        "removes it and its kprobes on every exit (Ctrl-C, SIGTERM and SIGHUP keep what was read). "
                        "COMMAND may write markers to $IOMMULAB_TRACE_MARKER. The work is done by a POSIX shell "
                        "script (--print-script) that also runs where Python does not.")
    cp.add_argument("-o", dest="out", metavar="TRACE", help="output: TRACE.xz (xz), TRACE.gz (gzip) or plain")
    cp.add_argument("--duration", type=float, metavar="S", help="record S seconds (default: while COMMAND runs, "
                    "or 10 s)")
    cp.add_argument("--phase", metavar="NAME", help="bracket the recording with TB_BEGIN/TB_END NAME")
    cp.add_argument("--buffer-kb", type=int, default=65536, metavar="KB", help="per-CPU ring buffer while recording")
    cp.add_argument("--domains", action=argparse.BooleanOptionalAction, default=True,
                    help="record each event's domain (kprobes on __iommu_map/__iommu_unmap) where the kernel "
                    "allows kprobes, else the DMA API's events naming each mapping's device (Linux 6.12+), so "
                    "replay keeps concurrent devices apart (default: on; it says so when it cannot)")
    cp.add_argument("--timer", action=argparse.BooleanOptionalAction, default=True,
                    help="record when the flush queue's timer fires (a kprobe on fq_flush_timeout) where the kernel "
                    "allows it; replay of a trace without domains runs its lazy flush timer as recorded (default: "
                    "on)")
    cp.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    cp.add_argument("--print-script", action="store_true", help="print the capture script (for hosts without "
                    "Python) and exit")
    cp.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]: record while it runs")

    v = sub.add_parser("validate", help="run every published target's scenario: model vs published, with the error",
                       description="Run the scenario of each published target (C1, C3, ...: targets.toml in the "
                       "package) and print the model's value next to the published one, the relative error and "
                       "whether it is within the target's tolerance.")
    v.add_argument("ids", nargs="*", metavar="TARGET", help="only these targets: an id, or the start of ids up to a "
                   "`.` or `_` (C1, m5.morello), in any case (default: all)")
    v.add_argument("--list", action="store_true", help="list the targets (id, published figure, tolerance, kind) "
                   "without running anything")
    v.add_argument("--set", dest="sets", action="append", default=[], type=_set_pair, metavar="KEY=VALUE",
                   help="override a scenario key in every target run (e.g. platform.memory.walk_read_ns=150)")
    v.add_argument("--seeds", type=_seeds, default=DEFAULT_SEEDS, metavar="N",
                   help=f"run each target at N seeds, the scenario's and the next ones, and compare their mean "
                   f"(default {DEFAULT_SEEDS}, at most {MAX_SEEDS})")
    v.add_argument("--json", action="store_true",
                   help='print {"targets": [{"id", "published", "model", "error", "ok", "seeds", "spread", ...}, ...]}')
    v.add_argument("--plot", metavar="FILE.html", help="also write an HTML report: model against published with "
                   "the tolerance bands, and the table (not overwritten without --force)")
    v.add_argument("--force", action="store_true", help="overwrite the --plot file if it exists")
    _ranges_arg(v, "also each target over N (default %(const)s) samples of its profile's ranged constants: whether "
                "the published figure lies in the model's 90%% interval, and how wide it is")
    v.add_argument("--fail-on-miss", action="store_true", help="exit 1 when any target is outside its tolerance "
                   "(for CI); the table or JSON is printed first")
    _runner_args(v)

    c = sub.add_parser("calibrate", help="fit a profile parameter to a published target and write it with provenance",
                       description="Bisect one physical parameter of a platform profile until a published target's "
                       "model value meets the published figure (the calibrations declared in targets.toml, or "
                       "--param/--target/--range), print the value, and with --out write the profile with the "
                       "value and its provenance in [sources].")
    c.add_argument("--param", help="profile key, e.g. iommu.smmuv3.sync_ns (default: every declared calibration)")
    c.add_argument("--profile", help="built-in profile name or profile file (default: the declared one)")
    c.add_argument("--target", dest="target_id", metavar="ID", help="target id (default: the declared one)")
    c.add_argument("--range", dest="rng", type=_range, metavar="LOW:HIGH", help="search range (default: declared)")
    c.add_argument("--seeds", type=_seeds, default=DEFAULT_SEEDS, metavar="N",
                   help=f"fit the mean over N seeds, as validate compares it (default {DEFAULT_SEEDS})")
    c.add_argument("--out", metavar="FILE", help="write the calibrated profile here (one calibration only)")
    c.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    c.add_argument("--json", action="store_true", help="print the fitted values as JSON")
    c.add_argument("--list", action="store_true",
                   help="list the declared calibrations (each fitted constant, its profile value and its target, "
                   "micro or macro) without running anything")
    _runner_args(c)

    sw = sub.add_parser("sweep", help="run every point of a sweep file into a Parquet dataset (resumable)",
                        description="Run every point of the axes a sweep file names (one simulation each) and write "
                        "one row per run to a Parquet dataset in --out as runs finish. Run again, it skips the runs "
                        "already there. See docs/sweeps.md for the file's form.")
    sw.add_argument("sweep", nargs="?", metavar="SWEEP.toml", help="sweep file")
    sw.add_argument("--example", action="store_true", help="print an example sweep file to start from, and exit")
    sw.add_argument("--out", metavar="DIR", help="dataset directory (default: sweep-<file name>)")
    sw.add_argument("--ray", nargs="?", const=True, default=False, metavar="ADDRESS",
                    help="run the points as Ray tasks: on the cluster at ADDRESS, or a local one")
    sw.add_argument("--report", metavar="FILE.html", help="write the HTML report when done")
    sw.add_argument("--json", action="store_true", help="print the results (one object per run) as JSON")
    _runner_args(sw)

    rep = sub.add_parser("report", help="an HTML report (interactive plots, tables) of a sweep or Parquet results",
                         description="Read a sweep's dataset directory or a Parquet file of runs (sweep, run "
                         "--parquet, compare --parquet) and write one self-contained HTML file with interactive "
                         "plots: throughput against exposure per policy, every metric against every swept axis, "
                         "and the runs' configurations. Several seeds of a point are shown as their mean and "
                         "min-max.")
    rep.add_argument("results", metavar="DIR|FILE.parquet", help="results to report")
    rep.add_argument("-o", dest="out", metavar="FILE.html", help="report file (default: report.html beside the "
                     "results; never overwritten without --force)")
    rep.add_argument("--csv", metavar="FILE", help="also write the results as CSV (one row per run)")
    rep.add_argument("--force", action="store_true", help="overwrite existing output files")

    f = sub.add_parser("profiles", help="list the built-in platform profiles, or print one",
                       description="List built-in platform profiles; with a NAME, print each of its constants "
                       "with its value, its range, its source and the range's reason.")
    f.add_argument("name", nargs="?", help="built-in profile to print")
    f.add_argument("--json", action="store_true", help="as JSON: every built-in's name, vendor and description, "
                   "or the named one (with its [sources] and [ranges]) as a JSON object")
    f.add_argument("--toml", action="store_true", help="the named profile's file as it is (to copy and edit)")

    pf = sub.add_parser("profile", help="measure the kernel's map/unmap path on this host, and fit a profile to it",
                        description="measure: record the latency of the kernel's own DMA map/unmap path functions "
                        "(kprobes at their entry and return, in a tracing instance of the capture script's own, "
                        "removed on every exit) while a workload runs, into a JSON summary. fit: write a platform "
                        "profile whose CPU-path and invalidation constants come from that summary, and print what "
                        "the model then gives for each measured function beside what was measured.")
    psub = pf.add_subparsers(dest="profile_cmd", metavar="measure|fit")
    pm = psub.add_parser("measure", help="record the map/unmap path's latencies (root; or read a trace)",
                         description="Record how long the kernel's DMA map/unmap path functions take (capture "
                         "script -M: iommu_dma_map_page, alloc_iova_fast, iommu_map, qi_submit_sync, ...) while "
                         "COMMAND runs (or for --duration), and write per-function latencies as JSON. With --trace, "
                         "summarise a trace recorded elsewhere with `iommulab capture --print-script` run as "
                         "`sh capture.sh -M -o TRACE` (a host without Python).")
    pm.add_argument("-o", dest="out", metavar="M.json", required=True, help="the measurement (never overwritten "
                    "without --force)")
    pm.add_argument("--trace", metavar="TRACE", help="summarise this trace (capture.sh -M or -L) instead of recording")
    pm.add_argument("--duration", type=float, metavar="S", help="record S seconds (default: while COMMAND runs, "
                    "or 10 s)")
    pm.add_argument("--functions", metavar="F,F", help="also measure these kernel functions")
    pm.add_argument("--keep-trace", metavar="FILE", help="keep the recorded trace here")
    pm.add_argument("--force", action="store_true", help="overwrite -o if it exists")
    pm.add_argument("--json", action="store_true", help="print the measurement as JSON")
    pm.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    pm.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]: record while it runs")
    pt = psub.add_parser("fit", help="write a profile from a measurement, and compare its model with it",
                         description="Write PROFILE (a copy of --base) with the constants the measurement sets, "
                         "each with its provenance (measured on HOST, DATE, KERNEL) in [sources], then print, per "
                         "measured function, the measured mean latency beside what the model gives with it.")
    pt.add_argument("measurement", metavar="M.json")
    pt.add_argument("--base", required=True, metavar="PROFILE", help="built-in profile name or profile file to start "
                    "from (the closest platform: vtd-server, smmuv3-server, kunpeng920, ...)")
    pt.add_argument("-o", dest="out", required=True, metavar="FILE.toml", help="the fitted profile (never "
                    "overwritten without --force)")
    pt.add_argument("--force", action="store_true", help="overwrite -o if it exists")
    pt.add_argument("--json", action="store_true", help="print the fitted values and the comparison as JSON")
    return p


# --inv-log windows: the simulator's clock is in ns, and each window re-reads every counter of the run.
INV_LOG_MIN_MS = 0.001
INV_LOG_MAX_WINDOWS = 10_000


def _cmd_run(a: argparse.Namespace) -> int:
    variants = load(a.scenario, dict(a.sets), raw_strings=True)
    if a.inv_log is not None:
        if a.json:
            raise ScenarioError("--inv-log prints dmar.c-style text lines, not JSON: drop --json or --inv-log")
        if a.ranges is not None:
            raise ScenarioError("--inv-log prints one run's counters, not a ranged run's: drop --ranges or --inv-log")
        if not (a.inv_log >= INV_LOG_MIN_MS and math.isfinite(a.inv_log)):
            raise ScenarioError(f"--inv-log {a.inv_log:g}: expected a window of at least {INV_LOG_MIN_MS:g} ms")
        for v in variants:
            ms = json.loads(v.scenario_json())["run"]["duration_ms"]
            if ms / a.inv_log > INV_LOG_MAX_WINDOWS:
                raise ScenarioError(
                    f"--inv-log {a.inv_log:g}: {ms:g} ms of run.duration_ms would print {ms / a.inv_log:.0f} windows; "
                    f"expected at most {INV_LOG_MAX_WINDOWS} (a window of at least {ms / INV_LOG_MAX_WINDOWS:g} ms)")
        for v in variants:
            sys.stdout.write(inv_log(v, a.inv_log))
        return 0
    _distinct(("the scenario", _input(a.scenario)), ("--parquet", a.parquet), ("--csv", a.csv))
    _fresh(a.parquet, a.force, "--parquet")
    _fresh(a.csv, a.force, "--csv")
    ranged_doc = None
    with _progress(a) as progress:
        if a.ranges is not None:
            ranged_doc = ranged(a.scenario, dict(a.sets), a.ranges, progress, raw_strings=True, jobs=a.jobs,
                                bases=variants)
            results = [with_ranges(r) for r in ranged_doc]
        else:
            results = run_variants(variants, progress, a.jobs)
    _write_runs(a, results)
    if a.json:
        json.dump(as_result(results).to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sc = json.loads(variants[0].scenario_json())
        sys.stdout.write(format_table(sc, results, list(a.sets)))
        if ranged_doc:
            sys.stdout.write("\n".join(format_ranges(sc, results)) + "\n")
    return 0


RANGES_HELP = ("also sample the profile's ranged constants N times (default %(const)s) and give each headline figure "
               "its median and 90%% interval, with the constants that drive it (docs/ranges.md)")


def _ranges_arg(p: argparse.ArgumentParser, help: str = RANGES_HELP) -> None:
    """--ranges [N]: off by default, N = DEFAULT_SAMPLES when given alone."""
    p.add_argument("--ranges", nargs="?", const=DEFAULT_SAMPLES, type=int, default=None, metavar="N", help=help)


class _progress:
    """The progress bar a command draws on stderr (a terminal only, not with --json, --quiet or --no-progress):
    one line, runs done and the ETA."""

    def __init__(self, a: argparse.Namespace, what: str = "runs"):
        quiet = any(getattr(a, k, False) for k in ("json", "no_progress", "quiet"))
        self.bar = None if quiet else stderr_progress(what)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def _default_driver(arch: str) -> str:
    """The hardware IOMMU driver an `arch` kernel has first (explain's default)."""
    return next(n for n in vendors.names(arch=arch) if not vendors.DRIVERS[n].get("paravirtual"))


def _caching_mode_caps() -> str:
    return ", ".join(f"{d['title']} {d['caching_mode_cap']}" for d in vendors.DRIVERS.values()
                     if d["caching_mode_cap"])


def _policy_list(text: str) -> list[str]:
    ps = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in ps if p not in POLICIES]
    if not ps or bad:
        raise argparse.ArgumentTypeError(f"expected policies from {','.join(POLICIES)}, got {text!r}")
    return ps


def _list_calibrations(ts, as_json: bool) -> int:
    """Each declared calibration: the constant, its value in the profile, the target and what kind it is."""
    rows = declared_calibrations(ts)
    if as_json:
        json.dump({"calibrations": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for r in rows:
        what = "a micro-target" if r["kind"] == "micro" else "a throughput or workload count (macro)"
        print("\n".join(wrap(f"{r['profile']}: {r['param']} = {r['value']}  fitted on {r['target']} = "
                             f"{r['published']:g}, {what}: {r['source']}")))
    return 0


def _factor_list(text: str) -> list[float]:
    try:
        fs = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        fs = []
    if not fs or any(not (1 / MAX_FACTOR <= f <= MAX_FACTOR) or f == 1 for f in fs):
        raise argparse.ArgumentTypeError(f"expected factors from {1 / MAX_FACTOR:g} to {MAX_FACTOR:g} other than "
                                         f"1, e.g. 0.5,2; got {shown(text)!r}")
    return fs


def _fresh(path: str | None, force: bool, what: str) -> None:
    """Refuse, before anything is written, to overwrite a file the user has or to write through a link to a
    file not there (unless --force), and a path no file can be written at."""
    if not path:
        return
    if os.path.lexists(path) and not force:
        if not os.path.exists(path):
            raise ScenarioError(f"{what} {shown(path)}: a link to {shown(os.readlink(path))}, which does not exist; "
                                "pass --force to write through it, or pick another name")
        raise ScenarioError(f"{what} {shown(path)}: exists; pass --force to overwrite it, or pick another name")
    if os.path.isdir(path):
        raise ScenarioError(f"{what} {shown(path)}: a directory; expected a file name")
    where = os.path.dirname(path) or "."
    if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
        raise ScenarioError(f"{what} {shown(path)}: cannot write in {shown(where)}: "
                            + ("no such directory" if not os.path.isdir(where) else "permission denied"))


def _write(path: str, data: str | bytes, what: str) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        raise ScenarioError(f"{what} {shown(path)}: cannot write: {e.strerror or e}") from None


def _writable(path: str | None, what: str) -> None:
    """Refuse, before anything is written, an output file that cannot be written (a missing directory, a
    file where a directory should be, a directory where the file should be, no permission)."""
    if not path:
        return
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ScenarioError(f"{what} {path}: cannot write: {e.strerror or e}") from None
    if not existed:
        os.remove(path)


def _json_safe(v):
    """`v` with every NaN and infinity as None (JSON has neither; a derived column can hold them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def _write_runs(a: argparse.Namespace, results: list) -> None:
    """--parquet and --csv: the runs one row each, in the form a sweep writes (so `report` reads the Parquet;
    in the CSV nested results are dotted columns and lists JSON text)."""
    from .dataset import frame

    if not (a.parquet or a.csv):
        return
    rows = [{"run": i, "iommulab_version": __version__, "result": r.to_dict()} for i, r in enumerate(results)]
    df = frame(rows)
    if a.parquet:
        _write_frame(df, a.parquet, "--parquet", "parquet")
    if a.csv:
        _write_frame(df, a.csv, "--csv", "csv")


def _write_frame(df, path: str, what: str, kind: str) -> None:
    """`df` as Parquet or CSV (`kind`) at `path`: made in memory, then written as any output is, so that a write
    that fails (a full disk, /dev/full: polars reports it as a ComputeError, not an OSError) is one line."""
    import io

    buf = io.BytesIO()
    if kind == "parquet":
        df.write_parquet(buf)
    else:
        df.write_csv(buf)
    _write(path, buf.getvalue(), what)


def _input(path: str | None) -> str | None:
    """`path` when it names a file the command reads (not a built-in's name), for `_distinct`."""
    return path if path and os.path.isfile(path) else None


def _distinct(*outputs: tuple[str, str | None]) -> None:
    """Refuse two outputs (flag, path), or an output and the input, that name one file: the second would
    overwrite the first unasked, --force or not (it overwrites a file of an earlier run, not this one's)."""
    seen: dict[str, str] = {}
    for what, path in outputs:
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ScenarioError(f"{what} {shown(path)}: the same file as {seen[real]}; give each output a file of "
                                "its own")
        seen[real] = what


def _cmd_sensitivity(a: argparse.Namespace) -> int:
    from .sensitivity import DEFAULT_FACTORS, format_sensitivity, sensitivity

    if a.top < 1:
        raise ScenarioError(f"--top {a.top}: expected 1 or more")
    with _progress(a) as progress:
        doc = sensitivity(a.scenario, dict(a.sets), a.factor or DEFAULT_FACTORS, progress, raw_strings=True,
                          jobs=a.jobs)
    return _emit(a.json, doc, lambda d: format_sensitivity(d, list(a.sets), a.top))


def _cmd_compare(a: argparse.Namespace) -> int:
    from .plots import results_page

    variants = load(a.scenario, dict(a.sets), raw_strings=True)
    sc = json.loads(variants[0].scenario_json())
    name = sc.get("name") or "scenario"
    plot = None
    if not a.no_plot:
        plot = a.plot or f"compare-{name}.html"
        if a.plot is None and os.path.exists(plot) and not a.force:
            # The default name is taken (an earlier run's plot): the next free one, never overwriting it.
            k = 2
            while os.path.exists(f"compare-{name}-{k}.html"):
                k += 1
            plot = f"compare-{name}-{k}.html"
        _fresh(plot, a.force, "--plot")
    _distinct(("the scenario", _input(a.scenario)), ("--plot", plot), ("--parquet", a.parquet), ("--csv", a.csv))
    _fresh(a.parquet, a.force, "--parquet")
    _fresh(a.csv, a.force, "--csv")
    with _progress(a) as progress:
        results = compare(a.scenario, dict(a.sets), a.policies, progress, raw_strings=True, jobs=a.jobs,
                          ranges=a.ranges)
    if plot:
        rows = [r.flat() for r in results]
        _write(plot, results_page(rows, f"iommulab compare · {name}", subtitle=sc.get("description", ""),
                                  iops=bool(sc["workload"].get("nvme"))), "--plot")
    _write_runs(a, results)
    if a.json:
        out = {"scenario": name, "plot": plot, "runs": [r.to_dict() for r in results]}
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_compare(sc, results, plot, list(a.sets)))
    return 0


def _cmd_sweep(a: argparse.Namespace) -> int:
    from importlib.resources import files

    from . import sweeps as sweep_mod

    if a.example:
        sys.stdout.write(files("iommulab").joinpath("example-sweep.toml").read_text())
        return 0
    if not a.sweep:
        raise ScenarioError("sweep: give a sweep file (iommulab sweep --example prints one to start from)")
    sw = sweep_mod.read(a.sweep)
    out = a.out or "sweep-" + os.path.splitext(os.path.basename(a.sweep))[0]
    _fresh(a.report, False, "--report")
    _writable(a.report, "--report")
    log = None if a.json or a.quiet else (
        lambda m: sys.stderr.write(f"iommulab sweep: {m} · results in {out}\n"))
    with _progress(a) as progress:
        df = sweep_mod.sweep(sw, out, jobs=a.jobs, ray=a.ray, progress=progress, log=log)
    if a.report:
        _write(a.report, _report_html(out, df), "--report")
    if a.json:
        json.dump(_json_safe({"out": out, "runs": df.to_dicts()}), sys.stdout, indent=2, default=str,
                  allow_nan=False)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(sweep_mod.format_summary(df, sw))
    print(f"{df.height} runs in {out}" + (f" · report {a.report}" if a.report else ""))
    return 0


def _report_html(path: str, df) -> str:
    """The report of the results `df` read from `path` (seeds averaged when a point has several)."""
    from . import dataset
    from .plots import results_page

    spec = dataset.spec_of(path) if os.path.isdir(path) else {}
    axes = dataset.axes_of(df, spec)
    if "seed" in df.columns:
        agg = dataset.aggregate_seeds(df, axes)
        df = agg if agg.height < df.height else df
    title = f"iommulab report · {os.path.basename(os.path.normpath(path))}"
    return results_page(df.to_dicts(), title, axes, spec or None, iops=_nvme_sweep(spec))


def _nvme_sweep(spec: dict[str, Any]) -> bool:
    """Whether a sweep's dataset (its sweep.json `spec`) is an NVMe workload's, read by kIOPS."""
    try:
        sc = load(spec["scenario"], dict(spec.get("set") or {}))[0].scenario_json()
    except (KeyError, ScenarioError):
        return False
    return bool(json.loads(sc)["workload"].get("nvme"))


def _cmd_report(a: argparse.Namespace) -> int:
    from . import dataset

    out = a.out or os.path.join(a.results if os.path.isdir(a.results) else os.path.dirname(a.results) or ".",
                                "report.html")
    _distinct(("the results", _input(a.results)), ("-o", out), ("--csv", a.csv))
    _fresh(out, a.force, "-o")
    _fresh(a.csv, a.force, "--csv")
    df = dataset.load(a.results)
    page = _report_html(a.results, df)
    _writable(out, "-o")
    _writable(a.csv, "--csv")
    _write(out, page, "-o")
    if a.csv:
        _write_frame(df, a.csv, "--csv", "csv")
    print(f"wrote {out}" + (f" and {a.csv}" if a.csv else ""))
    return 0


def _cmd_replay(a: argparse.Namespace) -> int:
    with _progress(a, "bytes") as bar:
        res = replay(a.trace, iommu=a.iommu, caching_mode=a.caching_mode == "on", ats=a.ats, kernel=a.kernel,
                     cmdline=a.cmdline, mode=a.mode, hz=a.hz, tick_phase_us=a.tick_phase_us,
                     ats_phases=a.ats_phases, progress=bar and bar.bytes)
    return _emit(a.json, res, format_replay)


def _cmd_explain(a: argparse.Namespace) -> int:
    iommu = a.iommu or _default_driver(a.arch)
    a.kernel = a.kernel or default_kernel(iommu)
    utf8(a.kernel, "--kernel")
    utf8(a.cmdline, "--cmdline")
    res = json.loads(_core.explain(a.arch, a.kernel, a.cmdline, a.caching_mode == "on", iommu))
    if a.json:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    lines = wrap(f"Linux {a.kernel} on {a.arch} with {iommu}" + (" (caching mode)" if a.caching_mode == "on" else "")
                 + (f", command line: {a.cmdline}" if a.cmdline else ""))
    lines += [x for line in res["kernel_log"] for x in wrap(line, "    ", "  ")] + [""]
    devs = res["devices"]
    lines += fit(["device"] + [d["device"] for d in devs],
                 [left("type", [d["sysfs"] for d in devs]), left("mode", [d["policy"] for d in devs])],
                 text=("why", [d["why"] for d in devs]))
    sys.stdout.write(terminal("\n".join(lines) + "\n"))
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from . import hostinfo
    import tomli_w

    # Every output is checked before anything is read or written: a refusal leaves nothing behind.
    _fresh(a.scenario, a.force, "--scenario")
    if a.save:
        hostinfo.check_save(a.save)
    res, tree = hostinfo.inspect(a.root)
    if a.save:
        n = hostinfo.save(tree, a.save)
        sys.stderr.write(f"saved {n} files to {shown(a.save)}\n")
    if a.scenario:
        _write(a.scenario, tomli_w.dumps(hostinfo.scenario_skeleton(res, hostinfo.cpu_count(tree))), "--scenario")
    if a.json:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(terminal(hostinfo.format_inspect(res)))
        if a.scenario:
            print(f"wrote {shown(a.scenario)}")
    return 0


def _with_path_hints(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` with every argument that names a file or a directory marked for the shell's completion (shtab),
    by its metavar (FILE, DIR, SCENARIO.toml, TRACE, …)."""
    import shtab

    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for sub in act.choices.values():
                _with_path_hints(sub)
            continue
        meta = str(act.metavar or "").upper()
        if "DIR" in meta or meta == "RESULTS":
            act.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif any(w in meta for w in ("FILE", "TOML", "TRACE", "HTML", "JSON", "PARQUET", "CSV")):
            act.complete = shtab.FILE  # type: ignore[attr-defined]
    return parser


def _emit(as_json: bool, doc: Any, text: Callable[[Any], str]) -> int:
    """Print a command's result: as JSON, or as the text `text` makes of it."""
    if as_json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(terminal(text(doc)))
    return 0


def _cmd_advise(a: argparse.Namespace) -> int:
    from .advise import advise, format_advise

    return _emit(a.json, advise(a.root, a.workload, a.max_exposure, dict(a.sets), a.ranges, a.jobs), format_advise)


def _capture_script() -> str:
    from importlib.resources import files

    return files("iommulab").joinpath("capture.sh").read_text()


def _duration_args(a: argparse.Namespace) -> list[str]:
    """The capture script's -d for --duration, checked before anything is touched."""
    if a.duration is None:
        return []
    if not (0 < a.duration <= 86400):
        raise ScenarioError(f"--duration {a.duration}: expected 0 < seconds <= 86400")
    return ["-d", str(int(math.ceil(a.duration)))]


def _run_capture(a: argparse.Namespace, args: list[str], rename: tuple[str, str] | None = None) -> int:
    """The capture script with `args`, then --dry-run's -n and -- COMMAND. Its own one-line errors and exit code
    are the command's; `rename` (path, words): what it says of the path, it says in those words."""
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    args = [*args, *(["-n"] if a.dry_run else []), *(["--", *cmd] if cmd else [])]
    return _run_to_the_end(["sh", "-c", _capture_script(), "capture", *args], rename)


def _cmd_capture(a: argparse.Namespace) -> int:
    if a.print_script:
        sys.stdout.write(_capture_script())
        return 0
    if not a.out:
        raise ScenarioError("capture: -o TRACE is required")
    args = ["-o", a.out, "-b", str(a.buffer_kb), *_duration_args(a)]
    if a.phase:
        args += ["-p", a.phase]
    if a.domains:
        args.append("-k")
    if a.timer:
        args.append("-t")
    return _run_capture(a, args)


def _cmd_profile(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import measure

    if a.profile_cmd == "fit":
        _fresh(a.out, a.force, "-o")
        m = measure.load(a.measurement)
        name, text = measure.base_profile(a.base)
        f = measure.fit(text, m)
        _write(a.out, measure.fitted_profile(name, f), "-o")
        rows = measure.modelled(f, a.out, m.get("kernel"))
        if a.json:
            json.dump({"profile": a.out, "fitted": {k: {"value": round(v, 4), "how": f.how[k]}
                                                    for k, v in sorted(f.values.items())},
                       "functions": rows, "not_fitted": f.skipped}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(terminal(measure.format_fit(f, rows, a.out)))
        return 0
    if a.profile_cmd != "measure":
        parser.parse_args(["profile", "--help"])
        return 2
    _fresh(a.out, a.force, "-o")
    _fresh(a.keep_trace, a.force, "--keep-trace")
    if a.trace:
        m = measure.summarize(a.trace)
    else:
        duration = _duration_args(a)
        fns = [x for x in (a.functions or "").split(",") if x]
        for fn in fns:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", fn):
                raise ScenarioError(f"--functions {fn}: expected kernel function names, separated by commas")
        with tempfile.TemporaryDirectory(prefix="iommulab-measure-") as d:
            trace = a.keep_trace or os.path.join(d, "trace.txt")
            # A trace of our own is deleted once summarised: it is named as what it is, not by a path that
            # will not exist when the user looks (the script's "wrote …" line, a summary's error).
            name = None if a.keep_trace else f"the recorded trace (temporary: summarised into {shown(a.out)}, " \
                "then deleted)"
            rc = _run_capture(a, ["-M", "-o", trace, *(x for fn in fns for x in ("-L", fn)), *duration],
                              rename=name and (trace, name))
            if a.dry_run or not os.path.exists(trace):
                return rc
            m = measure.summarize(trace, name)
    _write(a.out, json.dumps(m, indent=1) + "\n", "-o")
    if a.json:
        json.dump(m, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(terminal(measure.format_measure(m, a.out)))
    # A recording the user interrupted keeps what it read, and says so in its exit status.
    return 0 if a.trace else rc


def _run_to_the_end(argv: list[str], rename: tuple[str, str] | None = None) -> int:
    """Run a host tool that undoes its changes when signalled: SIGINT, SIGTERM and SIGHUP reach it (forwarded,
    where they were sent to this process alone), and it is waited for however long its cleanup takes, never
    killed (subprocess.run would kill it a quarter second after Ctrl-C, before it restored anything). With
    `rename` (text, words), its stdout and stderr pass through threads that write `words` for `text`."""
    import signal
    import subprocess
    import threading

    pipe = subprocess.PIPE if rename else None
    proc = subprocess.Popen(argv, stdout=pipe, stderr=pipe)
    relays = []
    if rename:
        text, words = (os.fsencode(x) for x in rename)

        def copy(src, dst) -> None:
            for line in src:
                dst.write(line.replace(text, words))
                dst.flush()

        for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            relays.append(threading.Thread(target=copy, args=(src, dst), name="iommulab-capture-relay", daemon=True))
            relays[-1].start()

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    # A signal ignored here (nohup ignores SIGHUP) is ignored by the tool too: nothing to pass on.
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    old = {s: signal.signal(s, forward) for s in sigs}
    try:
        rc = proc.wait()
        for t in relays:
            t.join()
        return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cmd_list(kind: str, items: list[tuple[str, str]], name: str | None, as_json: bool = False,
              as_toml: bool = False) -> int:
    if name is None:
        docs = [(n, tomllib.loads(text)) for n, text in items]
        if as_json:
            keys = ("description", "vendor")
            json.dump([{"name": n, **{k: d[k] for k in keys if k in d}} for n, d in docs], sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        for n, d in docs:
            print(f"{n:<16} {d.get('description', '')}")
        return 0
    if kind == "scenario" and name in dict(_core.builtin_aliases()):
        load(name)  # a renamed built-in: the core refuses it, naming the new name
    for n, text in items:
        if n == name:
            if as_json:
                json.dump(tomllib.loads(text), sys.stdout, indent=2)
                sys.stdout.write("\n")
            elif kind == "profile" and not as_toml:
                sys.stdout.write(format_profile(n, text))
            else:
                sys.stdout.write(text)
            return 0
    raise ScenarioError(f"{kind} `{name}`: no such built-in (built-in: {', '.join(n for n, _ in items)})")


def _list_names(items: list[tuple[str, str]]) -> int:
    """The built-ins' names, each with its description wrapped beside it."""
    docs = [(n, tomllib.loads(text).get("description", "")) for n, text in items]
    w = max(len(n) for n, _ in docs) + 2
    lines = [x for n, d in docs for x in wrap(d, " " * w, n.ljust(w))]
    sys.stdout.write(terminal("\n".join(lines) + "\n"))
    return 0


def _cmd_validate(a: argparse.Namespace) -> int:
    from .validate import format_targets

    if a.list:
        ts = load_targets()
        if a.ids:
            ts.targets = ts.select(a.ids)
        if a.json:
            keys = ("id", "published", "tolerance", "kind", "scenario", "source")
            json.dump({"targets": [{k: getattr(t, k) for k in keys} for t in ts.targets]}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(format_targets(ts))
        return 0
    _fresh(a.plot, a.force, "--plot")
    with _progress(a) as progress:
        rows = validate(a.ids or None, {k: _toml_or_str(v) for k, v in a.sets}, seeds=a.seeds, jobs=a.jobs,
                        progress=progress, ranges=a.ranges)
    if a.plot:
        from .plots import validate_page

        _write(a.plot, validate_page(rows), "--plot")
    if a.json:
        json.dump({"targets": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_validate(rows))
    missed = [r["id"] for r in rows if not r["ok"]]
    if a.fail_on_miss and missed:
        # One line, a few ids: the table or the JSON names every miss.
        more = f" and {len(missed) - 3} more" if len(missed) > 3 else ""
        sys.stderr.write(f"iommulab: {len(missed)} of {len(rows)} targets outside their tolerance: "
                         f"{', '.join(missed[:3])}{more}\n")
        return 1
    return 0


def _cmd_calibrate(a: argparse.Namespace) -> int:
    ts = load_targets()
    if a.list:
        return _list_calibrations(ts, a.json)
    cals = [c for c in ts.calibrations if a.param in (None, c.param)]
    # --profile and --target pick among the declared calibrations where they name one (else they override).
    for attr, want in (("profile", a.profile), ("target", a.target_id)):
        picked = [c for c in cals if getattr(c, attr) == want]
        cals = picked or cals
    if a.param and not cals:
        if not (a.target_id and a.rng and a.profile):
            raise ScenarioError(f"--param {a.param}: not declared in targets.toml; give --profile, --target and --range")
        cals = [Calibration(param=a.param, profile=a.profile, target=a.target_id, range=a.rng)]
    cals = [Calibration(param=c.param, profile=a.profile or c.profile, target=a.target_id or c.target,
                        range=a.rng or c.range) for c in cals]
    if a.out and len(cals) != 1:
        raise ScenarioError(f"--out: {len(cals)} calibrations selected; choose one with --param, --profile or "
                            "--target")
    if a.out and os.path.exists(a.out) and not a.force:
        raise ScenarioError(f"--out {a.out}: exists; pass --force to overwrite it")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        raise ScenarioError(f"--out {a.out}: no such directory")
    done = []
    for c in cals:
        with _progress(a, "probes") as progress:
            done.append(calibrate(c, ts, seeds=a.seeds, jobs=a.jobs, progress=progress))
    if a.out:
        try:
            with open(a.out, "w") as f:
                f.write(done[0]["profile_text"])
        except OSError as e:
            raise ScenarioError(f"--out {a.out}: cannot write: {e.strerror or e}") from None
    if a.json:
        json.dump({"calibrations": [{k: v for k, v in d.items() if k != "profile_text"} for d in done]},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for d in done:
        print("\n".join(wrap(f"{d['profile']}: {d['param']} = {d['value']}  ({d['target']}: model "
                             f"{d['model']:.4g}, published {d['published']:g}, error {100 * d['error']:+.1f}%)")))
    if a.out:
        print(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if a.cmd == "run":
            return _cmd_run(a)
        if a.cmd == "sensitivity":
            return _cmd_sensitivity(a)
        if a.cmd == "compare":
            return _cmd_compare(a)
        if a.cmd == "scenarios" and a.name is None and not a.json:
            return _list_names(_core.builtin_scenarios())
        if a.cmd == "scenarios":
            return _cmd_list("scenario", _core.builtin_scenarios(), a.name, a.json)
        if a.cmd == "explain":
            return _cmd_explain(a)
        if a.cmd == "inspect":
            return _cmd_inspect(a)
        if a.cmd == "advise":
            return _cmd_advise(a)
        if a.cmd == "completion":
            import shtab

            sys.stdout.write(shtab.complete(_with_path_hints(build_parser()), shell=a.shell))
            return 0
        if a.cmd == "capture":
            return _cmd_capture(a)
        if a.cmd == "replay":
            return _cmd_replay(a)
        if a.cmd == "validate":
            return _cmd_validate(a)
        if a.cmd == "calibrate":
            return _cmd_calibrate(a)
        if a.cmd == "sweep":
            return _cmd_sweep(a)
        if a.cmd == "report":
            return _cmd_report(a)
        if a.cmd == "profiles" and a.name is None and not a.json:
            return _list_names(_core.builtin_profiles())
        if a.cmd == "profiles":
            return _cmd_list("profile", _core.builtin_profiles(), a.name, a.json, a.toml)
        if a.cmd == "profile":
            return _cmd_profile(a, parser)
        parser.print_help()
        return 0
    except ScenarioError as e:
        sys.stderr.write(f"iommulab: error: {shown(str(e))}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("iommulab: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
