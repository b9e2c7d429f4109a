"""Human-readable output: the comparison table ``iommulab run`` prints, and what every command's text shares: the
width it is set to (`width`), tables in blocks of columns that fit it (`fit`), prose wrapped to it (`wrap`,
`legend`), and one way of writing a time (`duration`) and an exposure (`exposure`)."""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

from . import __version__

# The width text is set to when neither COLUMNS nor a terminal gives one (output to a pipe or a file).
DEFAULT_WIDTH = 100
# The narrowest width honoured: below it a run's label and one figure no longer share a line. A bound of the
# front end, not of any terminal.
MIN_WIDTH = 40


def width() -> int:
    """The width every command's text fits: COLUMNS, else the terminal's, else DEFAULT_WIDTH (at least
    MIN_WIDTH)."""
    return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def wrap(text: str, indent: str = "  ", first: str = "") -> list[str]:
    """`text` as lines no wider than `width()`: the first led by `first`, the later ones by `indent` (a hanging
    indent). Words are not split at hyphens (flags, names), only when one alone is wider than a line."""
    return textwrap.wrap(text, width(), initial_indent=first, subsequent_indent=indent,
                         break_on_hyphens=False) or [first.rstrip()]


def command_lines(command: str, indent: str = "  ") -> list[str]:
    """A shell command on lines no wider than `width()` where its words allow, each but the last ending in a
    backslash (the shell joins them), so that it runs as printed."""
    import shlex

    words = [shlex.quote(w) for w in shlex.split(command)]
    out = [indent + words[0]]
    for w in words[1:]:
        if len(out[-1]) + 1 + len(w) + 2 > width():
            out[-1] += " \\"
            out.append(indent + "  " + w)
        else:
            out[-1] += " " + w
    return out


def legend(items: list[tuple[str, str]]) -> list[str]:
    """A legend: one term a line, `term: meaning`, wrapped with a hanging indent."""
    return [line for term, meaning in items for line in wrap(f"{term}: {meaning}")]


# The narrowest a wrapped text column is set beside figures: narrower, it reads a word a line, and it gets a
# block of its own instead.
TEXT_MIN = 30


def fit(label: list[str], columns: list[list[str]], indent: str = "", head: int = 1,
        text: tuple[str, list[str]] | None = None) -> list[str]:
    """A table set in blocks of columns no wider than `width()`, each block repeating the label column (as ps
    and fio do) under its own header and rule, a blank line between blocks. `label` and each of `columns` are
    `head` header lines and then one cell per row; a column's cells are padded to one width and carry the gap
    before them. A column wider than a line on its own gets a block of its own (and is as wide as it is).
    `text` (header, a cell per row): a last column of sentences, wrapped to the room the last block leaves."""
    lw = max(len(x) for x in label)
    room = width() - len(indent) - lw
    blocks: list[list[list[str]]] = [[]]
    used = 0
    for col in columns:
        cw = max(len(x) for x in col)
        if blocks[-1] and used + cw > room:
            blocks.append([])
            used = 0
        blocks[-1].append(col)
        used += cw
    if text is not None and blocks[-1] and room - used - 2 < TEXT_MIN:
        blocks.append([])
        used = 0
    out: list[str] = []
    for b, block in enumerate(blocks):
        lines = [indent + label[i].ljust(lw) + "".join(c[i] for c in block) for i in range(len(label))]
        if text is not None and b == len(blocks) - 1:
            lines = _with_text(lines, text, head, max(room - used - 2, 1))
        lines = [x.rstrip() for x in lines]
        rule = indent + "-" * (max(map(len, lines)) - len(indent))
        out += ([""] if out else []) + lines[:head] + [rule] + lines[head:]
    return out


def _with_text(lines: list[str], text: tuple[str, list[str]], head: int, tw: int) -> list[str]:
    """`lines` (`head` header lines, then a row each) with the column of sentences `text` beside them, each
    wrapped to `tw` columns under itself."""
    p = max(map(len, lines)) + 2
    out = [lines[0].ljust(p) + text[0]] + lines[1:head]
    for line, cell in zip(lines[head:], text[1]):
        parts = textwrap.wrap(cell, tw, break_on_hyphens=False) or [""]
        out += [line.ljust(p) + parts[0]] + [" " * p + x for x in parts[1:]]
    return out


def right(head: str, cells: list[str], gap: int = 1) -> list[str]:
    """A column of figures for `fit`: header and cells right-aligned, `gap` spaces before the widest."""
    n = max(len(x) for x in [head, *cells]) + gap
    return [x.rjust(n) for x in [head, *cells]]


def left(head: str, cells: list[str], gap: int = 2) -> list[str]:
    """A column of text for `fit`: header and cells left-aligned after `gap` spaces."""
    n = max(len(x) for x in [head, *cells])
    return [" " * gap + x.ljust(n) for x in [head, *cells]]


def _figure(x: float) -> str:
    """A time's figure: whole from 100, else one decimal, a trailing .0 dropped (16 ms, 15.9 ms, 877 µs)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}".removesuffix(".0")


def duration(us: float) -> str:
    """A time as every command writes one, the unit with it: ns under 1 µs, µs under 10 ms, ms from 10 ms
    (420 ns, 2.6 µs, 9568 µs, 15.9 ms)."""
    if us >= 10_000:
        return f"{_figure(us / 1000)} ms"
    if us >= 1:
        return f"{_figure(us)} µs"
    return f"{us * 1000:.0f} ns"


def rate(x: float) -> str:
    """A per-second rate as fio prints one, never in scientific notation: 1.69M, 38.4k, 512."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def per_sec(r, n: float) -> str:
    """A count over the run's window, per second."""
    return rate(n / r.sim_seconds) if r.sim_seconds else "0"


def _by_type(r) -> str:
    """Non-zero invalidation types per second, e.g. ``psi 1.05M`` or ``tlbi_nh_va 30 tlbi_nh_asid 20``."""
    parts = [f"{k} {per_sec(r, n)}" for k, n in r.invalidations.items() if k != "total" and n]
    return " ".join(parts) or "-"


def exposure(protected: bool | None, window_us: float | None) -> str:
    """An exposure time, written the same way in every table and sentence: ``all`` for passthrough (the device
    reaches every page), ``none`` when no page was exposed, else a `duration`."""
    if protected is False:
        return "all"
    if window_us is None:
        return "none"
    return duration(window_us)


# What `all` means wherever an exposure is shown. The model runs an identity domain and a machine without an
# IOMMU alike (nothing is translated, nothing invalidated): a scenario's run labelled noiommu is passthrough.
ALL = "all: passthrough, an identity domain or no IOMMU at all, where the device reaches every page"


def exposure_legend(which: str = "p99", what: str = "99th percentile") -> tuple[str, str]:
    """The legend of the exposure columns `which` (p99; p50, p99, max), `what` they are over the run's pages."""
    return (f"exposure {which}", "how long an unmapped page stayed reachable by the device after its owner got it "
            f"back, {what} over the run's pages (none: no page was; {ALL})")


BOUNCE_LEGEND = ("exposure where DMA bounces", "how long the stale copy of an unmapped buffer stayed readable in "
                 "swiotlb's shared slots until a later mapping reused them, per 2 KiB slot (copies still there "
                 "when the run ended count until then); the buffers themselves are never reachable "
                 "(docs/swiotlb.md)")
EXPOSED_LEGEND = ("exposed", "share of unmapped pages given back to their owner before an invalidation covering "
                  f"them completed ({ALL})")
LIMITED_BY_LEGEND = ("limited by", "the resource that bound the run (line, link, emulator, device_thread, bql, "
                     "iommu.queue, lock:NAME, iommu.translation, cpu.WHERE with WHERE the CPU block's largest share: dma_api, "
                     "cmdq_insert, inv_wait, lock_spin or stack; swiotlb.full; else the workload's own: senders, "
                     "offered_load, queue_depth; docs/model.md \"What binds a run\")")
BY_TYPE_LEGEND = ("inv/s by type", "the IOMMU's own invalidation commands per second")


def flat_cell(row: dict, col: str, fmt: str | None, missing: str) -> str:
    """A figure of a flattened result row (`safety.window.p99_us`) as tables print it: `fmt` None for an
    exposure window; `all` for any safety figure of an identity domain; `missing` where the row has none."""
    if fmt is None:
        return exposure(row.get("safety.protected"), row.get(col))
    if col.startswith("safety.") and row.get("safety.protected") is False:
        return "all"  # an identity domain: the device reaches every page
    v = row.get(col)
    return missing if v is None else fmt.format(v)


def run_exposure(r, key: str = "p99_us") -> str:
    s = r.safety
    return exposure(s["protected"], (s.get("window") or {}).get(key))


def exposed(r) -> str:
    """The share of a run's unmapped pages it exposed (`all` under passthrough)."""
    s = r.safety
    return f"{s['exposed_share'] * 100:.1f}%" if s["protected"] else "all"


# What bound each run, left-aligned text (see `render`).
LIMITED_BY_COLUMN = ("limited by", 0, lambda r: r.limited_by)

# The headline first (goodput, CPU, exposure, what bound the run), so that the first block `fit` sets holds it;
# then how the invalidations went.
HEADLINE = [
    # header, width (0: text, left-aligned), formatter
    ("Gbps", 8, lambda r: f"{r.throughput_gbps:.2f}"),
    ("CPU busy", 9, lambda r: f"{r.cpu_busy * 100:.1f}%"),
    ("exposure p99", 14, run_exposure),
    LIMITED_BY_COLUMN,
]
INVALIDATION = [
    ("inv wait", 9, lambda r: f"{r.cpu_inv_wait_share * 100:.1f}%"),
    ("unmapped pg/s", 14, lambda r: per_sec(r, r.iova_pages_unmapped)),
    ("inv/page", 9, lambda r: f"{r.inv_per_page:.4f}"),
    ("IOTLB miss/pg", 14, lambda r: f"{r.iotlb_misses_per_page:.3f}"),
    ("inv/s by type", 0, _by_type),
]
COLUMNS = HEADLINE + INVALIDATION


def _lat(r, key: str) -> str:
    lat = getattr(r, "latency", None)
    return duration(lat[key]) if lat else "-"


LATENCY_COLUMNS = [
    ("kreq/s", 9, lambda r: f"{r.packets_per_sec / 1e3:.0f}"),
    ("latency p50", 12, lambda r: _lat(r, "p50_us")),
    ("latency p99", 12, lambda r: _lat(r, "p99_us")),
]
IOPS_COLUMNS = [
    ("kIOPS", 9, lambda r: f"{r.packets_per_sec / 1e3:.0f}"),
]
# Frames forwarded per second (a packet-rate workload).
MPPS_COLUMNS = [
    ("Mpps", 7, lambda r: f"{r.packets_per_sec / 1e6:.2f}"),
]


def workload_kind(scenario: dict[str, Any], results: list) -> str:
    """What a scenario's runs are read by besides goodput: latency (a fixed request rate), iops (NVMe), mpps
    (frames forwarded), bench (the DMA map benchmark) or gbps alone."""
    w = scenario.get("workload", {})
    if w.get("dma_map_benchmark"):
        return "bench"
    if any(getattr(r, "latency", None) for r in results):
        return "latency"
    return "iops" if w.get("nvme") else "mpps" if w.get("l2fwd") else "gbps"


def with_workload(columns: list, kind: str) -> list:
    """`columns` (goodput first) with the workload's own figures: kIOPS, kreq/s and latency after goodput, Mpps
    before it."""
    if kind == "latency":
        return columns[:1] + LATENCY_COLUMNS + columns[1:]
    if kind == "iops":
        return columns[:1] + IOPS_COLUMNS + columns[1:]
    if kind == "mpps":
        return MPPS_COLUMNS + columns
    return columns


WORKLOAD_LEGEND = {
    "latency": [("kreq/s", "responses per second"),
                ("latency p50, p99", "request latency as the client sees it (at a fixed rate, from when each "
                 "request was due)")],
    "iops": [("kIOPS", "I/Os completed per second, in thousands (fio's IOPS; Gbps: their bytes)")],
    "mpps": [("Mpps", "frames forwarded per second, in millions (Gbps: their bytes)")],
}


def _mb(r, which: str, key: str) -> str:
    v = getattr(r, which, None)
    return f"{v[key]:.1f}" if v else "-"


MAP_BENCHMARK_COLUMNS = [
    ("map µs", 8, lambda r: _mb(r, "map_latency_us", "avg")),
    ("±", 6, lambda r: _mb(r, "map_latency_us", "stddev")),
    ("unmap µs", 10, lambda r: _mb(r, "unmap_latency_us", "avg")),
    ("±", 6, lambda r: _mb(r, "unmap_latency_us", "stddev")),
    ("k/s/thread", 11, lambda r: f"{r.map_benchmark['loops_per_sec_per_thread'] / 1e3:.1f}"),
    ("CPU busy", 9, lambda r: f"{r.cpu_busy * 100:.1f}%"),
    ("inv wait", 9, lambda r: f"{r.cpu_inv_wait_share * 100:.1f}%"),
    ("syncs/s", 10, lambda r: per_sec(r, r.syncs)),
    ("cas/ok", 7, lambda r: f"{r.cmdq_cas_attempts_per_success:.2f}" if r.cmdq_cas_attempts_per_success else "-"),
    LIMITED_BY_COLUMN,
    ("inv/s by type", 0, _by_type),
]


def map_benchmark_lines(r) -> list[str]:
    """What tools/testing/selftests/dma/dma_map_benchmark prints for one run (seconds: the measured window)."""
    o = r.map_benchmark
    if o["map_failures"]:
        # A failed dma_map_single() ends its thread with -ENOMEM and the ioctl fails (perror("ioctl")).
        return [f"ioctl: Cannot allocate memory ({o['map_failures']} maps failed: no IOVA space left below the "
                "DMA mask)"]
    return [
        f"dma mapping benchmark: threads:{o['threads']} seconds:{o['seconds']:g} node:{o['node']} "
        f"dir:{o['dma_dir']} granule: {o['granule']}",
        f"average map latency(us):{r.map_latency_us['avg']:.1f} standard deviation:{r.map_latency_us['stddev']:.1f}",
        f"average unmap latency(us):{r.unmap_latency_us['avg']:.1f} "
        f"standard deviation:{r.unmap_latency_us['stddev']:.1f}",
    ]


def set_lines(sets: list[tuple[str, str]] | None) -> list[str]:
    """What the command line changed in the scenario (its description is the scenario's own)."""
    return wrap("set: " + " ".join(f"{k}={v}" for k, v in sets)) if sets else []


def note_lines(results: list) -> list[str]:
    """What to know about a policy on this workload, once per distinct note."""
    notes = sorted({r.policy_note for r in results if getattr(r, "policy_note", "")})
    return [line for n in notes for line in wrap(f"note: {n}")]


def labelled(label: str, lw: int, text: str) -> list[str]:
    """A line about one run: its label in a column `lw` wide, then `text` wrapped under itself (or, when the
    label takes half the line, under a small indent)."""
    indent = " " * (lw + 2) if lw + 2 <= width() // 2 else "    "
    return wrap(text, indent, f"{label:<{lw}}  ")


def _contention(results: list, lw: int) -> list[str]:
    """The most contended shared lock or cache line of each run (by the CPU time its takers lost)."""
    out = []
    for r in results:
        locks = [c for c in getattr(r, "contention", None) or [] if c["cpu_share"] > 0]
        if not locks:
            continue
        c = max(locks, key=lambda c: c["cpu_share"])
        out += labelled(r.label, lw, (
            f"{c['name']}: {c['acquisitions']} taken, {c['contended_share'] * 100:.1f}% found held, "
            f"wait mean {duration(c['wait_mean_ns'] / 1e3)} p99 {duration(c['wait_p99_ns'] / 1e3)}, "
            f"{c['transfers']} line transfers, "
            f"{c['cpu_share'] / max(1, len(r.cpu_spin_share)) * 100:.1f}% of the workload CPUs' time"))
    return ["", "most contended shared state (spin and cache-line transfers):"] + out if out else []


def _vm_exits(results: list, lw: int) -> list[str]:
    """A guest's exits to the hypervisor per run: by cause with their mean vCPU cost, the share of vCPU time
    they took, the emulator's and the device thread's busy shares (and the device's wait for QEMU's BQL), and
    the device's own IOTLB (vhost's) misses."""
    out = []
    for r in results:
        vm = getattr(r, "vm_exits", None)
        if not vm:
            continue
        causes = ", ".join(f"{c['cause']} {c['per_sec'] / 1e3:.1f}k at {duration(c['mean_us'])}"
                           for c in vm["by_cause"] if c["count"])
        atc = (getattr(r, "caches", None) or {}).get("atc")
        dev = f" · device IOTLB misses {atc['misses']}" if atc and atc["hits"] + atc["misses"] else ""
        if vm.get("vfio_maps") or vm.get("vfio_unmaps"):
            dev += (f" · VFIO maps {vm['vfio_maps']} unmaps {vm['vfio_unmaps']}, pages pinned "
                    f"{vm['pages_pinned']} unpinned {vm['pages_unpinned']}")
        if getattr(r, "syncs", 0):
            dev += f" · invalidation wait {duration(r.sync_wait_mean_us)} per sync"
        # A software device's thread (virtio-net's), when there is one.
        thread = f" · device thread busy {vm['device_busy'] * 100:.1f}%" if vm["device_busy"] else ""
        # QEMU's device waiting for the BQL its vCPUs' IOMMU handlers hold.
        if vm.get("device_bql_wait"):
            thread += f" (waited {vm['device_bql_wait'] * 100:.1f}% for the BQL, held {vm['bql_busy'] * 100:.1f}%)"
        out += labelled(r.label, lw, f"{vm['per_sec'] / 1e3:.1f}k exits/s ({causes or 'none'}) · vCPU time in "
                        f"exits {vm['vcpu_share'] * 100:.1f}% · emulator busy {vm['emulator_busy'] * 100:.1f}%"
                        f"{thread}{dev}")
    return ["", "guest exits to the hypervisor:"] + out if out else []


def _swiotlb(results: list, lw: int) -> list[str]:
    """Each bouncing run's swiotlb: bounces and bytes copied, the pool and its high-water mark, the maps that
    found it full and what the driver did with them."""
    out = []
    for r in results:
        sw = getattr(r, "swiotlb", None)
        if not sw:
            continue
        secs = max(r.sim_seconds, 1e-12)
        pool_mib = sw["pool_slots"] * 2 / 1024
        hw = sw["high_water_slots"]
        drops = getattr(r, "drops", None) or {}
        failed = (f"buffer full {sw['full_events']} times"
                  + (f" ({sw['too_large']} larger than a segment)" if sw["too_large"] else "")
                  + (f", {drops.get('dma_map', 0)} packets dropped" if drops.get("dma_map") else "")
                  + (f", {drops.get('requeued', 0)} I/Os requeued" if drops.get("requeued") else ""))
        grown = (f" · grew: {sw['transient_pools']} transient pools, {sw['pools_added']} pools added"
                 if sw["transient_pools"] or sw["pools_added"] else "")
        out += labelled(r.label, lw, (
            f"{sw['bounces'] / secs / 1e3:.1f}k bounces/s, {sw['bounced_gbps']:.1f} Gbit/s copied · pool "
            f"{pool_mib:g} MiB, high water {hw} slots ({hw / max(1, sw['pool_slots']) * 100:.1f}%) · "
            f"{failed}{grown}"))
    return ["", "bounce buffers (swiotlb; a slot is 2 KiB, the high water since the start):"] + out if out else []


def render(columns: list, results: list, lw: int) -> list[str]:
    """The table of `columns` (header, width, formatter), one row per run, in blocks that fit the width (`fit`):
    columns of width w right-aligned in at least w; those of width 0 (text such as ``limited by``) left-aligned
    after two spaces, as wide as their longest cell."""
    cols = []
    for h, w, fmt in columns:
        cells = [fmt(r) for r in results]
        if w:
            n = max(w, len(h) + 1, *(len(c) + 1 for c in cells))
            cols.append([x.rjust(n) for x in [h, *cells]])
        else:
            cols.append(left(h, cells))
    return fit(["run".ljust(lw)] + [r.label for r in results], cols)


def cpu_time_lines(results: list, lw: int) -> list[str]:
    """Where each run's CPU time went (shares of the workload CPUs' time), and what bound it."""
    cols = [("DMA API", "dma_api"), ("cmdq insert", "cmdq_insert"), ("inv wait", "inv_wait"),
            ("lock spin", "lock_spin"), ("stack", "stack"), ("idle", "idle")]
    columns = [(h, max(len(h) + 2, 9), (lambda k: lambda r: f"{r.cpu_breakdown[k] * 100:.1f}%")(k))
               for h, k in cols]
    title = ("where the CPU time went (share of the workload CPUs' time; cmdq insert: putting invalidation "
             "commands into a shared command queue until the IOMMU can see them, inv wait: the wait for their "
             "completion after that):")
    return [""] + wrap(title) + render(columns, results, lw)


def warning_lines(results: list) -> list[str]:
    """Each run's warnings, each wrapped."""
    return [line for r in results for w in (getattr(r, "warnings", None) or [])
            for line in wrap(f"warning: {r.label}: {w}")]


def header_lines(scenario: dict[str, Any], what: str = "") -> list[str]:
    """The scenario a table is of: its name and description, then platform, kernel and window."""
    run, plat, os_ = scenario["run"], scenario["platform"], scenario["os"]
    name = f"iommulab {__version__} · {what + ' · ' if what else ''}{scenario.get('name') or 'scenario'}"
    return wrap(f"{name}: {scenario.get('description', '')}".rstrip(": ")) + wrap(
        f"platform {plat['profile']} ({plat['vendor']}) · kernel {os_['kernel']} {os_['arch']} · "
        f"{run['duration_ms']:g} ms simulated after {run['warmup_ms']:g} ms warm-up · seed {run['seed']}")


RUN_LEGEND = [
    ("Gbps", "application goodput"),
    ("CPU busy", "mean over the workload's CPUs"),
    exposure_legend(),
    LIMITED_BY_LEGEND,
    ("inv wait", "share of CPU busy time spent invalidating, from the request to its completion (on SMMUv3 the "
                 "shared queue's insertion included; the CPU block below splits it out as cmdq insert)"),
    ("unmapped pg/s", "IOVA pages unmapped per second"),
    ("inv/page", "IOMMU TLB invalidation descriptors/commands per page unmapped"),
    ("IOTLB miss/pg", "IOTLB misses per 4 KiB of data delivered"),
    BY_TYPE_LEGEND,
]
MAP_BENCHMARK_LEGEND = [
    ("map µs, unmap µs", "average latency ± standard deviation, in whole 0.1 µs as the kernel sums them"),
    ("k/s/thread", "map+unmap loops per second per thread"),
    ("syncs/s", "CMD_SYNCs or wait descriptors per second"),
    ("cas/ok", "cmpxchg attempts on the SMMUv3 queue per slot reserved"),
    LIMITED_BY_LEGEND,
    BY_TYPE_LEGEND,
]


def format_table(scenario: dict[str, Any], results: list, sets: list[tuple[str, str]] | None = None) -> str:
    kind = workload_kind(scenario, results)
    bench = kind == "bench"
    columns = MAP_BENCHMARK_COLUMNS if bench else with_workload(COLUMNS, kind)
    lines = header_lines(scenario) + set_lines(sets) + [""]
    lw = max([len("run")] + [len(r.label) for r in results])
    lines += render(columns, results, lw)
    if bench:
        for r in results:
            lines += ["", f"{r.label}:"] + [x for m in map_benchmark_lines(r) for x in wrap(m, "    ", "  ")]
    notes = note_lines(results)
    if notes:
        lines += [""] + notes
    lines += cpu_time_lines(results, lw)
    lines += _contention(results, lw)
    lines += _vm_exits(results, lw)
    lines += _swiotlb(results, lw)
    warnings = warning_lines(results)
    if warnings:
        lines += [""] + warnings
    if bench:
        return "\n".join(lines + [""] + legend(MAP_BENCHMARK_LEGEND)) + "\n"
    terms = RUN_LEGEND[:1] + WORKLOAD_LEGEND.get(kind, []) + RUN_LEGEND[1:]
    if kind == "mpps":
        terms = WORKLOAD_LEGEND["mpps"] + RUN_LEGEND[:1] + [
            ("CPU busy", "the forwarding lcore's work, its polling aside")] + RUN_LEGEND[2:]
    if any(getattr(r, "swiotlb", None) for r in results):
        terms.append(BOUNCE_LEGEND)
    return "\n".join(lines + [""] + legend(terms)) + "\n"
