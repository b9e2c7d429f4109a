"""``iommulab sensitivity``: each constant of a run's platform profile varied alone, and what that changes.

A run's results rest on the profile's constants, most of them estimates. Scaling one constant at a time (by each
factor, the others as the profile has them) and running again shows which constants a result depends on:
the ones to measure first. A constant whose every scaled run gives the baseline's results is off the run's
path and left out of the table."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from . import __version__
from .api import ProgressFn, load, resolved, run_variants, toml_value
from ._core import ScenarioError
from .report import EXPOSED_LEGEND, fit, left, legend, right, set_lines, wrap

# Keys of a profile that describe the machine's structure, not a cost or a size to be measured: scaling them
# changes what is simulated (how many CPUs, the page-table format), not how fast it is.
STRUCTURE = {"cores", "cluster_cores", "socket_cores", "pages", "ias_bits", "granule_kb", "stage", "mamv",
             "iotlb_ways", "pwc_ways", "atc_ways"}

# What each run is read by: (result key path, JSON key, header in the table, the baseline as the table shows it).
METRICS = [
    (("throughput_gbps",), "Gbps", "Gbps", lambda v: f"{v:.2f}"),
    (("cpu_busy",), "CPU", "CPU busy", lambda v: f"{v:.1%}"),
    (("safety", "exposed_share"), "exposed", "exposed", lambda v: f"{v:.1%}"),
]
# An NVMe workload's rate (its goodput's bytes are its I/Os times their size: the table shows kIOPS alone).
IOPS_METRIC = (("packets_per_sec",), "IOPS", "kIOPS", lambda v: f"{v / 1e3:.0f}")
# The DMA map benchmark's own figure, on its runs (they move no data: no goodput to read).
BENCH_METRIC = (("map_benchmark", "loops_per_sec_per_thread"), "loops/s", "loops/s", lambda v: f"{v:.0f}")

DEFAULT_FACTORS = (0.5, 2.0)
# The factors a constant may be scaled by: 1/MAX_FACTOR to MAX_FACTOR. A bound of the front end, not a kernel
# constant: a million times a nanosecond cost is a millisecond, another machine rather than an error in this one's
# profile; and past it a profile's integers leave the core's types (u32, u64) and floats reach infinity.
MAX_FACTOR = 1e6


def _metrics(d: Mapping[str, Any], nvme: bool = False) -> list[tuple[tuple[str, ...], str, str, Any]]:
    """What a run with result `d` is read by (`nvme`: the run is an NVMe workload's)."""
    return METRICS + [BENCH_METRIC] * bool(d.get("map_benchmark")) + [IOPS_METRIC] * nvme


def constants(platform: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """The profile's numeric constants as (dotted key under `platform.`, value): numbers and lists of numbers,
    structure keys left out."""
    out = []
    for k, v in platform.items():
        key = f"{prefix}{k}"
        if k in ("sources", "ranges", "profile", "description", "vendor") or k in STRUCTURE:
            continue
        if isinstance(v, Mapping):
            out += constants(v, f"{key}.")
        elif _number(v) or (isinstance(v, list) and v and all(_number(x) for x in v)):
            out.append((key, v))
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scaled(v: Any, f: float) -> Any:
    """`v` times `f`, integers staying integers."""
    if isinstance(v, list):
        return [scaled(x, f) for x in v]
    out = v * f
    if not math.isfinite(out):
        raise OverflowError(f"{v!r} x {f!r}")
    return round(out) if isinstance(v, int) else out


def _get(d: Mapping[str, Any], path: tuple[str, ...]) -> float:
    for p in path:
        d = d[p]
    return float(d)


def _kind(source: str | None) -> str:
    """How a constant is known, from its profile's [sources] line."""
    if not source:
        return "-"
    s = source.lower()
    if s.startswith("calibrated"):
        return "fitted"
    # "estimate, borrowed from ...", "... ; estimate inside that range": a source that bounds it, no more.
    if "estimate" in s:
        return "estimate"
    return "sourced"


def sensitivity(scenario: Any = None, sets: Mapping[str, Any] | None = None, factors=DEFAULT_FACTORS,
                progress: ProgressFn | None = None, raw_strings: bool = False, jobs: int | None = None
                ) -> dict[str, Any]:
    """Every run of the scenario, then each of its profile's constants scaled by each factor alone: the results'
    changes, relative to the run's baseline, for the constants that change anything."""
    if not factors or any(not _number(f) or not 1 / MAX_FACTOR <= f <= MAX_FACTOR or f == 1 for f in factors):
        raise ScenarioError(f"factors {list(factors)!r}: expected numbers from {1 / MAX_FACTOR:g} to "
                            f"{MAX_FACTOR:g} other than 1")
    sets = dict(sets or {})
    bases = load(scenario, sets, raw_strings=raw_strings)
    todo, slots = [], []
    runs = []
    for b in bases:
        # Each scaled run is this run's own scenario with one key set (whatever axes or profiles the scenario's
        # other runs have).
        base = resolved(b)
        sc = json.loads(b.scenario_json())
        sources = sc["platform"].get("sources") or {}
        run = {"label": b.label, "profile": sc["platform"]["profile"], "constants": []}
        runs.append(run)
        todo.append(b)
        slots.append((run, None, bool(sc["workload"].get("nvme"))))
        for key, value in constants(sc["platform"]):
            c = {"key": key, "value": value, "source": _kind(sources.get(key)), "scaled": []}
            run["constants"].append(c)
            for f in factors:
                try:
                    v = scaled(value, f)
                    [var] = load(base, {f"platform.{key}": toml_value(v)}, raw_strings=True)
                except ScenarioError as e:
                    c["scaled"].append({"factor": f, "value": v, "invalid": str(e)})
                    continue
                except OverflowError:
                    # A constant near a float's largest (a profile may hold 1e300): scaled, no longer a number.
                    c["scaled"].append({"factor": f, "value": None, "invalid": f"{key} x {f:g}: not a finite number"})
                    continue
                todo.append(var)
                slots.append((run, c, {"factor": f, "value": v}))
    results = run_variants(todo, progress, jobs)
    for (run, c, entry), r in zip(slots, results):
        d = r.to_dict()
        if c is None:
            run["metrics"] = [k for _, k, _, _ in _metrics(d, entry)]
            run["baseline"] = {k: _get(d, path) for path, k, _, _ in _metrics(d, entry)}
            run["protected"] = d["safety"]["protected"]
        else:
            entry.update({k: _get(d, path) for path, k, _, _ in _metrics(d, True) if k in run["metrics"]})
            c["scaled"].append(entry)
    for run in runs:
        base = run["baseline"]
        for c in run["constants"]:
            for e in c["scaled"]:
                if "invalid" not in e:
                    e["change"] = {h: _rel(e[h], base[h]) for h in run["metrics"]}
        run["constants"] = sorted((c for c in run["constants"] if _moves(c)), key=lambda c: -_reach(c))
    return {"scenario": json.loads(bases[0].scenario_json()).get("name") or "scenario", "factors": list(factors),
            "runs": runs}


def _rel(x: float, base: float) -> float | None:
    """(x - base) / base; None where the baseline is 0 and x is not."""
    if x == base:
        return 0.0
    return (x - base) / base if base else None


def _moves(c: dict[str, Any]) -> bool:
    return any(v != 0.0 for e in c["scaled"] for v in e.get("change", {}).values())


def largest_change(c: dict[str, Any]) -> tuple[float, float]:
    """The largest relative change a constant makes, over its factors, to throughput (a map benchmark's loops per
    second: it moves no data) and to CPU busy."""
    ch = [e["change"] for e in c["scaled"] if "change" in e]
    rate = max((abs(x[h]) for x in ch for h in ("Gbps", "IOPS", "loops/s") if x.get(h) is not None), default=0.0)
    cpu = max((abs(x["CPU"]) for x in ch if x["CPU"] is not None), default=0.0)
    return rate, cpu


def _reach(c: dict[str, Any]) -> float:
    """How far the constant moves throughput, then CPU (the sort key)."""
    rate, cpu = largest_change(c)
    return rate + cpu * 1e-3


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


LEGEND = [
    ("change", "(scaled - baseline) / baseline of the run's figure, for each factor"),
    ("Gbps", "application goodput"),
    ("kIOPS", "I/Os completed per second, in thousands (an NVMe workload's rate, in place of its goodput)"),
    ("CPU busy", "mean over the workload's CPUs"),
    EXPOSED_LEGEND,
    ("loops/s", "a map benchmark's map+unmap loops per second per thread"),
    ("source", "how the profile knows the constant ([sources]: sourced, fitted or estimate); structure keys "
     "(cores, table format, ways) are not scaled"),
]


def _shown(run: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The figures a run's table shows: (JSON key, header, baseline format); kIOPS in place of an NVMe run's
    Gbps."""
    keys = run["metrics"]
    figures = [IOPS_METRIC if m[1] == "Gbps" and "IOPS" in keys else m for m in METRICS + [BENCH_METRIC]]
    return [(k, h, fmt) for _, k, h, fmt in figures if k in keys]


# Each factor's change in a column this wide (+10.8%, invalid).
CHANGE_WIDTH = 8


def _group(head: str, fs: list[float], cells: list[list[str]]) -> list[str]:
    """One figure's changes as one column of the table: its name over its factors, a cell per factor."""
    sub = "".join(f"×{f:g}".rjust(CHANGE_WIDTH) for f in fs)
    rows = ["".join(c.rjust(CHANGE_WIDTH) for c in row) for row in cells]
    n = max(len(head), len(sub)) + 2
    return [head.rjust(n), sub.rjust(n)] + [r.rjust(n) for r in rows]


def _run_lines(run: dict[str, Any], fs: list[float], top: int) -> list[str]:
    """One run's baseline and its table: the constants that move it most, each factor's change to each figure."""
    base = run["baseline"]
    shown = _shown(run)
    unprotected = run.get("protected") is False
    figures = "  ".join(f"{h} {'all' if k == 'exposed' and unprotected else fmt(base[k])}" for k, h, fmt in shown)
    lines = [""] + wrap(f"{run['label'] or 'run'} (profile {run['profile']}): {figures}")
    consts = run["constants"][:top]
    if not consts:
        return lines + ["  no constant moves this run"]
    value = right("value", [json.dumps(c["value"]) if isinstance(c["value"], (list, int)) else f"{c['value']:g}"
                            for c in consts], 2)
    cols = [[""] + value]
    for k, h, _ in shown:
        cells = []
        for c in consts:
            es = [next(e for e in c["scaled"] if e["factor"] == f) for f in fs]
            cells.append(["invalid" if "invalid" in e else _pct(e["change"][k]) for e in es])
        cols.append(_group(h, fs, cells))
    source = left("source", [c["source"] for c in consts])
    cols.append([" " * len(source[0])] + source)
    lines += fit(["", "constant"] + [c["key"] for c in consts], cols, "  ", head=2)
    more = len(run["constants"]) - top
    if more > 0:
        lines.append(f"  … {more} more constants move this run (--json lists them all)")
    return lines


def format_sensitivity(doc: dict[str, Any], sets: list[tuple[str, str]] | None = None, top: int = 15) -> str:
    """The table: per run, the constants that move it most, each factor's change to each figure it is read by."""
    fs = doc["factors"]
    lines = wrap(f"iommulab {__version__} · sensitivity · {doc['scenario']}: each profile constant scaled alone by "
                 + ", ".join(f"×{f:g}" for f in fs))
    lines += set_lines(sets)
    for run in doc["runs"]:
        lines += _run_lines(run, fs, top)
    heads = {h for run in doc["runs"] for _, h, _ in _shown(run)}
    lines += [""] + legend([t for t in LEGEND if t[0] in heads | {"change", "source"}])
    return "\n".join(lines) + "\n"
