"""`iommulab sensitivity`: each profile constant scaled alone, and what it changes in each run."""

import json

import pytest

from conftest import cli

SHORT = ["--set", "run.duration_ms=5", "--set", "run.warmup_ms=2", "--set", "workload.nic_rx.page_pool=false"]


def doc(policy: str, *extra: str) -> dict:
    p = cli("sensitivity", "default", "--set", f"os.policy={policy}", *SHORT, *extra, "--json", check_rc=0)
    return json.loads(p.stdout)


def test_strict_moves_most_with_the_invalidation_costs_and_passthrough_not_at_all():
    strict = doc("strict")["runs"][0]
    keys = [c["key"] for c in strict["constants"]]
    # The queued invalidation's costs are among the three that move strict's goodput most, and making them
    # dearer costs goodput.
    assert any(k.startswith("iommu.vtd.inv_") for k in keys[:3]), keys[:5]
    desc = next(c for c in strict["constants"] if c["key"] == "iommu.vtd.inv_desc_ns")
    twice = next(e for e in desc["scaled"] if e["factor"] == 2.0)
    assert twice["change"]["Gbps"] < -0.05 and twice["value"] == 2 * desc["value"]
    # Passthrough translates nothing and invalidates nothing: no IOMMU constant is on its path.
    pt = doc("passthrough")["runs"][0]
    assert pt["constants"] and not any(c["key"].startswith("iommu.") for c in pt["constants"])


def test_every_listed_constant_moves_its_run_and_says_how_it_is_known():
    d = doc("lazy", "--factor", "0.25,4")
    assert d["factors"] == [0.25, 4.0]
    for c in d["runs"][0]["constants"]:
        assert c["source"] in ("sourced", "fitted", "estimate", "-")
        changes = [v for e in c["scaled"] if "change" in e for v in e["change"].values()]
        assert any(v != 0 for v in changes), c
        assert {e["factor"] for e in c["scaled"]} == {0.25, 4.0}


def test_the_table_shows_the_baseline_and_each_factor():
    out = cli("sensitivity", "default", "--set", "os.policy=strict", *SHORT, "--top", "3", check_rc=0).stdout
    assert "strict (profile vtd-server): Gbps " in out
    # Each figure over its factors' columns.
    head = next(i for i, line in enumerate(out.splitlines()) if line.lstrip().startswith("constant"))
    over, under = out.splitlines()[head - 1:head + 1]
    assert over.split() == ["Gbps", "CPU", "busy", "exposed"] and under.split()[-7:] == ["×0.5", "×2"] * 3 + ["source"]
    assert "more constants move this run (--json lists them all)" in out


def test_the_python_api_takes_python_values():
    from iommulab.sensitivity import sensitivity

    d = sensitivity("default", {"os.policy": "strict", "run.duration_ms": 5, "run.warmup_ms": 2,
                                "workload.nic_rx.page_pool": False})
    assert [r["label"] for r in d["runs"]] == ["strict"]
    assert any(c["key"].startswith("iommu.vtd.") for c in d["runs"][0]["constants"])


@pytest.mark.parametrize("args, want", [
    (["--factor", "1"], "--factor"),
    (["--factor", "-2"], "--factor"),
    (["--factor", "two"], "--factor"),
    (["--top", "0"], "--top"),
    (["--set", "platform.cpu.nope=1"], "platform.cpu.nope"),
])
def test_bad_arguments_get_one_line(args, want):
    p = cli("sensitivity", "default", *args)
    assert p.returncode == 2 and want in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_models_list_of_estimates_is_each_profiles_own():
    # docs/model.md's "Estimates, and what each moves" (tools/estimates.py --write): every built-in profile,
    # its count of constants marked "estimate", and only estimates among the constants it lists.
    import pathlib
    import re
    import tomllib

    from iommulab import _core

    text = (pathlib.Path(__file__).parents[1] / "docs/model.md").read_text()
    section = text[text.index("<!-- estimates:begin -->"):text.index("<!-- estimates:end -->")]
    profiles = dict(_core.builtin_profiles())
    blocks = re.split(r"\n\*\*([\w-]+)\*\* \((\d+) estimates;", section)[1:]
    assert {blocks[i] for i in range(0, len(blocks), 3)} == set(profiles)
    for name, count, body in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
        sources = tomllib.loads(profiles[name])["sources"]
        estimates = {k for k, v in sources.items() if "estimate" in v.lower()}
        assert int(count) == len(estimates), name
        listed = re.findall(r"^\| `([\w.]+)` \|", body, re.M)
        assert set(listed) <= estimates, (name, set(listed) - estimates)
