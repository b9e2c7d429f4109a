"""``iommulab sweep``: every point of a space of scenario keys, one simulation each, into a Parquet dataset.

A sweep file names a base scenario and axes::

    scenario = "default"                       # built-in name, or a path relative to this file
    seeds = 3                                  # optional: each point at the scenario's seed and the next ones
    [set]                                      # optional: keys every point takes
    "run.duration_ms" = 20
    [axes]                                     # every combination is one point
    "os.policy" = ["strict", "lazy"]
    "workload.nic_rx.queues" = { from = 1, to = 16, step = 3 }     # 1, 4, 7, 10, 13, 16
    "workload.nic_rx.ring_size" = { from = 256, to = 4096, times = 2 }   # 256, 512, ..., 4096
    [derived]                                  # optional: columns computed from others (SQL expressions)
    gbps_per_cpu = "throughput_gbps / cpu_busy"

With ``ranges = N`` each run is ranged (docs/ranges.md): its row gains ``ranges.FIGURE.p5/p50/p95`` and
``driven_by`` (the run and its samples then go one run at a time, the samples on every core).

Each run is one row of the dataset (dataset.py): the axes as columns (named by their keys), every scalar result
flattened (``safety.window.p99_us``), the run's seed, ``scenario_hash`` (of the fully resolved scenario) and
``iommulab_version``. Runs are loaded one at a time as workers free up, so memory does not grow with the
sweep; run again, a sweep skips every run whose scenario hash is already in the dataset.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from . import __version__, _core
from ._core import ScenarioError
from .ranges import MAX_SAMPLES, MIN_SAMPLES, check_samples, ranged, with_ranges
from .api import TICK_SECONDS, ProgressFn, check_jobs, override_pairs, run_each, run_one, scenario_source
from .api import load as load_scenario
from .inputs import shown, toml_text
from .report import EXPOSED_LEGEND, exposure_legend, fit, flat_cell, left, legend, right
from .dataset import (META, SPEC_FILE, Numbering, Writer, aggregate_seeds, axes_of, canon, derive, derived_expr,
                      done_keys, first_line, frame, grids_of, is_dataset, load, locked, parts, printable,
                      spec_of)

# Most runs a sweep may describe: its points x seeds x its scenario's [compare] variants (a typo in a range
# should not start ten million runs). A bound of the front end, not a kernel constant: a million runs of the
# shortest scenario fill a day of a 2-core machine and a dataset of a few GB.
MAX_POINTS = 1_000_000


@dataclass
class Sweep:
    """A parsed sweep: `scenario` is a built-in name, an absolute path, or a dict."""

    scenario: Any
    axes: dict[str, list[Any]]
    sets: dict[str, Any] = field(default_factory=dict)
    seeds: int = 1
    derived: dict[str, str] = field(default_factory=dict)
    description: str = ""
    where: str = "sweep"
    # Each run ranged over this many samples of its profile's ranged constants (None: one point).
    ranges: int | None = None

    def spec(self) -> dict[str, Any]:
        """What the dataset records about the sweep (sweep.json)."""
        return {"scenario": self.scenario, "description": self.description, "seeds": self.seeds, "set": self.sets,
                "axes": self.axes, "derived": self.derived, "iommulab_version": __version__,
                **({"ranges": self.ranges} if self.ranges is not None else {})}

    def points(self) -> int:
        return math.prod(len(v) for v in self.axes.values())


def _short(v: Any) -> str:
    """A value for an error line, cut short."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_number(x: Any) -> bool:
    """A finite float, or a whole number in TOML's 64-bit range."""
    return isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63 \
        or isinstance(x, float) and math.isfinite(x)


def _axis(where: str, key: str, v: Any) -> list[Any]:
    """An axis' values: a list of scalars, or a range table {from, to, step} / {from, to, times}."""
    w = f"{where}: axes.{printable(key)}"
    if isinstance(v, Mapping):
        return _range(w, v)
    if not isinstance(v, list) or not v:
        raise ScenarioError(f"{w}: expected a non-empty list of values or a range table, got {_short(v)}")
    seen = set()
    for x in v:
        if not isinstance(x, (str, int, float)):
            raise ScenarioError(f"{w}: expected scalar values (numbers, strings, booleans), got {_short(x)}")
        if canon(x) in seen:
            raise ScenarioError(f"{w}: {_short(x)} appears twice")
        seen.add(canon(x))
    if len(v) > MAX_POINTS:
        raise ScenarioError(f"{w}: {len(v)} values; expected at most {MAX_POINTS}")
    return list(v)


def _range(w: str, v: Mapping[str, Any]) -> list[Any]:
    """A range table's values, counted before any is made (a float step can make a range astronomically long)."""
    if set(v) - {"from", "to", "step", "times"} or "from" not in v or "to" not in v or ("step" in v) == ("times" in v):
        raise ScenarioError(f"{w}: expected a list, or {{ from = A, to = B, step = S }} or "
                            f"{{ from = A, to = B, times = F }}, got {_short(v)}")
    if not all(_is_number(x) for x in v.values()):
        raise ScenarioError(f"{w}: from, to, step and times must be finite numbers (whole ones within 64 bits), "
                            f"got {_short(v)}")
    a, b = v["from"], v["to"]
    integer = all(isinstance(x, int) for x in v.values())
    if "step" in v:
        s = v["step"]
        if s <= 0 or a > b:
            raise ScenarioError(f"{w}: expected from <= to and step > 0, got {_short(v)}")
        n = (b - a) // s if integer else (b - a) / s  # float: inf when it overflows
        _at_most(w, n)
        return [a + i * s if integer else round(a + i * s, 12) for i in range(math.floor(n + 1e-9) + 1)]
    f = v["times"]
    if f <= 1 or a <= 0 or a > b:
        raise ScenarioError(f"{w}: expected 0 < from <= to and times > 1, got {_short(v)}")
    _at_most(w, (math.log(b) - math.log(a)) / math.log(f))
    out, x = [], a
    while x <= b or not integer and x <= b * (1 + 1e-12):
        out.append(x if integer else round(x, 12))
        x = x * f
    return out


def _at_most(w: str, steps: float) -> None:
    if not steps < MAX_POINTS:
        raise ScenarioError(f"{w}: more than {MAX_POINTS} values; expected at most {MAX_POINTS}")


def parse(doc: Mapping[str, Any], where: str = "sweep", base_dir: str | None = None) -> Sweep:
    """A sweep from its TOML document (a dict); `base_dir` resolves a relative scenario path."""
    unknown = set(doc) - {"scenario", "description", "seeds", "set", "axes", "derived", "ranges"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key {sorted(map(str, unknown))[0]!r} (expected scenario, "
                            "description, seeds, set, axes, derived, ranges)")
    ranges = doc.get("ranges")
    if ranges is not None:
        try:
            check_samples(ranges)
        except ScenarioError:
            raise ScenarioError(f"{where}: ranges: expected a number of samples from {MIN_SAMPLES} to "
                                f"{MAX_SAMPLES}, got {_short(ranges)}") from None
    if "scenario" not in doc:
        raise ScenarioError(f'{where}: missing key "scenario" (a built-in name or a scenario file)')
    sc = _scenario(where, doc["scenario"], base_dir)
    seeds = doc.get("seeds", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ScenarioError(f"{where}: seeds: expected a whole number of at least 1, got {_short(seeds)}")
    sets = doc.get("set", {})
    axes_doc = doc.get("axes", {})
    derived = doc.get("derived", {})
    for name, t in (("set", sets), ("axes", axes_doc), ("derived", derived)):
        if not isinstance(t, Mapping):
            raise ScenarioError(f"{where}: {name}: expected a table, got {_short(t)}")
    axes = {k: _axis(where, k, v) for k, v in axes_doc.items()}
    if "run.seed" in axes and seeds > 1:
        raise ScenarioError(f"{where}: seeds = {seeds} and an axis run.seed: give the seeds one way")
    both = set(axes) & set(sets)
    if both:
        raise ScenarioError(f"{where}: {sorted(map(str, both))[0]!r} is both an axis and in [set]")
    n = math.prod(len(v) for v in axes.values()) * seeds
    if n > MAX_POINTS:
        raise ScenarioError(f"{where}: {n} runs; expected at most {MAX_POINTS}")
    for k, e in derived.items():
        if not isinstance(e, str):
            raise ScenarioError(f"{where}: derived.{printable(k)}: expected an SQL expression string, got {_short(e)}")
        derived_expr(where, k, e)
    return Sweep(scenario=sc, axes=axes, sets=dict(sets), seeds=seeds, derived=dict(derived),
                 description=str(doc.get("description", "")), where=where, ranges=ranges)


def _scenario(where: str, sc: Any, base_dir: str | None) -> Any:
    """The base scenario: a built-in name, an absolute path (a relative one is from `base_dir`), or a dict."""
    if isinstance(sc, Mapping):
        return sc
    if not isinstance(sc, str):
        raise ScenarioError(f"{where}: scenario: expected a built-in name or a file path, got {_short(sc)}")
    builtin = {n for n, _ in _core.builtin_scenarios()}
    path = os.path.join(base_dir, sc) if base_dir and not os.path.isabs(sc) else sc
    if sc in builtin and not (base_dir and os.path.exists(path)):
        return sc
    if not os.path.exists(path):
        raise ScenarioError(f"{where}: scenario {_short(sc)}: no such file, and no built-in scenario of that name "
                            f"(built-ins: {', '.join(sorted(builtin))})")
    return os.path.abspath(path)


def read(path: str | os.PathLike) -> Sweep:
    """A sweep file."""
    path = os.fspath(path)
    try:
        doc = tomllib.loads(toml_text(path, "a sweep file"))
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{shown(path)}: {e}") from None
    return parse(doc, path, os.path.dirname(os.path.abspath(path)))


@dataclass
class Run:
    """One simulation of a sweep: number `index` (dataset.Numbering) at point number `point`, with the scenario
    keys `keys` (its seed among them), compared variant `variant` of what they load; `pos` is its place in the
    sweep's order."""

    index: int
    point: int
    keys: dict[str, Any]
    axes: dict[str, Any]
    variant: int
    label: str
    scenario_hash: str
    handle: Any = None  # the core's Variant (local runs)
    pos: int = 0


def runs(sw: Sweep, numbering: Numbering) -> Iterator[Run]:
    """Every run of the sweep, loaded one at a time, in sweep order: points (first axis outermost), then seeds,
    then the base scenario's own [compare] variants (whose keys become axes too)."""
    names = list(sw.axes)
    pos = 0
    for combo in itertools.product(*sw.axes.values()):
        axes = dict(zip(names, combo))
        keys = {**sw.sets, **axes}
        base_seed = None
        for i in range(sw.seeds):
            k = dict(keys) if not i else {**keys, "run.seed": base_seed + i}
            variants = _load(sw, k)
            if len(variants) != numbering.variants:
                raise ScenarioError(f"{sw.where}: {_short(k)} loads {len(variants)} variants, the first point "
                                    f"{numbering.variants}: every point must compare the same keys")
            base_seed = _seed_of(variants[0]) if base_seed is None else base_seed
            for j, v in enumerate(variants):
                h = hashlib.sha256(v.scenario_json().encode()).hexdigest()[:16]
                run, point = numbering.number(axes, i, j)
                yield Run(run, point, k, _variant_axes(axes, v), j, v.label, h, v, pos)
                pos += 1


def _variant_axes(axes: dict[str, Any], v: Any) -> dict[str, Any]:
    """A run's axis columns: the point's axes and the keys its [compare] variant set."""
    return {**axes, **{key: tomllib.loads(f"v = {val}")["v"] for key, val in v.overrides}}


def _seed_of(v: Any) -> int:
    return json.loads(v.scenario_json())["run"]["seed"]


def _load(sw: Sweep, keys: dict[str, Any]) -> list[Any]:
    try:
        return load_scenario(sw.scenario, keys)
    except ScenarioError as e:
        raise ScenarioError(f"{sw.where}: {e}") from None


# --- before the first run ----------------------------------------------------------------------------------

def _checked_points(sw: Sweep) -> list[dict[str, Any]]:
    """The points a sweep loads before its first run: each value of an axis of names and the least and
    greatest of an axis of numbers, at the other axes' first values (a value the scenario rejects is found
    there, not hours in; a combination it rejects, when its point comes)."""
    first = {k: v[0] for k, v in sw.axes.items()}
    points = {canon(first): first}
    for k, vals in sw.axes.items():
        numbers = all(_is_number(x) for x in vals)
        for x in (min(vals), max(vals)) if numbers else vals:
            p = {**first, k: x}
            points.setdefault(canon(p), p)
    return list(points.values())


def check(sw: Sweep) -> int:
    """Load the checked points (each simulation built, not run) and check the derived columns against the
    columns their runs will have: the result's (every part a result can hold), the axes and META. Returns the
    variants per point."""
    rows, variants = [], None
    for axes in _checked_points(sw):
        vs = _load(sw, {**sw.sets, **axes})
        if variants is None:
            variants = len(vs)
            _at_most_runs(sw, variants)
        if len(vs) != variants:
            raise ScenarioError(f"{sw.where}: {_short(axes)} loads {len(vs)} variants, the first point {variants}: "
                                "every point must compare the same keys")
        for v in vs:
            try:
                result = json.loads(v.simulate().every_part_json())
            except ScenarioError as e:
                raise ScenarioError(f"{sw.where}: {e}") from None
            rows.append(_row(Run(0, 0, {}, _variant_axes(axes, v), 0, v.label, ""), result))
    _check_derived(sw, frame(rows))
    return variants


def _at_most_runs(sw: Sweep, variants: int) -> None:
    """Refuse, before a simulation is built, a sweep whose runs (points x seeds x the scenario's [compare]
    variants) pass MAX_POINTS: the file's own count leaves out the variants, which multiply it by up to 4096."""
    n = sw.points() * sw.seeds * variants
    if n > MAX_POINTS:
        raise ScenarioError(f"{sw.where}: {sw.points() * sw.seeds} points x seeds, each {variants} runs of the "
                            f"scenario's [compare]: {n} runs; expected at most {MAX_POINTS}")


def _check_derived(sw: Sweep, schema) -> None:
    """Each derived column: a new name, naming only columns that exist, and computable on `schema`'s rows."""
    known = set(schema.columns)
    for name, text in sw.derived.items():
        w = f"{sw.where}: derived.{printable(name)}"
        if name in known:
            raise ScenarioError(f"{w}: the name of a column every run has (a result, an axis or one of "
                                f"{', '.join(META)}); give the derived column another name")
        expr = derived_expr(sw.where, name, text)
        try:
            unknown = [c for c in expr.meta.root_names() if c not in known]
        except Exception as e:
            raise ScenarioError(f"{w}: {first_line(e)}") from None
        if unknown:
            raise ScenarioError(f"{w}: no column {unknown[0]!r} (a result, an axis, one of {', '.join(META)} or a "
                                "derived column above; quote dotted names)")
        known.add(name)
    derive(schema, sw.derived, sw.where)


# --- the dataset -------------------------------------------------------------------------------------------

def _make(out: str) -> None:
    """Make the dataset directory `out`, refusing a file, or a directory that is not a dataset."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ScenarioError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and not is_dataset(out):
        raise ScenarioError(f"--out {out}: exists and is not a sweep dataset; give a new or empty directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ScenarioError(f"--out {out}: cannot create: {e.strerror or e}") from None


def _take(sw: Sweep, out: str, variants: int) -> tuple[set[tuple[str, str]], Numbering]:
    """With the dataset locked: the runs already there and the numbering, refusing a dataset of another
    sweep; sweep.json then records this one."""
    for f in os.listdir(out):
        if f.endswith(".tmp") and (f.startswith("part-") or f == SPEC_FILE + ".tmp"):
            os.remove(os.path.join(out, f))  # a file a killed sweep did not finish writing
    have = done_keys(out)
    spec = spec_of(out)
    if parts(out) and not spec:
        raise ScenarioError(f"--out {out}: holds runs but no {SPEC_FILE}; give another --out")
    grids = _same_sweep(sw, spec, variants, out) if spec else []
    numbering = Numbering.extended(grids, sw.axes, sw.seeds, variants)
    _write_spec(out, {**sw.spec(), "variants": variants, "grids": numbering.grids})
    return have, numbering


def _same_sweep(sw: Sweep, spec: dict[str, Any], variants: int, out: str) -> list[dict[str, Any]]:
    """The grids of the dataset's sweep, refusing a dataset of another sweep: another base scenario, other
    [set] keys or values, other axis keys or another count of variants. Axis values, seeds, derived columns
    and the description may change."""
    theirs = {"scenario": spec.get("scenario"), "set": spec.get("set"), "axes": sorted(spec.get("axes", {})),
              "variants": spec.get("variants", variants)}
    mine = {"scenario": sw.scenario, "set": sw.sets, "axes": sorted(sw.axes), "variants": variants}
    differ = [k for k in mine if canon(mine[k]) != canon(theirs[k])]
    if differ:
        raise ScenarioError(f"--out {out}: holds another sweep (not the same {differ[0]} as {sw.where}); give "
                            "another --out, or move it aside")
    return grids_of(spec, os.path.join(out, SPEC_FILE))


def _write_spec(out: str, spec: dict[str, Any]) -> None:
    tmp = os.path.join(out, SPEC_FILE + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(spec, f, indent=2, default=str)
        os.replace(tmp, os.path.join(out, SPEC_FILE))
    except OSError as e:
        raise ScenarioError(f"{tmp}: cannot write: {e.strerror or e}") from None


# --- running -----------------------------------------------------------------------------------------------

def _row(r: Run, result: dict[str, Any]) -> dict[str, Any]:
    return {"run": r.index, "point": r.point, "scenario_hash": r.scenario_hash, "iommulab_version": __version__,
            "overrides": _overrides(r), **r.axes, "result": result}


def _overrides(r: Run) -> str:
    return json.dumps(r.keys, sort_keys=True, default=str)


def _task(kind: str, source: str, pairs: list[tuple[str, str]], name: str, variant: int) -> dict[str, Any]:
    """One run as a Ray task: load the scenario where the task runs, and return its result."""
    return run_one(_core.load(kind, source, pairs, name)[variant]).to_dict()


def _ray_module():
    try:
        import ray
    except ImportError:
        raise ScenarioError("--ray needs Ray: pip install 'iommulab[ray]'") from None
    return ray


def _ray(sw: Sweep, todo: Iterator[Run], address: str | None, jobs: int | None,
         done: Callable[[Run, dict[str, Any]], None], tick: Callable[[], None]) -> None:
    """Run `todo` as Ray tasks, two per cluster CPU in flight, calling done(run, result) as each finishes."""
    ray = _ray_module()
    if not ray.is_initialized():
        kw: dict[str, Any] = {"address": address} if address else {"num_cpus": jobs} if jobs else {}
        ray.init(log_to_driver=False, include_dashboard=False, configure_logging=False, **kw)
    kind, source, name = scenario_source(sw.scenario)
    task = ray.remote(num_cpus=1)(_task)
    window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    refs: dict[Any, Run] = {}

    def submit(n: int) -> None:
        for r in itertools.islice(todo, n):
            refs[task.remote(kind, source, override_pairs(r.keys, False), name, r.variant)] = r

    try:
        submit(window)
        while refs:
            finished, _ = ray.wait(list(refs), num_returns=1, timeout=TICK_SECONDS)
            for ref in finished:
                done(refs.pop(ref), ray.get(ref))
            submit(len(finished))
            tick()
    except BaseException:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise


def sweep(sw: Sweep | str | os.PathLike | Mapping[str, Any], out: str | os.PathLike | None = None, *,
          jobs: int | None = None, ray: bool | str = False, progress: ProgressFn | None = None,
          log: Callable[[str], None] | None = None):
    """Run every point of a sweep (a :class:`Sweep`, a sweep file, or a sweep document as a dict) and return
    the results as a polars DataFrame (see :func:`dataset.load`). With `out`, rows go to a Parquet dataset
    there as runs finish, and runs already in it are not run again. `ray`: True for a local Ray cluster, or
    its address. Everything is checked (the file, the derived columns, Ray, `out`) before the first run."""
    if not isinstance(sw, Sweep):
        sw = parse(sw) if isinstance(sw, Mapping) else read(sw)
    if jobs is not None:
        check_jobs(jobs)
    if ray:
        if sw.ranges is not None:
            raise ScenarioError(f"{sw.where}: ranges: a ranged sweep runs here (each run's samples on every core), "
                                "not on Ray: drop ranges or --ray")
        _ray_module()
    variants = check(sw)
    total = sw.points() * sw.seeds * variants
    if out is None:
        return _sweep(sw, Numbering.extended([], sw.axes, sw.seeds, variants), set(), None, total, jobs, ray,
                      progress, log)
    out = os.fspath(out)
    _make(out)
    with locked(out):
        have, numbering = _take(sw, out, variants)
        if log:
            log(f"{total} runs" + (f", skipping those of the {len(have)} already in {out}" if have else ""))
        _sweep(sw, numbering, have, Writer(out), total, jobs, ray, progress, log)
    return load(out)


def _sweep(sw: Sweep, numbering: Numbering, have: set[tuple[str, str]], writer: Writer | None, total: int,
           jobs: int | None, ray: bool | str, progress: ProgressFn | None, log: Callable[[str], None] | None):
    """Run the sweep's runs not in `have`, into `writer` (else returned as a DataFrame)."""
    rows: list[dict[str, Any]] = []
    queued: dict[int, Run] = {}
    skipped = 0

    def todo() -> Iterator[Run]:
        nonlocal skipped
        for r in runs(sw, numbering):
            if (r.scenario_hash, _overrides(r)) in have:
                skipped += 1
                if progress:
                    progress(r.pos, total, r.label, 1.0)
                continue
            yield r

    def done(r: Run, result: dict[str, Any]) -> None:
        if writer:
            writer.add(_row(r, result))
        else:
            rows.append(_row(r, result))
        if progress and ray:  # Ray tasks report only their end
            progress(r.pos, total, r.label, 1.0)

    def handles() -> Iterator[Any]:
        for k, r in enumerate(todo()):
            queued[k] = r
            yield r.handle

    def step(k: int, _n: int, label: str, frac: float) -> None:
        if progress:
            progress(queued[k].pos, total, label, frac)

    tick = writer.tick if writer else lambda: None
    try:
        if ray:
            _ray(sw, todo(), None if ray is True else str(ray), jobs, done, tick)
        elif sw.ranges is not None:
            for r in todo():
                [summary] = ranged(None, None, sw.ranges, jobs=jobs, bases=[r.handle])
                done(r, _ranged_row(with_ranges(summary).to_dict()))
                if progress:
                    progress(r.pos, total, r.label, 1.0)
                tick()
        else:
            run_each(handles(), lambda k, res: done(queued.pop(k), res.to_dict()), step, jobs, total=total,
                     tick=tick)
    finally:
        if writer:
            writer.flush()
    if log and skipped:
        log(f"{skipped} were already there, {total - skipped} ran")
    if writer:
        return None
    import polars as pl

    df = frame(sorted(rows, key=lambda r: r["run"])) if rows else pl.DataFrame()
    return derive(df, sw.derived, sw.where) if rows else df


def _ranged_row(result: dict[str, Any]) -> dict[str, Any]:
    """A ranged run's result as a dataset row takes it: its ranges and the constants driving them (the per-figure
    detail, `drivers`, stays with `run --ranges --json`)."""
    return {k: v for k, v in result.items() if k != "drivers"}


# The summary `sweep` prints: (column, header, format; None for an exposure).
SUMMARY = [("throughput_gbps", "Gbps", "{:.2f}"), ("cpu_busy", "CPU busy", "{:.1%}"),
           ("safety.exposed_share", "exposed", "{:.1%}"), ("safety.window.p99_us", "exposure p99", None),
           ("limited_by", "limited by", "{}"), ("inv_per_page", "inv/page", "{:.4f}")]
# An NVMe workload's rate, after goodput.
IOPS = ("packets_per_sec", "kIOPS", "{:.0f}")


def _summary_columns(agg, sw: Sweep) -> list[tuple[str, str, str | None]]:
    """The summary's figures: SUMMARY, with kIOPS after goodput when the sweep's scenario is an NVMe one."""
    cols = [c for c in SUMMARY if c[0] in agg.columns]
    try:
        nvme = bool(json.loads(load_scenario(sw.scenario, dict(sw.sets))[0].scenario_json())["workload"].get("nvme"))
    except ScenarioError:
        nvme = False
    return cols[:1] + [IOPS] + cols[1:] if nvme and "packets_per_sec" in agg.columns else cols


def format_summary(df, sw: Sweep) -> str:
    """One line per point (seeds averaged): its axes and the headline figures, in blocks that fit the width."""
    if df.height == 0:
        return "no runs\n"
    axes = [a for a in axes_of(df, sw.spec()) if a != "run.seed"]
    agg = aggregate_seeds(df, axes)
    cols = [c for c in axes if c in agg.columns]
    if "label" in agg.columns and agg["label"].n_unique() > 1 and not cols:
        cols = ["label"]
    rows = list(agg.iter_rows(named=True))
    # The axes are the label every block repeats.
    keys = [right(c.rsplit(".", 1)[-1], [str(r[c]) for r in rows], 2) for c in cols]
    label = ["".join(k[i] for k in keys).removeprefix("  ") for i in range(len(rows) + 1)] if keys else \
        ["point"] + [str(i) for i in range(len(rows))]
    figures = []
    for c, h, fmt in _summary_columns(agg, sw):
        cells = [f"{r[c] / 1e3:.0f}" if h == "kIOPS" else flat_cell(r, c, fmt, "-") for r in rows]
        figures.append(left(h, cells) if h == "limited by" else right(h, cells, 2))
    out = fit(label, figures)
    out += [""] + legend([EXPOSED_LEGEND, exposure_legend()])
    seeds = agg["seeds"].max() if "seeds" in agg.columns else 1
    if seeds and seeds > 1:
        out.append(f"(mean over {seeds} seeds per point)")
    return "\n".join(out) + "\n"
