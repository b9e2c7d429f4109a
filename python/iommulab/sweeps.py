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

Each run is one row of the dataset: the axes as columns (named by their keys), every scalar result flattened
(``safety.window.p99_us``), the run's seed, ``scenario_hash`` (of the fully resolved scenario) and
``iommulab_version``. Rows are written as the runs finish, in part files renamed into place, so a killed sweep
loses only the runs in flight; run again, it skips every run whose scenario hash is already in the dataset.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import __version__, _core
from ._core import ScenarioError
from .api import ProgressFn, check_jobs, flatten, override_pairs, run_each, run_one, scenario_source
from .api import load as load_scenario

SPEC_FILE = "sweep.json"
PART_GLOB = "part-*.parquet"
# Most points a sweep file may describe (a typo in a range should not start a million runs).
MAX_POINTS = 1_000_000
# Columns every row has besides the axes and the results.
META = ("run", "point", "scenario_hash", "iommulab_version", "overrides")
# Rows are flushed to a new part file once this many are pending or this many seconds have passed.
FLUSH_ROWS, FLUSH_SECONDS = 64, 5.0


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

    def spec(self) -> dict[str, Any]:
        """What the dataset records about the sweep (sweep.json)."""
        return {"scenario": self.scenario, "description": self.description, "seeds": self.seeds, "set": self.sets,
                "axes": self.axes, "derived": self.derived, "iommulab_version": __version__}


def _axis(where: str, key: str, v: Any) -> list[Any]:
    """An axis' values: a list of scalars, or a range table {from, to, step} / {from, to, times}."""
    w = f"{where}: axes.{key}"
    if isinstance(v, dict):
        unknown = set(v) - {"from", "to", "step", "times"}
        if unknown or "from" not in v or "to" not in v or ("step" in v) == ("times" in v):
            raise ScenarioError(f"{w}: expected a list, or {{ from = A, to = B, step = S }} or "
                                f"{{ from = A, to = B, times = F }}, got {v!r}")
        nums = {k: x for k, x in v.items()}
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in nums.values()):
            raise ScenarioError(f"{w}: from, to, step and times must be numbers, got {v!r}")
        a, b = v["from"], v["to"]
        integer = all(isinstance(x, int) for x in nums.values())
        out: list[Any] = []
        if "step" in v:
            s = v["step"]
            if s <= 0 or a > b:
                raise ScenarioError(f"{w}: expected from <= to and step > 0, got {v!r}")
            n = math.floor((b - a) / s + 1e-9) + 1
            if n > MAX_POINTS:
                raise ScenarioError(f"{w}: {n} values; expected at most {MAX_POINTS}")
            out = [a + i * s if integer else round(a + i * s, 12) for i in range(n)]
        else:
            f = v["times"]
            if f <= 1 or a <= 0 or a > b:
                raise ScenarioError(f"{w}: expected 0 < from <= to and times > 1, got {v!r}")
            x = a
            while x <= b * (1 + 1e-12):
                out.append(x if integer else round(x, 12))
                x = x * f
                if len(out) > MAX_POINTS:
                    raise ScenarioError(f"{w}: more than {MAX_POINTS} values")
        return out
    if not isinstance(v, list) or not v:
        raise ScenarioError(f"{w}: expected a non-empty list of values or a range table, got {v!r}")
    for x in v:
        if isinstance(x, (dict, list)):
            raise ScenarioError(f"{w}: expected scalar values (numbers, strings, booleans), got {x!r}")
    seen = set()
    for x in v:
        k = json.dumps(x)
        if k in seen:
            raise ScenarioError(f"{w}: {x!r} appears twice")
        seen.add(k)
    return list(v)


def parse(doc: Mapping[str, Any], where: str = "sweep", base_dir: str | None = None) -> Sweep:
    """A sweep from its TOML document (a dict); `base_dir` resolves a relative scenario path."""
    unknown = set(doc) - {"scenario", "description", "seeds", "set", "axes", "derived"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected scenario, description, seeds, "
                            "set, axes, derived)")
    if "scenario" not in doc:
        raise ScenarioError(f'{where}: missing key "scenario" (a built-in name or a scenario file)')
    sc = doc["scenario"]
    if isinstance(sc, str):
        builtin = {n for n, _ in _core.builtin_scenarios()}
        if sc not in builtin or (base_dir and os.path.exists(os.path.join(base_dir, sc))):
            path = os.path.join(base_dir, sc) if base_dir and not os.path.isabs(sc) else sc
            if not os.path.exists(path):
                raise ScenarioError(f"{where}: scenario {sc!r}: no such file, and no built-in scenario of that "
                                    f"name (built-ins: {', '.join(sorted(builtin))})")
            sc = os.path.abspath(path)
    elif not isinstance(sc, Mapping):
        raise ScenarioError(f"{where}: scenario: expected a built-in name or a file path, got {sc!r}")
    seeds = doc.get("seeds", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ScenarioError(f"{where}: seeds: expected a whole number of at least 1, got {seeds!r}")
    sets = doc.get("set", {})
    axes_doc = doc.get("axes", {})
    derived = doc.get("derived", {})
    for name, t in (("set", sets), ("axes", axes_doc), ("derived", derived)):
        if not isinstance(t, Mapping):
            raise ScenarioError(f"{where}: {name}: expected a table, got {t!r}")
    axes = {k: _axis(where, k, v) for k, v in axes_doc.items()}
    if "run.seed" in axes and seeds > 1:
        raise ScenarioError(f"{where}: seeds = {seeds} and an axis run.seed: give the seeds one way")
    both = set(axes) & set(sets)
    if both:
        raise ScenarioError(f"{where}: {sorted(both)[0]!r} is both an axis and in [set]")
    n = math.prod(len(v) for v in axes.values()) * seeds
    if n > MAX_POINTS:
        raise ScenarioError(f"{where}: {n} runs; expected at most {MAX_POINTS}")
    for k, e in derived.items():
        if not isinstance(e, str):
            raise ScenarioError(f"{where}: derived.{k}: expected an SQL expression string, got {e!r}")
        _derived_expr(where, k, e)
    return Sweep(scenario=sc, axes=axes, sets=dict(sets), seeds=seeds, derived=dict(derived),
                 description=str(doc.get("description", "")), where=where)


def read(path: str | os.PathLike) -> Sweep:
    """A sweep file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ScenarioError(f"{path}: cannot open: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: {e}") from None
    return parse(doc, path, os.path.dirname(os.path.abspath(path)))


def _derived_expr(where: str, name: str, text: str):
    import polars as pl

    try:
        return pl.sql_expr(text).alias(name)
    except Exception as e:  # polars raises several kinds for a bad expression
        raise ScenarioError(f"{where}: derived.{name}: {str(e).splitlines()[0]}") from None


@dataclass
class Run:
    """One simulation of a sweep: point `point` with the scenario keys `keys` (its seed among them), compared
    variant `variant` of what they load."""

    index: int
    point: int
    keys: dict[str, Any]
    axes: dict[str, Any]
    variant: int
    label: str
    scenario_hash: str
    handle: Any = None  # the core's Variant (local runs)


def runs(sw: Sweep) -> list[Run]:
    """Every run of the sweep, in sweep order: points (first axis outermost), then seeds, then the base
    scenario's own [compare] variants (whose keys become axes too)."""
    names = list(sw.axes)
    out: list[Run] = []
    base_seed: dict[str, int] = {}
    for p, combo in enumerate(itertools.product(*sw.axes.values())):
        axes = dict(zip(names, combo))
        keys = {**sw.sets, **axes}
        for i in range(sw.seeds):
            k = dict(keys)
            if i:
                bk = json.dumps(sorted(keys.items()), default=str)
                if bk not in base_seed:
                    base_seed[bk] = _seed_of(_load(sw, keys)[0])
                k["run.seed"] = base_seed[bk] + i
            for j, v in enumerate(_load(sw, k)):
                sc = v.scenario_json()
                h = hashlib.sha256(sc.encode()).hexdigest()[:16]
                ax = dict(axes)
                for key, val in v.overrides:
                    ax[key] = tomllib.loads(f"v = {val}")["v"]
                out.append(Run(len(out), p, k, ax, j, v.label, h, v))
    return out


def _seed_of(v: Any) -> int:
    return json.loads(v.scenario_json())["run"]["seed"]


def _load(sw: Sweep, keys: dict[str, Any]) -> list[Any]:
    try:
        return load_scenario(sw.scenario, keys)
    except ScenarioError as e:
        raise ScenarioError(f"{sw.where}: {e}") from None


# --- the dataset -------------------------------------------------------------------------------------------

def _parts(out: str) -> list[str]:
    import glob

    return sorted(glob.glob(os.path.join(glob.escape(out), PART_GLOB)))


def spec_of(path: str) -> dict[str, Any]:
    """The sweep.json of a dataset directory ({} for a lone Parquet file or a dataset without one)."""
    try:
        with open(os.path.join(path, SPEC_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def done_keys(out: str) -> set[tuple[str, str]]:
    """(scenario hash, overrides) of the runs already in the dataset at `out` (refusing one written by another
    iommulab version)."""
    import polars as pl

    keys: set[tuple[str, str]] = set()
    for f in _parts(out):
        try:
            df = pl.read_parquet(f, columns=["scenario_hash", "overrides", "iommulab_version"])
        except Exception as e:
            raise ScenarioError(f"{f}: not a readable part of a sweep dataset: {str(e).splitlines()[0]}") from None
        other = set(df["iommulab_version"].unique()) - {__version__}
        if other:
            raise ScenarioError(f"{out}: holds runs of iommulab {sorted(other)[0]} (this is {__version__}); "
                                "give another --out, or move it aside")
        keys.update(zip(df["scenario_hash"].to_list(), df["overrides"].to_list()))
    return keys


class Writer:
    """Rows to part files of the dataset, each written whole under a temporary name and renamed into place."""

    def __init__(self, out: str):
        self.out = out
        self.pending: list[dict[str, Any]] = []
        self.last = time.monotonic()
        self.stamp = time.strftime("%Y%m%dT%H%M%S")
        self.seq = len(_parts(out))
        self.written = 0

    def add(self, row: dict[str, Any]) -> None:
        self.pending.append(row)
        if len(self.pending) >= FLUSH_ROWS or time.monotonic() - self.last >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        df = frame(self.pending)
        while True:
            path = os.path.join(self.out, f"part-{self.stamp}-{self.seq:05d}.parquet")
            self.seq += 1
            if not os.path.exists(path):
                break
        tmp = path + ".tmp"
        df.write_parquet(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.written += len(self.pending)
        self.pending = []
        self.last = time.monotonic()


def frame(rows: list[dict[str, Any]]):
    """Rows ({meta, axes, "result": {...}}) as a DataFrame: results flattened, list-valued outputs as JSON text
    (the per-CPU, per-level and per-lock details; the scalars are the columns)."""
    import polars as pl

    res = flatten([r["result"] for r in rows])
    meta = pl.DataFrame([{k: v for k, v in r.items() if k != "result"} for r in rows], infer_schema_length=None)
    clash = set(meta.columns) & set(res.columns)
    if clash:
        raise ScenarioError(f"sweep: axis {sorted(clash)[0]!r} has the name of a result column")
    nested = [c for c, t in res.schema.items() if isinstance(t, (pl.List, pl.Struct, pl.Array, pl.Object))]
    if nested:
        res = res.with_columns(pl.Series(c, [json.dumps(x) if x is not None else None
                                             for x in res[c].to_list()], dtype=pl.String) for c in nested)
    return pl.concat([meta, res], how="horizontal")


def load(path: str | os.PathLike, aggregate: bool = False):
    """A sweep's results (a directory written by ``sweep``, or one Parquet file) as a polars DataFrame in run
    order, with the sweep's derived columns. `aggregate`: one row per point, its seeds' mean (with
    ``COLUMN.min`` / ``COLUMN.max`` beside each number and ``seeds``, the count)."""
    import polars as pl

    path = os.fspath(path)
    spec: dict[str, Any] = {}
    if os.path.isdir(path):
        files = _parts(path)
        if not files:
            raise ScenarioError(f"{path}: no sweep results (no {PART_GLOB} files)")
        spec = spec_of(path)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ScenarioError(f"{path}: no such file or directory")
    frames = []
    for f in files:
        try:
            frames.append(pl.read_parquet(f))
        except Exception as e:
            raise ScenarioError(f"{f}: not a Parquet file of sweep results: {str(e).splitlines()[0]}") from None
    df = pl.concat(frames, how="diagonal_relaxed")
    if "run" in df.columns:
        df = df.sort("run")
    for name, text in spec.get("derived", {}).items():
        try:
            df = df.with_columns(_derived_expr(path, name, text))
        except ScenarioError:
            raise
        except Exception as e:
            raise ScenarioError(f"{path}: derived.{name}: {str(e).splitlines()[0]}") from None
    if aggregate:
        df = aggregate_seeds(df, axes_of(df, spec))
    return df


def axes_of(df, spec: Mapping[str, Any] | None = None) -> list[str]:
    """The axis columns of a results frame: the sweep's axes, and any other scenario key columns (the base
    scenario's compared keys)."""
    scenario_tables = ("run.", "platform.", "os.", "workload.", "hypervisor.")
    axes = list((spec or {}).get("axes", {}))
    axes += [c for c in df.columns if c.startswith(scenario_tables) and c not in axes]
    return [a for a in axes if a in df.columns]


def aggregate_seeds(df, axes: list[str]):
    """One row per point (axes and label, seed aside): numbers as their mean with min and max beside."""
    import polars as pl

    keys = [a for a in axes if a != "run.seed"] + [c for c in ("label",) if c in df.columns]
    skip = set(keys) | set(META) | {"seed", "run.seed", "sim_seconds"}
    nums = [c for c, t in df.schema.items() if c not in skip and t.is_numeric()]
    if not keys:
        df = df.with_columns(pl.lit(0).alias("_all"))
        keys = ["_all"]
    aggs = [pl.len().alias("seeds")]
    for c in nums:
        aggs += [pl.col(c).mean().alias(c), pl.col(c).min().alias(f"{c}.min"), pl.col(c).max().alias(f"{c}.max")]
    first = [pl.col(c).first() for c in df.columns if c not in set(keys) | set(nums) | {"seed", "run.seed"}]
    out = df.group_by(keys, maintain_order=True).agg(aggs + first)
    return out.drop("_all") if "_all" in out.columns else out


# --- running -----------------------------------------------------------------------------------------------

def _row(r: Run, result: dict[str, Any]) -> dict[str, Any]:
    return {"run": r.index, "point": r.point, "scenario_hash": r.scenario_hash, "iommulab_version": __version__,
            "overrides": _overrides(r), **r.axes, "result": result}


def _overrides(r: Run) -> str:
    return json.dumps(r.keys, sort_keys=True)


def _task(kind: str, source: str, pairs: list[tuple[str, str]], name: str, variant: int) -> dict[str, Any]:
    """One run as a Ray task: load the scenario where the task runs, and return its result."""
    return run_one(_core.load(kind, source, pairs, name)[variant]).to_dict()


def _ray(sw: Sweep, todo: list[Run], address: str | None, jobs: int | None,
         done: Callable[[Run, dict[str, Any]], None]) -> None:
    try:
        import ray
    except ImportError:
        raise ScenarioError("--ray needs Ray: pip install 'iommulab[ray]'") from None
    if not ray.is_initialized():
        kw: dict[str, Any] = {"address": address} if address else {"num_cpus": jobs} if jobs else {}
        ray.init(log_to_driver=False, include_dashboard=False, configure_logging=False, **kw)
    kind, source, name = scenario_source(sw.scenario)
    task = ray.remote(num_cpus=1)(_task)
    refs = {task.remote(kind, source, override_pairs(r.keys, False), name, r.variant): r for r in todo}
    pending = list(refs)
    try:
        while pending:
            finished, pending = ray.wait(pending, num_returns=1)
            for ref in finished:
                done(refs[ref], ray.get(ref))
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise


def sweep(sw: Sweep | str | os.PathLike | Mapping[str, Any], out: str | os.PathLike | None = None, *,
          jobs: int | None = None, ray: bool | str = False, progress: ProgressFn | None = None,
          log: Callable[[str], None] | None = None):
    """Run every point of a sweep (a :class:`Sweep`, a sweep file, or a sweep document as a dict) and return
    the results as a polars DataFrame (see :func:`load`). With `out`, rows go to a Parquet dataset there as runs
    finish, and runs already in it are not run again. `ray`: True for a local Ray cluster, or its address."""
    if not isinstance(sw, Sweep):
        sw = parse(sw) if isinstance(sw, Mapping) else read(sw)
    if jobs is not None:
        check_jobs(jobs)
    all_runs = runs(sw)
    have: set[tuple[str, str]] = set()
    writer = None
    if out is not None:
        out = os.fspath(out)
        if os.path.exists(out) and not os.path.isdir(out):
            raise ScenarioError(f"--out {out}: exists and is not a directory")
        if os.path.isdir(out) and os.listdir(out) and not (_parts(out) or spec_of(out).get("iommulab_version")):
            # Never write into (or over the files of) a directory that is not a sweep's dataset.
            raise ScenarioError(f"--out {out}: exists and is not a sweep dataset; give a new or empty directory")
        os.makedirs(out, exist_ok=True)
        for f in os.listdir(out):
            if f.startswith("part-") and f.endswith(".parquet.tmp"):
                os.remove(os.path.join(out, f))  # a part a killed sweep did not finish writing
        have = done_keys(out)
        tmp = os.path.join(out, SPEC_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(sw.spec(), f, indent=2, default=str)
        os.replace(tmp, os.path.join(out, SPEC_FILE))
        writer = Writer(out)
    # A run is known by its resolved scenario and the keys the sweep set (two points may resolve to the same
    # scenario, e.g. through a key the scenario ignores: each keeps its row).
    todo = [r for r in all_runs if (r.scenario_hash, _overrides(r)) not in have]
    if log:
        skipped = len(all_runs) - len(todo)
        log(f"{len(all_runs)} runs" + (f", {skipped} already in {out}" if skipped else "")
            + (f", {len(todo)} to run" if skipped else ""))
    rows: list[dict[str, Any]] = []

    def done(r: Run, result: dict[str, Any]) -> None:
        row = _row(r, result)
        if writer:
            writer.add(row)
        else:
            rows.append(row)

    def ray_done(r: Run, result: dict[str, Any]) -> None:
        done(r, result)
        if progress:  # Ray tasks report only their end
            progress(todo_pos[r.index], len(todo), r.label, 1.0)

    todo_pos = {r.index: i for i, r in enumerate(todo)}
    try:
        if ray:
            _ray(sw, todo, None if ray is True else str(ray), jobs, ray_done)
        elif todo:
            run_each([r.handle for r in todo], lambda i, res: done(todo[i], res.to_dict()), progress, jobs)
    finally:
        if writer:
            writer.flush()
    if out is not None:
        return load(out)
    import polars as pl

    df = frame(sorted(rows, key=lambda r: r["run"])) if rows else pl.DataFrame()
    for name, text in sw.derived.items():
        df = df.with_columns(_derived_expr(sw.where, name, text))
    return df


# The summary `sweep` prints: (column, header, format).
SUMMARY = [("throughput_gbps", "Gbps", "{:.2f}"), ("cpu_busy", "CPU busy", "{:.1%}"),
           ("inv_per_page", "inv/page", "{:.4f}"), ("safety.exposed_share", "exposed", "{:.1%}"),
           ("safety.window.p99_us", "win p99 µs", "{:.4g}")]


def format_summary(df, sw: Sweep) -> str:
    """One line per point (seeds averaged): its axes and the headline figures."""
    if df.height == 0:
        return "no runs\n"
    axes = [a for a in axes_of(df, sw.spec()) if a != "run.seed"]
    agg = aggregate_seeds(df, axes)
    cols = [c for c in axes if c in agg.columns]
    if "label" in agg.columns and agg["label"].n_unique() > 1 and not cols:
        cols = ["label"]
    heads = [c.rsplit(".", 1)[-1] for c in cols] + [h for c, h, _ in SUMMARY if c in agg.columns]
    lines = []
    for r in agg.iter_rows(named=True):
        cells = [str(r[c]) for c in cols]
        for c, _, fmt in SUMMARY:
            if c in agg.columns:
                if c.startswith("safety.") and r.get("safety.protected") is False:
                    cells.append("all")  # an identity domain: the device reaches every page
                else:
                    cells.append("-" if r[c] is None else fmt.format(r[c]))
        lines.append(cells)
    w = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(heads)]
    out = ["  ".join(h.rjust(w[i]) for i, h in enumerate(heads)), "-" * (sum(w) + 2 * (len(w) - 1))]
    out += ["  ".join(c.rjust(w[i]) for i, c in enumerate(l)) for l in lines]
    out.append("exposed: share of unmapped pages released before their invalidation completed (all: identity "
               "domain) · win p99: that gap's p99 (-: none exposed)")
    seeds = agg["seeds"].max() if "seeds" in agg.columns else 1
    if seeds and seeds > 1:
        out.append(f"(mean over {seeds} seeds per point)")
    return "\n".join(out) + "\n"
