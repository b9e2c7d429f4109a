"""`iommulab advise`: on this host (or a saved tree), for a workload, what passthrough, lazy and strict invalidation
each cost, what each leaves a device able to reach and what binds each, and which to run by a stated rule.

The host is read as `inspect` reads it (IOMMUs, kernel, command line, groups) plus its CPUs, NICs and NVMe drives;
the scenario is the workload's built-in (or the user's) on the closest built-in platform profile, with what the
host says put in and everything else listed as assumed. Each option is the host's command line with the kernel's
own switch, resolved by the default-domain rules (`explain`): an option the kernel would not honour here (lazy
under VT-d caching mode) runs as what the kernel would do instead, and says so."""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from typing import Any

from . import _core, hostinfo, vendors
from .api import RunResult, ScenarioError, load, run_variants, toml_value
from .report import exposure, rate
from .validate import profile_value, read_profile

# The kernel's own bound on how long lazy leaves a freed page reachable: the flush-queue timer
# (IOVA_DEFAULT_FQ_TIMEOUT, _core.FQ_TIMEOUT_MS) in whole jiffies and one more, _core.fq_timer_bound_us(hz).

# The shortest window advise runs: a lazy domain's flush-queue timer fires five times in it (10 ms each), so each
# option's exposure and flush counts are measured, not sampled once (metrics::limits MIN_TIMER_PERIODS).
MIN_WINDOW_MS = 50
# Options within this share of the fastest count as equally fast: the model's throughput moves about 1 % between
# seeds of one scenario (validate's seed ranges), so a smaller difference is not one to choose by.
TIE = 0.02
# What a workload name means: (built-in scenario, its workload table).
WORKLOADS = {"nic-rx": ("default", "nic_rx"), "nic-tx": ("tx", "nic_tx"), "nvme": ("nvme", "nvme"), "rr": ("rr", "rr")}
# The kernel's switches for each option (Documentation/admin-guide/kernel-parameters.txt): the generic iommu.*
# ones, which every architecture reads (x86 also takes iommu=pt for passthrough).
OPTIONS = [("passthrough", ["iommu.passthrough=1"]), ("lazy", ["iommu.passthrough=0", "iommu.strict=0"]),
           ("strict", ["iommu.passthrough=0", "iommu.strict=1"])]
# Command-line words the options replace.
REPLACED = re.compile(r"^(iommu\.strict|iommu\.passthrough)=|^iommu=(pt|nopt)$")


def _exposure_us(text: str) -> float:
    """--max-exposure: a time (10ms, 500us, 0.5s, 2000 in µs) or `any` (passthrough allowed)."""
    t = text.strip().lower()
    if t in ("any", "inf", "unbounded"):
        return math.inf
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|µs|ms|s)?", t)
    if not m:
        raise ScenarioError(f"--max-exposure {text!r}: expected a time such as 10ms, 500us or 0, or `any`")
    return float(m.group(1)) * {"us": 1, "µs": 1, None: 1, "ms": 1e3, "s": 1e6}[m.group(2)]


def _cmdline(host: str, words: list[str]) -> str:
    return " ".join([w for w in host.split() if not REPLACED.match(w)] + words)


def plan(res: dict[str, Any], hw: dict[str, Any], workload: str,
         given: dict[str, str] | None = None) -> tuple[Any, dict[str, Any], list[str], list[str]]:
    """The scenario for this host and workload: (scenario, keys set from the host, what was taken from the host,
    what was assumed with the key that overrides it). `given`: the keys --set gives (they win; the queues
    follow the CPUs they give)."""
    profile, why = hostinfo.profile_for(res)
    base, table = WORKLOADS.get(workload, (workload, None))
    if table is None:
        # A scenario's own workload: sized to the host as a built-in's is.
        tables = json.loads(load(base)[0].scenario_json())["workload"]
        table = next((t for t in ("nic_rx", "nic_tx", "rr", "nvme") if tables.get(t)), None)
    sets: dict[str, Any] = {"compare": {}, "platform.profile": profile}
    took = [f"platform profile {profile} ({why})"]
    p = tomllib.loads(read_profile(profile)[1])
    hyp = p.get("hypervisor")
    no_vfio = hyp and _core.emulation_refuses(p["vendor"], hyp.get("qemu", "7.2"), True, False)
    if no_vfio and workload in ("nic-rx", "nic-tx"):
        # A guest whose emulated IOMMU takes no VFIO device: its NIC is QEMU's virtio-net.
        base, table = "guest-x86", "virtio_net"
        sets |= {"platform.hypervisor.host_profile": hyp["host_profile"], "os.policy": "strict",
                 "workload.virtio_net.direction": "rx" if workload == "nic-rx" else "tx"}
        took.append(f"the guest's virtio-net, not a VFIO NIC: {no_vfio}")
    assumed = [f"every cost constant from {profile} (iommulab profiles {profile}; measure yours with iommulab "
               "profile measure)"]
    kernel = hostinfo._kernel(res.get("kernel") or "")
    if kernel:
        if hostinfo.newer_than_modelled(kernel):
            took.append(f"kernel {res['kernel']} (the model's newest, {_core.KERNEL_NEWEST}, stands in)")
            kernel = _core.KERNEL_NEWEST
        else:
            took.append(f"kernel {kernel}")
        sets["os.kernel"] = kernel
    else:
        assumed.append("the kernel: the scenario's (os.kernel)")
    if vendors.names(modelled=True, arch=res.get("arch")):
        sets["os.arch"] = res["arch"]
    cm = vendors.with_caching_mode(res["iommus"])
    if cm:
        sets |= _dotted("platform.iommu", vendors.scenario_iommu(cm))
        took.append(f"{vendors.DRIVERS[cm['vendor']]['title']} caching mode on "
                    f"({vendors.DRIVERS[cm['vendor']]['caching_mode_cap']})")
    cores = hw["cpus"]
    if (given or {}).get("platform.cpu.cores", "").isdigit():
        cores = int(given["platform.cpu.cores"])
        took.append(f"{cores} CPUs (--set)")
    elif cores:
        sets["platform.cpu.cores"] = cores
        took.append(f"{cores} CPUs" + (f" ({hw['cpu_model']})" if hw.get("cpu_model") else ""))
    else:
        cores = profile_value(p, "cpu.cores")
        assumed.append(f"{cores} CPUs, the profile's (platform.cpu.cores)")
    # Clusters and sockets no larger than those CPUs (--set's own values, given after these, win).
    for k in ("cluster_cores", "socket_cores"):
        if profile_value(p, f"cpu.{k}", cores) > cores:
            sets[f"platform.cpu.{k}"] = cores
    if table in ("nic_rx", "nic_tx", "rr"):
        nic = max(hw["nics"], key=lambda n: n["speed_gbps"] or 0, default=None)
        if nic and nic["speed_gbps"]:
            sets[f"workload.{table}.line_rate_gbps"] = nic["speed_gbps"]
            took.append(f"NIC {nic['name']} ({nic['device']}) at {nic['speed_gbps']:g} Gbps")
        else:
            assumed.append(f"the NIC's line rate: the {base} scenario's (workload.{table}.line_rate_gbps)")
        # One queue per CPU, as drivers set them up and RSS spreads flows over them; at most 16 (a modelling
        # bound: the built-in scenarios go no further).
        queues = min(q for q in (cores, nic and nic["rx_queues"], 16) if q)
        sets[f"workload.{table}.queues"] = queues
        if table != "rr":
            sets[f"workload.{table}.flows"] = queues
        (took if hw["cpus"] or "platform.cpu.cores" in (given or {}) else assumed).append(
            f"{queues} queue{'s' * (queues > 1)}" + (" and flows" if table != "rr" else "")
            + " (one per CPU up to the NIC's receive queues, as RSS spreads them; "
            f"workload.{table}.queues)")
    elif table == "nvme":
        if hw["nvme"]:
            sets["workload.nvme.drives"] = len(hw["nvme"])
            took.append(f"{len(hw['nvme'])} NVMe drive(s) ({', '.join(hw['nvme'])})")
        else:
            assumed.append("the drives: the nvme scenario's two (workload.nvme.drives)")
        sets["workload.nvme.jobs"] = min(cores, 4)
        assumed.append("fio 4k randread, iodepth 32, one job per CPU up to 4 (workload.nvme.*)")
    if workload not in WORKLOADS:
        took.append(f"the workload of {base}")
    return base, sets, took, assumed


def _dotted(prefix: str, table: dict[str, Any]) -> dict[str, Any]:
    """A nested table under `prefix` as --set keys: {"a": {"b": 1}} gives {"PREFIX.a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        out |= _dotted(f"{prefix}.{k}", v) if isinstance(v, dict) else {f"{prefix}.{k}": v}
    return out


def _resolve(res: dict[str, Any], kernel: str | None, words: list[str]) -> tuple[str, str, dict[str, str]]:
    """An option's command line, the policy the kernel's rules give a PCI device with it, and why; and the
    untrusted devices' policy."""
    cmd = _cmdline(res.get("cmdline") or "", words)
    vendor = vendors.first({i["vendor"] for i in res["iommus"]})
    if not vendor or not kernel or res.get("arch") not in vendors.DRIVERS[vendor]["archs"]:
        return cmd, "", {}
    cm = vendors.with_caching_mode(res["iommus"]) is not None
    rules = json.loads(_core.explain(res["arch"], kernel, cmd, cm, vendor))
    by = {d["device"]: d for d in rules["devices"]}
    return cmd, by["PCI device"]["policy"], by.get("untrusted PCI device", {})


def _reach(r: RunResult) -> str:
    s = r.safety
    if not s["protected"]:
        return "all memory, at any time"
    sub = s["sub_page"]["mean_reachable_bytes"] / 1024
    mine = "the buffers mapped for it" + (f" (and {sub:.1f} KiB of other data sharing their pages)" if sub else "")
    w = s.get("window")
    if not w:
        return f"only {mine}"
    return f"{mine}, and pages freed back to their owners for up to {w['max_us'] / 1000:.1f} ms"


# What ranks the options, by the workload's kind: (JSON key, table header, value of a run, higher is better).
MEASURES = {
    "gbps": ("throughput_gbps", "Gbps", lambda r: r.throughput_gbps, True),
    "iops": ("iops", "kIOPS", lambda r: r.packets_per_sec, True),
    "latency": ("latency_p99_us", "p99 µs", lambda r: (r.latency or {}).get("p99_us", 0.0), False),
}


def _measure(base: str, r: RunResult) -> str:
    if getattr(r, "latency", None):
        return "latency"  # a fixed offered load: what the options change is the latency
    return "iops" if base == "nvme" or r.line_rate_gbps == 0 or r.scenario == "nvme" else "gbps"


def advise(root: str | os.PathLike = "/", workload: str = "nic-rx", max_exposure: str | None = None,
           sets: dict[str, str] | None = None) -> dict[str, Any]:
    """The verdict for the host at `root`: host, assumed, options (one run each) and the recommendation. `sets`:
    scenario keys with TOML values as the command line gives them."""
    given = _exposure_us(max_exposure) if max_exposure is not None else None
    res, _ = hostinfo.inspect(root)
    hw = res["hardware"]
    base, keys, took, assumed = plan(res, hw, workload, sets)
    keys = {k: toml_value(v) for k, v in keys.items()} | dict(sets or {})
    sc = json.loads(load(base, keys, raw_strings=True)[0].scenario_json())
    kernel = sc["os"]["kernel"]
    if sc["run"]["duration_ms"] < MIN_WINDOW_MS and "run.duration_ms" not in (sets or {}):
        keys["run.duration_ms"] = str(MIN_WINDOW_MS)
        took.append(f"a {MIN_WINDOW_MS} ms window (the scenario's {sc['run']['duration_ms']:g} ms is too short to "
                    "time a lazy flush queue)")
    hz = sc["os"]["hz"]
    bound = _core.fq_timer_bound_us(hz) if given is None else given
    options, caveats = [], []
    no_iommu = not res["iommus"] and not res["groups"]
    variants = []
    for name, words in OPTIONS:
        cmd, policy, untrusted = _resolve(res, kernel, words)
        opt = {"option": name, "cmdline": " ".join(words), "policy": policy or name}
        if policy and policy != name:
            opt["note"] = f"the kernel gives {policy} here, not {name}"
        if untrusted and untrusted.get("policy") != opt["policy"]:
            opt["untrusted"] = untrusted["policy"]
        options.append(opt)
        variants += load(base, {**keys, "os.policy": toml_value(opt["policy"]), "os.cmdline": toml_value(cmd)},
                         raw_strings=True)
    results = run_variants(variants)
    kind = _measure(base, results[0])
    key, _, value, higher = MEASURES[kind]
    for opt, r in zip(options, results):
        w = (r.safety.get("window") or {}).get("p99_us")
        opt |= {"throughput_gbps": r.throughput_gbps, key: value(r), **({"kreq_per_sec": r.packets_per_sec / 1e3}
                                                                         if kind == "latency" else {}),
                "cpu_busy": r.cpu_busy, "protected": r.safety["protected"],
                # null: an identity domain, every page reachable at any time; 0: no page exposed.
                "exposure_p99_us": w or 0.0 if r.safety["protected"] else None,
                "limited_by": r.limited_by, "reach": _reach(r), "warnings": r.warnings}
    # The measure as "more is better".
    speed = (lambda o: o[key]) if higher else (lambda o: -o[key])
    exposed = lambda o: math.inf if o["exposure_p99_us"] is None else o["exposure_p99_us"]
    ok = [o for o in options if exposed(o) <= bound]
    fastest = "the fastest option" if higher else "the option with the lowest p99 latency"
    rule = (f"{fastest} whose p99 exposure is within {_bound_text(bound)}"
            + (" (--max-exposure)" if given is not None else
               f" (the default: the kernel's own bound on lazy exposure, its {_core.FQ_TIMEOUT_MS} ms flush-queue timer "
               f"at HZ {hz})")
            + f"; options within {TIE:.0%} of the best count as equally good, and of those the one exposing "
            "least wins (then one the kernel honours as asked)")
    rec = None
    if ok:
        best = max(speed(o) for o in ok)
        rec = min((o for o in ok if speed(o) >= best - abs(best) * TIE), key=lambda o: (exposed(o), bool(o.get("note"))))
    for o in options:
        if o.get("note"):
            caveats.append(f"{o['cmdline']}: {o['note']} (iommulab explain --cmdline '{o['cmdline']}' says why)")
    untrusted = [d["device"] for d in res["devices"] if d.get("untrusted")]
    if untrusted:
        caveats.append(f"untrusted (external-facing) devices stay strict whatever the command line: "
                       f"{', '.join(untrusted)}")
    vfio = sorted({d["device"] for d in res["devices"] if d.get("driver") == "vfio-pci" or d.get("type") == "unmanaged"})
    if vfio:
        caveats.append(f"devices assigned to user space or a VM (VFIO) are not affected: {', '.join(vfio)}")
    if hw.get("confidential"):
        caveats.append(f"a confidential guest ({hw['confidential']}): DMA bounces through swiotlb's shared "
                       "buffers, so a device never reaches private memory whatever the option; the bounce copy is "
                       "not modelled")
    if no_iommu:
        caveats.insert(0, "No IOMMU is visible: every device reaches all memory now, as under passthrough. "
                          "Enabling one (in firmware, and intel_iommu=on on Intel) would cost what the lazy and "
                          "strict rows say, on the profile that stands in for this hardware.")
    caveats += [n for n in res["notes"] if not n.startswith("No IOMMU")]
    return {
        "host": {"kernel": res["kernel"], "arch": res["arch"], "cmdline": res["cmdline"],
                 "iommus": res["iommus"], **hw},
        "scenario": base, "set": {k: v for k, v in keys.items() if k != "compare"},
        "from_host": took, "assumed": assumed,
        "measure": key,
        "options": options,
        "recommendation": {"option": rec["option"] if rec else None, "cmdline": rec["cmdline"] if rec else None,
                           "rule": rule,
                           "why": (f"{_speed_text(rec, key)}; {_exposed_text(rec)}" if rec else
                                   "no option keeps the exposure within the bound")},
        "caveats": caveats,
    }


def _bound_text(us: float) -> str:
    return "any time (passthrough allowed)" if math.isinf(us) else f"{us / 1000:g} ms" if us >= 1000 else f"{us:g} µs"


def _exposure_text(o: dict[str, Any]) -> str:
    v = o["exposure_p99_us"]
    return exposure(v is not None, v or None) + (" µs" if v else "")


def _exposed_text(o: dict[str, Any]) -> str:
    v = o["exposure_p99_us"]
    if v is None:
        return "a device reaches all memory"
    return f"p99 exposure {v:.0f} µs" if v else "no page is exposed"


def _speed_text(o: dict[str, Any], key: str) -> str:
    if key == "iops":
        return f"{rate(o['iops'])} IOPS"
    if key == "latency_p99_us":
        return f"p99 latency {o[key]:.1f} µs at {o['kreq_per_sec']:.0f}k requests/s"
    return f"{o['throughput_gbps']:.1f} Gbps"


def format_advise(doc: dict[str, Any]) -> str:
    h = doc["host"]
    iommus = ", ".join(f"{i['name']} ({i['vendor']}"
                       + (f", caching mode {'on' if i.get('caching_mode') else 'off'}" if "caching_mode" in i else "")
                       + ")" for i in h["iommus"]) or "no IOMMU"
    lines = [f"host: Linux {h['kernel'] or '?'} {h['arch']} · {iommus} · "
             f"{h['cpus'] or '?'} CPUs · NICs {', '.join(n['name'] for n in h['nics']) or 'none seen'} · "
             f"NVMe {', '.join(h['nvme']) or 'none seen'}",
             f"scenario: {doc['scenario']} with " + " ".join(f"{k}={v}" for k, v in doc["set"].items()),
             "from the host: " + "; ".join(doc["from_host"]),
             "assumed: " + "; ".join(doc["assumed"]) + " (change any with --set KEY=VALUE)", ""]
    key = doc["measure"]
    header = next(h for k, h, _, _ in MEASURES.values() if k == key)
    cell = {"iops": lambda o: f"{o['iops'] / 1e3:.0f}", "latency_p99_us": lambda o: f"{o[key]:.1f}",
            "throughput_gbps": lambda o: f"{o['throughput_gbps']:.2f}"}[key]
    head = ["option", "command line", header, "CPU busy", "exposure p99 µs", "limited by", "a device can reach"]
    rows = [[o["option"] + (" *" if o.get("note") else ""), o["cmdline"], cell(o), f"{o['cpu_busy'] * 100:.1f}%",
             _exposure_text(o).removesuffix(" µs"), o["limited_by"], o["reach"]] for o in doc["options"]]
    w = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head) - 1)]
    right = {2, 3, 4}
    fmt = lambda cells: "  ".join((c.rjust(w[i]) if i in right else c.ljust(w[i])) if i < len(w) else c
                                  for i, c in enumerate(cells)).rstrip()
    lines += [fmt(head), "-" * (sum(w) + 2 * len(w) + len(head[-1]))] + [fmt(r) for r in rows]
    r = doc["recommendation"]
    lines += ["", f"recommendation: {r['option']} ({r['cmdline']}): {r['why']}" if r["option"] else
              f"recommendation: none: {r['why']}", f"rule: {r['rule']}"]
    warn = sorted({f"{o['option']}: {x}" for o in doc["options"] for x in o.get("warnings") or []})
    if doc["caveats"] or warn:
        lines += ["", "caveats:"] + [f"  - {c}" for c in doc["caveats"]] + [f"  - warning: {x}" for x in warn]
    return "\n".join(lines) + "\n"
