"""Human-readable output: the comparison table ``iommulab run`` prints."""

from __future__ import annotations

from typing import Any

from . import __version__

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
    """An exposure window in µs, written the same way in every table: ``all`` for an identity domain (the device
    reaches every page), ``none`` when no page was exposed."""
    if protected is False:
        return "all"
    if window_us is None:
        return "none"
    return f"{window_us:.0f}" if window_us >= 100 else f"{window_us:.1f}"


EXPOSURE_LEGEND = ("exposure µs: how long an unmapped page stayed reachable by the device after its owner got it "
                   "back (none: no page was; all: an identity domain, the device reaches all memory)")
LIMITED_BY_LEGEND = ("limited by: the resource that bound the run (line, link, emulator, device_thread, bql, iommu.queue, "
                     "lock:NAME, iommu.translation, cpu.WHERE; else the workload's own: senders, offered_load, "
                     "queue_depth; docs/model.md \"What binds a run\") · inv/s by type: the IOMMU's own commands")


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


# What bound each run, left-aligned text (see `render`).
LIMITED_BY_COLUMN = ("  limited by", 0, lambda r: r.limited_by)

COLUMNS = [
    # header, width, formatter
    ("Gbps", 8, lambda r: f"{r.throughput_gbps:.2f}"),
    ("CPU busy", 9, lambda r: f"{r.cpu_busy * 100:.1f}%"),
    ("inv wait", 9, lambda r: f"{r.cpu_inv_wait_share * 100:.1f}%"),
    ("unmapped pg/s", 14, lambda r: per_sec(r, r.iova_pages_unmapped)),
    ("inv/page", 9, lambda r: f"{r.inv_per_page:.4f}"),
    ("IOTLB miss/pg", 14, lambda r: f"{r.iotlb_misses_per_page:.3f}"),
    ("exposure p99 µs", 16, run_exposure),
    LIMITED_BY_COLUMN,
    ("  inv/s by type", 0, _by_type),
]


def _lat(r, key: str) -> str:
    lat = getattr(r, "latency", None)
    return f"{lat[key]:.1f}" if lat else "-"


LATENCY_COLUMNS = [
    ("kreq/s", 9, lambda r: f"{r.packets_per_sec / 1e3:.0f}"),
    ("p50 µs", 8, lambda r: _lat(r, "p50_us")),
    ("p99 µs", 8, lambda r: _lat(r, "p99_us")),
]


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
    ("  inv/s by type", 0, _by_type),
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
    return ["set: " + " ".join(f"{k}={v}" for k, v in sets)] if sets else []


def note_lines(results: list) -> list[str]:
    """What to know about a policy on this workload, once per distinct note."""
    return [f"note: {n}" for n in sorted({r.policy_note for r in results if getattr(r, "policy_note", "")})]


def _contention(results: list, lw: int) -> list[str]:
    """The most contended shared lock or cache line of each run (by the CPU time its takers lost)."""
    out = []
    for r in results:
        locks = [c for c in getattr(r, "contention", None) or [] if c["cpu_share"] > 0]
        if not locks:
            continue
        c = max(locks, key=lambda c: c["cpu_share"])
        out.append(
            f"{r.label:<{lw}}  {c['name']}: {c['acquisitions']} taken, {c['contended_share'] * 100:.1f}% found held, "
            f"wait mean {c['wait_mean_ns']:.0f} ns p99 {c['wait_p99_ns']} ns, {c['transfers']} line transfers, "
            f"{c['cpu_share'] / max(1, len(r.cpu_spin_share)) * 100:.1f}% of the workload CPUs' time"
        )
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
        causes = ", ".join(f"{c['cause']} {c['per_sec'] / 1e3:.1f}k at {c['mean_us']:.1f} µs"
                           for c in vm["by_cause"] if c["count"])
        atc = (getattr(r, "caches", None) or {}).get("atc")
        dev = f" · device IOTLB misses {atc['misses']}" if atc and atc["hits"] + atc["misses"] else ""
        if vm.get("vfio_maps") or vm.get("vfio_unmaps"):
            dev += (f" · VFIO maps {vm['vfio_maps']} unmaps {vm['vfio_unmaps']}, pages pinned "
                    f"{vm['pages_pinned']} unpinned {vm['pages_unpinned']}")
        if getattr(r, "syncs", 0):
            dev += f" · invalidation wait {r.sync_wait_mean_us:.1f} µs per sync"
        # A software device's thread (virtio-net's), when there is one.
        thread = f" · device thread busy {vm['device_busy'] * 100:.1f}%" if vm["device_busy"] else ""
        # QEMU's device waiting for the BQL its vCPUs' IOMMU handlers hold.
        if vm.get("device_bql_wait"):
            thread += f" (waited {vm['device_bql_wait'] * 100:.1f}% for the BQL, held {vm['bql_busy'] * 100:.1f}%)"
        out.append(f"{r.label:<{lw}}  {vm['per_sec'] / 1e3:.1f}k exits/s ({causes or 'none'}) · vCPU time in exits "
                   f"{vm['vcpu_share'] * 100:.1f}% · emulator busy {vm['emulator_busy'] * 100:.1f}%{thread}{dev}")
    return ["", "guest exits to the hypervisor:"] + out if out else []


def render(columns: list, results: list, lw: int) -> list[str]:
    """The header, a rule and one row per run: columns of width w right-aligned in w; those of width 0 (text
    such as ``limited by``) left-aligned after two spaces, as wide as their longest cell."""
    cells = [[fmt(r) for _, _, fmt in columns] for r in results]
    widths = [w or max([len(h.strip())] + [len(c[i]) for c in cells]) for i, (h, w, _) in enumerate(columns)]

    def line(label: str, row: list[str]) -> str:
        out = f"{label:<{lw}}"
        for (_, w, _), x, n in zip(columns, row, widths):
            out += f"{x:>{n}}" if w else f"  {x:<{n}}"
        return out.rstrip()

    head = line("run", [h.strip() if not w else h for h, w, _ in columns])
    rows = [line(r.label, c) for r, c in zip(results, cells)]
    return [head, "-" * max(len(x) for x in [head] + rows)] + rows


def cpu_time_lines(results: list, lw: int) -> list[str]:
    """Where each run's CPU time went (shares of the workload CPUs' time), and what bound it."""
    cols = [("DMA API", "dma_api"), ("inv wait", "inv_wait"), ("lock spin", "lock_spin"), ("stack", "stack"),
            ("idle", "idle")]
    columns = [(h, max(len(h) + 2, 9), (lambda k: lambda r: f"{r.cpu_breakdown[k] * 100:.1f}%")(k))
               for h, k in cols]
    return ["", "where the CPU time went (share of the workload CPUs' time):"] + render(columns, results, lw)


def warning_lines(results: list) -> list[str]:
    """Each run's warnings, one line each."""
    return [f"warning: {r.label}: {w}" for r in results for w in (getattr(r, "warnings", None) or [])]


IOPS_COLUMNS = [
    ("kIOPS", 9, lambda r: f"{r.packets_per_sec / 1e3:.0f}"),
]

# Frames forwarded per second (a packet-rate workload).
MPPS_COLUMNS = [
    ("Mpps", 7, lambda r: f"{r.packets_per_sec / 1e6:.2f}"),
]


def format_table(scenario: dict[str, Any], results: list, sets: list[tuple[str, str]] | None = None) -> str:
    columns = COLUMNS
    bench = bool(scenario.get("workload", {}).get("dma_map_benchmark"))
    if bench:
        columns = MAP_BENCHMARK_COLUMNS
    elif any(getattr(r, "latency", None) for r in results):
        columns = COLUMNS[:1] + LATENCY_COLUMNS + COLUMNS[1:]
    elif scenario.get("workload", {}).get("nvme"):
        columns = COLUMNS[:1] + IOPS_COLUMNS + COLUMNS[1:]
    elif scenario.get("workload", {}).get("l2fwd"):
        columns = MPPS_COLUMNS + COLUMNS
    run = scenario["run"]
    plat = scenario["platform"]
    os_ = scenario["os"]
    lines = [
        f"iommulab {__version__} · {scenario.get('name') or 'scenario'}: {scenario.get('description', '')}".rstrip(": "),
        f"platform {plat['profile']} ({plat['vendor']}) · kernel {os_['kernel']} {os_['arch']} · "
        f"{run['duration_ms']:g} ms simulated after {run['warmup_ms']:g} ms warm-up · seed {run['seed']}",
    ]
    lines += set_lines(sets) + [""]
    lw = max([len("run")] + [len(r.label) for r in results])
    lines += render(columns, results, lw)
    if bench:
        for r in results:
            lines += ["", f"{r.label}:"] + ["  " + x for x in map_benchmark_lines(r)]
    notes = note_lines(results)
    if notes:
        lines += [""] + notes
    lines += cpu_time_lines(results, lw)
    lines += _contention(results, lw)
    lines += _vm_exits(results, lw)
    warnings = warning_lines(results)
    if warnings:
        lines += [""] + warnings
    if bench:
        lines += [
            "",
            "map µs, unmap µs: average latency ± standard deviation, in whole 0.1 µs as the kernel sums them · "
            "k/s/thread: map+unmap loops per second per thread · syncs/s: CMD_SYNCs or wait descriptors per second · "
            "cas/ok: cmpxchg attempts on the SMMUv3 queue per slot reserved",
            LIMITED_BY_LEGEND,
        ]
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "Gbps: application goodput · CPU busy: mean over the workload's CPUs · inv wait: share of CPU busy time "
        "spent waiting for invalidation completion",
        "unmapped pg/s: IOVA pages unmapped per second · inv/page: IOMMU TLB invalidation descriptors/commands per "
        "page unmapped · IOTLB miss/pg: IOTLB misses per 4 KiB of data delivered",
        EXPOSURE_LEGEND,
        LIMITED_BY_LEGEND,
    ]
    if columns[1] is LATENCY_COLUMNS[0]:
        lines.append("kreq/s: responses per second · p50/p99 µs: request latency as the client sees it (at a fixed "
                     "rate, from when each request was due)")
    elif columns[1] is IOPS_COLUMNS[0]:
        lines.append("kIOPS: I/Os completed per second (fio's IOPS)")
    elif columns[0] is MPPS_COLUMNS[0]:
        lines.append("Mpps: frames forwarded per second, in millions (Gbps: their bytes) · CPU busy: the forwarding "
                     "lcore's work, its polling aside")
    return "\n".join(lines) + "\n"
