"""The Python API: load scenarios, run them, and look at results as dicts or data frames."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import tomli_w

from . import _core
from ._core import ScenarioError
from .inputs import shown, utf8

ProgressFn = Callable[[int, int, str, float], None]
"""Called as progress(run_index, run_count, label, fraction_done)."""


def toml_value(v: Any) -> str:
    """A Python value as TOML value text (what ``--set key=VALUE`` takes); a dict is an inline table."""
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"  # on one line: a --set value is one line
    try:
        return tomli_w.dumps({"v": v})[len("v = "):].strip()
    except TypeError:
        raise ScenarioError(f"override value {v!r}: expected a bool, number, string, list or dict") from None


def _toml_key(k: Any) -> str:
    return tomli_w.dumps({str(k): 0}).rsplit(" = ", 1)[0]


def override_pairs(overrides: Mapping[str, Any] | None, raw: bool) -> list[tuple[str, str]]:
    pairs = []
    for k, v in (overrides or {}).items():
        key = k.replace("__", ".")
        value = v if raw and isinstance(v, str) else toml_value(v)
        utf8(f"{key}={value}", "--set")
        pairs.append((key, value))
    return pairs


def scenario_source(scenario: str | os.PathLike | Mapping[str, Any] | None) -> tuple[str, str, str]:
    """How the core loads `scenario`: (kind, source, name) with kind "builtin" (source: its name), "file"
    (source: the path) or "text" (source: TOML text; a dict is written as TOML)."""
    if scenario is None:
        return "builtin", "default", "default"
    if isinstance(scenario, Mapping):
        try:
            return "text", tomli_w.dumps(scenario), "<dict>"
        except TypeError as e:
            raise ScenarioError(f"scenario dict: {e}") from None
    if not isinstance(scenario, (str, os.PathLike)):
        raise ScenarioError(f"scenario {scenario!r}: expected a built-in name, a TOML path or a dict")
    path = os.fspath(scenario)
    builtin = [n for n, _ in _core.builtin_scenarios()]
    aliases = dict(_core.builtin_aliases())
    if (path in builtin or path in aliases) and not os.path.exists(path):
        return "builtin", path, aliases.get(path, path)
    if not os.path.exists(path) and not path.endswith(".toml") and os.sep not in path:
        raise ScenarioError(f"{shown(path)}: no such scenario file, and no built-in scenario of that name "
                            f"(built-ins: {', '.join(builtin)})")
    return "file", path, shown(path)


def load(scenario: str | os.PathLike | Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
         *, raw_strings: bool = False) -> list[_core.Variant]:
    """Load a scenario (None: the built-in default; a name of a built-in; a TOML path; or a dict) and expand
    its ``[compare]`` table into variants. Keys of ``overrides`` are dotted paths (``__`` also separates).
    (A sweep's results directory or Parquet file loads with :func:`iommulab.load`, which returns a DataFrame.)"""
    kind, source, name = scenario_source(scenario)
    return _core.load(kind, source, override_pairs(overrides, raw_strings), name)


def resolved(v: _core.Variant) -> dict[str, Any]:
    """A variant's scenario as a dict that loads back into that variant alone (its profile named, every key as
    merged, no [compare]): the base of a variant with more keys set, whatever axes or profiles its scenario's
    other variants have. Its profile's provenance ([sources], [ranges]) is left to the profile."""
    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(y) for k, y in x.items() if y is not None}
        return [clean(y) for y in x] if isinstance(x, list) else x
    d = clean(json.loads(v.scenario_json()))
    for k in ("sources", "ranges"):
        d["platform"].pop(k, None)
    d.pop("provenance", None)
    return d


class RunResult:
    """The result of one run. Every key of :meth:`to_dict` is also an attribute."""

    def __init__(self, data: dict[str, Any], wall_seconds: float = 0.0):
        self._d = data
        self.wall_seconds = wall_seconds

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_d"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._d))

    def flat(self) -> dict[str, Any]:
        """One level of keys: nested objects become ``parent.child`` (lists stay lists)."""
        return flatten([self._d]).to_dicts()[0]

    def to_pandas(self):
        return ResultSet([self]).to_pandas()

    def to_polars(self):
        return ResultSet([self]).to_polars()

    def __repr__(self) -> str:
        return (f"RunResult(label={self.label!r}, policy={self.policy!r}, throughput_gbps={self.throughput_gbps}, "
                f"inv_per_page={self.inv_per_page})")


class ResultSet:
    """Several runs (a comparison). Index by position or by label; ``to_dict()`` is ``{"runs": [...]}``."""

    def __init__(self, runs: list[RunResult]):
        self.runs = list(runs)

    def __len__(self) -> int:
        return len(self.runs)

    def __iter__(self) -> Iterator[RunResult]:
        return iter(self.runs)

    def __getitem__(self, key: int | str) -> RunResult:
        if isinstance(key, str):
            for r in self.runs:
                if r.label == key:
                    return r
            raise KeyError(key)
        return self.runs[key]

    def to_dict(self) -> dict[str, Any]:
        return {"runs": [r.to_dict() for r in self.runs]}

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("to_pandas() needs pandas: pip install 'iommulab[dataframe]'") from e
        return pd.json_normalize([r._d for r in self.runs], sep=".")

    def to_polars(self):
        return flatten([r._d for r in self.runs])

    def __repr__(self) -> str:
        return f"ResultSet({[r.label for r in self.runs]})"


def flatten(rows: list[dict[str, Any]]):
    """Results as a polars DataFrame, nested objects flattened to ``parent.child`` columns (lists stay lists)."""
    import polars as pl

    return pl.json_normalize(rows, separator=".", infer_schema_length=None)


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_jobs(jobs: int | None) -> int:
    """`jobs` as a worker count: None is every CPU; otherwise a whole number of at least 1."""
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ScenarioError(f"jobs: expected a whole number of at least 1, got {jobs!r}")
    return jobs


# Each run advances in this many steps: progress is reported, and an interrupted batch stops, between them.
RUN_STEPS = 100
# How often run_each calls its tick while runs are in flight (a sweep's writer flushes rows then).
TICK_SECONDS = 0.25


def run_one(v: _core.Variant, on_step: Callable[[float], None] | None = None,
            stop: threading.Event | None = None) -> RunResult:
    """Run one variant to the end in RUN_STEPS steps, calling on_step(fraction) after each; raise
    KeyboardInterrupt at a step once `stop` is set."""
    t0 = time.perf_counter()
    sim = v.simulate()
    end = sim.end_ns
    for s in range(1, RUN_STEPS + 1):
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        sim.advance_to(end * s // RUN_STEPS)
        if on_step:
            on_step(s / RUN_STEPS)
    return RunResult(json.loads(sim.result_json()), time.perf_counter() - t0)


def run_each(variants: Iterable[_core.Variant], done: Callable[[int, RunResult], None],
             progress: ProgressFn | None = None, jobs: int | None = None, *, total: int | None = None,
             tick: Callable[[], None] | None = None) -> None:
    """Run each variant to the end on up to `jobs` threads (default: every CPU; the core releases the GIL),
    calling done(index, result) in the calling thread as runs finish, and tick() there at least every
    TICK_SECONDS. `variants` may be an iterator (`total`: how many it yields): it is drawn from as threads free
    up, two per thread ahead, so a long sweep is never all in memory. `progress` is called (under a lock) as
    each run advances by 1%. A failed run or Ctrl-C stops the others at their next step."""
    total = len(variants) if total is None else total  # type: ignore[arg-type]
    jobs = min(check_jobs(jobs), max(1, total))
    lock = threading.Lock()
    stop = threading.Event()

    def one(i: int, v: _core.Variant) -> RunResult:
        def step(frac: float) -> None:
            if progress:
                with lock:
                    progress(i, total, v.label, frac)
        return run_one(v, step, stop)

    queue = enumerate(variants)
    futures: dict[Any, int] = {}
    ex = ThreadPoolExecutor(jobs, thread_name_prefix="iommulab-run")

    def submit(n: int) -> None:
        for i, v in itertools.islice(queue, n):
            futures[ex.submit(one, i, v)] = i

    try:
        submit(2 * jobs)
        while futures:
            finished, _ = wait(futures, timeout=TICK_SECONDS, return_when=FIRST_COMPLETED)
            for f in sorted(finished, key=futures.__getitem__):
                done(futures.pop(f), f.result())
            submit(len(finished))
            if tick:
                tick()
    except BaseException:
        stop.set()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def run_variants(variants: list[_core.Variant], progress: ProgressFn | None = None,
                 jobs: int | None = None) -> list[RunResult]:
    """Run each variant to the end (see :func:`run_each`), returning results in the variants' order. Runs are
    independent and deterministic, so the results are the same for every `jobs`."""
    results: list[RunResult] = [None] * len(variants)  # type: ignore[list-item]
    run_each(variants, results.__setitem__, progress, jobs)
    return results


def run(scenario: str | os.PathLike | Mapping[str, Any] | None = None, *, progress: ProgressFn | None = None,
        jobs: int | None = None, ranges: int | None = None, **overrides: Any) -> RunResult | ResultSet:
    """Run a scenario and return its result: a :class:`RunResult` for one run, a :class:`ResultSet` when the
    scenario compares several (``[compare]``). Overrides are scenario keys, dotted (``**{"os.policy": "strict"}``)
    or with ``__`` (``os__policy="strict"``); setting a compared key pins it. Runs go on `jobs` threads
    (default: every CPU). `ranges`: each run also over that many samples of its profile's ranged constants, its
    result gaining ``ranges``, ``driven_by`` and ``drivers`` (docs/ranges.md)."""
    if ranges is not None:
        from .ranges import ranged, with_ranges

        return as_result([with_ranges(d) for d in ranged(scenario, overrides, ranges, progress, jobs=jobs)])
    return as_result(run_variants(load(scenario, overrides), progress, jobs))


def as_result(results: list[RunResult]) -> RunResult | ResultSet:
    """One run as itself, several as a :class:`ResultSet` (whose ``to_dict()`` is ``{"runs": [...]}``)."""
    return results[0] if len(results) == 1 else ResultSet(results)


# How often a progress bar is redrawn at most.
REFRESH_SECONDS = 0.1


class Progress:
    """A progress bar on stderr (tqdm) counting runs, with elapsed time and ETA; shown once the runs have taken
    over a second (``IOMMULAB_PROGRESS_DELAY`` seconds), never when stderr is not a terminal. Call it as a
    :data:`ProgressFn`; :meth:`close` when done (or use it as a context manager)."""

    def __init__(self, what: str = "runs"):
        try:
            self.delay = float(os.environ.get("IOMMULAB_PROGRESS_DELAY", "1.0"))
        except ValueError:
            self.delay = 1.0
        self.what = what
        self.bar = None
        self.done: dict[int, float] = {}  # the runs in flight
        self.finished = 0
        self.shown = 0.0

    def __call__(self, i: int, n: int, label: str, frac: float) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=n, unit=self.what[:-1] if self.what.endswith("s") else self.what,
                            delay=self.delay, file=sys.stderr, leave=False, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n:.1f}/{total_fmt} " + self.what
                            + " [{elapsed}<{remaining}]{postfix}")
        if frac >= 1.0:
            self.done.pop(i, None)
            self.finished += 1
        else:
            self.done[i] = frac
        now = time.monotonic()
        if now - self.shown >= REFRESH_SECONDS:  # a resumed sweep passes its runs already done in a burst
            self.shown = now
            self.bar.n = self.finished + sum(self.done.values())
            self.bar.set_postfix_str(label[:40], refresh=False)
            self.bar.refresh()

    def bytes(self, done: int, total: int) -> None:
        """Progress through a file: `done` of `total` bytes."""
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, delay=self.delay, file=sys.stderr, leave=False,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def stderr_progress(what: str = "runs") -> Progress | None:
    """A :class:`Progress` when stderr is a terminal, else None."""
    return Progress(what) if sys.stderr.isatty() else None


def newer_than_modelled(kernel: str) -> bool:
    """Whether MAJOR.MINOR `kernel` is after the newest kernel whose changes the model knows (replay and the
    default-domain rules take it with that one's rules; scenarios stop there)."""
    def v(k: str) -> tuple[int, ...]:
        return tuple(int(x) for x in k.split(".")[:2])
    try:
        return v(kernel) > v(_core.KERNEL_NEWEST)
    except ValueError:
        return False
