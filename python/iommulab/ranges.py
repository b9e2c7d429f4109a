"""Ranged runs: each headline figure with the interval its profile's unknown constants allow.

A profile's ``[ranges]`` say how far each constant may be from the value it holds (docs/ranges.md). A ranged run
samples every ranged constant of the run's profile at once in a Latin hypercube (each constant's column drawn
from a generator seeded by the run's seed and the constant's name alone), runs each sample, and reports each
figure as the 5th, 50th and 95th percentiles of the sample. A screen, as ``sensitivity`` does it, names what
drives each figure: the constants, in groups, moved to the ends of their ranges, then each constant of a group
that changed anything moved alone to both ends."""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any, Mapping

from ._core import ScenarioError
from .api import ProgressFn, load, resolved, run_variants, toml_value
from .report import duration, wrap
from .sensitivity import constants, scaled

# The sample, by default: enough for a 90 % interval's ends to sit between the sample's first and second
# (last and second-to-last) values, small enough for a ranged advise in seconds. A bound of the front end
# (docs/ranges.md "What the interval does not capture").
DEFAULT_SAMPLES = 24
MIN_SAMPLES = 8
MAX_SAMPLES = 1000
# Screening moves the ranged constants together in groups of this many (by name) first: a group whose moves
# change nothing in the run's result is off its path, and only the others' constants are moved one by one.
GROUP = 8
# A constant is named as driving a figure when, alone at either end of its range, it moves the figure by more
# than this share. A bound of the front end (docs/ranges.md).
MIN_SWING = 0.01
# Screening runs measure a fifth of the run's window (at least SCREEN_MIN_MS) after the run's own warm-up: it
# ranks constants by what they move, at a fraction of the cost; the sample runs the whole window. A bound of the
# front end (docs/ranges.md "Cost").
SCREEN_SHARE = 5
SCREEN_MIN_MS = 10.0
# Constants named as driving each figure, at most.
NAMED = 2


def bounds(value: Any, r: Mapping[str, Any]) -> tuple[float, float]:
    """A range as factors of the value: (a, b) with a <= 1 <= b (a value of 0 ranges over nothing)."""
    if "factor" in r:
        a, b = r["factor"]
        return float(a), float(b)
    if not value:
        return 1.0, 1.0
    return r["low"] / value, r["high"] / value


def _at(u: float, a: float, b: float) -> float:
    """The factor at quantile `u` of [a, b]: log-uniform (costs and sizes are scale quantities)."""
    return a * (b / a) ** u if a > 0 else a + (b - a) * u


def _set_sized(platform: Mapping[str, Any], key: str, v: Any) -> Any:
    """A cache's entries stay a whole number of sets: a multiple of the same section's ways (a `_entries` key
    beside a `_ways` one; 0 ways: fully associative)."""
    if not key.endswith("_entries"):
        return v
    sec = platform
    *parents, last = key.split(".")
    for p in parents:
        sec = sec.get(p) or {}
    ways = sec.get(last[: -len("entries")] + "ways") or 0
    fix = (lambda x: max(ways, round(x / ways) * ways)) if ways else (lambda x: max(1, x))
    return [fix(x) for x in v] if isinstance(v, list) else fix(v)


def scaled_to(platform: Mapping[str, Any], key: str, value: Any, f: float) -> Any:
    """`value` times factor `f` as sensitivity scales it (integers rounded), a cache's entries to whole sets."""
    return _set_sized(platform, key, scaled(value, f))


def lhs_column(seed: int, key: str, n: int) -> list[float]:
    """Quantiles in (0, 1) for `n` samples of one constant: one in each of n strata, in a shuffled order, from a
    generator seeded by (seed, key) alone: every run of a scenario (every policy) draws sample i at the same
    quantiles, so runs compare on the same sampled machine."""
    rng = random.Random(f"iommulab-ranges:{seed}:{key}")
    order = list(range(n))
    rng.shuffle(order)
    return [(order[i] + rng.random()) / n for i in range(n)]


def figures(sc: Mapping[str, Any], d: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The headline figures of a run (result key, dotted; its name in tables)."""
    w = sc.get("workload", {})
    if d.get("map_benchmark"):
        out = [("map_benchmark.loops_per_sec_per_thread", "loops/s/thread"), ("map_latency_us.avg", "map"),
               ("unmap_latency_us.avg", "unmap")]
    elif d.get("latency"):
        out = [("packets_per_sec", "kreq/s"), ("latency.p99_us", "latency p99")]
    elif w.get("nvme"):
        out = [("packets_per_sec", "kIOPS")]
    elif w.get("l2fwd"):
        out = [("packets_per_sec", "Mpps")]
    else:
        out = [("throughput_gbps", "Gbps")]
    out.append(("cpu_busy", "CPU busy"))
    if (d.get("safety") or {}).get("protected"):
        out.append(("safety.window.p99_us", "exposure p99"))
    return out


def value(d: Mapping[str, Any], key: str) -> float:
    """A figure of a result dict; a protected run's exposure p99 is 0 when no page was exposed."""
    cur: Any = d
    for p in key.split("."):
        cur = (cur or {}).get(p) if isinstance(cur, Mapping) else None
    if cur is None and key == "safety.window.p99_us":
        return 0.0
    return float(cur)


def percentiles(xs: list[float]) -> dict[str, float]:
    """p5, p50 and p95 of a sample (inclusive quantiles: linear between the sample's order statistics)."""
    q = statistics.quantiles(xs, n=20, method="inclusive")
    return {"p5": q[0], "p50": statistics.median(xs), "p95": q[18]}


def check_samples(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not MIN_SAMPLES <= n <= MAX_SAMPLES:
        raise ScenarioError(f"--ranges {n!r}: expected a number of samples from {MIN_SAMPLES} to {MAX_SAMPLES}")
    return n


def ranged(scenario: Any = None, sets: Mapping[str, Any] | None = None, n: int = DEFAULT_SAMPLES,
           progress: ProgressFn | None = None, raw_strings: bool = False, jobs: int | None = None,
           bases: list | None = None, screen: bool = True) -> list[dict[str, Any]]:
    """Each run of the scenario, ranged: per run its point figures, their p5/p50/p95 over `n` samples of the
    profile's ranged constants, and the constants that drive the spread. Deterministic in (scenario, seed, n),
    whatever `jobs`. `bases`: the runs, already loaded (each sample is its run's scenario with the sample's keys
    set: `api.resolved`). `screen` False: no screen (no constant named as driving a figure)."""
    n = check_samples(n)
    sets = dict(sets or {})
    bases = bases if bases is not None else load(scenario, sets, raw_strings=raw_strings)
    runs = [prepare(b) for b in bases]
    if not screen:
        for run in runs:
            run["groups"] = []
    phases = _Phases(progress, sum(n + 1 + 2 * len(r["keys"]) * screen for r in runs))
    # 1. The point, the sample (every ranged constant drawn at once), and the screen's own point and groups
    # of constants at their low ends and at their high ends together.
    todo = []
    for run in runs:
        cols = {k: lhs_column(run["scenario"]["run"]["seed"], k, n) for k in run["keys"]}
        todo.append(run["variant"])
        todo += [_variant(run, {k: run["at"](k, cols[k][i]) for k in run["keys"]}) for i in range(n)]
        if screen:
            todo.append(_variant(run, {}, screen=True))
        for g in run["groups"]:
            todo += [_variant(run, {k: run["at"](k, end) for k in g}, screen=True) for end in (0, 1)]
    res = iter(phases.run(todo, jobs))
    for run in runs:
        base = next(res).to_dict()
        run.update(base=base, figures=figures(run["scenario"], base))
        run["point"] = {k: value(base, k) for k, _ in run["figures"]}
        run["sampled"] = [next(res).to_dict() for _ in range(n)]
        run["screen"] = next(res).to_dict() if screen else base
        ends = [(g, [next(res).to_dict() for _ in range(2)]) for g in run["groups"]]
        # On the path: a group whose moves changed anything in the result. Screened one by one: a group whose
        # moves changed a headline figure by more than MIN_SWING (one alone can only name a driver then).
        run["on_path"] = [k for g, e in ends if e != [run["screen"]] * 2 for k in g]
        run["candidates"] = [k for g, e in ends if any(_moves(run, d) for d in e) for k in g]
    # 2. Each constant of a group that moved a headline figure, alone at both ends of its range.
    phases.expect(2 * sum(len(r["candidates"]) for r in runs))
    todo = [_variant(run, {k: run["at"](k, end)}, screen=True) for run in runs for k in run["candidates"]
            for end in (0, 1)]
    res = iter(phases.run(todo, jobs))
    for run in runs:
        run["swings"] = {k: (next(res).to_dict(), next(res).to_dict()) for k in run["candidates"]}
    out = [_summary(run, n) for run in runs]
    for o, run in zip(out, runs):
        o["with"] = lambda values, run=run: _variant(run, values)
    return out


def _change(run: dict[str, Any], d: Mapping[str, Any], f: str) -> float:
    """A screening run's figure `f` relative to the screen's own point (infinite from a point of 0)."""
    at = value(run["screen"], f)
    return (value(d, f) - at) / abs(at) if at else (0.0 if value(d, f) == at else math.inf)


def _moves(run: dict[str, Any], d: Mapping[str, Any]) -> bool:
    """Whether a screening run moved a headline figure by more than MIN_SWING from the screen's own point."""
    return any(abs(_change(run, d, f)) > MIN_SWING for f, _ in run["figures"])


def prepare(b) -> dict[str, Any]:
    """A run to range: its scenario (and as a dict its samples load from: `api.resolved`), its ranged constants
    (by name) in groups of GROUP, and `at(key, u)`: the constant at quantile u of its range."""
    sc = json.loads(b.scenario_json())
    plat = sc["platform"]
    ranges = plat.get("ranges") or {}
    consts = dict(constants(plat))
    keys = [k for k in sorted(ranges) if k in consts and bounds(consts[k], ranges[k]) != (1.0, 1.0)]

    def at(k: str, u: float) -> Any:
        return scaled_to(plat, k, consts[k], _at(u, *bounds(consts[k], ranges[k])))
    return {"label": b.label, "variant": b, "scenario": sc, "resolved": resolved(b), "keys": keys, "at": at,
            "groups": [keys[i:i + GROUP] for i in range(0, len(keys), GROUP)],
            "exact": sorted(k for k in consts if k not in ranges)}


class _Phases:
    """One progress count over a ranged run's three batches (the later ones' sizes known as the earlier end)."""

    def __init__(self, progress: ProgressFn | None, rest: int):
        self.progress, self.done, self.rest = progress, 0, rest

    def expect(self, rest: int) -> None:
        self.rest = rest

    def run(self, todo: list, jobs: int | None) -> list:
        base, total = self.done, self.done + max(self.rest, len(todo))
        cb = (lambda i, _n, label, frac: self.progress(base + i, total, label, frac)) if self.progress else None
        out = run_variants(todo, cb, jobs) if todo else []
        self.done += len(todo)
        self.rest = max(0, self.rest - len(todo))
        return out


def screen_ms(duration_ms: float) -> float:
    """The measured window a screening run takes: a fifth of the run's, at least SCREEN_MIN_MS (the whole run's
    when shorter); the warm-up stays the run's."""
    return min(duration_ms, max(SCREEN_MIN_MS, duration_ms / SCREEN_SHARE))


def _variant(run: dict[str, Any], values: Mapping[str, Any], screen: bool = False):
    """The run's variant with `values` (dotted platform keys) set (`screen`: on the screen's shorter window)."""
    window = {"run.duration_ms": toml_value(screen_ms(run["scenario"]["run"]["duration_ms"]))} if screen else {}
    try:
        [v] = load(run["resolved"], {**window, **{f"platform.{k}": toml_value(x) for k, x in values.items()}},
                   raw_strings=True)
    except ScenarioError as e:
        raise ScenarioError(f"run `{run['label']}`: a sample within the profile's ranges is not a valid "
                            f"scenario ({e}); narrow the range that allows it") from None
    return v


def _summary(run: dict[str, Any], n: int) -> dict[str, Any]:
    """A ranged run: its point figures, their percentiles over the sample, and per figure the constants (at most
    NAMED) that move it most alone, each with the figure's change at its range's low and high ends (relative
    to the screen's own point)."""
    figs = run["figures"]
    rng = {f: percentiles([value(d, f) for d in run["sampled"]]) for f, _ in figs}
    drivers: dict[str, list] = {}
    for f, _ in figs:
        named = [{"constant": k, "at_low": _change(run, lo, f), "at_high": _change(run, hi, f)}
                 for k, (lo, hi) in run["swings"].items()]
        named = [x for x in named if max(abs(x["at_low"]), abs(x["at_high"])) > MIN_SWING]
        named.sort(key=lambda x: (-abs(x["at_high"] - x["at_low"]), x["constant"]))
        drivers[f] = named[:NAMED]
    by = list(dict.fromkeys(x["constant"] for f, _ in figs for x in drivers[f]))
    return {"label": run["label"], "samples": n, "sampled_constants": len(run["keys"]),
            "on_path": len(run["on_path"]), "exact_constants": run["exact"], "names": dict(figs),
            "point": run["point"], "ranges": rng, "driven_by": by[:NAMED], "drivers": drivers,
            "screen_ms": screen_ms(run["scenario"]["run"]["duration_ms"]), "result": run["base"],
            "keys": run["keys"], "sampled": run["sampled"], "at": run["at"], "seed": run["scenario"]["run"]["seed"]}


def _pct(x: float) -> str:
    return "from none" if math.isinf(x) else f"{x * 100:+.0f}%"


def with_ranges(summary: Mapping[str, Any]):
    """A ranged run's result, its ranges beside its point figures (`ranges`, `driven_by`, `drivers`,
    `range_samples`): in --json, CSV and Parquet as any other key."""
    from .api import RunResult

    d = dict(summary["result"])
    d.update(ranges=summary["ranges"], driven_by=summary["driven_by"], drivers=summary["drivers"],
             range_samples=summary["samples"], ranged_constants=summary["sampled_constants"],
             ranged_on_path=summary["on_path"], range_screen_ms=summary["screen_ms"])
    return RunResult(d)


def fmt(key: str, name: str, x: float) -> str:
    """A figure as the ranged table prints it (the run table's units)."""
    if key == "cpu_busy":
        return f"{x * 100:.1f}%"
    if name == "Mpps":
        return f"{x / 1e6:.2f}"
    if key == "packets_per_sec":
        return f"{x / 1e3:.0f}"
    if key == "map_benchmark.loops_per_sec_per_thread":
        return f"{x / 1e3:.1f}k"
    if key == "safety.window.p99_us" and x == 0:
        return "none"
    if key.endswith("_us") or key.endswith(".avg"):
        return duration(x)
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def format_ranges(scenario: Mapping[str, Any], results: list) -> list[str]:
    """The ranged block under a run table: per run, each figure as its point, then the median and 90 %
    interval of the sample; then what drives each spread."""
    results = [r for r in results if getattr(r, "ranges", None)]
    if not results:
        return []
    n = results[0].range_samples
    lines = [""] + wrap(f"ranges: point, then median [5th – 95th percentile] over {n} samples of the profile's "
                        "ranged constants; driven by: the constants that move the figure most, alone at their "
                        f"range's ends (on a {results[0].range_screen_ms:g} ms window; docs/ranges.md)", "  ")
    for r in results:
        d = r.to_dict()
        lines.append(f"{r.label}  ({r.ranged_constants} ranged constants, {r.ranged_on_path} on its path)")
        for f, name in figures(scenario, d):
            p = r.ranges[f]
            lines.append(f"  {name:<14} {fmt(f, name, value(d, f)):>10}   {fmt(f, name, p['p50'])} "
                         f"[{fmt(f, name, p['p5'])} – {fmt(f, name, p['p95'])}]")
            for x in r.drivers[f]:
                lines += wrap(f"driven by {x['constant']}: {_pct(x['at_low'])} at its low end, "
                              f"{_pct(x['at_high'])} at its high", "      ", "    ")
    return lines
