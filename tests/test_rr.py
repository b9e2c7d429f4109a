"""Request/response: small requests in, one response per request mapped per send; latency as the client sees it."""

import json

import iommulab
from conftest import cli


def test_rr_prints_rate_and_latency_columns_and_json_percentiles():
    p = cli("run", "rr", "--set", "workload.rr.rate_rps=200000", check_rc=0)
    assert "latency p99" in p.stdout and "kreq/s" in p.stdout
    runs = json.loads(cli("run", "rr", "--set", "workload.rr.rate_rps=200000", "--json", check_rc=0).stdout)["runs"]
    for r in runs:
        lat = r["latency"]
        assert lat["count"] > 0 and 0 < lat["p50_us"] <= lat["p99_us"] <= lat["p999_us"] <= lat["max_us"]
        assert abs(r["packets_per_sec"] - 200000) / 200000 < 0.02
    # Throughput workloads carry no latency key.
    tx = json.loads(cli("run", "tx", "--json", check_rc=0).stdout)["runs"]
    assert all("latency" not in r for r in tx)


def test_the_iommu_lengthens_each_request_and_strict_waits_for_every_unmap():
    by = {p: iommulab.run("rr", **{"os.policy": p, "workload.rr.rate_rps": 200000})
          for p in ("passthrough", "lazy", "strict")}
    assert by["lazy"].latency["p50_us"] > by["passthrough"].latency["p50_us"]
    assert by["strict"].latency["p50_us"] > by["passthrough"].latency["p50_us"]
    assert by["strict"].cpu_inv_wait_share > 0.1 > by["lazy"].cpu_inv_wait_share


def test_a_bad_rr_key_is_one_line_naming_it():
    p = cli("run", "rr", "--set", "workload.rr.request_bytes=9000")
    assert p.returncode == 2 and "workload.rr.request_bytes" in p.stderr and "\n" not in p.stderr.strip(), p.stderr
