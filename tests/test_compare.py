"""`iommulab compare` end to end, and the safety accounting on randomized scenarios."""

import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import iommulab
from conftest import cli
from iommulab.compare import POLICIES

QUICK = ["--set", "run.duration_ms=3", "--set", "run.warmup_ms=2", "--no-progress"]


def test_compare_prints_every_policy_and_writes_the_plot_once(tmp_path):
    plot = tmp_path / "cmp.html"
    p = cli("compare", *QUICK, "--plot", str(plot), check_rc=0)
    # The table in blocks of columns that fit 100 columns, each with a row per run.
    blocks = [b.splitlines()[2:] for b in p.stdout.split("\n\n") if b.startswith("run ")]
    assert len(blocks) > 1 and all(len(b) == len(blocks[0]) for b in blocks)
    rows = [line.split()[0] for line in blocks[0]]
    # The default scenario also compares page_pool: one row per policy and value.
    assert sorted(set(rows)) == sorted(POLICIES) and len(rows) == 2 * len(POLICIES)
    # Rates as fio prints them (1.69M, 38.4k), never in scientific notation.
    assert not re.search(r"\d[eE][+-]\d", p.stdout), p.stdout
    assert re.search(r" \d+\.\d\dM ", p.stdout)
    page = plot.read_text()
    # plotly.js inlined once (the page opens offline); goodput against exposure, goodput and CPU time per run, the
    # lazy runs' exposure windows.
    assert page.startswith("<!DOCTYPE html>") and page.count("Plotly.newPlot") == 3 and '"all"' in page
    assert all(f'"name":"{p}"' in page for p in POLICIES) and "https://" not in page.split("<script")[0]
    # Nothing the user has is overwritten without asking.
    plot.write_text("mine")
    p = cli("compare", *QUICK, "--plot", str(plot), check_rc=2)
    assert p.stderr.count("\n") == 1 and "--force" in p.stderr and plot.read_text() == "mine"
    cli("compare", *QUICK, "--plot", str(plot), "--force", check_rc=0)
    assert plot.read_text().startswith("<!DOCTYPE html>")


def test_compare_json_and_policy_choice(tmp_path):
    p = cli("compare", "c2", *QUICK, "--policies", "strict,xsmmu", "--no-plot", "--json", check_rc=0)
    out = json.loads(p.stdout)
    assert out["scenario"] == "c2" and out["plot"] is None
    assert [r["policy"] for r in out["runs"]] == ["strict", "xsmmu"]
    for r in out["runs"]:
        assert r["safety"]["protected"] and r["safety"]["pages_exposed"] == 0
    p = cli("compare", "--policies", "strict,fast", check_rc=2)
    assert p.stderr.count("\n") == 1 and "fast" in p.stderr


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["strict", "lazy", "xsmmu", "fands", "fns", "blocks", "passthrough"]),
    queues=st.integers(1, 4),
    flows=st.integers(1, 8),
    mtu=st.sampled_from([1500, 4000, 9000]),
    rq=st.sampled_from(["cyclic", "mlx5_striding"]),
    page_pool=st.booleans(),
    line=st.sampled_from([25, 100]),
    seed=st.integers(0, 1000),
)
def test_only_lazy_releases_pages_before_their_invalidation(policy, queues, flows, mtu, rq, page_pool, line, seed):
    r = iommulab.run(None, **{
        "os.policy": policy, "run.seed": seed, "run.duration_ms": 25, "run.warmup_ms": 2,
        "workload.nic_rx.queues": queues, "workload.nic_rx.flows": flows, "workload.nic_rx.mtu": mtu,
        "workload.nic_rx.rq": rq, "workload.nic_rx.page_pool": page_pool,
        "workload.nic_rx.line_rate_gbps": line,
    })
    s = r.safety
    if policy == "passthrough":
        assert not s["protected"]
        return
    assert s["protected"]
    if policy == "lazy":
        # Bounded by the flush queue: the 10 ms timer as the timer wheel rounds it at HZ=250, plus the flush.
        assert s.get("window") is None or s["window"]["max_us"] <= 10_000 + 2 * 4_000 + 1_000, s
    else:
        assert s["pages_exposed"] == 0 and s["pages_exposed_at_end"] == 0, s
        assert r.stale_translations == 0 or policy == "xsmmu", r.stale_translations


def test_attack_mode_reports_what_replays_reached():
    p = cli("run", "--json", "--set", "os.policy=lazy", "--set", "attack.replay_per_sec=1e6", "--set",
            "attack.recent=256", "--set", "workload.nic_rx.page_pool=false", "--set",
            "workload.nic_rx.line_rate_gbps=1", "--set", "run.duration_ms=30", check_rc=0)
    a = json.loads(p.stdout)["attack"]
    assert set(a) == {"probes", "reached_mapped", "reached_unmapped", "reached_unmapped_bytes", "reached_released"}
    assert a["probes"] > 0 and a["reached_unmapped_bytes"] == 4096 * a["reached_unmapped"]
    p = cli("run", "--set", "attack.replay_per_sec=-1", check_rc=2)
    assert p.stderr.count("\n") == 1 and "attack.replay_per_sec" in p.stderr


def test_inv_log_prints_seed_002_window_lines():
    out = cli("run", "c2", "--set", "os.policy=xsmmu", "--inv-log", "10", check_rc=0).stdout.splitlines()
    lines = [x for x in out if "DMAR:" in x]
    # 20 ms after warm-up in 10 ms windows: two pairs of lines.
    assert len(lines) == 4
    assert "Total=" in lines[0] and "DSI=" in lines[0] and "/s)" in lines[0]
    assert "IOVA_unmapped=" in lines[1] and "inv/page=" in lines[1] and "DSI_xSMMU/page=" in lines[1]
    p = cli("run", "c2", "--inv-log", "-1", check_rc=2)
    assert p.stderr.count("\n") == 1 and "--inv-log" in p.stderr


def test_sub_page_exposure_counts_small_buffers_sharing_pages():
    by = {}
    for policy in ["passthrough", "strict", "blocks"]:
        r = iommulab.run("tx", **{"os.policy": policy, "run.duration_ms": 3, "run.warmup_ms": 1})
        by[policy] = r.safety["sub_page"]
    assert by["passthrough"]["buffers"] == 0 and by["passthrough"]["mean_reachable_bytes"] == 0
    for policy in ["strict", "blocks"]:
        sp = by[policy]
        # Frags and heads smaller than their pages: some bytes of other data, never a whole page.
        assert sp["buffers"] > 0 and 0 < sp["bytes_p50"] <= sp["bytes_p99"] <= sp["bytes_max"] < 4096, sp
        assert sp["mean_reachable_bytes"] > 0, sp


def test_wqe_block_schemes_refuse_a_granule_they_cannot_map():
    p = cli("run", "c1", "--set", "os.policy=fands", "--set", "workload.nic_rx.rq=mlx5_striding", "--set",
            "platform.iommu.granule_kb=64", "--set", "platform.iommu.pwc_entries=[4,28]", check_rc=2)
    assert p.stderr.count("\n") == 1 and "os.policy" in p.stderr and "granule" in p.stderr
