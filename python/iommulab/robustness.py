"""How sure `advise` is: its rule applied to every sampled machine of a ranged run (docs/ranges.md), and, where the
verdict does not hold on nearly all of them, the constant that decides it, the value that flips it and how to
measure it on this host."""

from __future__ import annotations

import math
from typing import Any, Callable

from .api import RunResult, run_variants
from .ranges import bounds, lhs_column

# A recommendation is robust when it is the rule's choice on at least this share of the sampled machines.
ROBUST_SHARE = 0.9
# Bisection steps for the value that flips the verdict: the bracket ends within 1/2^4 of the constant's range
# (in its log scale) of where the verdict changes.
BISECTIONS = 4

# What each constant `iommulab profile measure` sets, by the kernel function whose latency it times (measure.fit).
MEASURED_BY = {
    "cpu.iova_rcache_ns": "alloc_iova_fast and free_iova_fast",
    "cpu.pgtable_walk_ns": "iommu_iova_to_phys",
    "cpu.dma_iommu_op_ns": "iommu_dma_map_page",
    "cpu.fq_entry_ns": "queue_iova",
    "cpu.pte_ns": "iommu_map over mapping sizes",
    "cpu.pgtable_map_ns": "iommu_map over mapping sizes",
    "iommu.vtd.inv_desc_ns": "qi_submit_sync over descriptor counts",
    "iommu.vtd.inv_wait_ns": "qi_submit_sync over descriptor counts",
    "iommu.smmuv3.cmd_ns": "arm_smmu_cmdq_issue_cmdlist over command counts",
    "iommu.smmuv3.sync_ns": "arm_smmu_cmdq_issue_cmdlist over command counts",
}


def how_to_measure(key: str) -> str:
    """How a user measures constant `key` on their own host."""
    fn = MEASURED_BY.get(key)
    if fn:
        return (f"iommulab profile measure (as root) times {fn} on this host; iommulab profile fit writes "
                f"{key} into a profile of your own, with the measurement's range")
    if key.startswith("iommu.smmuv3."):
        return ("the kernel's dma_map_benchmark (tools/testing/selftests/dma) with 1 and N threads gives the "
                "SMMU's map/unmap latencies; write the value into a profile of your own")
    return ("no probe of iommulab's times it: a published figure for this hardware, written into a profile of "
            f"your own, narrows its range (iommulab sensitivity shows what {key} moves)")


def sampled_options(options: list[dict[str, Any]], summaries: list[dict[str, Any]], i: int,
                    fill: Callable[[dict[str, Any], RunResult], dict[str, Any]]) -> list[dict[str, Any]]:
    """The options as sample i of their ranged runs gives them (the rule's noise, their seeds' spread, kept)."""
    return [fill(o, RunResult(s["sampled"][i])) for o, s in zip(options, summaries)]


def _auc(xs: list[float], flip: list[bool]) -> float:
    """P(a flipped sample's x > a kept one's), ties counting half: 0.5 where x does not tell them apart."""
    hi = [x for x, f in zip(xs, flip) if f]
    lo = [x for x, f in zip(xs, flip) if not f]
    if not hi or not lo:
        return 0.5
    return sum((a > b) + 0.5 * (a == b) for a in hi for b in lo) / (len(hi) * len(lo))


def deciding(summary: dict[str, Any], n: int, flipped: list[bool]) -> tuple[str, bool] | None:
    """The sampled constant whose values best tell the samples whose verdict flipped from the others (by the
    area under the curve of its draws), and whether high values flip it."""
    best = None
    for k in summary["keys"]:
        u = lhs_column(summary["seed"], k, n)
        a = _auc(u, flipped)
        if best is None or abs(a - 0.5) > abs(best[0] - 0.5):
            best = (a, k)
    return (best[1], best[0] > 0.5) if best and best[0] != 0.5 else None


def point_quantile(value: float, r: dict[str, Any]) -> float:
    """Where a constant's profile value sits in its range, as the sampler's quantile (log scale)."""
    a, b = bounds(value, r)
    return math.log(1 / a) / math.log(b / a) if a > 0 and b > a else 0.5


def flip_value(summaries: list[dict[str, Any]], key: str, high: bool, verdict_of: Callable[[list], str | None],
               point: str | None, consts: dict[str, Any], ranges: dict[str, Any],
               jobs: int | None = None) -> tuple[Any, str | None] | None:
    """The value of `key` alone (the other constants at the profile's) past which the verdict is no longer
    `point`, found by bisection between its profile value and the end of its range it flips towards, and what
    the verdict is there; None when the end alone does not flip it."""
    s0 = summaries[0]
    lo = point_quantile(consts[key], ranges[key])
    hi = 1.0 if high else 0.0

    def verdict(u: float) -> str | None:
        results = run_variants([s["with"]({key: s["at"](key, u)}) for s in summaries], None, jobs)
        return verdict_of(results)
    other = verdict(hi)
    if other == point:
        return None
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        v = verdict(mid)
        if v == point:
            lo = mid
        else:
            hi, other = mid, v
    return s0["at"](key, hi), other
