"""Profiles measured on the user's own host. `iommulab profile measure` records how long the kernel's own DMA
map/unmap path functions take (a kprobe at each one's entry and a kretprobe at its return, through the capture
script's -M) while a workload runs, and summarises them per function; `iommulab profile fit` writes a platform
profile whose CPU-path and invalidation constants come from those latencies, and sets what the model then
predicts for each measured function beside what was measured (docs/measure.md)."""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from typing import IO, Any

from ._core import ScenarioError
from . import vendors
from .inputs import open_trace, shown
from .robustness import MEASURED_BY
from .validate import profile_value, read_profile, set_profile_range, set_profile_value

MEASURE_FORMAT = 1
# Per function, at most this many latencies are kept for its percentiles (every other one is dropped when full,
# so the sample stays spread over the whole recording); the means use every call.
SAMPLE_MAX = 1 << 16
# A pid's open calls deeper than this are given up as unpaired (a return probe that missed): bounded memory.
STACK_MAX = 64
# Distinct argument values kept per function (a size, a descriptor count); the rest are summed under "other".
KEYS_MAX = 64
# A regression over an argument needs this many calls at each of at least two values.
FIT_MIN_CALLS = 20
PAGE = 4096
# A trace line longer than this is an error, as replay's (replay/ftrace.rs MAX_LINE_BYTES).
MAX_LINE_BYTES = 1 << 20
# The IOVA rcache serves allocations of up to 2^(IOVA_RANGE_CACHE_MAX_SIZE - 1) pages (drivers/iommu/iova.c).
RCACHE_MAX_PAGES = 32

# ` task-pid [cpu] flags ts: lat_FUNC: (site) args` as tracefs prints an event (the flags and a tgid column are
# options a host may have turned off).
_EVENT = re.compile(rb"^\s*.*?-(\d+)\s+(?:\(\s*[\d-]+\)\s+)?\[(\d+)\]\s+(?:\S+\s+)?(\d+)\.(\d{6}):\s+lat_(\w+?)(_r)?:"
                    rb"\s*\([^)]*\)\s*(.*)$")
_ARG = re.compile(rb"(\w+)=(0x[0-9a-fA-F]+|-?\d+)")
_HEADER = "# iommulab measure: "


class _Fn:
    """One function's calls: counts, sums for the means, a bounded sample for percentiles, and per argument
    value (`key`) the same sums."""

    def __init__(self):
        self.n = 0
        self.sum = self.sumsq = self.self_sum = 0.0
        self.sample: list[int] = []
        self.stride = 1
        self.by: dict[str, list[float]] = {}  # key -> [calls, sum, self_sum]

    def add(self, dur: int, own: int, key: str | None):
        self.n += 1
        self.sum += dur
        self.sumsq += dur * dur
        self.self_sum += own
        if self.n % self.stride == 0:
            self.sample.append(dur)
            if len(self.sample) >= SAMPLE_MAX:
                self.sample = self.sample[1::2]
                self.stride *= 2
        if key is not None:
            if key not in self.by and len(self.by) >= KEYS_MAX:
                key = "other"
            b = self.by.setdefault(key, [0, 0.0, 0.0])
            b[0] += 1
            b[1] += dur
            b[2] += own

    def summary(self) -> dict[str, Any]:
        s = sorted(self.sample)
        mean = self.sum / self.n
        pct = (lambda q: s[min(len(s) - 1, int(q * len(s)))])
        return {"calls": self.n, "mean_ns": round(mean, 1), "self_mean_ns": round(self.self_sum / self.n, 1),
                "stddev_ns": round(math.sqrt(max(0.0, self.sumsq / self.n - mean * mean)), 1),
                "p50_ns": pct(0.5), "p99_ns": pct(0.99),
                "by": {k: {"calls": int(c), "mean_ns": round(t / c, 1), "self_mean_ns": round(o / c, 1)}
                       for k, (c, t, o) in sorted(self.by.items(), key=lambda kv: -kv[1][0])}}


def _key(fn: str, args: dict[str, int], kernel: tuple[int, int]) -> str | None:
    """What sizes a call's work, as `name=value`: pages mapped or unmapped, descriptors, commands and sync."""
    if "size" in args:
        return f"pages={max(1, -(-args['size'] // PAGE))}"
    if "pages" in args:
        return f"pages={args['pages']}"
    if "count" in args:
        return f"count={args['count']}"
    if fn == "arm_smmu_cmdq_issue_cmdlist" and {"a3", "a4", "a5"} <= set(args):
        # (smmu, cmds, n, sync) until 6.11; (smmu, cmdq, cmds, n, sync) from 6.12.
        n, sync = (args["a4"], args["a5"]) if kernel >= (6, 12) else (args["a3"], args["a4"] & 0xff)
        return f"n={n},sync={int(bool(sync))}"
    return None


def _kernel_version(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def summarize(path: str | os.PathLike, name: str | None = None) -> dict[str, Any]:
    """A trace recorded with the capture script's -M or -L, as per-function latencies: for each function its
    calls, mean, standard deviation, p50 and p99 (inclusive, ns), its self time (less the probed functions it
    called) and the same by its sizing argument; with the host, kernel, date, command line, IOMMUs and IOMMU
    groups the script recorded. `name`: what errors call the trace (default: its path)."""
    f, raw = open_trace(path)
    name = name or shown(path)
    meta: dict[str, Any] = {"iommus": [], "groups": [], "probes": [], "missed": {}}
    fns: dict[str, _Fn] = {}
    stacks: dict[tuple[int, int], list[list]] = {}  # (pid, cpu for pid 0) -> open calls [fn, t0, key, child ns]
    unpaired = 0
    kernel = (0, 0)
    try:
        with f:
            for line in _lines(f, name):
                if line.startswith(b"#"):
                    text = line.decode("utf-8", "replace").rstrip("\n")
                    if text.startswith(_HEADER):
                        kernel = _header(meta, text[len(_HEADER):]) or kernel
                    continue
                m = _EVENT.match(line)
                if not m:
                    continue
                pid, cpu = int(m.group(1)), int(m.group(2))
                t = int(m.group(3)) * 1_000_000_000 + int(m.group(4)) * 1000
                fn, ret = m.group(5).decode(), m.group(6) is not None
                st = stacks.setdefault((pid, cpu if pid == 0 else -1), [])
                if not ret:
                    args = {k.decode(): int(v, 16) if v.startswith(b"0x") else int(v)
                            for k, v in _ARG.findall(m.group(7))}
                    st.append([fn, t, _key(fn, args, kernel), 0])
                    if len(st) > STACK_MAX:
                        st.pop(0)
                        unpaired += 1
                    continue
                # A return closes the innermost open call of its function; calls opened above it lost theirs.
                for i in range(len(st) - 1, -1, -1):
                    if st[i][0] == fn:
                        break
                else:
                    unpaired += 1
                    continue
                unpaired += len(st) - 1 - i
                _, t0, key, child = st[i]
                del st[i:]
                dur = max(0, t - t0)
                fns.setdefault(fn, _Fn()).add(dur, max(0, dur - child), key)
                if st:
                    st[-1][3] += dur
    except (OSError, EOFError, ValueError) as e:
        raise ScenarioError(f"{name}: cannot read: {e}") from None
    finally:
        if raw is not None:
            raw.close()
    unpaired += sum(len(s) for s in stacks.values())
    if not fns:
        raise ScenarioError(f"{name}: no measured calls (lat_* events); expected a trace recorded with "
                            "`iommulab profile measure` or the capture script's -M or -L")
    return {"format": MEASURE_FORMAT, **meta, "unpaired": unpaired,
            "functions": {k: fns[k].summary() for k in sorted(fns)}}


def _lines(f: IO[bytes], name: str):
    """The trace's lines, each bounded: one longer than MAX_LINE_BYTES is an error naming it."""
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE_BYTES:
            raise ScenarioError(f"{name}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes; expected ftrace text")
        yield line


def _header(meta: dict[str, Any], text: str) -> tuple[int, int] | None:
    """One `# iommulab measure:` line into `meta`; the kernel's version when the line gives it."""
    key, _, value = text.partition(" ")
    if key in ("host", "kernel", "machine", "date", "cmdline"):
        meta[key] = value
        return _kernel_version(value) if key == "kernel" else None
    if key == "iommu":
        meta["iommus"].append(value)
    elif key == "group":
        m = re.match(r"(\S+) type (\S*) devices ?(.*)", value)
        if m:
            meta["groups"].append({"group": m.group(1), "type": m.group(2), "devices": m.group(3).split()})
    elif key == "probe":
        meta["probes"].append(value)
    elif key == "missed":
        fn, _, n = value.partition(" ")
        meta["missed"][fn] = int(n) if n.isdigit() else n
    return None


# The longest mean latency a measurement may hold. A bound of the front end, not a kernel constant: the map and
# unmap path's functions take 0.1-100 µs; a mean of a second is a stalled kernel or a damaged file, not a cost to
# model, and a profile holds every constant fitted from it as a u64 of ns.
MAX_LATENCY_NS = 1e9
# The largest argument value a `by` key may hold: pages of a 64-bit IOVA space (2^64 / 4 KiB).
MAX_ARG = 1 << 52
# How deep a measurement's JSON may nest: `profile measure` writes 4 levels (functions.FN.by.KEY).
MAX_DEPTH = 8


class _NotFinite(str):
    """NaN, Infinity or a number past a double's range where the JSON holds a number (json reads them as
    floats): kept as written, so that the check names its key."""


def _finite(text: str) -> float | _NotFinite:
    v = float(text)
    return v if math.isfinite(v) else _NotFinite(text)


def _walk(doc: Any, limit: int) -> str | None:
    """Why `doc` is no measurement's JSON, found without recursion (a hostile file may nest 100,000 levels):
    nesting deeper than `limit`, or a number that is not finite (at its key); None when neither."""
    todo: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while todo:
        x, d, where = todo.pop()
        if isinstance(x, _NotFinite):
            return f"{where.lstrip('.') or 'the document'}: {x} is not a finite number"
        if isinstance(x, (dict, list)):
            if d > limit:
                return f"nested deeper than {limit} levels"
            items = x.items() if isinstance(x, dict) else enumerate(x)
            todo += [(y, d + 1, f"{where}.{shown(str(k))}" if isinstance(x, dict) else f"{where}[{k}]")
                     for k, y in items]
    return None


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A measurement `profile measure` wrote (JSON), checked for everything `fit` reads: an error names the key
    and what was expected (NaN, Infinity, a boolean or a string where a latency goes, or nesting beyond the
    format's, never reach the fit)."""
    name = shown(path)
    from .inputs import toml_text  # the same bounded, regular-file read

    text = toml_text(path, "a measurement (JSON from iommulab profile measure)")
    try:
        doc = json.loads(text, parse_constant=_NotFinite, parse_float=_finite)
        why = _walk(doc, MAX_DEPTH)
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{name}:{e.lineno}: not JSON ({e.msg}); expected a measurement from "
                            "iommulab profile measure") from None
    except RecursionError:
        why = f"nested deeper than {MAX_DEPTH} levels"
    if why:
        raise ScenarioError(f"{name}: {why}; expected a measurement from iommulab profile measure (finite "
                            f"numbers, at most {MAX_DEPTH} levels deep)")
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if isinstance(fmt, bool) or fmt != MEASURE_FORMAT or not isinstance(doc.get("functions"), dict):
        raise ScenarioError(f"{name}: expected a measurement from iommulab profile measure (format "
                            f"{MEASURE_FORMAT}, with functions)")
    _check_meta(doc, name)
    for fn, s in doc["functions"].items():
        _check_function(s, f"{name}: functions.{shown(fn)}")
    return doc


def _check_function(s: Any, where: str) -> None:
    """One function's summary: its calls and latencies, and the same per argument value (`by`), each keyed
    NAME=N[,NAME=N] as `_key` writes them (N in ASCII digits, at most MAX_ARG) or `other`."""
    if not isinstance(s, dict):
        raise ScenarioError(f"{where}: expected an object with calls, mean_ns and self_mean_ns")
    _check_calls(s, where)
    for k in ("stddev_ns", "p50_ns", "p99_ns"):
        if k in s:
            _check_ns(s, k, where)
    by = s.get("by", {})
    if not isinstance(by, dict):
        raise ScenarioError(f"{where}.by: expected an object of argument values")
    for key, b in by.items():
        w = f"{where}.by.{shown(key)}"
        if key != "other" and not all(re.fullmatch(r"\w+=\d{1,16}", p, re.ASCII) and int(p.split("=")[1]) <= MAX_ARG
                                      for p in key.split(",")):
            raise ScenarioError(f"{w}: expected NAME=N[,NAME=N] with N at most {MAX_ARG}, or other")
        if not isinstance(b, dict):
            raise ScenarioError(f"{w}: expected an object with calls, mean_ns and self_mean_ns")
        _check_calls(b, w)


def _check_calls(s: dict[str, Any], where: str) -> None:
    """`calls` a whole number of at least 1, `mean_ns` and `self_mean_ns` latencies."""
    c = s.get("calls")
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ScenarioError(f"{where}.calls: expected a whole number of at least 1, got {json.dumps(c)}")
    for k in ("mean_ns", "self_mean_ns"):
        _check_ns(s, k, where)


def _check_ns(s: dict[str, Any], k: str, where: str) -> None:
    v = s.get(k)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_LATENCY_NS:
        raise ScenarioError(f"{where}.{k}: expected a latency from 0 to {MAX_LATENCY_NS:.0f} ns, got "
                            f"{shown(json.dumps(v))[:40]}")


def _check_meta(doc: dict[str, Any], name: str) -> None:
    """What the measurement says of its host, as `summarize` writes it: text, lists of text, the IOMMU groups."""
    for k in ("host", "kernel", "machine", "date", "cmdline"):
        if k in doc and not isinstance(doc[k], str):
            raise ScenarioError(f"{name}: {k}: expected text, got {shown(json.dumps(doc[k]))[:40]}")
    for k in ("iommus", "probes"):
        if not (isinstance(doc.get(k, []), list) and all(isinstance(x, str) for x in doc.get(k, []))):
            raise ScenarioError(f"{name}: {k}: expected a list of text")
    groups = doc.get("groups", [])
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("type"), str) for g in groups)):
        raise ScenarioError(f"{name}: groups: expected a list of objects with a type (DMA, DMA-FQ, identity)")
    if not isinstance(doc.get("missed", {}), dict):
        raise ScenarioError(f"{name}: missed: expected an object of probe-miss counts")
    un = doc.get("unpaired", 0)
    if isinstance(un, bool) or not isinstance(un, int) or un < 0:
        raise ScenarioError(f"{name}: unpaired: expected a whole number of at least 0")


def base_profile(base: str) -> tuple[str, str]:
    """(name, TOML text) of the profile `profile fit --base` names, checked as a bare-metal platform profile. A
    guest profile is refused: its [cpu] holds only the vCPUs' count, every other CPU cost is its host
    profile's (hypervisor.host_profile), and that is the profile a fit of the map path's costs changes."""
    name, text = read_profile(base)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        at = re.search(r" \(at line (\d+), column \d+\)$", str(e))
        line, msg = (f":{at.group(1)}", str(e)[:at.start()]) if at else ("", str(e))
        raise ScenarioError(f"{shown(name)}{line}: not TOML ({msg}); expected a platform profile (a built-in "
                            "name, `iommulab profiles` lists them, or a profile file)") from None
    vendor = doc.get("vendor")
    if not (isinstance(vendor, str) and vendors.DRIVERS.get(vendor, {}).get("modelled")
            and all(isinstance(doc.get(t), dict) for t in ("iommu", "memory", "cpu"))):
        raise ScenarioError(f"{shown(name)}: not a platform profile (expected vendor = one of "
                            f"{', '.join(vendors.names(modelled=True))}, and [iommu], [memory] and [cpu]); "
                            "`iommulab profiles` lists the built-in ones")
    host = profile_value(doc, "hypervisor.host_profile", None)
    if isinstance(doc.get("hypervisor"), dict):
        raise ScenarioError(f"{shown(name)}: a guest profile, whose CPU costs but the vCPUs' count are its host "
                            f"profile's (hypervisor.host_profile = {shown(str(host))}); fit that: --base "
                            f"{shown(str(host))}")
    return name, text


# --- fit -------------------------------------------------------------------------------------------------------


def _line(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x over (x, y, weight); None without two x values."""
    w = sum(p[2] for p in points)
    if len({p[0] for p in points}) < 2 or w <= 0:
        return None
    mx = sum(x * c for x, _, c in points) / w
    my = sum(y * c for _, y, c in points) / w
    sxx = sum(c * (x - mx) ** 2 for x, _, c in points)
    sxy = sum(c * (x - mx) * (y - my) for x, y, c in points)
    b = sxy / sxx
    return my - b * mx, b


def _by(s: dict[str, Any], name: str, field: str = "self_mean_ns", **where: int) -> list[tuple[float, float, float]]:
    """(argument value, mean, calls) of the calls keyed `name=value` (and `where`'s other values)."""
    out = []
    for k, b in s.get("by", {}).items():
        kv = dict(p.split("=", 1) for p in k.split(",") if "=" in p)
        if name in kv and kv[name].isdigit() and all(kv.get(a) == str(v) for a, v in where.items()):
            out.append((float(kv[name]), float(b[field]), float(b["calls"])))
    return out


class Fit:
    """The constants a measurement sets in a base profile (`text`, TOML, with NEWER_KEYS written in), each with
    how it was derived; and per function whose constants were all set from it, the (size, mean, calls) points
    they were set from (its row matches them by construction)."""

    def __init__(self, text: str, m: dict[str, Any]):
        self.text, self.base, self.m = text, tomllib.loads(text), m
        self.fns = m["functions"]
        self.values: dict[str, float] = {}
        self.how: dict[str, str] = {}
        self.skipped: list[str] = []
        self.exact: dict[str, list[tuple[float, float, float]]] = {}

    def get(self, key: str) -> float:
        if key in self.values:
            return self.values[key]
        v = profile_value(self.base, key, None)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ScenarioError(f"the base profile: {key}: expected a number (a platform profile has one), got "
                                f"{shown(json.dumps(v, default=str))[:40]}")
        return float(v)

    def has(self, key: str) -> bool:
        return profile_value(self.base, key, None) is not None

    def set(self, key: str, value: float, how: str) -> bool:
        """Set `key`; a value that is not a cost a profile can hold (negative, not finite, past MAX_LATENCY_NS,
        not a number) is not written: the base's is kept, and said. False then."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_LATENCY_NS:
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            why = "< 0" if number and value < 0 else f"expected 0 to {MAX_LATENCY_NS:.0f}"
            self.skipped.append(f"{key}: the measurement gives {f'{value:.0f}' if number else repr(value)} ns "
                                f"({why}); kept the base's")
            return False
        self.values[key] = value
        self.how[key] = how
        return True

    def calls(self, fn: str) -> float:
        return float(self.fns.get(fn, {}).get("calls", 0))


# Keys a profile written before them may lack, with the value the core then takes (hw/platform.rs serde
# defaults): a fit writes them in.
NEWER_KEYS = {"cpu.pgtable_map_ns": 0}


def with_newer_keys(text: str) -> str:
    """Profile TOML `text` with each of NEWER_KEYS it lacks set to its default under its table's header."""
    doc = tomllib.loads(text)
    for key, value in NEWER_KEYS.items():
        *table, name = key.split(".")
        header = "[" + ".".join(table) + "]"
        if profile_value(doc, key, None) is None and isinstance(profile_value(doc, ".".join(table), None), dict):
            text = re.sub(rf"(?m)^{re.escape(header)}[ \t]*(#.*)?$", lambda mo: f"{mo.group(0)}\n{name} = {value}",
                          text, count=1)
    return text


def fit(base_text: str, m: dict[str, Any]) -> Fit:
    """The constants of a profile (`base_text`, TOML) that `m` (from summarize) measures. Each comes from one
    function's mean latency, less what the model charges inside it from other constants; where a function was
    called with several sizes, a line over the sizes gives the per-size and the fixed cost apart."""
    f = Fit(with_newer_keys(base_text), m)
    fns = f.fns
    # The IOVA allocator's per-CPU caches: alloc_iova_fast and free_iova_fast of up to 32 pages (cpu.iova_rcache_ns
    # is charged once per allocation and once per free, dma/iova.rs).
    pts = [(x, y, c) for fn in ("alloc_iova_fast", "free_iova_fast")
           for x, y, c in _by(fns.get(fn, {}), "pages") if x <= RCACHE_MAX_PAGES]
    if pts:
        n = sum(c for _, _, c in pts)
        f.set("cpu.iova_rcache_ns", sum(y * c for _, y, c in pts) / n,
              f"alloc_iova_fast and free_iova_fast self time, {n:.0f} calls of up to {RCACHE_MAX_PAGES} pages")
    # A walk of the page table to a leaf: iommu_iova_to_phys is one and nothing else (the unmap path's lookup).
    if f.calls("iommu_iova_to_phys"):
        s = fns["iommu_iova_to_phys"]
        f.set("cpu.pgtable_walk_ns", s["self_mean_ns"], f"iommu_iova_to_phys self time, {s['calls']} calls")
    # Writing the page table: iommu_map (iommu_map_atomic before 6.3) self time = its own per-call cost + a walk +
    # a PTE per page. Over several sizes a line gives the PTE (its slope) and the rest (its intercept).
    mapfn = next((fn for fn in ("iommu_map", "iommu_map_atomic") if f.calls(fn)), None)
    if mapfn:
        _fit_map(f, mapfn, [p for p in _by(fns[mapfn], "pages") if p[2] >= FIT_MIN_CALLS])
    # The rest of iommu_dma_map_page's own path: its self time, the probed calls under it taken out.
    if f.calls("iommu_dma_map_page"):
        s = fns["iommu_dma_map_page"]
        f.set("cpu.dma_iommu_op_ns", s["self_mean_ns"], f"iommu_dma_map_page self time, {s['calls']} calls")
    if f.calls("queue_iova"):
        s = fns["queue_iova"]
        f.set("cpu.fq_entry_ns", s["self_mean_ns"], f"queue_iova self time, {s['calls']} calls")
    _fit_invalidation(f)
    return f


def _fit_map(f: Fit, mapfn: str, pts: list[tuple[float, float, float]]):
    """cpu.pte_ns and cpu.pgtable_map_ns (or, without iommu_iova_to_phys, cpu.pgtable_walk_ns) from `mapfn`'s
    self time over sizes, so that op + walk + PTE x pages gives its mean at every fitted size's weight."""
    if not pts:
        return
    ab = _line(pts)
    walked = f.calls("iommu_iova_to_phys") > 0
    rest = "cpu.pgtable_map_ns" if walked else "cpu.pgtable_walk_ns"
    other = f.get("cpu.pgtable_walk_ns") if walked else f.get("cpu.pgtable_map_ns")
    if ab and ab[1] > 0 and ab[0] - other >= 0:
        ok = f.set("cpu.pte_ns", ab[1], f"{mapfn} self time, slope per page of a line over {len(pts)} sizes")
        ok = f.set(rest, ab[0] - other, f"{mapfn} self time, intercept of a line over {len(pts)} sizes, less "
                   + ("one walk (cpu.pgtable_walk_ns)" if walked else "cpu.pgtable_map_ns")) and ok
    else:
        # No slope to read (one size, sizes too noisy to order, or an intercept below a walk): the mean over
        # every call, less its own cost and a walk each, per page mapped.
        fixed, n = f.get("cpu.pgtable_walk_ns") + f.get("cpu.pgtable_map_ns"), sum(c for *_, c in pts)
        ok = f.set("cpu.pte_ns", sum(c * (y - fixed) for _, y, c in pts) / sum(c * x for x, _, c in pts),
                   f"{mapfn} self time over {n:.0f} calls of {len(pts)} size(s), less a walk "
                   "(cpu.pgtable_walk_ns) and cpu.pgtable_map_ns each, per page")
    if ok:
        f.exact[mapfn] = pts


def _fit_invalidation(f: Fit):
    """The vendor's synchronous invalidation on bare metal: VT-d's qi_submit_sync, SMMUv3's command list with a
    CMD_SYNC. In a guest it is a trap into the hypervisor, priced by the guest's exit and handler costs: not
    fitted here."""
    guest = f.has("hypervisor")
    if f.has("iommu.vtd") and f.calls("qi_submit_sync"):
        if guest:
            f.skipped.append("qi_submit_sync: in a guest its time is the exit to the VMM and QEMU's work (the "
                             "hypervisor's costs), not the hardware's: not fitted")
            return
        # qi_submit_sync(): q_lock, (count + 1) descriptors written, count processed and the wait's, q_lock again.
        fixed = 2 * f.get("cpu.lock_ns") + f.get("iommu.vtd.submit_desc_ns")
        per = f.get("iommu.vtd.submit_desc_ns")
        pts = [p for p in _by(f.fns["qi_submit_sync"], "count", field="mean_ns") if p[2] >= FIT_MIN_CALLS]
        _fixed_and_per(f, "qi_submit_sync", pts, fixed, per, "iommu.vtd.inv_desc_ns", "iommu.vtd.inv_wait_ns",
                       "descriptor")
    if f.has("iommu.smmuv3") and f.calls("arm_smmu_cmdq_issue_cmdlist"):
        if guest:
            f.skipped.append("arm_smmu_cmdq_issue_cmdlist: in a guest its CMD_SYNC is an exit to the VMM: not fitted")
            return
        # A command list with its CMD_SYNC: (n + 1) commands written, n consumed, the CMD_SYNC, its signal seen.
        sub = f.get("iommu.smmuv3.submit_cmd_ns")
        pts = [p for p in _by(f.fns["arm_smmu_cmdq_issue_cmdlist"], "n", field="mean_ns", sync=1)
               if p[2] >= FIT_MIN_CALLS]
        _fixed_and_per(f, "arm_smmu_cmdq_issue_cmdlist with sync", pts, sub + f.get("iommu.smmuv3.sync_signal_ns"),
                       sub, "iommu.smmuv3.cmd_ns", "iommu.smmuv3.sync_ns", "command")


def _fixed_and_per(f: Fit, what: str, pts: list[tuple[float, float, float]], fixed: float, per: float,
                   per_key: str, fixed_key: str, unit: str):
    """`what`'s mean = fixed + fixed_key + x (per + per_key) over x units: over several sizes a line gives both
    constants; at one size, fixed_key at the commonest."""
    ab = _line(pts)
    if ab and ab[1] > per:
        f.set(per_key, ab[1] - per, f"{what}, slope per {unit} less its write")
        f.set(fixed_key, ab[0] - fixed, f"{what}, intercept less the locks and writes the model charges around it")
    elif pts:
        x, y, c = max(pts, key=lambda p: p[2])
        f.set(fixed_key, y - fixed - x * (per + f.get(per_key)),
              f"{what} at {x:.0f} {unit}(s) ({c:.0f} calls), less the locks and writes the model charges, and "
              f"{per_key} each")


def fitted_profile(base_name: str, f: Fit) -> str:
    """The base profile `f` was fitted on with the fitted values and, in [sources], where each came from."""
    m = f.m
    # The host's own words go into a comment line and [sources]: one line each, whatever the trace held.
    where = shown(f"measured on {m.get('host', '?')}, {m.get('date', '?')}, Linux {m.get('kernel', '?')}")
    text = f"# Fitted by iommulab profile fit from {base_name}: {where}.\n" + f.text
    for key in sorted(f.values):
        v = f.values[key]
        integer = isinstance(profile_value(f.base, key), int)
        v = int(round(v)) if integer else round(v, 4)
        text = set_profile_value(text, base_name, key, v, f"{where} ({f.how[key]})")
        half, fns = measured_spread(f, key, v)
        text = set_profile_range(text, key, max(0.0, v - half), v + half,
                                 f"measured: {fns}'s mean ± 1.96 standard errors over its calls (at least "
                                 f"{TRACE_NS:g} ns, the trace's resolution)")
    return text


# The trace's timestamps are whole nanoseconds: no measured latency is known closer than this.
TRACE_NS = 1.0


def measured_spread(f: "Fit", key: str, value: float) -> tuple[float, str]:
    """Half the width of a fitted constant's range, and the functions it was measured from: 1.96 standard
    errors of their mean (their standard deviation over the square root of their calls), relative to the
    mean, applied to the value; at least TRACE_NS."""
    fns = [w for w in re.split(r"[ ,]+", MEASURED_BY.get(key, "")) if w in f.fns] or sorted(f.fns)[:1]
    rel = max((f.fns[fn].get("stddev_ns", 0.0) / math.sqrt(f.fns[fn]["calls"]) / f.fns[fn]["mean_ns"]
               for fn in fns if f.fns[fn].get("mean_ns")), default=0.0)
    return max(TRACE_NS, 1.96 * rel * abs(value)), " and ".join(fns) or "the measured functions"


def policy_of(m: dict[str, Any]) -> str | None:
    """The DMA domains' policy on the measured host (its IOMMU groups' type), when they agree."""
    kinds = {g["type"] for g in m.get("groups", [])} & {"DMA", "DMA-FQ", "identity"}
    if len(kinds) != 1:
        return "lazy" if "DMA-FQ" in kinds else ("strict" if "DMA" in kinds else None)
    return {"DMA": "strict", "DMA-FQ": "lazy", "identity": "passthrough"}[kinds.pop()]


def modelled(f: Fit, profile: str, kernel: str | None) -> list[dict[str, Any]]:
    """Per measured function: its mean measured latency and what the model gives for it with the fitted
    profile (file `profile`). The DMA API's map and unmap come from the model's dma_map_benchmark (one thread,
    the host's policy, the most common size); the others from the constants that price them."""
    from . import api

    fns = f.fns
    rows = []

    def row(fn: str, field: str, model: float | None, role: str, pts: list[tuple[float, float, float]] | None = None):
        """`fn`'s measured mean beside `model`; over `pts` (size, mean, calls) alone where given."""
        if fn not in fns:
            return
        calls, meas = fns[fn]["calls"], float(fns[fn][field])
        if pts:
            calls = int(sum(c for *_, c in pts))
            meas = sum(y * c for _, y, c in pts) / calls
        rows.append({"function": fn, "calls": calls, "measured_ns": round(meas, 1),
                     "time": "self" if field == "self_mean_ns" else "whole",
                     "modelled_ns": None if model is None else round(model, 1),
                     "error": None if model is None or meas == 0 else round((model - meas) / meas, 4), "role": role})

    def per_size(pts: list[tuple[float, float, float]], fixed: float) -> float:
        return sum((fixed + x * g("cpu.pte_ns")) * c for x, _, c in pts) / sum(c for *_, c in pts)

    g = f.get
    for fn in ("alloc_iova_fast", "free_iova_fast"):
        row(fn, "self_mean_ns", g("cpu.iova_rcache_ns"),
            "shares cpu.iova_rcache_ns with the other" if "cpu.iova_rcache_ns" in f.values
            else "predicted: cpu.iova_rcache_ns")
    walk_map = g("cpu.pgtable_walk_ns") + g("cpu.pgtable_map_ns")
    for fn in ("iommu_map", "iommu_map_atomic"):
        if fn in f.exact:
            row(fn, "self_mean_ns", per_size(f.exact[fn], walk_map),
                "sets cpu.pte_ns, cpu.pgtable_map_ns: its own cost + a walk + a PTE per page", f.exact[fn])
        elif pts := _by(fns.get(fn, {}), "pages"):
            row(fn, "self_mean_ns", per_size(pts, walk_map),
                "predicted: its own cost + a walk + a PTE per page (not fitted: see below)", pts)
    pts = _by(fns.get("iommu_unmap_fast", {}), "pages")
    if pts:
        row("iommu_unmap_fast", "self_mean_ns", per_size(pts, g("cpu.pgtable_walk_ns")),
            "predicted: a walk + a PTE per page", pts)
    row("iommu_iova_to_phys", "self_mean_ns", g("cpu.pgtable_walk_ns"), "sets cpu.pgtable_walk_ns: one walk")
    row("queue_iova", "self_mean_ns", g("cpu.fq_entry_ns"), "sets cpu.fq_entry_ns")
    # The whole map and unmap, as the model's map benchmark times them on this profile.
    sizes = _by(fns.get("iommu_dma_map_page", {}), "pages")
    if sizes:
        pages = int(max(sizes, key=lambda p: p[2])[0])
        keys = {"platform.profile": profile, "workload.dma_map_benchmark.threads": 1,
                "workload.dma_map_benchmark.granule": pages, "workload.dma_map_benchmark.dma_dir": "from_device",
                "run.duration_ms": 2, "run.warmup_ms": 1}
        arch = {"x86_64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(f.m.get("machine", ""))
        arch = arch or vendors.DRIVERS[f.base["vendor"]]["archs"][0]
        keys["os.arch"] = arch
        pol = policy_of(f.m)
        if pol in ("strict", "lazy"):
            keys["os.policy"] = pol
        ver = _kernel_version(kernel or "")
        if ver != (0, 0):
            keys["os.kernel"] = _nearest_kernel(ver)
        try:
            mb = api.run("map-benchmark", **keys).map_benchmark
            mp, um = mb["map_ns_mean"], mb["unmap_ns_mean"]
        except ScenarioError as e:
            f.skipped.append(f"the model's map benchmark did not run on this profile: {e}")
            mp = um = None
        row("iommu_dma_map_page", "mean_ns", mp, f"predicted: the model's dma_map_benchmark, {pages} page(s), "
            f"{keys.get('os.policy', 'the scenario policy')}")
        row("iommu_dma_unmap_page", "mean_ns", um, "predicted: the same benchmark's unmap")
    return rows


def _nearest_kernel(ver: tuple[int, int]) -> str:
    """`ver` within the kernels the model follows (os.kernel: 5.15 to the newest)."""
    from ._core import KERNEL_NEWEST

    newest = _kernel_version(KERNEL_NEWEST)
    return "%d.%d" % min(max(ver, (5, 15)), newest)


# --- output ----------------------------------------------------------------------------------------------------


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1000:.3f}"


def format_measure(m: dict[str, Any], out: str) -> str:
    """The measurement as a table: per function its calls, mean, self time, p50 and p99 in µs."""
    from .report import fit, legend, right, wrap

    lines = wrap(f"measured on {m.get('host', '?')}, Linux {m.get('kernel', '?')}, {m.get('date', '?')}"
                 + (f" · IOMMU {', '.join(m['iommus'])}" if m.get("iommus") else " · no IOMMU in sysfs")
                 + (f" · {policy_of(m)}" if policy_of(m) else "")) + [""]
    fns = list(m["functions"].items())
    cols = [right("calls", [str(s["calls"]) for _, s in fns], 2)]
    cols += [right(h, [_us(s[k]) for _, s in fns], 2) for h, k in
             (("mean µs", "mean_ns"), ("self µs", "self_mean_ns"), ("p50 µs", "p50_ns"), ("p99 µs", "p99_ns"))]
    lines += fit(["function"] + [fn for fn, _ in fns], cols)
    lines += [""] + legend([
        ("mean", "entry to return, as the trace's clock gives it (µs resolution: a mean over many calls is finer)"),
        ("self", "less the measured functions it called; each probe adds its own time to its caller's")])
    if m.get("unpaired"):
        lines += wrap(f"{m['unpaired']} calls left out: an entry or return without the other (a missed kretprobe, "
                      "or the recording's edges)")
    for fn, n in m.get("missed", {}).items():
        lines += wrap(f"{fn}: the kernel missed {n} probe hits")
    lines.append(f"wrote {shown(out)}")
    return "\n".join(lines) + "\n"


def format_fit(f: Fit, rows: list[dict[str, Any]], out: str) -> str:
    """The constants written, then measured against modelled latency per function."""
    from .report import fit, left, legend, right, wrap

    lines = wrap(f"wrote {shown(out)}: {len(f.values)} constants from the measurement") + [""]
    for k in sorted(f.values):
        lines += wrap(f"{k} = {f.values[k]:.1f}  ({f.how[k]})", "    ", "  ")
    cols = [right("calls", [str(r["calls"]) for r in rows], 2), left("time", [r["time"] for r in rows], 1),
            right("measured µs", [_us(r["measured_ns"]) for r in rows], 2),
            right("model µs", [_us(r["modelled_ns"]) for r in rows], 2),
            right("error", ["-" if r["error"] is None else f"{r['error']:+.1%}" for r in rows], 2)]
    lines += [""] + fit(["function"] + [r["function"] for r in rows], cols, text=("role", [r["role"] for r in rows]))
    lines += [""] + legend([
        ("sets", "the measurement fixed a constant from this function (its error shows only rounding)"),
        ("shares", "one constant from several functions' mean (its error: how far they differ)"),
        ("predicted", "composed by the model from constants set elsewhere (a check)")])
    lines += [x for s in f.skipped for x in wrap(f"not fitted: {s}")]
    return "\n".join(lines) + "\n"
