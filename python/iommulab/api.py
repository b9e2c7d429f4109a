"""The Python API: load scenarios, run them, and look at results as dicts or data frames."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _core
from ._core import ScenarioError

ProgressFn = Callable[[int, int, str, float], None]
"""Called as progress(run_index, run_count, label, fraction_done)."""


def toml_value(v: Any) -> str:
    """A Python value as TOML value text (what ``--set key=VALUE`` takes)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise ScenarioError(f"override value {v!r}: expected a bool, number, string, list or dict")


def _toml_key(k: Any) -> str:
    k = str(k)
    return k if k and all(c.isalnum() or c in "-_" for c in k) else json.dumps(k)


def _to_toml(d: Mapping[str, Any]) -> str:
    return "".join(f"{_toml_key(k)} = {toml_value(v)}\n" for k, v in d.items())


def _override_pairs(overrides: Mapping[str, Any] | None, raw: bool) -> list[tuple[str, str]]:
    pairs = []
    for k, v in (overrides or {}).items():
        key = k.replace("__", ".")
        pairs.append((key, v if raw and isinstance(v, str) else toml_value(v)))
    return pairs


def load(scenario: str | os.PathLike | Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
         *, raw_strings: bool = False) -> list[_core.Variant]:
    """Load a scenario (None: the built-in default; a name of a built-in; a TOML path; or a dict) and expand
    its ``[compare]`` table into variants. Keys of ``overrides`` are dotted paths (``__`` also separates)."""
    pairs = _override_pairs(overrides, raw_strings)
    if scenario is None:
        return _core.load("builtin", "default", pairs)
    if isinstance(scenario, Mapping):
        return _core.load("text", _to_toml(scenario), pairs, "<dict>")
    if not isinstance(scenario, (str, os.PathLike)):
        raise ScenarioError(f"scenario {scenario!r}: expected a built-in name, a TOML path or a dict")
    path = os.fspath(scenario)
    builtin = [n for n, _ in _core.builtin_scenarios()]
    if path in builtin and not os.path.exists(path):
        return _core.load("builtin", path, pairs)
    if not os.path.exists(path) and not path.endswith(".toml") and os.sep not in path:
        raise ScenarioError(f"{path}: no such scenario file, and no built-in scenario of that name "
                            f"(built-ins: {', '.join(builtin)})")
    return _core.load("file", path, pairs)


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
        """One level of keys: nested objects become ``parent.child``, lists ``name.0``, ``name.1``."""
        out: dict[str, Any] = {}

        def walk(prefix: str, v: Any) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else k, x)
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    walk(f"{prefix}.{i}", x)
            else:
                out[prefix] = v

        walk("", self._d)
        return out

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
        return pd.DataFrame([r.flat() for r in self.runs])

    def to_polars(self):
        try:
            import polars as pl
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("to_polars() needs polars: pip install 'iommulab[dataframe]'") from e
        return pl.DataFrame([r.flat() for r in self.runs])

    def __repr__(self) -> str:
        return f"ResultSet({[r.label for r in self.runs]})"


def run_variants(variants: list[_core.Variant], progress: ProgressFn | None = None) -> list[RunResult]:
    """Run each variant to the end, in order, reporting progress in about 1% steps."""
    out = []
    for i, v in enumerate(variants):
        t0 = time.perf_counter()
        sim = v.simulate()
        end = sim.end_ns
        steps = 100 if progress else 1
        for s in range(1, steps + 1):
            sim.advance_to(end * s // steps)
            if progress:
                progress(i, len(variants), v.label, s / steps)
        out.append(RunResult(json.loads(sim.result_json()), time.perf_counter() - t0))
    return out


def run(scenario: str | os.PathLike | Mapping[str, Any] | None = None, *, progress: ProgressFn | None = None,
        **overrides: Any) -> RunResult | ResultSet:
    """Run a scenario and return its result: a :class:`RunResult` for one run, a :class:`ResultSet` when the
    scenario compares several (``[compare]``). Overrides are scenario keys, dotted (``**{"os.policy": "strict"}``)
    or with ``__`` (``os__policy="strict"``); setting a compared key pins it."""
    return as_result(run_variants(load(scenario, overrides), progress))


def as_result(results: list[RunResult]) -> RunResult | ResultSet:
    """One run as itself, several as a :class:`ResultSet` (whose ``to_dict()`` is ``{"runs": [...]}``)."""
    return results[0] if len(results) == 1 else ResultSet(results)


def stderr_progress() -> ProgressFn | None:
    """A progress bar on stderr when it is a terminal, shown once the runs have taken over a second
    (``IOMMULAB_PROGRESS_DELAY`` seconds)."""
    if not sys.stderr.isatty():
        return None
    try:
        delay = float(os.environ.get("IOMMULAB_PROGRESS_DELAY", "1.0"))
    except ValueError:
        delay = 1.0
    t0 = time.perf_counter()
    shown = [False]

    def bar(i: int, n: int, label: str, frac: float) -> None:
        if time.perf_counter() - t0 < delay:
            return
        shown[0] = True
        done = (i + frac) / n
        w = 30
        fill = int(done * w)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (w - fill)}] {done * 100:5.1f}%  run {i + 1}/{n} {label[:40]:<40}")
        if i + 1 == n and frac >= 1.0:
            sys.stderr.write("\r" + " " * (w + 60) + "\r")
        sys.stderr.flush()

    return bar
