"""``iommulab compare``: every DMA policy on one scenario, throughput against exposure.

Each policy runs the scenario with ``os.policy`` pinned (other ``[compare]`` axes still expand, so a scenario that
also compares, say, page_pool gives one row per policy and value). The table and the plot put what a policy costs
(goodput) beside how long it leaves freed pages reachable by the device (the safety accounting of each run)."""

from __future__ import annotations

from typing import Any, Mapping

from . import __version__, _core
from .api import ProgressFn, RunResult, load, run_variants
from .ranges import format_ranges, ranged, with_ranges
from .report import (EXPOSED_LEGEND, LIMITED_BY_COLUMN, LIMITED_BY_LEGEND, WORKLOAD_LEGEND, exposed,
                     exposure_legend, header_lines, legend, note_lines, per_sec, render, run_exposure, set_lines,
                     warning_lines, with_workload, workload_kind, wrap)

# Every policy the simulator has, cheapest protection first (the core's list).
POLICIES: list[str] = _core.policies()


def compare(scenario: Any = None, sets: Mapping[str, Any] | None = None, policies: list[str] | None = None,
            progress: ProgressFn | None = None, raw_strings: bool = False, jobs: int | None = None,
            ranges: int | None = None) -> list[RunResult]:
    """Run the scenario once per policy (per remaining compared value), on up to `jobs` threads; `ranges`: each
    run ranged over that many samples of its profile's ranged constants (docs/ranges.md)."""
    variants, names = [], []
    for p in policies or POLICIES:
        vs = load(scenario, {**(sets or {}), "os.policy": p}, raw_strings=raw_strings)
        variants += vs
        names += [" ".join([p] + [f"{k.rsplit('.', 1)[-1]}={x}" for k, x in v.overrides]) for v in vs]
    if ranges is not None:
        docs = ranged(scenario, sets, ranges, progress, raw_strings, jobs, bases=variants)
        results = [with_ranges(d) for d in docs]
    else:
        results = run_variants(variants, progress, jobs)
    for r, name in zip(results, names):
        r._d["label"] = name
    return results


def _sub_page(r: RunResult) -> str:
    s = r.safety
    if not s["protected"]:
        return "all"
    return f"{s['sub_page']['mean_reachable_bytes'] / 1024:.1f}"


# Goodput and exposure first (the first block of columns that fit the width), then the invalidation work.
COLUMNS = [
    # header, width, formatter
    ("Gbps", 8, lambda r: f"{r.throughput_gbps:.2f}"),
    ("CPU busy", 9, lambda r: f"{r.cpu_busy * 100:.1f}%"),
    ("exposed", 9, exposed),
    ("exposure p50", 14, lambda r: run_exposure(r, "p50_us")),
    ("exposure p99", 14, lambda r: run_exposure(r, "p99_us")),
    ("exposure max", 14, lambda r: run_exposure(r, "max_us")),
    LIMITED_BY_COLUMN,
    ("inv/page", 9, lambda r: f"{r.inv_per_page:.4f}"),
    ("unmapped pg/s", 14, lambda r: per_sec(r, r.iova_pages_unmapped)),
    ("inv/s", 10, lambda r: per_sec(r, r.invalidations['total'])),
    ("stale hits", 11, lambda r: f"{r.stale_translations}"),
    ("sub-page KiB", 13, lambda r: _sub_page(r)),
]
LEGEND = [
    ("Gbps", "application goodput"),
    ("CPU busy", "mean over the workload's CPUs"),
    EXPOSED_LEGEND,
    exposure_legend("p50, p99, max", "median, 99th percentile and longest"),
    LIMITED_BY_LEGEND,
    ("inv/page", "IOMMU TLB invalidation descriptors/commands per page unmapped"),
    ("unmapped pg/s", "IOVA pages unmapped per second"),
    ("inv/s", "the IOMMU's invalidation commands per second"),
    ("stale hits", "device translations served by an entry the page table no longer held"),
    ("sub-page KiB", "other data sharing the pages of mapped small buffers, reachable on average at any instant"),
]


def format_compare(scenario: dict[str, Any], results: list[RunResult], plot: str | None = None,
                   sets: list[tuple[str, str]] | None = None) -> str:
    kind = workload_kind(scenario, results)
    lines = header_lines(scenario, "compare") + set_lines(sets) + [""]
    lw = max([len("run")] + [len(r.label) for r in results])
    lines += render(with_workload(COLUMNS, kind), results, lw)
    terms = LEGEND[:1] + WORKLOAD_LEGEND.get(kind, []) + LEGEND[1:]
    lines += [""] + legend(terms)
    lines += note_lines(results) + warning_lines(results)
    lines += format_ranges(scenario, results)
    if plot:
        lines += wrap(f"plot: {plot}")
    return "\n".join(lines) + "\n"
