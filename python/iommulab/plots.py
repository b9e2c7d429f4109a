"""Plots and the HTML report (plotly): throughput against exposure per policy, any metric against any swept
axis, the validate table with its tolerance bands, and the runs' configurations. One self-contained HTML file:
plotly.js is inlined once, so the report opens offline."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from . import __version__

# One colour per policy (plotly's default qualitative order, cheapest protection first).
COLOURS = {"passthrough": "#d62728", "lazy": "#ff7f0e", "xsmmu": "#2ca02c", "blocks": "#17becf", "fns": "#8c564b",
           "fands": "#9467bd", "strict": "#1f77b4"}
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


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _policy(row: dict[str, Any]) -> str:
    return str(row.get("policy") or row.get("os.policy") or "")


def _name(row: dict[str, Any], keys: list[str]) -> str:
    """A run's name in legends: its label, else the values of the given axes."""
    parts = [f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in keys if k in row and row[k] is not None]
    return " ".join(parts) or str(row.get("label") or "run")


def tradeoff_figure(rows: list[dict[str, Any]], title: str, name_keys: list[str] | None = None):
    """Goodput against the p99 exposure window, one marker per run with a goodput, coloured by policy."""
    import plotly.graph_objects as go

    fig = go.Figure()
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("throughput_gbps") is not None:
            by_policy.setdefault(_policy(r), []).append(r)
    for pol, rs in by_policy.items():
        err = [(_or(r.get("throughput_gbps.max"), r["throughput_gbps"]) - r["throughput_gbps"],
                r["throughput_gbps"] - _or(r.get("throughput_gbps.min"), r["throughput_gbps"])) for r in rs]
        fig.add_trace(go.Scatter(
            x=[_exposure(r) for r in rs], y=[r["throughput_gbps"] for r in rs], mode="markers", name=pol or "run",
            marker={"size": 11, "color": COLOURS.get(pol)},
            error_y={"type": "data", "array": [e[0] for e in err], "arrayminus": [e[1] for e in err],
                     "visible": any(e != (0, 0) for e in err)},
            text=[_name(r, name_keys or []) if name_keys else str(r.get("label", "")) for r in rs],
            hovertemplate="%{text}<br>%{y:.2f} Gbps<br>p99 window %{x:.3g} µs<extra>" + html.escape(pol) + "</extra>"))
    ticks = [NONE_US] + [10.0 ** d for d in range(0, 6)] + [UNPROTECTED_US]
    fig.update_layout(
        title=title, template="plotly_white", height=480, legend_title_text="policy",
        xaxis={"type": "log", "title": "exposure: p99 window from a page's release to its invalidation (µs, log)",
               "tickvals": ticks, "ticktext": ["none"] + [f"{t:g}" for t in ticks[1:-1]] + ["unprotected"],
               "range": [math.log10(NONE_US) - 0.3, math.log10(UNPROTECTED_US) + 0.3]},
        yaxis={"title": "goodput (Gbps)", "rangemode": "tozero"})
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


def runs_table(rows: list[dict[str, Any]], axes: list[str]) -> str:
    """Each run's configuration: label, axes, seed, scenario hash and the keys it set."""
    cols = [c for c in ["run", "label"] + axes + ["seed", "seeds", "scenario_hash", "overrides"]
            if any(c in r for r in rows)]
    return _table(cols, [[r.get(c) for c in cols] for r in rows])


def results_page(rows: list[dict[str, Any]], title: str, axes: list[str] | None = None,
                 spec: dict[str, Any] | None = None, validate_rows: list[dict[str, Any]] | None = None,
                 subtitle: str = "") -> str:
    """The report of a set of runs (a sweep's points, a comparison's policies), one row per run or point."""
    axes = axes or []
    page = Page(title, subtitle or (spec or {}).get("description", ""))
    if any(r.get("throughput_gbps") is not None for r in rows):
        page.heading("Throughput against exposure",
                     "Each marker is one run (the mean over seeds, with their min-max, when a sweep has several): "
                     "goodput against the p99 time a freed page stayed reachable by the device.")
        page.figure(tradeoff_figure(rows, "goodput against exposure, per policy", [a for a in axes if a != "run.seed"]))
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
        page.heading("Runs", "What each run (or point) was: its axes, seed and the scenario keys it set.")
        page.html(runs_table(rows, axes))
    if spec:
        page.heading("Sweep")
        page.code(json.dumps(spec, indent=2, default=str))
    return page.render()


def validate_page(rows: list[dict[str, Any]]) -> str:
    return results_page([], "iommulab validate", validate_rows=rows)
