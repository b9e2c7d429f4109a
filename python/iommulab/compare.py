"""``iommulab compare``: every DMA policy on one scenario, throughput against exposure.

Each policy runs the scenario with ``os.policy`` pinned (other ``[compare]`` axes still expand, so a scenario that
also compares, say, page_pool gives one row per policy and value). The table and the plot put what a policy costs
(goodput) beside how long it leaves freed pages reachable by the device (the safety accounting of each run)."""

from __future__ import annotations

import html
import math
from typing import Any, Mapping

from . import __version__
from .api import ProgressFn, RunResult, load, run_variants
from .report import note_lines, set_lines

# Every policy the simulator has, cheapest protection first.
POLICIES = ["passthrough", "lazy", "xsmmu", "blocks", "fns", "fands", "strict"]


def compare(scenario: Any = None, sets: Mapping[str, Any] | None = None, policies: list[str] | None = None,
            progress: ProgressFn | None = None, raw_strings: bool = False) -> list[RunResult]:
    """Run the scenario once per policy (per remaining compared value)."""
    variants, names = [], []
    for p in policies or POLICIES:
        vs = load(scenario, {**(sets or {}), "os.policy": p}, raw_strings=raw_strings)
        variants += vs
        names += [" ".join([p] + [f"{k.rsplit('.', 1)[-1]}={x}" for k, x in v.overrides]) for v in vs]
    results = run_variants(variants, progress)
    for r, name in zip(results, names):
        r._d["label"] = name
    return results


def _window(r: RunResult, key: str) -> str:
    s = r.safety
    if not s["protected"]:
        return "all"
    w = s.get("window")
    return f"{w[key] / 1000:.3f}" if w else "0"


def _exposed(r: RunResult) -> str:
    s = r.safety
    if not s["protected"]:
        return "all"
    return f"{s['exposed_share'] * 100:.1f}%"


def _sub_page(r: RunResult) -> str:
    s = r.safety
    if not s["protected"]:
        return "all"
    return f"{s['sub_page']['mean_reachable_bytes'] / 1024:.1f}"


COLUMNS = [
    # header, width, formatter
    ("Gbps", 8, lambda r: f"{r.throughput_gbps:.2f}"),
    ("CPU busy", 9, lambda r: f"{r.cpu_busy * 100:.1f}%"),
    ("inv/page", 9, lambda r: f"{r.inv_per_page:.4f}"),
    ("unmapped pg/s", 14, lambda r: f"{r.iova_pages_unmapped / r.sim_seconds:.4g}"),
    ("inv/s", 10, lambda r: f"{r.invalidations['total'] / r.sim_seconds:.4g}"),
    ("exposed", 9, _exposed),
    ("win p50 ms", 11, lambda r: _window(r, "p50_us")),
    ("win p99 ms", 11, lambda r: _window(r, "p99_us")),
    ("win max ms", 11, lambda r: _window(r, "max_us")),
    ("stale hits", 11, lambda r: f"{r.stale_translations}"),
    ("sub-page KiB", 13, lambda r: _sub_page(r)),
]


def format_compare(scenario: dict[str, Any], results: list[RunResult], plot: str | None = None,
                   sets: list[tuple[str, str]] | None = None) -> str:
    lines = [
        f"iommulab {__version__} · compare · {scenario.get('name') or 'scenario'}: "
        f"{scenario.get('description', '')}".rstrip(": "),
        f"platform {scenario['platform']['profile']} ({scenario['platform']['vendor']}) · kernel "
        f"{scenario['os']['kernel']} · {scenario['run']['duration_ms']:g} ms after {scenario['run']['warmup_ms']:g} ms "
        f"warm-up · seed {scenario['run']['seed']}",
    ]
    lines += set_lines(sets) + [""]
    lw = max([len("run")] + [len(r.label) for r in results])
    head = f"{'run':<{lw}}" + "".join(f"{h:>{w}}" for h, w, _ in COLUMNS)
    lines += [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.label:<{lw}}" + "".join(f"{fmt(r):>{w}}" for _, w, fmt in COLUMNS))
    lines += [
        "",
        "exposed: share of unmapped pages released to their owner before an invalidation covering them completed "
        "(all: identity domain, the device reaches every page) · win: that gap per exposed page, p50/p99/max "
        "(0: none exposed) · stale hits: device translations served by an entry the page table no longer held "
        "· sub-page: other data sharing the pages of mapped small buffers, reachable on average at any instant",
    ]
    lines += note_lines(results)
    if plot:
        lines.append(f"plot: {plot}")
    return "\n".join(lines) + "\n"


def _x_of(r: RunResult) -> float | None:
    """Exposure for the plot: the p99 window in µs, 0 when nothing was exposed, None when unprotected."""
    s = r.safety
    if not s["protected"]:
        return None
    w = s.get("window")
    return w["p99_us"] if w else 0.0


# Plot geometry (px) and the log axis of exposure windows (µs).
W, H, LEFT, RIGHT, TOP, BOTTOM = 1060, 440, 70, 330, 40, 70
LANE = 90  # the "none" and "unprotected" lanes either side of the log axis
# One colour per policy (matplotlib's tab10 order).
COLOURS = {"passthrough": "#d62728", "lazy": "#ff7f0e", "xsmmu": "#2ca02c", "fands": "#9467bd", "fns": "#8c564b", "blocks": "#17becf", "strict": "#1f77b4"}
X_DECADES = (0, 5)  # 1 µs .. 100 ms


def plot_svg(title: str, results: list[RunResult]) -> str:
    """Throughput against exposure, one point per run, as a self-contained SVG."""
    x0, x1 = LEFT + LANE, W - RIGHT - LANE
    y0, y1 = H - BOTTOM, TOP
    ymax = max([r.line_rate_gbps for r in results] + [r.throughput_gbps for r in results] + [1.0])

    def sx(v: float | None) -> float:
        if v is None:
            return W - RIGHT - LANE / 2
        if v <= 0:
            return LEFT + LANE / 2
        d = min(max(math.log10(v), X_DECADES[0]), X_DECADES[1])
        return x0 + (d - X_DECADES[0]) / (X_DECADES[1] - X_DECADES[0]) * (x1 - x0)

    def sy(g: float) -> float:
        return y0 - g / ymax * (y0 - y1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
           f'<line x1="{LEFT}" y1="{y0}" x2="{W - RIGHT}" y2="{y0}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{y0}" x2="{LEFT}" y2="{y1}" stroke="black"/>']
    for k in range(6):
        g = ymax * k / 5
        out.append(f'<text x="{LEFT - 6}" y="{sy(g) + 4:.1f}" text-anchor="end">{g:.0f}</text>')
        out.append(f'<line x1="{LEFT}" y1="{sy(g):.1f}" x2="{W - RIGHT}" y2="{sy(g):.1f}" stroke="#eee"/>')
    ticks = [(LEFT + LANE / 2, "none", 30)]
    ticks += [(sx(10.0 ** d), f"{10 ** d / 1000:g}", 16) for d in range(X_DECADES[0], X_DECADES[1] + 1)]
    ticks.append((W - RIGHT - LANE / 2, "unprotected", 30))
    for x, lab, dy in ticks:
        out.append(f'<text x="{x:.1f}" y="{y0 + dy}" text-anchor="middle">{lab}</text>')
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 4}" stroke="black"/>')
    out.append(f'<text x="{(x0 + x1) / 2}" y="{H - 20}" text-anchor="middle">exposure: p99 window from a page\'s '
               f'release to its invalidation (ms, log)</text>')
    out.append(f'<text x="16" y="{(y0 + y1) / 2}" text-anchor="middle" transform="rotate(-90 16 '
               f'{(y0 + y1) / 2})">goodput (Gbps)</text>')
    # Runs that land on the same spot share one point and one label.
    spots: dict[tuple[int, int], list[RunResult]] = {}
    for r in results:
        spots.setdefault((round(sx(_x_of(r))), round(sy(r.throughput_gbps))), []).append(r)
    # Numbered points; the legend on the right names the runs behind each number.
    for i, ((x, y), rs) in enumerate(spots.items(), 1):
        colour = COLOURS.get(rs[0].label.split(" ")[0], "#444")
        out.append(f'<circle cx="{x}" cy="{y}" r="5" fill="{colour}"/>')
        out.append(f'<text x="{x + 7}" y="{y - 5}" fill="{colour}" font-size="11">{i}</text>')
        ly = TOP + 14 * sum(len(v) for v in list(spots.values())[:i - 1]) + 6 * (i - 1)
        for j, r in enumerate(rs):
            lab = f"{i} {r.label}" if j == 0 else f"  {r.label}"
            out.append(f'<text x="{W - RIGHT + 20}" y="{ly + 14 * j}" fill="{colour}">{html.escape(lab)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
