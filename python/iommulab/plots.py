"""Plots and the HTML report (plotly): throughput against exposure per policy, any metric against any swept
axis, the validate table with its tolerance bands, and the runs' configurations. One self-contained HTML file:
plotly.js is inlined once, so the report opens offline."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from . import __version__, _core
from .report import duration, exposure, flat_cell

# One colour per policy, in the core's order (cheapest protection first), from plotly's default qualitative set.
PALETTE = ["#d62728", "#ff7f0e", "#2ca02c", "#17becf", "#8c564b", "#9467bd", "#1f77b4", "#e377c2", "#7f7f7f",
           "#bcbd22"]
COLOURS = dict(zip(_core.policies(), PALETTE))
# Where runs with nothing exposed, and unprotected runs, sit on the log axis of exposure windows (µs): lanes
# either side of the 1 µs .. 100 ms decades.
NONE_US, UNPROTECTED_US = 0.1, 1e6
# Metrics offered first in the metric menus (then every other numeric result column).
KEY_METRICS = ["throughput_gbps", "cpu_busy", "inv_per_page", "safety.exposed_share", "safety.window.p99_us",
               "cpu_inv_wait_share", "iotlb_misses_per_page", "packets_per_sec", "latency.p99_us"]
# Columns that describe a run rather than measure it.
NOT_METRICS = {"run", "point", "seed", "seeds", "sim_seconds", "line_rate_gbps"}


def _exposure(row: dict[str, Any]) -> float:
    """A run's p99 exposure window in µs for the log axis: NONE_US when nothing was exposed, UNPROTECTED_US when
    the domain is an identity map."""
    if not row.get("safety.protected", True):
        return UNPROTECTED_US
    w = row.get("safety.window.p99_us")
    return w if w and w > 0 else NONE_US


def _exposure_text(row: dict[str, Any]) -> str:
    """A run's p99 exposure as the tables write it (all, none, 877 µs, 15.9 ms)."""
    return exposure(row.get("safety.protected"), row.get("safety.window.p99_us") or None)


# What a run's rate is read as: goodput, or an NVMe workload's kIOPS. (result column, axis title, scale, unit)
GBPS = ("throughput_gbps", "goodput (Gbps)", 1.0, "Gbps")
KIOPS = ("packets_per_sec", "kIOPS (I/Os completed per second, in thousands)", 1e-3, "kIOPS")


def _time_axis(lo_us: float, hi_us: float) -> dict[str, Any]:
    """Ticks of a log axis of times in µs at each decade from `lo_us` to `hi_us`, written as the tables write a
    time (100 ns, 1 µs, ..., 10 ms)."""
    ticks = [10.0 ** d for d in range(math.floor(math.log10(lo_us)), math.ceil(math.log10(hi_us)) + 1)]
    return {"tickvals": ticks, "ticktext": [duration(t) for t in ticks]}


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _policy(row: dict[str, Any]) -> str:
    return str(row.get("policy") or row.get("os.policy") or "")


def _name(row: dict[str, Any], keys: list[str]) -> str:
    """A run's name in legends: its label, else the values of the given axes."""
    parts = [f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in keys if k in row and row[k] is not None]
    return " ".join(parts) or str(row.get("label") or "run")


def _variant(row: dict[str, Any], name_keys: list[str] | None) -> str:
    """What tells a run apart from the others of its policy (``page_pool=true``): its name less the policy."""
    name = _name(row, name_keys or []) if name_keys else str(row.get("label", ""))
    return " ".join(w for w in name.split() if w not in (_policy(row), f"policy={_policy(row)}"))


# Marker symbols, one per variant of a policy (page_pool on and off, …), so runs that share a colour differ.
SYMBOLS = ["circle", "diamond", "square", "triangle-up", "x", "star", "cross", "triangle-down"]


def _bar(row: dict[str, Any], key: str) -> tuple[float, float]:
    """An error bar around a run's figure `key` (up, down): a ranged run's 5th to 95th percentile
    (docs/ranges.md), else the spread of a sweep point's seeds (its min and max), else none."""
    x = row.get(key)
    if x is None:
        return 0.0, 0.0
    hi = _or(row.get(f"ranges.{key}.p95"), _or(row.get(f"{key}.max"), x))
    lo = _or(row.get(f"ranges.{key}.p5"), _or(row.get(f"{key}.min"), x))
    return max(0.0, hi - x), max(0.0, x - lo)


def tradeoff_figure(rows: list[dict[str, Any]], title: str, name_keys: list[str] | None = None,
                    rate: tuple[str, str, float, str] = GBPS):
    """Goodput (or kIOPS, `rate`) against the p99 exposure, one marker per run with a goodput, coloured by policy
    and shaped by what else tells runs apart; half-transparent so that overlapping runs show."""
    import plotly.graph_objects as go

    key, axis, scale, unit = rate
    fig = go.Figure()
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("throughput_gbps") is not None and r.get(key) is not None:
            by_policy.setdefault(_policy(r), []).append(r)
    variants = list(dict.fromkeys(_variant(r, name_keys) for rs in by_policy.values() for r in rs))
    for pol, rs in by_policy.items():
        y = [r[key] * scale for r in rs]
        err = [tuple(e * scale for e in _bar(r, key)) for r in rs]
        xerr = [_bar(r, "safety.window.p99_us") if r.get("safety.protected") else (0.0, 0.0) for r in rs]
        fig.add_trace(go.Scatter(
            x=[_exposure(r) for r in rs], y=y, mode="markers", name=pol or "run",
            marker={"size": 12, "color": COLOURS.get(pol), "opacity": 0.75, "line": {"width": 1, "color": "#333"},
                    "symbol": [SYMBOLS[variants.index(_variant(r, name_keys)) % len(SYMBOLS)] for r in rs]},
            error_y={"type": "data", "array": [e[0] for e in err], "arrayminus": [e[1] for e in err],
                     "visible": any(e != (0, 0) for e in err)},
            error_x={"type": "data", "array": [e[0] for e in xerr], "arrayminus": [e[1] for e in xerr],
                     "visible": any(e != (0, 0) for e in xerr)},
            text=[f"{_name(r, name_keys or []) if name_keys else r.get('label', '')}<br>limited by "
                  f"{r.get('limited_by', '?')}<br>exposure p99 {_exposure_text(r)}" for r in rs],
            hovertemplate="%{text}<br>%{y:.2f} " + unit + "<extra>" + html.escape(pol) + "</extra>"))
    ticks = [NONE_US] + [10.0 ** d for d in range(0, 6)] + [UNPROTECTED_US]
    fig.update_layout(
        title=title, template="plotly_white", height=480, legend_title_text="policy",
        xaxis={"type": "log", "title": "exposure p99: how long an unmapped page stayed reachable by the device "
               "after its owner got it back (log)",
               "tickvals": ticks, "ticktext": ["none"] + [duration(t) for t in ticks[1:-1]] + ["all"],
               "range": [math.log10(NONE_US) - 0.3, math.log10(UNPROTECTED_US) + 0.3]},
        yaxis={"title": axis, "rangemode": "tozero"})
    return fig


# Where the workload CPUs' time went (cpu_breakdown), in stacking order, with a colour each.
CPU_PARTS = [("dma_api", "DMA API", "#1f77b4"), ("cmdq_insert", "command queue insertion", "#9467bd"),
             ("inv_wait", "invalidation wait", "#d62728"),
             ("lock_spin", "lock spin", "#ff7f0e"), ("stack", "stack (outside the DMA API)", "#7f7f7f"),
             ("idle", "idle", "#e5e5e5")]


def _run_names(rows: list[dict[str, Any]], name_keys: list[str] | None) -> list[str]:
    return [_name(r, name_keys or []) if name_keys else str(r.get("label") or r.get("run")) for r in rows]


def cost_figure(rows: list[dict[str, Any]], name_keys: list[str] | None = None,
                rate: tuple[str, str, float, str] = GBPS):
    """Per run: goodput (or kIOPS, `rate`) as a bar coloured by policy (with what bound it), and where the CPUs'
    time went as stacked bars."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    key, axis, scale, unit = rate
    rows = [r for r in rows if r.get("throughput_gbps") is not None and r.get(key) is not None]
    names = _run_names(rows, name_keys)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=(f"{axis}, labelled with what bound the run",
                                        "where the workload CPUs' time went (share)"))
    fig.add_trace(go.Bar(x=names, y=[r[key] * scale for r in rows], showlegend=False,
                         marker={"color": [COLOURS.get(_policy(r), "#888") for r in rows]},
                         text=[r.get("limited_by", "") for r in rows], textposition="inside", textangle=-90,
                         hovertemplate="%{x}<br>%{y:.2f} " + unit + "<br>limited by %{text}<extra></extra>"),
                  row=1, col=1)
    for key, label, colour in CPU_PARTS:
        fig.add_trace(go.Bar(x=names, y=[r.get(f"cpu_breakdown.{key}") or 0 for r in rows], name=label,
                             marker={"color": colour}, legendgroup="cpu",
                             hovertemplate="%{x}<br>" + html.escape(label) + " %{y:.1%}<extra></extra>"), row=2, col=1)
    fig.update_layout(template="plotly_white", height=640, barmode="stack", legend_title_text="CPU time",
                      yaxis2={"tickformat": ".0%", "range": [0, 1]})
    return fig


def exposure_figure(rows: list[dict[str, Any]], name_keys: list[str] | None = None):
    """Per protected run that exposed pages: its exposure's p50, p99, p99.9 and max (log) on one line, coloured
    by policy; runs that exposed nothing, or are unprotected, are left out."""
    import plotly.graph_objects as go

    fig = go.Figure()
    qs = [("p50_us", "p50", "circle"), ("p99_us", "p99", "diamond"), ("p999_us", "p99.9", "square"),
          ("max_us", "max", "x")]
    shown = [r for r in rows if r.get("safety.protected", True) and r.get("safety.window.p99_us")]
    xs = [r.get(f"safety.window.{k}") for r in shown for k, _, _ in qs]
    xs = [x for x in xs if x] or [1.0]
    for r, name in zip(shown, _run_names(shown, name_keys)):
        pol = _policy(r)
        x = [r.get(f"safety.window.{k}") for k, _, _ in qs]
        fig.add_trace(go.Scatter(
            x=x, y=[name] * len(qs), mode="lines+markers",
            name=name, showlegend=False, text=[f"exposure {q} {duration(v) if v else 'none'}"
                                               for (_, q, _), v in zip(qs, x)],
            marker={"symbol": [s for _, _, s in qs], "size": 10, "color": COLOURS.get(pol)},
            line={"color": COLOURS.get(pol)},
            hovertemplate="%{y}<br>%{text}<extra>" + html.escape(pol) + "</extra>"))
    fig.update_layout(template="plotly_white", height=160 + 40 * len(shown),
                      title="exposure per run: p50 (circle), p99 (diamond), p99.9 (square), max (x)",
                      xaxis={"type": "log", "title": "how long an unmapped page stayed reachable by the device after "
                             "its owner got it back (log)", **_time_axis(min(xs), max(xs))},
                      yaxis={"type": "category"})
    return fig


def metrics_of(rows: list[dict[str, Any]]) -> list[str]:
    """Numeric result columns, the key metrics first."""
    cols: dict[str, None] = {}
    for r in rows:
        for k, v in r.items():
            if (isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS
                    and not k.endswith((".min", ".max")) and not k.startswith(("run.", "platform.", "os.",
                                                                                 "workload.", "hypervisor."))):
                cols[k] = None
    return [m for m in KEY_METRICS if m in cols] + sorted(m for m in cols if m not in KEY_METRICS)


def axis_figure(rows: list[dict[str, Any]], axis: str, series: list[str], metrics: list[str]):
    """`metrics` (a menu) against one swept `axis`, one line per combination of the `series` keys (the
    policy first); seeds' spread as error bars when the rows are aggregated."""
    import plotly.graph_objects as go

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_name(r, series) if series else "runs", []).append(r)
    numeric = all(isinstance(r.get(axis), (int, float)) and not isinstance(r.get(axis), bool) for r in rows)
    fig = go.Figure()
    for m_i, m in enumerate(metrics):
        for g, rs in groups.items():
            rs = sorted(rs, key=lambda r: r[axis]) if numeric else rs
            pol = _policy(rs[0])
            y = [r.get(m) for r in rs]
            hi = [(r.get(f"{m}.max") - r[m]) if r.get(f"{m}.max") is not None and r.get(m) is not None else 0
                  for r in rs]
            lo = [(r[m] - r.get(f"{m}.min")) if r.get(f"{m}.min") is not None and r.get(m) is not None else 0
                  for r in rs]
            fig.add_trace(go.Scatter(
                x=[r[axis] if numeric else str(r[axis]) for r in rs], y=y, name=g, mode="lines+markers",
                visible=m_i == 0, legendgroup=g, line={"color": COLOURS.get(pol)} if len(groups) <= len(COLOURS) else None,
                error_y={"type": "data", "array": hi, "arrayminus": lo, "visible": any(hi) or any(lo)}))
    n = len(groups)
    buttons = [{"label": m, "method": "update",
                "args": [{"visible": [i // n == k for i in range(n * len(metrics))]}, {"yaxis.title.text": m}]}
               for k, m in enumerate(metrics)]
    fig.update_layout(
        template="plotly_white", height=460, title=f"against {axis}",
        xaxis={"title": axis, "type": "linear" if numeric else "category"},
        yaxis={"title": metrics[0] if metrics else ""}, legend_title_text=", ".join(series) or None,
        updatemenus=[{"buttons": buttons, "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.18,
                      "yanchor": "top", "showactive": True}] if len(metrics) > 1 else [])
    return fig


def validate_figure(rows: list[dict[str, Any]]):
    """Model over published per target, with the target's tolerance band around 1."""
    import plotly.graph_objects as go

    ids = [r["id"] for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=ids, y=[2 * r["tolerance"] for r in rows], base=[1 - r["tolerance"] for r in rows],
                         marker={"color": "rgba(31,119,180,0.18)"}, name="tolerance", hoverinfo="skip"))
    ratio = [r["model"] / r["published"] if r["published"] else None for r in rows]
    lo = [(r["model"] - r["spread"][0]) / r["published"] if r["published"] else 0 for r in rows]
    hi = [(r["spread"][1] - r["model"]) / r["published"] if r["published"] else 0 for r in rows]
    fig.add_trace(go.Scatter(
        x=ids, y=ratio, mode="markers", name="model / published (seeds min-max)",
        marker={"size": 10, "color": ["#2ca02c" if r["ok"] else "#d62728" for r in rows]},
        error_y={"type": "data", "array": hi, "arrayminus": lo},
        text=[f"published {r['published']:.4g}, model {r['model']:.4g} ({100 * r['error']:+.1f}%)" for r in rows],
        hovertemplate="%{x}: %{text}<extra></extra>"))
    fig.add_hline(y=1.0, line={"color": "#888", "dash": "dot"})
    fig.update_layout(template="plotly_white", height=460, title="validate: model against published",
                      yaxis={"title": "model / published"}, xaxis={"title": "target", "tickangle": -40},
                      barmode="overlay")
    return fig


def _table(columns: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def validate_table(rows: list[dict[str, Any]]) -> str:
    return _table(["target", "published", "model", "seeds min", "seeds max", "error", "tolerance", "ok", "assumed",
                   "source"],
                  [[r["id"], r["published"], r["model"], r["spread"][0], r["spread"][1], f"{100 * r['error']:+.1f}%",
                    f"{100 * r['tolerance']:.0f}%", "ok" if r["ok"] else "MISS", ", ".join(r.get("assumed") or []),
                    r.get("source", "")] for r in rows])


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } .plot { min-height: 300px; }
#report-errors { color: #b00; font-weight: bold; white-space: pre-wrap; }
pre { background: #f7f7f7; padding: 0.6em; font-size: 0.85em; overflow-x: auto; }
"""
# Shows any script error on the page itself (and lets a test see it): a report that fails to draw says so.
ERRORS = """<div id="report-errors"></div><script>
window.addEventListener("error", function (e) {
  var d = document.getElementById("report-errors");
  d.setAttribute("data-errors", "1");
  d.textContent += "This report failed to draw: " + e.message + "\\n";
});
</script>"""


class Page:
    """An HTML report assembled from sections; plotly.js goes in once, with the first figure."""

    def __init__(self, title: str, subtitle: str = ""):
        self.title = title
        self.parts = [f"<h1>{html.escape(title)}</h1>"]
        if subtitle:
            self.parts.append(f"<p>{html.escape(subtitle)}</p>")
        self.figures = 0

    def heading(self, text: str, note: str = "") -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>" + (f"<p>{html.escape(note)}</p>" if note else ""))

    def figure(self, fig) -> None:
        self.parts.append('<div class="plot">' + fig.to_html(full_html=False, include_plotlyjs=self.figures == 0,
                                                               div_id=f"plot-{self.figures}",
                                                               config={"displaylogo": False}) + "</div>")
        self.figures += 1

    def html(self, text: str) -> None:
        self.parts.append(text)

    def code(self, text: str) -> None:
        self.parts.append(f"<pre>{html.escape(text)}</pre>")

    def render(self) -> str:
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{STYLE}</style></head><body>\n{ERRORS}\n"
                + "\n".join(self.parts)
                + f"\n<p><small>iommulab {html.escape(__version__)}</small></p></body></html>\n")


# The numbers each run's row shows: (column, header, format).
RUN_NUMBERS = [("throughput_gbps", "Gbps", "{:.2f}"), ("cpu_busy", "CPU busy", "{:.1%}"),
               ("cpu_inv_wait_share", "inv wait", "{:.1%}"), ("inv_per_page", "inv/page", "{:.4f}"),
               ("safety.exposed_share", "exposed", "{:.1%}"), ("safety.window.p50_us", "exposure p50", None),
               ("safety.window.p99_us", "exposure p99", None), ("safety.window.max_us", "exposure max", None),
               ("limited_by", "limited by", "{}")]
# An NVMe workload's rate, after goodput.
IOPS_NUMBER = ("packets_per_sec", "kIOPS", "{:.0f}")


def runs_table(rows: list[dict[str, Any]], axes: list[str], iops: bool = False) -> str:
    """Each run: label, axes, its numbers (goodput, kIOPS for an NVMe workload, CPU, exposure, what bound it),
    seed, scenario hash and the keys it set."""
    head = [c for c in ["run", "label"] + axes if any(c in r for r in rows)]
    numbers = RUN_NUMBERS[:1] + [IOPS_NUMBER] * iops + RUN_NUMBERS[1:]
    nums = [(c, h, f) for c, h, f in numbers if any(c in r for r in rows)]
    rows = [{**r, "packets_per_sec": r["packets_per_sec"] / 1e3} if iops and r.get("packets_per_sec") is not None
            else r for r in rows]
    tail = [c for c in ["seed", "seeds", "scenario_hash", "overrides"] if any(c in r for r in rows)]
    return _table(head + [h for _, h, _ in nums] + tail,
                  [[r.get(c) for c in head] + [flat_cell(r, c, f, "") for c, _, f in nums] + [r.get(c) for c in tail]
                   for r in rows], "runs")


def results_page(rows: list[dict[str, Any]], title: str, axes: list[str] | None = None,
                 spec: dict[str, Any] | None = None, validate_rows: list[dict[str, Any]] | None = None,
                 subtitle: str = "", iops: bool = False) -> str:
    """The report of a set of runs (a sweep's points, a comparison's policies), one row per run or point;
    `iops`: the runs are an NVMe workload's, read by kIOPS."""
    axes = axes or []
    page = Page(title, subtitle or (spec or {}).get("description", ""))
    if any(r.get("throughput_gbps") is not None for r in rows):
        rate = KIOPS if iops else GBPS
        what = "kIOPS" if iops else "goodput"
        page.heading("Throughput against exposure",
                     "Each marker is one run (the mean over seeds, with their min-max, when a sweep has several): "
                     f"{what} against its exposure p99, how long an unmapped page stayed reachable by the device "
                     "after its owner got it back.")
        keys = [a for a in axes if a != "run.seed"]
        page.figure(tradeoff_figure(rows, f"{what} against exposure, per policy", keys, rate))
        page.heading("What each run costs, and what bound it",
                     f"{'kIOPS' if iops else 'Goodput'} per run, and where its CPUs' time went: the DMA "
                     "API's own work, waiting for invalidations, spinning on the DMA layer's locks, everything else "
                     "(the stack), idle.")
        page.figure(cost_figure(rows, keys, rate))
        if any(r.get("safety.window.p99_us") for r in rows):
            page.heading("Exposure per run", "How long unmapped pages stayed reachable by the device after their "
                         "owner got them back, per run that exposed any (strict runs expose none; under "
                         "passthrough the device reaches every page).")
            page.figure(exposure_figure(rows, keys))
    swept = [a for a in axes if a not in ("os.policy", "run.seed") and len({json.dumps(r.get(a)) for r in rows}) > 1]
    metrics = metrics_of(rows)
    for a in swept:
        series = [k for k in ["os.policy"] + axes if k != a and k != "run.seed" and k in (rows[0] if rows else {})
                  and len({json.dumps(r.get(k)) for r in rows}) > 1]
        series = list(dict.fromkeys(series))
        page.heading(f"Metrics against {a}", "Pick the metric from the menu; one line per policy (and per value "
                     "of the other axes).")
        page.figure(axis_figure(rows, a, series, metrics))
    if validate_rows:
        page.heading("Published targets", "Model over published figure per target; the shaded bar is the target's "
                     "tolerance, the marker green within it and red outside.")
        page.figure(validate_figure(validate_rows))
        page.html(validate_table(validate_rows))
    if rows:
        page.heading("Runs", "What each run (or point) was and measured: its axes, its numbers (exposed: the "
                     "share of unmapped pages given back to their owner before an invalidation covering them "
                     "completed; exposure: how long such a page stayed reachable; none: no page was; all: "
                     "passthrough, an identity domain or no IOMMU at all, where the device reaches every page), "
                     "seed and the scenario keys it set.")
        page.html(runs_table(rows, axes, iops))
    if spec:
        page.heading("Sweep")
        page.code(json.dumps(spec, indent=2, default=str))
    return page.render()


def validate_page(rows: list[dict[str, Any]]) -> str:
    return results_page([], "iommulab validate", validate_rows=rows)
