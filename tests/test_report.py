"""The HTML report: what its plots plot (the figures it embeds), and, in a real browser, that headless Chromium
opens it offline, runs its scripts, and draws every plot.

The browser tests run where Chromium is installed (Debian's `chromium`); with IOMMULAB_BROWSER=1 (.ci/run sets
it and installs the package) a missing browser fails them instead of skipping them."""

import json
import os
import re
import shutil
import subprocess

import pytest

import iommulab
from conftest import cli
from iommulab import plots

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
browser = pytest.mark.skipif(BROWSER is None and os.environ.get("IOMMULAB_BROWSER") != "1",
                             reason="no Chromium here (apt-get install chromium)")
# Policy colours the plots must show (plots.COLOURS): strict, lazy, passthrough.
COLOURS = {"strict": (0x1f, 0x77, 0xb4), "lazy": (0xff, 0x7f, 0x0e), "passthrough": (0xd6, 0x27, 0x28)}


def _chromium(*args, timeout=120):
    assert BROWSER, "IOMMULAB_BROWSER=1 but no Chromium is installed"
    # No network: the report must open offline (plotly.js is inlined).
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--proxy-server=127.0.0.1:9", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=10000", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    f = d / "s.toml"
    f.write_text('scenario = "default"\nseeds = 2\n[set]\n"run.duration_ms" = 2\n"run.warmup_ms" = 1\n'
                 '"workload.nic_rx.page_pool" = true\n[axes]\n"os.policy" = ["strict", "lazy", "passthrough"]\n'
                 '"workload.nic_rx.queues" = [1, 2, 4]\n')
    cli("sweep", str(f), "--out", str(d / "o"), "--no-progress", check_rc=0)
    cli("report", str(d / "o"), "-o", str(d / "report.html"), check_rc=0)
    return d / "report.html"


@browser
def test_the_report_draws_every_plot_without_errors(report):
    p = _chromium("--dump-dom", report.as_uri())
    dom = p.stdout
    # Three figures (throughput/exposure, goodput and CPU time per run, metrics against queues; no exposure
    # figure: 2 ms runs settle no lazy page), each rendered by plotly into SVG.
    assert dom.count('class="plot-container plotly"') == 3, dom[:500]
    assert dom.count('class="main-svg"') >= 6 and 'class="barlayer' in dom
    # Markers and lines were drawn (plotly's point and trace groups), and the runs table is there.
    assert dom.count('class="point"') >= 9 and 'class="scatterlayer' in dom
    assert "<table" in dom and "workload.nic_rx.queues" in dom
    # No script error: neither the page's own catcher nor the console saw one.
    assert 'data-errors="1"' not in dom
    assert "Uncaught" not in p.stderr, p.stderr[-2000:]


@browser
def test_a_screenshot_shows_the_plots(report, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    p = _chromium("--window-size=1300,1400", f"--screenshot={shot}", report.as_uri())
    assert shot.exists(), p.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1300, 1400)
    colours = {c for _, c in img.getcolors(maxcolors=1 << 20)}
    # Not a blank page: many colours, and every policy's colour (anti-aliased edges aside, exact pixels
    # exist inside markers and lines).
    assert len(colours) > 100
    for pol, rgb in COLOURS.items():
        assert rgb in colours, f"no {pol} pixels in the screenshot"


@browser
def test_compare_and_validate_write_their_plots_through_the_report(tmp_path):
    plot = tmp_path / "cmp.html"
    cli("compare", "--set", "run.duration_ms=2", "--set", "run.warmup_ms=1", "--policies", "strict,lazy,passthrough",
        "--plot", str(plot), "--no-progress", check_rc=0)
    dom = _chromium("--dump-dom", plot.as_uri()).stdout
    # Goodput against exposure, goodput and CPU time per run, the lazy runs' exposure windows; the runs table
    # with each run's numbers (3 policies, page_pool on and off).
    assert dom.count('class="plot-container plotly"') == 3 and 'data-errors="1"' not in dom
    table = dom.split('<table class="runs">', 1)[1].split("</table>", 1)[0]
    assert "Gbps" in table and "<th>exposure p99</th>" in table and "limited by" in table
    assert table.count("<tr>") == 1 + 6 and ">all<" in table and ">none<" in table
    # Each exposure with its unit in the cell, as every command writes a time.
    assert re.search(r"<td>\d+(\.\d)? (ns|µs|ms)</td>", table)
    val = tmp_path / "val.html"
    p = cli("validate", "C2.strict_inv_per_page", "--seeds", "1", "--plot", str(val), "--json", check_rc=0)
    assert json.loads(p.stdout)["targets"][0]["id"] == "C2.strict_inv_per_page"
    dom = _chromium("--dump-dom", val.as_uri()).stdout
    assert dom.count('class="plot-container plotly"') == 1 and "C2.strict_inv_per_page" in dom
    assert 'data-errors="1"' not in dom


def _figures(page: str) -> list[tuple[list[dict], dict]]:
    """(traces, layout) of each plotly figure the page embeds, in order."""
    dec = json.JSONDecoder()
    figs = []
    for m in re.finditer(r"Plotly\.newPlot\(\s*", page):
        args, pos = [], m.end()
        for _ in range(3):  # the div's id, the traces, the layout
            v, pos = dec.raw_decode(page, pos)
            args.append(v)
            pos = re.compile(r"[\s,]*").match(page, pos).end()
        figs.append((args[1], args[2]))
    return figs


def _title(axis: dict) -> str:
    t = axis.get("title", "")
    return t.get("text", "") if isinstance(t, dict) else t


def test_the_plots_plot_goodput_against_exposure_and_each_metric_against_the_axis(report):
    # Drawn plots are not enough: with x and y swapped the browser tests above pass (issue 18).
    (trade, trade_layout), (cost, _), (queues, queues_layout) = _figures(report.read_text())
    points = iommulab.load(report.parent / "o", aggregate=True).to_dicts()
    # Goodput (y) against the p99 exposure window (x), one trace per policy.
    assert "exposure" in _title(trade_layout["xaxis"]) and "goodput" in _title(trade_layout["yaxis"])
    assert sorted(t["name"] for t in trade) == ["lazy", "passthrough", "strict"]
    for t in trade:
        want = {(plots._exposure(r), r["throughput_gbps"]) for r in points if r["os.policy"] == t["name"]}
        assert set(zip(t["x"], t["y"])) == want, t["name"]
    # Goodput per run (the first trace), then each CPU-time category stacked, from the runs' own breakdown.
    order = [t["name"] for t in cost[1:]]
    assert order == [label for _, label, _ in plots.CPU_PARTS]
    assert len(cost[0]["y"]) == len(points)
    for t, (key, _, _) in zip(cost[1:], plots.CPU_PARTS):
        assert sorted(t["y"]) == pytest.approx(sorted(r[f"cpu_breakdown.{key}"] for r in points))
    # Every metric of the menu (y) against the queues (x), one line per policy in the queues' order.
    assert _title(queues_layout["xaxis"]) == "workload.nic_rx.queues"
    assert _title(queues_layout["yaxis"]) == "throughput_gbps"
    buttons = queues_layout["updatemenus"][0]["buttons"]
    assert buttons[0]["label"] == "throughput_gbps" and len(buttons) > 5
    for b in buttons:
        shown = [t for t, on in zip(queues, b["args"][0]["visible"]) if on]
        assert sorted(t["name"] for t in shown) == ["policy=lazy", "policy=passthrough", "policy=strict"]
        for t in shown:
            rows = sorted((r for r in points if f"policy={r['os.policy']}" == t["name"]),
                          key=lambda r: r["workload.nic_rx.queues"])
            assert t["x"] == [1, 2, 4]
            assert t["y"] == pytest.approx([r[b["label"]] for r in rows], nan_ok=True), (b["label"], t["name"])
