"""A sweep's dataset: a directory that one sweep at a time writes runs into, and that reads back as one DataFrame.

    sweep.json         the sweep as last run, with the grids its runs are numbered by (:class:`Numbering`)
    part-*.parquet     rows, one per run; each part written whole under a temporary name and renamed into place
    sweep.lock         held (flock) by the sweep writing the dataset, and naming its PID

A lone Parquet file of runs (``run --parquet``, ``compare --parquet``) reads back the same way.
"""

from __future__ import annotations

import glob
import json
import math
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from . import __version__
from ._core import ScenarioError
from .api import flatten
from .inputs import file_kind

SPEC_FILE = "sweep.json"
LOCK_FILE = "sweep.lock"
PART_GLOB = "part-*.parquet"
# Columns every row has besides the axes and the results.
META = ("run", "point", "scenario_hash", "iommulab_version", "overrides")
# Columns without which a Parquet file is not results of runs (every writer above puts them in).
REQUIRED = ("run", "iommulab_version", "label", "throughput_gbps")
# Columns the report reads by name, expecting numbers (it takes every other column only where it holds numbers).
NUMERIC = ("run", "throughput_gbps", "safety.window.p99_us")
# A part costs about 6 ms to write, most of it the fsync (96 runs of 0.2 ms on two cores took 0.97 s batched,
# 1.71 s with a part per run), so rows are batched: a part is written once FLUSH_ROWS wait, or at the first add
# or tick FLUSH_SECONDS after the previous one. Choices of iommulab, not kernel constants: together they bound
# what a SIGKILL loses (docs/sweeps.md).
FLUSH_ROWS, FLUSH_SECONDS = 64, 1.0


def parts(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(out), PART_GLOB)))


def spec_of(path: str) -> dict[str, Any]:
    """The sweep.json of a dataset directory ({} when it has none)."""
    f = os.path.join(path, SPEC_FILE)
    try:
        with open(f, "rb") as fh:
            spec = json.loads(fh.read().decode())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ScenarioError(f"{f}: not the record of a sweep ({first_line(e)}); move it aside") from None
    if not (isinstance(spec, dict) and all(isinstance(spec.get(k, {}), dict) for k in ("axes", "set", "derived"))
            and all(isinstance(t, str) for t in spec.get("derived", {}).values())):
        raise ScenarioError(f"{f}: not the record of a sweep (expected an object with tables axes, set and "
                            "derived); move it aside")
    # What a resumed sweep reads of it besides (sweeps._take): report and resume accept the same records.
    whole = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
    if not (all(isinstance(v, list) for v in spec.get("axes", {}).values()) and whole(spec.get("seeds", 1))
            and whole(spec.get("variants", 1))):
        raise ScenarioError(f"{f}: not the record of a sweep (expected a list of values per axis, and seeds and "
                            "variants whole numbers of at least 1); move it aside")
    grids_of(spec, f)
    return spec


def is_dataset(out: str) -> bool:
    """Whether the directory `out` is empty or a sweep's dataset (never write into, or over the files of,
    anything else)."""
    if not set(os.listdir(out)) - {LOCK_FILE} or parts(out):
        return True
    try:
        return bool(spec_of(out).get("iommulab_version"))
    except ScenarioError:
        return False


@contextmanager
def locked(out: str) -> Iterator[None]:
    """Hold the dataset at `out` (flock on sweep.lock, which names this process meanwhile): two sweeps writing
    one dataset would each number and write the same runs. The kernel drops the lock of a killed process."""
    import fcntl

    with open(os.path.join(out, LOCK_FILE), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ScenarioError(f"--out {out}: another sweep (PID {f.read().strip() or '?'}) is writing it; wait "
                                "for it to end, or give another --out") from None
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)


def done_keys(out: str) -> set[tuple[str, str]]:
    """(scenario hash, overrides) of the runs already in the dataset at `out` (refusing one written by another
    iommulab version)."""
    import polars as pl

    keys: set[tuple[str, str]] = set()
    for f in parts(out):
        try:
            df = pl.read_parquet(f, columns=["scenario_hash", "overrides", "iommulab_version"])
        except Exception as e:
            raise ScenarioError(f"{f}: not a readable part of a sweep dataset: {first_line(e)}") from None
        other = set(df["iommulab_version"].unique()) - {__version__}
        if other:
            raise ScenarioError(f"{out}: holds runs of iommulab {sorted(map(str, other))[0]} (this is "
                                f"{__version__}); give another --out, or move it aside")
        keys.update(zip(df["scenario_hash"].to_list(), df["overrides"].to_list()))
    return keys


def canon(v: Any) -> str:
    """A value as comparable text (1 and 1.0 differ, as they do in the overrides a run is known by)."""
    return json.dumps(v, sort_keys=True, default=str)


class Numbering:
    """Run and point numbers that stay put as a dataset's sweep is extended. The dataset keeps each grid it was
    swept over (its axes' values and seeds), in order, each numbered on from where the one before ended. A
    run's number is its position in the first grid that holds it (points with the first axis outermost, then
    seeds, then the scenario's variants), from that grid's first number; a point's likewise. So a resumed
    sweep numbers as an uninterrupted one did, a run keeps its number when values are added, and no two runs
    share one; a later grid's numbers of runs an earlier grid holds stay unused."""

    def __init__(self, grids: list[dict[str, Any]], variants: int):
        self.grids = grids
        self.variants = variants
        self.index = [{k: {canon(v): i for i, v in enumerate(vals)} for k, vals in g["axes"].items()}
                      for g in grids]

    @classmethod
    def extended(cls, grids: list[dict[str, Any]], axes: dict[str, list[Any]], seeds: int, variants: int):
        """The numbering of `grids` with a grid of `axes` and `seeds` added unless one of them holds it."""
        n = cls(grids, variants)
        if any(seeds <= g["seeds"] and all({canon(v) for v in axes[k]} <= idx[k].keys() for k in axes)
               for g, idx in zip(grids, n.index)):
            return n
        first_run = first_point = 0
        if grids:
            last = grids[-1]
            points = math.prod(len(v) for v in last["axes"].values())
            first_run = last["first_run"] + points * last["seeds"] * variants
            first_point = last["first_point"] + points
        grid = {"axes": axes, "seeds": seeds, "first_run": first_run, "first_point": first_point}
        return cls(grids + [grid], variants)

    def number(self, axes: Mapping[str, Any], seed: int, variant: int) -> tuple[int, int]:
        """(run, point) of the run at `axes`, seed offset `seed` and variant `variant`."""
        point = None
        for g, idx in zip(self.grids, self.index):
            p = 0
            for k, vals in g["axes"].items():
                i = idx[k].get(canon(axes[k]))
                if i is None:
                    break
                p = p * len(vals) + i
            else:
                point = g["first_point"] + p if point is None else point
                if seed < g["seeds"]:
                    return g["first_run"] + (p * g["seeds"] + seed) * self.variants + variant, point
        raise AssertionError("validated: the last grid is the sweep's own, which holds each of its runs")


def grids_of(spec: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """The grids a dataset's runs are numbered by (a sweep.json written before grids were kept: its own)."""
    grids = spec.get("grids")
    if grids is None:
        grids = [{"axes": spec.get("axes", {}), "seeds": spec.get("seeds", 1), "first_run": 0, "first_point": 0}]
    ok = isinstance(grids, list) and all(
        isinstance(g, dict) and isinstance(g.get("axes"), dict) and set(g["axes"]) == set(spec.get("axes", {}))
        and all(isinstance(v, list) for v in g["axes"].values())
        and all(isinstance(g.get(k), int) and g[k] >= 0 for k in ("seeds", "first_run", "first_point"))
        for g in grids)
    if not ok:
        raise ScenarioError(f"{where}: grids: not the record of a sweep's runs; move the dataset aside")
    return grids


class Writer:
    """Rows to part files of the dataset, each written whole under a temporary name, fsynced and renamed into
    place: a sweep killed at any instant leaves only whole parts. See FLUSH_ROWS for when a part is written."""

    def __init__(self, out: str):
        self.out = out
        self.pending: list[dict[str, Any]] = []
        self.last = time.monotonic()
        self.stamp = time.strftime("%Y%m%dT%H%M%S")
        self.seq = len(parts(out))
        self.written = 0

    def add(self, row: dict[str, Any]) -> None:
        self.pending.append(row)
        self.tick()

    def tick(self) -> None:
        if len(self.pending) >= FLUSH_ROWS or (self.pending and time.monotonic() - self.last >= FLUSH_SECONDS):
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
        try:
            df.write_parquet(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as e:
            raise ScenarioError(f"{path}: cannot write: {first_line(e)}") from None
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


def derived_expr(where: str, name: str, text: str):
    """A derived column's polars SQL expression (one line naming it when it does not parse)."""
    import polars as pl

    try:
        return pl.sql_expr(text).alias(name)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars raises several kinds for a bad expression, a panic among them
        raise ScenarioError(f"{where}: derived.{printable(name)}: {first_line(e)}") from None


def derive(df, derived: Mapping[str, str], where: str):
    """`df` with the derived columns, each computed from the columns before it. A column an expression names
    that no run reported (``safety.window.p99_us`` when nothing was exposed) is null."""
    import polars as pl

    for name, text in derived.items():
        expr = derived_expr(where, name, text)
        try:
            missing = [c for c in expr.meta.root_names() if c not in df.columns and c != name]
            df = df.with_columns(pl.lit(None).alias(c) for c in missing).with_columns(expr)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise ScenarioError(f"{where}: derived.{printable(name)}: {first_line(e)}") from None
    return df


def printable(k: Any) -> str:
    """A key for an error line (a quoted TOML key can hold a newline)."""
    return k if isinstance(k, str) and k.isprintable() else repr(k)


def first_line(e: BaseException) -> str:
    """An exception's message as one line (polars' column errors end with every column's name: not those)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text.split("; valid columns:")[0]


def load(path: str | os.PathLike, aggregate: bool = False):
    """A sweep's results (a directory written by ``sweep``, or one Parquet file) as a polars DataFrame in run
    order, with the sweep's derived columns. `aggregate`: one row per point, its seeds' mean (with
    ``COLUMN.min`` / ``COLUMN.max`` beside each number and ``seeds``, the count)."""
    import polars as pl

    path = os.fspath(path)
    spec: dict[str, Any] = {}
    if os.path.isdir(path):
        files = parts(path)
        if not files:
            raise ScenarioError(f"{path}: no sweep results (no {PART_GLOB} files)")
        spec = spec_of(path)
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ScenarioError(f"{path}: {file_kind(os.stat(path).st_mode)}; expected a sweep's dataset directory or "
                            "a Parquet file")
    else:
        raise ScenarioError(f"{path}: no such file or directory")
    frames = []
    for f in files:
        try:
            frames.append(pl.read_parquet(f))
        except Exception as e:
            raise ScenarioError(f"{f}: not a Parquet file of sweep results: {first_line(e)}") from None
    df = _checked(pl.concat(frames, how="diagonal_relaxed"), path).sort("run")
    df = derive(df, spec.get("derived", {}), path)
    return aggregate_seeds(df, axes_of(df, spec)) if aggregate else df


def _checked(df, path: str):
    """`df` if it holds runs as iommulab writes them: the REQUIRED columns, and numbers (or nulls) in the
    NUMERIC ones."""
    import polars as pl

    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ScenarioError(f"{path}: not sweep results: no column {', '.join(missing)} (iommulab sweep, run "
                            "--parquet and compare --parquet write them)")
    for c in NUMERIC:
        t = df.schema.get(c, pl.Null)
        if not (t.is_numeric() or t == pl.Null):
            raise ScenarioError(f"{path}: not sweep results: column {c} holds {t}, expected numbers")
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
