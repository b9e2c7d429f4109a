"""Seed 002's instrumentation of drivers/iommu/intel/dmar.c (`iommu.print_iotlb_inv_count=1`): every window, one
line of IOTLB invalidations (total and by type, with per-second rates) and one of IOVA pages unmapped
(`intel_iommu_unmap`'s size >> VTD_PAGE_SHIFT), invalidations per page and, under xSMMU, its domain-wide
invalidations per page. The original prints every 10 s of a 60 s run; simulated runs are milliseconds long, so
the window is given in simulated ms and the rates are per simulated second."""

from __future__ import annotations

import json

# The dmesg names of the counters, by result key.
NAMES = [("psi", "PSI"), ("dsi", "DSI"), ("global", "Global"), ("tlbi_nh_va", "TLBI_VA"),
         ("tlbi_nh_asid", "TLBI_ASID"), ("tlbi_s2_ipa", "TLBI_IPA"), ("tlbi_s12_vmall", "TLBI_VMALL"),
         ("unmap", "UNMAP")]


def _line(t_s: float, text: str) -> str:
    return f"[{t_s:12.6f}] DMAR: {text}\n"


def inv_log(variant, window_ms: float) -> str:
    """Run `variant` and return its window lines."""
    sc = json.loads(variant.scenario_json())
    sim = variant.simulate()
    warm = sim.warmup_end_ns
    out = [f"# {variant.label}: policy {sc['os']['policy']}, window {window_ms:g} ms of simulated time\n"]
    step = max(1, round(window_ms * 1e6))
    prev, prev_t = dict.fromkeys(["total", "unmapped"] + [k for k, _ in NAMES], 0), warm
    t = warm
    while t < sim.end_ns:
        t = min(t + step, sim.end_ns)
        sim.advance_to(t)
        r = json.loads(sim.result_json())
        inv = r["invalidations"]
        now = {"total": inv["total"], "unmapped": r["iova_pages_unmapped"], **{k: inv.get(k, 0) for k, _ in NAMES}}
        d = {k: now[k] - prev[k] for k in now}
        secs = (t - prev_t) / 1e9

        def per_page(n: int) -> float:
            return n / d["unmapped"] if d["unmapped"] else 0.0

        kinds = " ".join(f"{name}={d[k]} ({d[k] / secs:.1f}/s)" for k, name in NAMES if k in inv)
        out.append(_line(t / 1e9, f"IOTLB inv in {window_ms:g} ms: Total={d['total']} ({d['total'] / secs:.1f}/s) "
                                  f"{kinds}"))
        tail = f" DSI_xSMMU/page={per_page(d['dsi']):.3f}" if sc["os"]["policy"] == "xsmmu" and d["dsi"] else ""
        out.append(_line(t / 1e9, f"IOVA_unmapped={d['unmapped']} ({d['unmapped'] / secs:.1f}/s) "
                                  f"inv/page={per_page(d['total']):.3f}{tail}"))
        prev, prev_t = now, t
    return "".join(out)
