"""Published targets: `validate` runs each target's scenario and compares the model with the published figure;
`calibrate` fits one physical profile parameter to one target by bisection and writes it into the profile with
its provenance."""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from . import _core
from ._core import ScenarioError
from .api import ProgressFn, load, run_variants, toml_value
from .inputs import toml_text
from .ranges import check_samples, lhs_column, percentiles, prepare
from .report import fit, left, legend, right, wrap

TARGETS_FILE = "targets.toml"
# Seeds each target's runs are repeated at (the scenario's seed and the next ones); the model value is their
# mean. One seed is one sample of the arrivals and of RSS: C3's per-page figures move by 10-20 % between
# seeds, more than some tolerances, while the published figures are averages of repeated runs.
DEFAULT_SEEDS = 5
# Most seeds validate and calibrate take. A bound of the front end, not a kernel constant: the mean of 100 seeds
# has a standard error of a tenth of one seed's spread (1/sqrt(100) of C3's 10-20 %, so 1-2 %), finer than any
# target's tolerance; every seed is a full set of runs kept in memory for the table, and each calibration probe
# runs them all again (validate at 100 seeds is some 6,000 runs, calibrate 26 probes of that).
MAX_SEEDS = 100
_TERM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_.]*)(?:\[(\d+)\])?$")


@dataclass
class Target:
    id: str
    source: str
    published: float
    tolerance: float
    scenario: str
    value: str
    runs: dict[str, dict[str, Any]]
    fitted: str | None = None
    # "micro": one operation's cost (a map's latency, a sync's time); "macro": a throughput or a count of a
    # whole workload. Profile constants are to be fitted on micro-targets only.
    kind: str = "macro"


@dataclass
class Calibration:
    param: str
    profile: str
    target: str
    range: tuple[float, float]


@dataclass
class Targets:
    targets: list[Target] = field(default_factory=list)
    calibrations: list[Calibration] = field(default_factory=list)

    def get(self, tid: str) -> Target:
        for t in self.targets:
            if t.id == tid:
                return t
        raise ScenarioError(f"target {tid!r}: no such target ({self._known()})")

    def select(self, words: list[str]) -> list[Target]:
        """The targets `words` name, in the file's order within each word: a word is an id or the start of ids
        up to a `.` or `_` (C1 selects C1.strict_lazy_ratio and C1.lazy_line_rate_share, not a C10), in any
        case, as `run c1` names the c1 scenario."""
        chosen: list[Target] = []
        for w in words:
            hit = [t for t in self.targets if _names(w, t.id)]
            if not hit:
                raise ScenarioError(f"target {w!r}: no such target ({self._known()})")
            chosen += [t for t in hit if t not in chosen]
        return chosen

    def _known(self) -> str:
        """What the ids are, in a few words (the list of ids is long): their groups."""
        groups = sorted(dict.fromkeys(t.id.split(".", 1)[0] for t in self.targets))
        return f"ids start with {', '.join(groups)}: validate --list"


def _names(word: str, tid: str) -> bool:
    """Whether `word` names the target `tid`: the id, or its start up to a `.` or `_`, in any case."""
    w, t = word.lower(), tid.lower()
    return t == w or bool(w) and t.startswith(w) and (w[-1] in "._" or t[len(w)] in "._")


def _need(where: str, d: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ScenarioError(f"{where}: missing key {key!r}")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ScenarioError(f"{where}.{key}: expected {names}, got {v!r}")
    return v


def load_targets(path: str | os.PathLike | None = None) -> Targets:
    """The shipped targets, or a targets file of the same form."""
    if path is None:
        text = resources.files("iommulab").joinpath(TARGETS_FILE).read_text()
        name = TARGETS_FILE
    else:
        name = os.fspath(path)
        text = toml_text(name, "a targets file")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{name}: {e}") from None
    out = Targets()
    for i, t in enumerate(doc.get("target", [])):
        where = f"{name}: target[{i}]"
        tid = _need(where, t, "id", str)
        where = f"{name}: target {tid}"
        unknown = set(t) - {"id", "source", "published", "tolerance", "scenario", "value", "runs", "fitted", "kind"}
        if unknown:
            raise ScenarioError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        runs = _need(where, t, "runs", dict)
        for rn, ov in runs.items():
            if not isinstance(ov, dict):
                raise ScenarioError(f"{where}.runs.{rn}: expected a table of scenario keys")
        tgt = Target(id=tid, source=str(t.get("source", "")), published=float(_need(where, t, "published", (int, float))),
                     tolerance=float(_need(where, t, "tolerance", (int, float))),
                     scenario=_need(where, t, "scenario", str), value=_need(where, t, "value", str), runs=runs,
                     fitted=t.get("fitted"), kind=t.get("kind", "macro"))
        if tgt.kind not in ("micro", "macro"):
            raise ScenarioError(f"{where}.kind: expected \"micro\" or \"macro\", got {tgt.kind!r}")
        for term in _terms(tgt):
            if term[0] not in runs:
                raise ScenarioError(f"{where}.value: run {term[0]!r} is not in runs ({', '.join(runs)})")
        out.targets.append(tgt)
    for i, c in enumerate(doc.get("calibration", [])):
        where = f"{name}: calibration[{i}]"
        rng = _need(where, c, "range", list)
        if (len(rng) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                     for x in rng) or not rng[0] < rng[1]):
            raise ScenarioError(f"{where}.range: expected [low, high], finite numbers with low < high, got {rng!r}")
        out.calibrations.append(Calibration(param=_need(where, c, "param", str), profile=_need(where, c, "profile", str),
                                            target=_need(where, c, "target", str), range=(rng[0], rng[1])))
        _micro_only(out.get(out.calibrations[-1].target), f"{where}.target")
    return out


def _micro_only(t: Target, where: str) -> None:
    """Micro-measurements in, macro predictions out: a profile constant is fitted on one operation's cost, never
    on a throughput or a count of a whole workload (those are what the model predicts)."""
    if t.kind != "micro":
        raise ScenarioError(f"{where}: {t.id} is a macro target (a throughput or a count of a whole workload); "
                            "a profile constant is fitted only on a kind = \"micro\" target")


def _terms(t: Target) -> list[tuple[str, str, int | None, str]]:
    """`value` as (run, key, index, operator before it) terms."""
    out = []
    op = "*"
    for tok in re.split(r"\s*([*/])\s*", t.value.strip()):
        if tok in ("*", "/"):
            op = tok
            continue
        m = _TERM.match(tok)
        if not m:
            raise ScenarioError(f"target {t.id}.value: {tok!r} is not RUN.KEY or RUN.KEY[INDEX]")
        out.append((m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None, op))
    return out


class Runner:
    """Runs scenario variants once each (same scenario and keys, same result: runs are deterministic), at
    `seeds` seeds: the scenario's own (or `run.seed` from `sets`) and the ones after it."""

    def __init__(self, sets: dict[str, Any] | None = None, seeds: int = DEFAULT_SEEDS, jobs: int | None = None,
                 progress: ProgressFn | None = None):
        if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_SEEDS:
            raise ScenarioError(f"seeds: expected a whole number from 1 to {MAX_SEEDS}, got {seeds!r}")
        self.sets = dict(sets or {})
        # Keys set for one run of a target only (a ranged sample's constants, of that run's profile).
        self.sets_for: dict[str, dict[str, Any]] = {}
        self.seeds = seeds
        self.jobs = jobs
        self.progress = progress
        self.cache: dict[str, dict[str, Any]] = {}
        # The scenario's own seed, per run's keys: seed i runs at it + i.
        self.base_seed: dict[str, int] = {}
        self.runs = 0

    def _variant(self, t: Target, run: str, keys: dict[str, Any]) -> Any:
        variants = load(t.scenario, keys)
        if len(variants) != 1:
            raise ScenarioError(f"target {t.id}.runs.{run}: scenario {t.scenario!r} gives {len(variants)} runs; "
                                "set its [compare] keys")
        return variants[0]

    def _keys(self, t: Target, run: str, i: int) -> tuple[str, dict[str, Any]]:
        """(cache key, scenario keys) of `run` of target `t` at the i-th seed."""
        keys = {**self.sets_for.get(run, {}), **t.runs[run], **self.sets}
        if i:
            bk = json.dumps([t.scenario, sorted(keys.items())], default=str)
            if bk not in self.base_seed:
                self.base_seed[bk] = json.loads(self._variant(t, run, keys).scenario_json())["run"]["seed"]
            keys["run.seed"] = self.base_seed[bk] + i
        return json.dumps([t.scenario, sorted(keys.items())], default=str), keys

    def prefetch(self, targets: list[Target]) -> None:
        """Run every run the targets need, at every seed, on `jobs` threads (each distinct run once)."""
        todo: dict[str, Any] = {}
        for t in targets:
            for run in t.runs:
                for i in range(self.seeds):
                    ck, keys = self._keys(t, run, i)
                    if ck not in self.cache and ck not in todo:
                        todo[ck] = self._variant(t, run, keys)
        for ck, res in zip(todo, run_variants(list(todo.values()), self.progress, self.jobs)):
            self.cache[ck] = res.to_dict()
        self.runs += len(todo)

    def result(self, t: Target, run: str, i: int = 0) -> dict[str, Any]:
        """Run `run` of target `t` at the i-th seed."""
        ck, keys = self._keys(t, run, i)
        if ck not in self.cache:
            self.cache[ck] = run_variants([self._variant(t, run, keys)], jobs=1)[0].to_dict()
            self.runs += 1
        return self.cache[ck]

    def assumed(self, t: Target) -> list[str]:
        """Settings of the target's scenario (as its runs set it) that its `[provenance]` says no source gives
        or that were fitted: the target checks the model under those assumptions."""
        keys = set()
        for run, ov in t.runs.items():
            prov = json.loads(self._variant(t, run, {**ov, **self.sets}).scenario_json()).get("provenance", {})
            keys.update(k for k, why in prov.items() if why.split(":", 1)[0] in ("assumed", "fitted"))
        return sorted(keys)

    def values(self, t: Target) -> list[float]:
        """The target's value at each seed."""
        return [self._value(t, i) for i in range(self.seeds)]

    def value(self, t: Target) -> float:
        """The target's value: the mean over the seeds."""
        return math.fsum(self.values(t)) / self.seeds

    def _value(self, t: Target, i: int) -> float:
        v = 1.0
        for run, key, idx, op in _terms(t):
            x: Any = self.result(t, run, i)
            for part in key.split("."):
                if not isinstance(x, dict) or part not in x:
                    raise ScenarioError(f"target {t.id}.value: {run}.{key}: no such result key")
                x = x[part]
            if idx is not None:
                if not isinstance(x, list) or idx >= len(x):
                    raise ScenarioError(f"target {t.id}.value: {run}.{key}[{idx}]: not a list that long")
                x = x[idx]
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                raise ScenarioError(f"target {t.id}.value: {run}.{key} is not a number")
            v = v * x if op == "*" else (v / x if x else math.inf)
        return v


def check(t: Target, values: list[float], assumed: list[str] | None = None) -> dict[str, Any]:
    """Model (the mean of `values`, one per seed) vs published; `assumed`: the scenario's settings no source
    gives (see Runner.assumed)."""
    model = math.fsum(values) / len(values)
    err = (model - t.published) / t.published if t.published else math.inf
    return {"id": t.id, "published": t.published, "model": float(f"{model:.7g}"), "error": round(err, 6),
            "ok": bool(abs(err) <= t.tolerance), "tolerance": t.tolerance, "source": t.source,
            "fitted": t.fitted, "kind": t.kind, "assumed": list(assumed or []), "seeds": len(values),
            "spread": [float(f"{min(values):.7g}"), float(f"{max(values):.7g}")]}


def validate(ids: list[str] | None = None, sets: dict[str, Any] | None = None,
             targets: Targets | None = None, seeds: int = DEFAULT_SEEDS, jobs: int | None = None,
             progress: ProgressFn | None = None, ranges: int | None = None) -> list[dict[str, Any]]:
    """Every target (or those `ids` name: an id or the start of ids, `Targets.select`), model (mean over
    `seeds` seeds) vs published; the runs go on up to `jobs` threads (default: every CPU). `ranges`: each
    target also over that many samples of its profile's ranged constants (`intervals`)."""
    ts = targets or load_targets()
    chosen = ts.select(ids) if ids else ts.targets
    r = Runner(sets, seeds, jobs, progress)
    r.prefetch(chosen)
    rows = [check(t, r.values(t), r.assumed(t)) for t in chosen]
    if ranges is not None:
        for row, iv in zip(rows, intervals(chosen, sets or {}, ranges, jobs)):
            row.update(iv)
    return rows


# An interval whose half-width is more than this share of its median says little: it is reported as
# uninformative, whether or not the published figure lies in it (docs/validation.md).
INFORMATIVE = 0.5


def intervals(chosen: list[Target], sets: dict[str, Any], n: int, jobs: int | None = None) -> list[dict[str, Any]]:
    """Per target, its value over `n` samples of its runs' profile's ranged constants (docs/ranges.md: each
    constant's draws seeded by its name, so a target's runs share each sample's machine), at the scenario's own
    seed: the 90 % interval, whether the published figure lies in it, and its width relative to its median."""
    n = check_samples(n)
    runners, todo = [], {}
    for t in chosen:
        # Each run's ranged constants and their columns of draws, once: sample i of every run is row i.
        draws = {}
        for run in t.runs:
            prep = prepare(Runner(sets, 1)._variant(t, run, {**t.runs[run], **sets}))
            seed = prep["scenario"]["run"]["seed"]
            draws[run] = (prep, {k: lhs_column(seed, k, n) for k in prep["keys"]})
        for i in range(n):
            r = Runner(sets, 1, jobs)
            r.sets_for = {run: {f"platform.{k}": prep["at"](k, cols[k][i]) for k in prep["keys"]}
                          for run, (prep, cols) in draws.items()}
            runners.append((t, r))
            for run in t.runs:
                ck, keys = r._keys(t, run, 0)
                todo[(len(runners) - 1, ck)] = r._variant(t, run, keys)
    for (j, ck), res in zip(todo, run_variants(list(todo.values()), None, jobs)):
        runners[j][1].cache[ck] = res.to_dict()
    out = []
    for k, t in enumerate(chosen):
        vals = [r.value(t) for _, r in runners[k * n:(k + 1) * n]]
        p = percentiles(vals)
        # Relative to the median; none where the median is 0 and the interval is not (no scale to read it on).
        width = ((p["p95"] - p["p5"]) / abs(p["p50"]) if p["p50"] else 0.0 if p["p95"] == p["p5"] else None)
        out.append({"interval": [float(f"{p['p5']:.7g}"), float(f"{p['p95']:.7g}")], "median": float(f"{p['p50']:.7g}"),
                    "in_interval": bool(p["p5"] <= t.published <= p["p95"]),
                    "interval_width": None if width is None else round(width, 4),
                    "informative": width is not None and width / 2 <= INFORMATIVE, "range_samples": n})
    return out


def format_validate(rows: list[dict[str, Any]]) -> str:
    """The table (in blocks that fit the width: the seeds' spread and a target's notes go to a block of their
    own when they do not fit beside its verdict), then how to read it."""
    notes = []
    for r in rows:
        marks = ["fitted: " + r["fitted"]] if r.get("fitted") else []
        if r.get("assumed"):
            marks.append("assumed: " + ", ".join(k.rsplit(".", 1)[-1] for k in r["assumed"]))
        notes.append("; ".join(marks))
    # The verdict first (the first block), then the seeds' spread and the notes.
    cols = [right("published", [f"{r['published']:.4g}" for r in rows], 2),
            right("model", [f"{r['model']:.4g}" for r in rows], 2),
            right("error", [f"{100 * r['error']:+.1f}%" for r in rows], 2),
            right("tol", [f"{100 * r['tolerance']:.0f}%" for r in rows], 2),
            left("ok", ["ok" if r["ok"] else "MISS" for r in rows]),
            right("seeds min-max", [f"{r['spread'][0]:.4g}-{r['spread'][1]:.4g}" for r in rows], 2)]
    ranged = bool(rows) and all("interval" in r for r in rows)
    if ranged:
        cols[5:5] = [right("90% interval", [f"{r['interval'][0]:.4g}-{r['interval'][1]:.4g}" for r in rows], 2),
                     left("in", ["in" if r["in_interval"] else "out" for r in rows]),
                     right("width", [("median 0" if r["interval_width"] is None else
                                      f"±{50 * r['interval_width']:.0f}%") + ("" if r["informative"] else " wide")
                                     for r in rows], 2)]
    out = fit(["target"] + [r["id"] for r in rows], cols, text=("notes", notes) if any(notes) else None)
    n_ok = sum(r["ok"] for r in rows)
    seeds = rows[0]["seeds"] if rows else DEFAULT_SEEDS
    out += [""] + wrap(f"{n_ok} of {len(rows)} within tolerance")
    if ranged:
        inside = [r for r in rows if r["in_interval"]]
        sharp = [r for r in inside if r["informative"]]
        out += wrap(f"the published figure inside the model's 90 % interval for {len(inside)} of {len(rows)} "
                    f"({len(sharp)} of those intervals informative, within ±{100 * INFORMATIVE:.0f} % of their "
                    f"median; {rows[0]['range_samples']} samples of each profile's ranged constants)")
    out += legend([
        ("model", f"the mean over {seeds} seeds (seeds min-max: their spread)"),
        ("error", "(model - published) / published, within tol(erance) or a MISS"),
        ("fitted", "a parameter was calibrated on this target, so it is not an independent check"),
        *([("90% interval", "the 5th to 95th percentile of the model over the profile's ranged constants "
            "(docs/ranges.md); in: the published figure inside it; width: its half-width around its median, "
            f"wide past ±{100 * INFORMATIVE:.0f} % (uninformative: no check, whatever in says)")] if ranged else []),
        ("assumed", "settings the target's scenario takes without a source (its [provenance]), so the check "
         "holds under those assumptions")])
    return "\n".join(out) + "\n"


def format_targets(ts: Targets) -> str:
    """`validate --list`: every target's id, published figure, tolerance and kind, then its source."""
    ts_ = ts.targets
    out = fit(["target"] + [t.id for t in ts_],
              [right("published", [f"{t.published:.4g}" for t in ts_], 2),
               right("tol", [f"{100 * t.tolerance:.0f}%" for t in ts_], 2),
               left("kind", [t.kind for t in ts_])])
    return "\n".join(out) + "\n"


# --- calibration -------------------------------------------------------------------------------------------

def read_profile(profile: str) -> tuple[str, str]:
    """(name for messages, TOML text) of a built-in profile name or a profile file."""
    builtin = dict(_core.builtin_profiles())
    if profile in builtin and not os.path.exists(profile):
        return profile, builtin[profile]
    return profile, toml_text(profile, "a profile file")


_REQUIRED = object()


def profile_value(doc: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """The value at dotted `key` ("iommu.smmuv3.sync_ns") of a profile as TOML gives it; `default` where a part
    is missing, else KeyError."""
    cur: Any = doc
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is _REQUIRED:
                raise KeyError(key)
            return default
        cur = cur[part]
    return cur


def declared_calibrations(ts: Targets) -> list[dict[str, Any]]:
    """Each declared calibration: the constant, its value in the profile now, and its target with its kind."""
    rows = []
    for c in ts.calibrations:
        t = ts.get(c.target)
        name, text = read_profile(c.profile)
        try:
            doc: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ScenarioError(f"{name}: {e}") from None
        rows.append({"param": c.param, "profile": c.profile, "value": profile_value(doc, c.param, None), "target": t.id, "kind": t.kind,
                     "published": t.published, "source": t.source})
    return rows


def set_profile_value(text: str, where: str, param: str, value: Any, note: str) -> str:
    """Profile TOML `text` with `param` (dotted) set to `value` and its [sources] entry set to `note`, every
    other line kept as it was."""
    return _set_source(_set_key(text, where, param, toml_value(value)), param, note)


def _set_key(text: str, where: str, param: str, value: str) -> str:
    """Replace `param` (dotted, under its table) in TOML text, keeping every other line as it was."""
    *table, key = param.split(".")
    header = "[" + ".".join(table) + "]" if table else None
    lines = text.splitlines(keepends=True)
    cur = None
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("["):
            cur = s.split("#")[0].strip()
            continue
        if cur == header and re.match(rf"^{re.escape(key)}\s*=", s):
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = f"{indent}{key} = {value}\n"
            return "".join(lines)
    raise ScenarioError(f"{where}: no key {param!r} to calibrate (expected `{key} = ...` under {header or 'the top'})")


def _set_source(text: str, param: str, note: str) -> str:
    return _set_entry(text, "sources", param, json.dumps(note))


def set_profile_range(text: str, param: str, low: float, high: float, why: str) -> str:
    """Profile TOML `text` with `param`'s [ranges] entry set to low..high for `why` (docs/ranges.md)."""
    return _set_entry(text, "ranges", param, f"{{ low = {toml_value(round(float(low), 4))}, high = "
                      f"{toml_value(round(float(high), 4))}, why = {json.dumps(why, ensure_ascii=False)} }}")


def _set_entry(text: str, section: str, param: str, rhs: str) -> str:
    """`"param" = rhs` in TOML text's top-level table `[section]` (replacing the entry there, or added at the
    table's end; the table added at the file's end when there is none), every other line kept as it was."""
    line = f"{json.dumps(param)} = {rhs}\n"
    lines = text.splitlines(keepends=True)
    cur, end = None, None
    for i, l in enumerate(lines):
        s = l.strip()
        if s.startswith("["):
            cur = s.split("#")[0].strip()
            continue
        if cur == f"[{section}]":
            if l.startswith(json.dumps(param) + " ="):
                lines[i] = line
                return "".join(lines)
            if s and not s.startswith("#"):
                end = i + 1
    if end is None:
        if not any(l.strip() == f"[{section}]" for l in lines):
            lines.append(f"\n[{section}]\n")
            end = len(lines)
        else:
            end = next(i for i, l in enumerate(lines) if l.strip() == f"[{section}]") + 1
    lines.insert(end, line)
    return "".join(lines)


def calibrate(c: Calibration, targets: Targets | None = None, steps: int = 24,
              seeds: int = DEFAULT_SEEDS, jobs: int | None = None, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Bisect `c.param` over `c.range` until the target's model value meets its published figure (each probe's
    runs on up to `jobs` threads; `progress` counts probes, at most steps + 2). Returns
    {"param", "value", "target", "published", "model", "error", "profile_text"}."""
    ts = targets or load_targets()
    t = ts.get(c.target)
    _micro_only(t, "--target")
    name, text = read_profile(c.profile)
    # The profile as TOML decides whether the parameter is an integer.
    try:
        cur = profile_value(tomllib.loads(text), c.param)
    except (KeyError, tomllib.TOMLDecodeError):
        raise ScenarioError(f"{name}: no key {c.param!r} to calibrate") from None
    integer = isinstance(cur, int) and not isinstance(cur, bool)

    def snap(x: float) -> float:
        """The value as the profile will hold it: probes are evaluated at exactly what would be written."""
        return int(round(x)) if integer else round(x, 6)

    probes: list[tuple[float, float]] = []

    def model_at(v: float) -> float:
        sets = {"platform.profile": c.profile, f"platform.{c.param}": v}
        r = Runner(sets, seeds, jobs)
        r.prefetch([t])
        if progress:
            progress(len(probes), steps + 2, f"{c.param} = {v:g}", 1.0)
        probes.append((v, r.value(t)))
        return probes[-1][1]

    lo, hi = snap(c.range[0]), snap(c.range[1])
    if integer and max(abs(lo), abs(hi)) >= 1 << 63:
        # TOML's integers are 64-bit signed: a probe past them could not be written into the profile.
        raise ScenarioError(f"--range {c.range[0]:g}:{c.range[1]:g}: {c.param} is a whole number; expected a "
                            f"range within ±{float(1 << 63):g}")
    m_lo, m_hi = model_at(lo), model_at(hi)
    f_lo, f_hi = m_lo - t.published, m_hi - t.published
    if f_lo * f_hi > 0:
        raise ScenarioError(f"calibrate {c.param} on {t.id}: the model gives {m_lo:.4g} at {lo:g} and "
                            f"{m_hi:.4g} at {hi:g}; published {t.published} is not between them")
    # (|model - published|, value, model) of the closest probe.
    best = min((abs(f_lo), lo, m_lo), (abs(f_hi), hi, m_hi))
    for _ in range(steps):
        mid = snap((lo + hi) / 2)
        if mid in (lo, hi):
            break
        m_mid = model_at(mid)
        f_mid = m_mid - t.published
        best = min(best, (abs(f_mid), mid, m_mid))
        if f_mid == 0:
            break
        if (f_mid < 0) == (f_lo < 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    _, value, model = best
    note = (f"calibrated on {t.id} with scenario {t.scenario} (published {t.published:g}: {t.source}); "
            f"model {model:.4g} at this value")
    new = set_profile_value(text, name, c.param, value, note)
    # What the calibration leaves free: the probes whose model is within the target's tolerance.
    free = [v for v, m in probes if abs(m - t.published) <= t.tolerance * abs(t.published)] + [value]
    new = set_profile_range(new, c.param, min(free), max(free),
                            f"calibrated: the values probed whose model is within {t.id}'s ±{100 * t.tolerance:g} %")
    return {"param": c.param, "profile": c.profile, "value": value, "target": t.id, "published": t.published,
            "model": float(f"{model:.7g}"), "error": round((model - t.published) / t.published, 6), "profile_text": new}
