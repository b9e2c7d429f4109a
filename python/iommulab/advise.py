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
from typing import Any, Callable

from . import _core, hostinfo, vendors
from .api import RunResult, ScenarioError, load, run_variants, toml_value
from .ranges import DEFAULT_SAMPLES, bounds, fmt, ranged
from .robustness import ROBUST_SHARE, deciding, flip_value, how_to_measure, sampled_options
from .sensitivity import constants
from .inputs import shown
from .report import command_lines, duration, exposure, fit, left, right, wrap
from .validate import Runner, check, load_targets, profile_value, read_profile

# The kernel's own bound on how long lazy leaves a freed page reachable: the flush-queue timer
# (IOVA_DEFAULT_FQ_TIMEOUT, _core.FQ_TIMEOUT_MS) in whole jiffies and one more, _core.fq_timer_bound_us(hz).

# The shortest window advise runs: a lazy domain's flush-queue timer fires five times in it (10 ms each), so each
# option's exposure and flush counts are measured, not sampled once (metrics::limits MIN_TIMER_PERIODS).
MIN_WINDOW_MS = 50
# Each option runs at this many seeds (the scenario's and the next ones): one seed is one sample of arrivals and
# of RSS, and the spread of an option's measure over its seeds is the run's own noise. Options closer to the best
# than the widest such spread count as equally good (the tie); CPU busy is weighed the same way. A modelling
# choice, not a kernel constant: three samples give a range at a third of the cost of validate's five.
SEEDS = 3
# An option whose p99 exposure is within this share under the bound is flagged ("a few percent", or its own
# spread over the seeds when wider): it qualifies by a margin a little more load or another seed can take.
# A modelling choice, not a kernel constant.
NEAR_BOUND = 0.05
# --set keys advise cannot honour: it runs every option with the host's command line and the option's switch.
REFUSED = {"os.policy": "advise runs every option (passthrough, lazy, strict); iommulab run pins one",
           "os.cmdline": "each option runs the host's command line with its own switch; iommulab run takes one"}
# validate's targets bear on the verdict when they check what advise ranks the options by: by measure, the
# result key a target's value must use (IOPS and latency have no target).
TARGET_MEASURE = {"throughput_gbps": "throughput_gbps"}
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


def plan(res: dict[str, Any], hw: dict[str, Any], workload: str, given: dict[str, str] | None = None
         ) -> tuple[Any, dict[str, Any], list[str], list[tuple[str, str]], str | None]:
    """The scenario for this host and workload: (scenario, keys set from the host, what was taken from the host,
    what was assumed as (what, the key whose value the run used), why the workload's built-in scenario was
    swapped for another, if it was). `given`: the keys --set gives (they win; the queues follow the CPUs
    they give)."""
    given = given or {}
    profile, why = hostinfo.profile_for(res)
    base, table = WORKLOADS.get(workload, (workload, None))
    if table is None:
        # A scenario's own workload: sized to the host as a built-in's is.
        tables = json.loads(load(base)[0].scenario_json())["workload"]
        table = next((t for t in ("nic_rx", "nic_tx", "rr", "nvme") if tables.get(t)), None)
    sets: dict[str, Any] = {"compare": {}, "platform.profile": profile}
    took = [f"platform profile {profile} ({why})"]
    if hw.get("guest"):
        took.insert(0, f"a guest{' of ' + hw['vmm'] if hw.get('vmm') else ''} ({hw['guest_evidence']}), not bare "
                       "metal: its IOMMU, if any, is its VMM's")
    p = tomllib.loads(read_profile(profile)[1])
    hyp = p.get("hypervisor")
    no_vfio = hyp and _core.emulation_refuses(p["vendor"], hyp.get("qemu", "7.2"), True, False)
    assumed = [(f"every cost constant from {profile} (iommulab profiles {profile}; measure yours with "
                "iommulab profile measure)", "")]
    kernel = hostinfo._kernel(res.get("kernel") or "")
    if kernel:
        if hostinfo.newer_than_modelled(kernel):
            took.append(f"kernel {res['kernel']} (the model's newest, {_core.KERNEL_NEWEST}, stands in)")
            kernel = _core.KERNEL_NEWEST
        else:
            took.append(f"kernel {kernel}")
        sets["os.kernel"] = kernel
    else:
        assumed.append(("the kernel", "os.kernel"))
    arch = _arch(res, took)
    if arch:
        sets["os.arch"] = arch
    cm = vendors.with_caching_mode(res["iommus"])
    if cm:
        sets |= _dotted("platform.iommu", vendors.scenario_iommu(cm))
        took.append(f"{vendors.DRIVERS[cm['vendor']]['title']} caching mode on "
                    f"({vendors.DRIVERS[cm['vendor']]['caching_mode_cap']})")
    swapped = None
    if hyp and (no_vfio or _refuses_vfio(base, table, sets)):
        base, table, swapped = _emulated_nic(p, no_vfio, base, workload, sets, took)
    cores = hw["cpus"]
    if re.fullmatch(r"[0-9]{1,6}", given.get("platform.cpu.cores", "")):
        cores = int(given["platform.cpu.cores"])
    elif cores:
        sets["platform.cpu.cores"] = cores
        took.append(f"{cores} CPUs" + (f" ({hw['cpu_model']})" if hw.get("cpu_model") else ""))
    else:
        cores = profile_value(p, "cpu.cores")
        assumed.append(("CPUs, the profile's", "platform.cpu.cores"))
    # Clusters and sockets no larger than those CPUs (--set's own values, given after these, win).
    for k in ("cluster_cores", "socket_cores"):
        if profile_value(p, f"cpu.{k}", cores) > cores:
            sets[f"platform.cpu.{k}"] = cores
    if table in ("nic_rx", "nic_tx", "rr", "virtio_net"):
        _nic(hw, table, base, cores, sets, took, assumed, given)
    elif table == "nvme":
        if hw["nvme"]:
            sets["workload.nvme.drives"] = len(hw["nvme"])
            took.append(f"{len(hw['nvme'])} NVMe drive(s) ({', '.join(hw['nvme'])})")
        else:
            assumed.append(("NVMe drives, the nvme scenario's", "workload.nvme.drives"))
        sets["workload.nvme.jobs"] = min(cores, 4)
        assumed.append(("fio jobs (4k randread, iodepth 32, one per CPU up to 4)", "workload.nvme.jobs"))
    if workload not in WORKLOADS:
        took.append(f"the workload of {base}")
    return base, sets, took, assumed, swapped


def _emulated_nic(p: dict[str, Any], no_vfio: str | None, base: str, workload: str, sets: dict[str, Any],
                  took: list[str]) -> tuple[str, str, str]:
    """A guest whose emulated IOMMU takes no VFIO device (QEMU's AMD IOMMU before 10.1; any without caching mode,
    which QEMU needs to shadow a VFIO device's mappings): its NIC is an emulated one, QEMU's virtio-net, whose
    built-in guest scenario stands in (scenario, table, why it was swapped). Another workload's device has no
    emulated stand-in: a one-line error says so."""
    title = vendors.DRIVERS[p["vendor"]]["title"]
    if workload not in ("nic-rx", "nic-tx"):
        cm_key = vendors.DRIVERS[p["vendor"]].get("caching_mode_key")
        raise ScenarioError(
            f"--workload {workload}: its device would be assigned through VFIO, which "
            + (no_vfio or f"QEMU's emulated {title} without caching mode cannot take (--set "
               f"platform.iommu.{cm_key}=true models a guest whose VMM sets it)")
            + "; the model has no emulated device for it")
    new = "guest-arm" if sets.get("os.arch") == "arm64" else "guest-x86"
    sets |= {"platform.hypervisor.host_profile": p["hypervisor"]["host_profile"], "os.policy": "strict",
             "workload.virtio_net.direction": "rx" if workload == "nic-rx" else "tx"}
    reason = no_vfio or f"QEMU's emulated {title} without caching mode takes no VFIO device"
    took.append(f"the guest's virtio-net, not a VFIO NIC: {reason}")
    return new, "virtio_net", f"run on {new}'s virtio-net, not {base}'s NIC: {reason}"


def _refuses_vfio(base: str, table: str, sets: dict[str, Any]) -> bool:
    """Whether the core refuses the scenario `base`'s device (a VFIO-assigned one) behind this profile's
    emulated IOMMU (one queue, so that only that check can fail)."""
    one = ({f"workload.{table}.queues": 1} if table in ("nic_rx", "nic_tx", "rr") else {}) | (
        {f"workload.{table}.flows": 1} if table in ("nic_rx", "nic_tx") else {})
    try:
        load(base, {k: toml_value(v) for k, v in (sets | one).items()}, raw_strings=True)
    except ScenarioError as e:
        return "VFIO" in str(e)
    return False


def _arch(res: dict[str, Any], took: list[str]) -> str | None:
    """The architecture the scenario runs: the host's, or, when its IOMMU cannot be on it or the model has none
    for it, the one the IOMMU's driver is built for (x86_64 without one), said in `took`."""
    arch = res.get("arch")
    vendor = vendors.first({i["vendor"] for i in res["iommus"]})
    archs = vendors.DRIVERS[vendor]["archs"] if vendor else [a for d in vendors.DRIVERS.values()
                                                              if d["modelled"] for a in d["archs"]]
    if arch in archs:
        return arch
    to = archs[0] if vendor else "x86_64"
    what = (f"{vendors.DRIVERS[vendor]['title']} cannot be on {arch}" if vendor else
            f"the model has no IOMMU for {arch}")
    took.append(f"architecture {shown(str(arch))}: {what}; runs as {to}")
    return to


def _nic(hw: dict[str, Any], table: str, base: str, cores: int, sets: dict[str, Any], took: list[str],
         assumed: list[tuple[str, str]], given: dict[str, str]) -> None:
    """The NIC's line rate and one queue and flow per CPU, up to the NIC's queues in the workload's direction."""
    nic = max(hw["nics"], key=lambda n: n["speed_gbps"] or 0, default=None)
    rate_key = f"workload.{table}.line_rate_gbps"
    if nic and nic["speed_gbps"] and rate_key not in given:
        sets[rate_key] = nic["speed_gbps"]
        took.append(f"NIC {nic['name']} ({nic['device']}) at {nic['speed_gbps']:g} Gbps")
    elif rate_key not in given:
        assumed.append((f"the NIC's line rate, the {base} scenario's (Gbps)", rate_key))
    if table == "virtio_net":
        return  # one virtqueue pair: the scenario's
    tx = table == "nic_tx" or (table == "virtio_net" and sets.get("workload.virtio_net.direction") == "tx")
    side = "transmit" if tx else "receive"
    nic_queues = nic and nic["tx_queues" if tx else "rx_queues"]
    # One queue per CPU, as drivers set them up and RSS (XPS on transmit) spreads flows over them; at most 16 (a
    # modelling bound: the built-in scenarios go no further).
    queues = min(q for q in (cores, nic_queues, 16) if q)
    qkey = f"workload.{table}.queues"
    if qkey in given:
        queues = int(given[qkey]) if re.fullmatch(r"[0-9]{1,6}", given[qkey]) else queues
    else:
        sets[qkey] = queues
        if table != "rr":
            sets[f"workload.{table}.flows"] = queues
        what = (f"queues{' and flows' if table != 'rr' else ''} (one per CPU up to the NIC's {side} queues"
                + (f", {nic_queues}" if nic_queues else "") + ")")
        if queues == 1:
            what = what.replace("queues", "queue", 1).replace("flows", "flow")
        if hw["cpus"] or "platform.cpu.cores" in given:
            took.append(f"{queues} {what}")
        else:
            assumed.append((what, qkey))
    if cores > queues:
        why = (f"the NIC has {nic_queues} {side} queue{'s' * (nic_queues > 1)}" if nic_queues == queues else
               "the model takes 16 queues at most" if queues == 16 else f"{qkey}={queues}")
        took.append(f"{cores - queues} of the {cores} CPUs take no {side} queue and stay idle ({why})")


def _dotted(prefix: str, table: dict[str, Any]) -> dict[str, Any]:
    """A nested table under `prefix` as --set keys: {"a": {"b": 1}} gives {"PREFIX.a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        out |= _dotted(f"{prefix}.{k}", v) if isinstance(v, dict) else {f"{prefix}.{k}": v}
    return out


def _rules(res: dict[str, Any], kernel: str | None, cmd: str) -> dict[str, dict[str, str]]:
    """What the kernel's default-domain rules give each kind of device with command line `cmd` ({} when they
    cannot be applied: no IOMMU the model has, on an architecture its driver is built for)."""
    vendor = vendors.first({i["vendor"] for i in res["iommus"]})
    if not vendor or not kernel or res.get("arch") not in vendors.DRIVERS[vendor]["archs"]:
        return {}
    cm = vendors.with_caching_mode(res["iommus"]) is not None
    return {d["device"]: d for d in json.loads(_core.explain(res["arch"], kernel, cmd, cm, vendor))["devices"]}


def _explain_command(res: dict[str, Any], kernel: str, words: list[str]) -> str:
    """The `iommulab explain` command that gives what the rules give this host with `words`: its
    architecture, kernel, IOMMU, caching mode and the words of its command line the rules read (iommu_setup()'s
    and iommu_dma_setup()'s, and the driver's own parameter: the rest change nothing explain says)."""
    vendor = vendors.first({i["vendor"] for i in res["iommus"]})
    cm = " --caching-mode on" if vendors.with_caching_mode(res["iommus"]) else ""
    read = {"iommu", "iommu.passthrough", "iommu.strict", vendors.DRIVERS[vendor].get("param")}
    cmd = " ".join(w for w in _cmdline(res.get("cmdline") or "", words).split() if w.split("=", 1)[0] in read)
    return f"iommulab explain --arch {res['arch']} --kernel {kernel} --iommu {vendor}{cm} --cmdline '{cmd}'"


def current(res: dict[str, Any], kernel: str | None) -> dict[str, str]:
    """The DMA option the host runs now, and where it comes from: the IOMMU groups' types (what runs), and the
    command line's switch or the rule the kernel followed (why)."""
    if not res["iommus"] and not res["groups"]:
        return {"policy": "passthrough", "from": "the absence of an IOMMU: every device reaches all memory"}
    types = [g["type"] for g in res["groups"] if g["devices"] and g["type"] in ("DMA", "DMA-FQ", "identity")]
    rule = _rules(res, kernel, res.get("cmdline") or "").get("PCI device", {})
    if types:
        gtype = max(set(types), key=types.count)
        policy = hostinfo.GROUP_MODES[gtype]
    else:
        gtype, policy = None, rule.get("policy")
    if not policy:
        return {"policy": "unknown", "from": "no IOMMU group has a DMA domain type"}
    words = [w for w in (res.get("cmdline") or "").split() if REPLACED.match(w)]
    why = rule.get("why", "")
    if rule.get("policy") == policy and "set via kernel command line" in why and words:
        src = " ".join(words)
    elif rule.get("policy") == policy and why:
        src = why if not why.startswith(("Default domain type", "DMA domain TLB")) else (
            "the kernel's default" + (f" (CONFIG_IOMMU_DEFAULT: {res['config_default']})"
                                      if res.get("config_default") else ""))
    elif not rule and words and _asked(words) == policy:
        src = " ".join(words)  # the rules cannot be applied here: the command line says it alone
    else:
        src = "the groups' type" + (f" (the kernel's rules give {rule['policy']})" if rule else "")
    return {"policy": policy, "from": src + (f" (IOMMU groups: {gtype})" if gtype else "")}


def _asked(words: list[str]) -> str | None:
    """The option the command line's own switches ask for (iommu_setup(), iommu_dma_setup(): the last of each
    wins, and passthrough before strictness)."""
    pt = strict = None
    for w in words:
        k, _, v = w.partition("=")
        if k == "iommu.passthrough":
            pt = v in ("1", "y", "Y", "on")
        elif w in ("iommu=pt", "iommu=nopt"):
            pt = w == "iommu=pt"
        elif k == "iommu.strict":
            strict = v in ("1", "y", "Y", "on")
    return "passthrough" if pt else {True: "strict", False: "lazy", None: None}[strict]


def _reach(r: RunResult) -> str:
    s = r.safety
    if not s["protected"]:
        return "all memory, at any time"
    if getattr(r, "swiotlb", None):
        w = s.get("window") or {}
        return ("only swiotlb's shared slots: a copy of each buffer while it is mapped, and the stale copy after "
                f"the unmap until the slot is reused (up to {duration(w.get('max_us', 0.0))} here); never the "
                "buffers themselves, in private memory")
    sub = s["sub_page"]["mean_reachable_bytes"] / 1024
    mine = "the buffers mapped for it" + (f" (and {sub:.1f} KiB of other data sharing their pages)" if sub else "")
    w = s.get("window")
    if not w:
        return f"only {mine}"
    return f"{mine}, and pages freed back to their owners for up to {duration(w['max_us'])}"


# What ranks the options, by the workload's kind: (JSON key, table header, value of a run, higher is better).
MEASURES = {
    "gbps": ("throughput_gbps", "Gbps", lambda r: r.throughput_gbps, True),
    "iops": ("iops", "kIOPS", lambda r: r.packets_per_sec, True),
    "latency": ("latency_p99_us", "latency p99", lambda r: (r.latency or {}).get("p99_us", 0.0), False),
}


def _measure(base: str, r: RunResult) -> str:
    if getattr(r, "latency", None):
        return "latency"  # a fixed offered load: what the options change is the latency
    return "iops" if base == "nvme" or r.line_rate_gbps == 0 or r.scenario == "nvme" else "gbps"


def advise(root: str | os.PathLike = "/", workload: str = "nic-rx", max_exposure: str | None = None,
           sets: dict[str, str] | None = None, ranges: int | None = DEFAULT_SAMPLES, jobs: int | None = None
           ) -> dict[str, Any]:
    """The verdict for the host at `root`: host, assumed, options (SEEDS runs each) and the recommendation;
    `ranges`: each option also ranged over that many samples of the profile's ranged constants, and the verdict
    said robust or not (None: one point). `sets`: scenario keys with TOML values as the command line gives
    them."""
    given = _exposure_us(max_exposure) if max_exposure is not None else None
    sets = dict(sets or {})
    for k in sets:
        if k in REFUSED:
            raise ScenarioError(f"--set {k}: not used here: {REFUSED[k]}")
    res, _ = hostinfo.inspect(root)
    hw = res["hardware"]
    base, keys, took, assumed, swapped = plan(res, hw, workload, sets)
    coco = _coco(sets, hw, took)
    keys = {k: toml_value(v) for k, v in keys.items()} | sets
    if coco:
        keys |= {"os.policy": toml_value("passthrough"), "os.coco": toml_value(coco)}
    sc = json.loads(load(base, keys, raw_strings=True)[0].scenario_json())
    kernel = sc["os"]["kernel"]
    if sc["run"]["duration_ms"] < MIN_WINDOW_MS and "run.duration_ms" not in sets:
        keys["run.duration_ms"] = str(MIN_WINDOW_MS)
        took.append(f"a {MIN_WINDOW_MS} ms window (the scenario's {sc['run']['duration_ms']:g} ms is too short to "
                    "time a lazy flush queue)")
    if coco:
        return _advise_bounce(res, hw, base, keys, sc, took, assumed, swapped, coco, jobs)
    hz = sc["os"]["hz"]
    bound = _core.fq_timer_bound_us(hz) if given is None else given
    options, variants = _option_runs(res, kernel, base, keys, sc["run"]["seed"])
    results = run_variants(variants, None, jobs)
    kind = _measure(base, results[0])
    key, _, value, higher = MEASURES[kind]
    for j, opt in enumerate(options):
        _fill(opt, results[j * SEEDS:(j + 1) * SEEDS], key, kind, value)
    now = current(res, kernel)
    _against(options, now, key)
    verdict = choose(options, bound, key, higher)
    sure = (_how_sure(base, options, variants[::SEEDS], verdict, bound, key, value, higher, ranges,
                      jobs) if ranges is not None else {"robust": None})
    rule = _rule_text(verdict, bound, given, hz, higher)
    rec = verdict["option"]
    flags = [f for o in options if exposed(o) <= bound and (f := _near_bound(o, bound, given))]
    checks = targets_bearing(sc["platform"]["profile"], key)
    why = (_why(rec, verdict, key) if rec else "no option keeps the exposure within the bound")
    if swapped:
        why += f"; {swapped}"
    return {
        "host": _host_doc(res, hw, now),
        "scenario": base, "set": {k: v for k, v in keys.items() if k != "compare"},
        "from_host": took, "assumed": [_assumed_text(w, k, sc) for w, k in assumed],
        "measure": key,
        "noise": {"seeds": SEEDS, "tie": verdict["tie"], "cpu_tie": verdict["cpu_tie"]},
        "options": options,
        "recommendation": {"option": rec["option"] if rec else None, "cmdline": rec["cmdline"] if rec else None,
                           "rule": rule, "why": why, "flags": flags, "swapped": swapped,
                           "validation": checks, **sure},
        "caveats": _caveats(res, hw, options, sc),
    }


# What the kernel reports of a confidential guest ("Memory Encryption Features active: AMD SEV SEV-ES SEV-SNP",
# TDX's "tdx_guest" flag) as os.coco: SEV and SEV-ES guests bounce as SEV-SNP ones do (force_dma_unencrypted).
COCO_OF = [("SEV-SNP", "sev-snp"), ("TDX", "tdx"), ("SEV", "sev-snp")]


def _coco(sets: dict[str, str], hw: dict[str, Any], took: list[str]) -> str | None:
    """The confidential-computing type advise models: --set os.coco's, else the guest's own; None when not
    confidential."""
    if "os.coco" in sets:
        v = sets["os.coco"].strip().strip('"')
        return None if v == "none" else v
    seen = hw.get("confidential")
    coco = next((c for k, c in COCO_OF if seen and k in seen), None)
    if coco:
        took.append(f"a confidential guest ({seen}): every streaming DMA bounces through swiotlb (os.coco = {coco})")
    return coco


def _advise_bounce(res: dict[str, Any], hw: dict[str, Any], base: str, keys: dict[str, str], sc: dict[str, Any],
                   took: list[str], assumed: list[tuple[str, str]], swapped: str | None, coco: str,
                   jobs: int | None) -> dict[str, Any]:
    """A confidential guest's verdict: no IOMMU option applies (every streaming mapping bounces whatever the
    command line), so what bouncing costs against the same guest not confidential, the pool's high-water mark
    for this workload, and the smallest `swiotlb=` the workload never finds full (the kernel rounds the pool to a
    power of two of 2 KiB slots), each from SEEDS seeds."""
    seed = sc["run"]["seed"]

    def runs(extra: dict[str, str]) -> list[RunResult]:
        return run_variants(_seeded(base, {**keys, **extra}, seed), None, jobs)

    plain, bounced = runs({"os.coco": toml_value("none")}), runs({})
    kind = _measure(base, plain[0])
    key, _, value, higher = MEASURES[kind]
    sw = [r.swiotlb for r in bounced]
    pool, high = sw[0]["pool_slots"], max(s["high_water_slots"] for s in sw)
    opts = [{"option": "not confidential", "cmdline": "(the same guest, not confidential)"},
            {"option": coco, "cmdline": f"swiotlb={pool} (the kernel's pool, {pool * 2 / 1024:g} MiB)"}]
    _fill(opts[0], plain, key, kind, value)
    _fill(opts[1], bounced, key, kind, value)
    full = sum(s["full_events"] for s in sw)
    # The smallest power of two of slots at or above the high-water mark that no seed finds full.
    slabs = 1 << max(7, (high - 1).bit_length())
    while slabs < 4 * max(pool, high):
        if all(r.swiotlb["full_events"] == 0 for r in runs({"os.swiotlb.slabs": str(slabs)})):
            break
        slabs *= 2
    cost = (opts[1][key] / opts[0][key] - 1) * 100 if opts[0][key] else None
    cpu = (opts[1]["cpu_busy"] - opts[0]["cpu_busy"]) * 100
    bounce = {"coco": coco, "pool_slots": pool, "high_water_slots": high, "full_events": full,
              "slabs": slabs, "cmdline": f"swiotlb={slabs}", "measure_pct": cost, "cpu_busy_points": cpu}
    fits = (f"the kernel's pool ({pool} slots) holds the workload's high water ({high}) with room to spare; "
            f"swiotlb={slabs} ({slabs * 2 / 1024:g} MiB) is the smallest that never filled over {SEEDS} seeds")
    if full:
        fits = (f"the kernel's pool ({pool} slots) filled {full} times over {SEEDS} seeds (dropped or requeued "
                f"I/O); swiotlb={slabs} ({slabs * 2 / 1024:g} MiB) never filled")
    unit = {"iops": "IOPS", "latency_p99_us": "latency p99", "throughput_gbps": "throughput"}[key]
    why = (f"bouncing costs {_signed(cost)} % {unit} and {cpu:+.1f} points of CPU busy against the same guest "
           f"not confidential; {fits}" if cost is not None else fits)
    return {
        "host": _host_doc(res, hw, current(res, sc["os"]["kernel"])),
        "scenario": base, "set": {k: v for k, v in keys.items() if k != "compare"},
        "from_host": took, "assumed": [_assumed_text(w, k, sc) for w, k in assumed] + [
            "the bounce copy at the profile's cpu.copy_ns_per_byte times kvm.coco_copy_factor, and swiotlb's "
            "own costs (cpu.swiotlb_op_ns, cpu.swiotlb_slot_ns): estimates (docs/swiotlb.md)"],
        "measure": key,
        "noise": {"seeds": SEEDS},
        "options": opts,
        "bounce": bounce,
        "recommendation": {"option": coco, "cmdline": bounce["cmdline"],
                           "rule": ("a confidential guest's devices reach only swiotlb's shared slots whatever the "
                                    "IOMMU options say: size the pool to the workload's high-water mark, rounded "
                                    "up to a power of two as the kernel rounds it"),
                           "why": why + (f"; {swapped}" if swapped else ""), "flags": [], "swapped": swapped,
                           "validation": [], "robust": None},
        # A confidential guest's devices never reach its private memory, IOMMU or not.
        "caveats": [c for c in _caveats(res, hw, [], sc)
                    if not c.startswith(("a confidential guest", "No IOMMU is visible"))] + [
            f"advise does not range a confidential guest's verdict (--ranges): {SEEDS} seeds at the profile's "
            "values"],
    }


def _option_runs(res: dict[str, Any], kernel: str, base: str, keys: dict[str, str],
                 seed: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each option as the kernel's rules resolve it on this host (the policy a PCI device gets, a note and the
    explain command when that is not the option asked for, untrusted devices' policy), and its runs at SEEDS
    seeds from `seed`, option by option."""
    options, variants = [], []
    for name, words in OPTIONS:
        cmd = _cmdline(res.get("cmdline") or "", words)
        rules = _rules(res, kernel, cmd)
        policy = rules.get("PCI device", {}).get("policy")
        opt = {"option": name, "cmdline": " ".join(words), "policy": policy or name}
        if policy and policy != name:
            opt["note"] = f"the kernel gives {policy} here, not {name}"
            opt["explain"] = _explain_command(res, kernel, words)
        untrusted = rules.get("untrusted PCI device")
        if untrusted and untrusted.get("policy") != opt["policy"]:
            opt["untrusted"] = untrusted["policy"]
        options.append(opt)
        own = {**keys, "os.policy": toml_value(opt["policy"]), "os.cmdline": toml_value(cmd)}
        variants += _seeded(base, own, seed)
    return options, variants


def _seeded(base: str, keys: dict[str, str], seed: int) -> list[Any]:
    """`base` with `keys` at SEEDS seeds from `seed`, seed by seed."""
    return [v for i in range(SEEDS) for v in load(base, {**keys, "run.seed": str(seed + i)}, raw_strings=True)]


def _host_doc(res: dict[str, Any], hw: dict[str, Any], now: dict[str, str]) -> dict[str, Any]:
    """What advise read of the host, and what it runs now, as its JSON's `host`."""
    return {"kernel": res["kernel"], "arch": res["arch"], "cmdline": res["cmdline"], "iommus": res["iommus"], **hw,
            "guest": bool(hw.get("guest")), "current": now}


def _fill(opt: dict[str, Any], runs: list[RunResult], key: str, kind: str, value: Any) -> None:
    """An option's figures from its runs at SEEDS seeds: the measure and CPU busy as their mean (each seed's kept
    in `seeds`), the exposure as the worst seed's p99."""
    r = runs[0]
    vals = [value(x) for x in runs]
    cpu = [x.cpu_busy for x in runs]
    win = [((x.safety.get("window") or {}).get("p99_us") or 0.0) for x in runs]
    mean = lambda v: math.fsum(v) / len(v)
    opt |= {"throughput_gbps": mean([x.throughput_gbps for x in runs]), key: mean(vals),
            **({"kreq_per_sec": mean([x.packets_per_sec for x in runs]) / 1e3} if kind == "latency" else {}),
            "cpu_busy": mean(cpu), "protected": r.safety["protected"],
            # null: an identity domain, every page reachable at any time; 0: no page exposed.
            "exposure_p99_us": max(win) if r.safety["protected"] else None,
            "limited_by": r.limited_by, "reach": _reach(r),
            "warnings": sorted({w for x in runs for w in x.warnings}),
            "seeds": {key: vals, "cpu_busy": cpu, "exposure_p99_us": win if r.safety["protected"] else None}}


def _sampled(key: str, value: Any) -> Callable[[dict[str, Any], RunResult], dict[str, Any]]:
    """An option as one run gives it (a sampled machine's), its seeds' spread (the rule's noise) kept."""
    def fill(o: dict[str, Any], r: RunResult) -> dict[str, Any]:
        win = (r.safety.get("window") or {}).get("p99_us") or 0.0
        return {**o, key: value(r), "cpu_busy": r.cpu_busy, "limited_by": r.limited_by,
                "exposure_p99_us": win if r.safety["protected"] else None}
    return fill


# Each option's figures ranged: the ranged run's figure -> (advise's key for it, its name in the text).
RANGED = {"throughput_gbps": ("throughput_gbps", "Gbps"), "packets_per_sec": ("iops", "kIOPS"),
          "latency.p99_us": ("latency_p99_us", "latency p99"), "cpu_busy": ("cpu_busy", "CPU busy"),
          "safety.window.p99_us": ("exposure_p99_us", "exposure p99")}


def _how_sure(base: str, options: list[dict[str, Any]], firsts: list,
              verdict: dict[str, Any], bound: float, key: str, value: Any, higher: bool, n: int,
              jobs: int | None) -> dict[str, Any]:
    """Each option ranged over `n` sampled machines, the rule applied to each, and whether the verdict holds on
    ROBUST_SHARE of them; where not, the constant that decides it, where it flips and how to measure it."""
    summaries = ranged(base, None, n, None, True, jobs, bases=firsts, screen=False)
    for o, s in zip(options, summaries):
        o["ranges"] = {RANGED[f][0]: p for f, p in s["ranges"].items() if f in RANGED}
    fill = _sampled(key, value)
    name = lambda v: v["option"]["option"] if v["option"] else None
    point = name(verdict)
    votes = [name(choose(sampled_options(options, summaries, i, fill), bound, key, higher)) for i in range(n)]
    out: dict[str, Any] = {"robust": votes.count(point) >= ROBUST_SHARE * n, "samples": n,
                           "agreement": votes.count(point) / n,
                           "sampled_verdicts": {str(v): votes.count(v) for v in sorted(set(votes), key=str)}}
    if out["robust"]:
        return out
    dec = deciding(summaries[0], n, [v != point for v in votes])
    if dec is None:
        return out
    k, high = dec
    plat = json.loads(firsts[0].scenario_json())["platform"]
    consts, rng = dict(constants(plat)), plat["ranges"]
    a, b = bounds(consts[k], rng[k])
    verdict_of = lambda rs: name(choose([fill(o, r) for o, r in zip(options, rs)], bound, key, higher))
    flip = flip_value(summaries, k, high, verdict_of, point, consts, rng, jobs)
    out["decided_by"] = {"constant": k, "value": consts[k], "range": [consts[k] * a, consts[k] * b],
                         "why": rng[k]["why"], "direction": "above" if high else "below",
                         "flips_at": flip[0] if flip else None, "flips_to": flip[1] if flip else None,
                         "how_to_measure": how_to_measure(k)}
    return out


def _spread(v: list[float]) -> float:
    """The range of `v` as a share of its mean (0 for a zero mean)."""
    m = math.fsum(v) / len(v)
    return (max(v) - min(v)) / abs(m) if m else 0.0


def exposed(o: dict[str, Any]) -> float:
    return math.inf if o["exposure_p99_us"] is None else o["exposure_p99_us"]


def choose(options: list[dict[str, Any]], bound: float, key: str, higher: bool) -> dict[str, Any]:
    """The rule: of the options whose p99 exposure is within `bound`, those as good as the best on the measure
    (within `tie`, the widest spread of any option's measure over its seeds; options the line rate holds tie
    with each other); when the line holds the best, where throughput cannot tell them apart, those as cheap in
    CPU as the cheapest (within `cpu_tie`, the same spread of CPU busy); then the one exposing least, then one
    the kernel honours as asked."""
    tie = max(_spread(o["seeds"][key]) for o in options)
    cpu_tie = max(_spread(o["seeds"]["cpu_busy"]) for o in options)
    out: dict[str, Any] = {"option": None, "tie": tie, "cpu_tie": cpu_tie, "ties": [], "cheaper": []}
    ok = [o for o in options if exposed(o) <= bound]
    if not ok:
        return out
    speed = (lambda o: o[key]) if higher else (lambda o: -o[key])
    top = max(ok, key=speed)
    line = lambda o: o["limited_by"] == "line"
    fast = [o for o in ok if speed(o) >= speed(top) - abs(speed(top)) * tie or line(o) and line(top)]
    least = min(o["cpu_busy"] for o in fast)
    cheap = [o for o in fast if o["cpu_busy"] <= least * (1 + cpu_tie) or not line(top)]
    out["option"] = min(cheap, key=lambda o: (exposed(o), bool(o.get("note"))))
    out["ties"] = [o["option"] for o in fast if o is not out["option"]]
    out["cheaper"] = [o["option"] for o in fast if o not in cheap]
    return out


def _rule_text(v: dict[str, Any], bound: float, given: float | None, hz: int, higher: bool) -> str:
    fastest = "the fastest option" if higher else "the option with the lowest latency p99"
    return (f"{fastest} whose exposure p99 is within {_bound_text(bound)}"
            + (" (--max-exposure)" if given is not None else
               f" (the default: the kernel's own bound on lazy exposure, its {_core.FQ_TIMEOUT_MS} ms flush-queue "
               f"timer at HZ {hz})")
            + f"; options within {_pct(v['tie'])} of the best count as equally good (the runs' own noise: the widest "
            f"spread of an option's measure over {SEEDS} seeds; options at the line rate tie); when the line "
            f"holds them, those within {_pct(v['cpu_tie'])} of the least CPU busy (its spread likewise); and of "
            "those the one exposing least wins (then one the kernel honours as asked)")


def _pct(x: float) -> str:
    return "0 % (no spread)" if not x else f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.0f} %"


def _why(rec: dict[str, Any], v: dict[str, Any], key: str) -> str:
    out = f"{_speed_text(rec, key)}; {_exposed_text(rec)}"
    if v["ties"]:
        out += f"; ties with {' and '.join(v['ties'])} on the measure"
    if v["cheaper"]:
        out += (f" and costs less CPU ({100 * rec['cpu_busy']:.1f} % busy) than "
                f"{' and '.join(v['cheaper'])}")
    return out


def _near_bound(o: dict[str, Any], bound: float, given: float | None) -> str | None:
    """A flag for an option whose p99 exposure is within NEAR_BOUND under the bound (or whose seeds put it
    nearer than their own spread)."""
    x = o["exposure_p99_us"]
    if not x or math.isinf(bound) or not bound:
        return None
    seeds = o["seeds"]["exposure_p99_us"] or [x]
    margin = (bound - x) / bound
    if margin > max(NEAR_BOUND, _spread(seeds)):
        return None
    what = ("the kernel's own bound: the flush-queue timer, not the workload, sets lazy's exposure"
            if given is None else "a slightly tighter --max-exposure excludes it")
    return (f"{o['option']}: exposure p99 {duration(x)} is {100 * margin:.1f} % under the {_bound_text(bound)} "
            f"bound ({what})")


def targets_bearing(profile: str, key: str) -> list[dict[str, Any]]:
    """validate's targets on `profile` that check what the verdict ranks by (a throughput of strict, lazy or
    passthrough), each run at its scenario's own seed (validate runs five: about a second here, against
    validate's tens)."""
    field = TARGET_MEASURE.get(key)
    if not field:
        return []
    names = {n for n, _ in OPTIONS}
    bearing = [t for t in load_targets().targets
               if t.kind == "macro" and field in t.value
               and all(set(r) == {"os.policy"} and r["os.policy"] in names for r in t.runs.values())
               and json.loads(load(t.scenario)[0].scenario_json())["platform"]["profile"] == profile]
    if not bearing:
        return []
    r = Runner(seeds=1)
    r.prefetch(bearing)
    return [{k: c[k] for k in ("id", "published", "model", "error", "tolerance", "ok")} | {"scenario": t.scenario}
            for t in bearing for c in [check(t, r.values(t))]]


def _assumed_text(what: str, key: str, sc: dict[str, Any]) -> str:
    """An assumed value as the run used it: `what`: VALUE (KEY)."""
    if not key:
        return what
    v: Any = sc
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return f"{what}: {v if not isinstance(v, float) else f'{v:g}'} ({key})"


def _against(options: list[dict[str, Any]], now: dict[str, str], key: str) -> None:
    """Each option's change against the one the host runs now (`against_now`), when that is one of them."""
    cur = next((o for o in options if o["option"] == now["policy"]), None)
    if not cur:
        return
    for o in options:
        o["now"] = o is cur
        if o is cur:
            continue
        o["against_now"] = {
            "measure_pct": 100 * (o[key] - cur[key]) / cur[key] if cur[key] else None,
            "cpu_busy_points": 100 * (o["cpu_busy"] - cur["cpu_busy"]),
            "exposure": _exposure_change(cur, o)}


def _exposure_change(cur: dict[str, Any], o: dict[str, Any]) -> str:
    a, b = cur["exposure_p99_us"], o["exposure_p99_us"]
    if a is not None and b is not None:
        d = b - a
        return "no change" if abs(d) < 1 else ("+" if d > 0 else "-") + duration(abs(d))
    word = lambda x: "all memory" if x is None else duration(x) if x else "none"
    return f"{word(a)} -> {word(b)}"


def _signed(pct: float) -> str:
    """A change in per cent: one decimal under 10 (and no -0)."""
    return f"{round(pct, 1) + 0.0:+.1f}" if abs(pct) < 10 else f"{pct:+.0f}"


def _caveats(res: dict[str, Any], hw: dict[str, Any], options: list[dict[str, Any]], sc: dict[str, Any]) -> list[str]:
    caveats = []
    for o in options:
        if o.get("note"):
            caveats.append(f"{o['cmdline']}: {o['note']} ({o['explain']} says why)")
    untrusted = [d["device"] for d in res["devices"] if d.get("untrusted")]
    if untrusted:
        caveats.append(f"untrusted (external-facing) devices stay strict whatever the command line: "
                       f"{', '.join(untrusted)}")
    vfio = sorted({d["device"] for d in res["devices"] if d.get("driver") == "vfio-pci" or d.get("type") == "unmanaged"})
    if vfio:
        caveats.append(f"devices assigned to user space or a VM (VFIO) are not affected: {', '.join(vfio)}")
    if hw.get("confidential"):
        caveats.append(f"a confidential guest ({hw['confidential']}): DMA bounces through swiotlb's shared "
                       "buffers, so a device never reaches private memory whatever the option; --set "
                       "os.coco=none compares the options as if it were not")
    if not res["iommus"] and not res["groups"]:
        caveats.insert(0, _no_iommu(res, hw, sc["platform"]["profile"]))
    return caveats + [n for n in res["notes"] if not n.startswith("No IOMMU")]


def _no_iommu(res: dict[str, Any], hw: dict[str, Any], profile: str) -> str:
    """What having no IOMMU means here: on bare metal, one to enable; in a guest, one the VMM must offer."""
    if not hw.get("guest"):
        return ("No IOMMU is visible: every device reaches all memory now, as under passthrough. Enabling one (in "
                "firmware, and intel_iommu=on on Intel) would cost what the lazy and strict rows say, on the "
                "profile that stands in for this hardware.")
    vmm = hw.get("vmm") or "its VMM"
    offers = (f"QEMU offers {', '.join(vendors.qemu_offers(res['arch']))}" if hw.get("vmm") == "QEMU" else
              f"ask {vmm} which it offers")
    return (f"No IOMMU is visible in this guest: every device reaches all of the guest's memory now, as under "
            f"passthrough. Only the VMM ({vmm}) can give it one, a virtual IOMMU ({offers}); the guest's firmware "
            f"and command line cannot. The lazy and strict rows model {profile}; --set platform.profile=P models "
            "another.")


def _bound_text(us: float) -> str:
    return "any time (passthrough allowed)" if math.isinf(us) else duration(us)


def _exposed_text(o: dict[str, Any]) -> str:
    v = o["exposure_p99_us"]
    if v is None:
        return "a device reaches all memory"
    return f"exposure p99 {duration(v)}" if v else "no page is exposed"


def _speed_text(o: dict[str, Any], key: str) -> str:
    if key == "iops":
        return f"{o['iops'] / 1e3:.0f} kIOPS"
    if key == "latency_p99_us":
        return f"latency p99 {duration(o[key])} at {o['kreq_per_sec']:.0f} kreq/s"
    return f"{o['throughput_gbps']:.1f} Gbps"


def _host_lines(doc: dict[str, Any]) -> list[str]:
    """Where advise runs: the host, what it runs now, the scenario, and each value taken from the host or
    assumed, one a line."""
    h = doc["host"]
    iommus = ", ".join(f"{i['name']} ({i['vendor']}"
                       + (f", caching mode {'on' if i.get('caching_mode') else 'off'}" if "caching_mode" in i else "")
                       + ")" for i in h["iommus"]) or "no IOMMU"
    where = (f"a guest{' of ' + h['vmm'] if h.get('vmm') else ''}" if h["guest"] else "bare metal (no sign of a VM)")
    now = h["current"]
    lines = wrap(f"host: {where} · Linux {h['kernel'] or '?'} {h['arch']} · {iommus} · "
                 f"{h['cpus'] or '?'} CPUs · NICs {', '.join(n['name'] for n in h['nics']) or 'none seen'} · "
                 f"NVMe {', '.join(h['nvme']) or 'none seen'}")
    lines += wrap(f"now: {now['policy']}, from {now['from']}")
    lines += wrap(f"scenario: {doc['scenario']} with " + " ".join(f"{k}={v}" for k, v in doc["set"].items()))
    lines += ["from the host:"] + [x for t in doc["from_host"] for x in wrap(t, "    ", "  - ")]
    lines += ["assumed (change any with --set KEY=VALUE):"]
    return lines + [x for t in doc["assumed"] for x in wrap(t, "    ", "  - ")]


# The figure each measure is shown by in the table.
CELL = {"iops": lambda o: f"{o['iops'] / 1e3:.0f}", "latency_p99_us": lambda o: duration(o["latency_p99_us"]),
        "throughput_gbps": lambda o: f"{o['throughput_gbps']:.2f}"}


def _table(doc: dict[str, Any]) -> list[str]:
    """The options' table (in blocks that fit the width), then what a device can reach under each."""
    key, opts = doc["measure"], doc["options"]
    header = next(h for k, h, _, _ in MEASURES.values() if k == key)
    cols = [left("command line", [o["cmdline"] for o in opts]),
            right(header, [CELL[key](o) for o in opts], 2),
            right("CPU busy", [f"{o['cpu_busy'] * 100:.1f}%" for o in opts], 2),
            right("exposure p99", [exposure(o["exposure_p99_us"] is not None, o["exposure_p99_us"] or None)
                                   for o in opts], 2),
            left("limited by", [o["limited_by"] for o in opts])]
    names = [o["option"] + (" *" if o.get("note") else "") + (" (now)" if o.get("now") else "") for o in opts]
    lines = fit(["option"] + names, cols)
    lines += ["", "a device can reach:"]
    return lines + [x for o in opts for x in wrap(o["reach"], "    ", f"  {o['option']}: ")]


def format_advise(doc: dict[str, Any]) -> str:
    now = doc["host"]["current"]
    lines = _host_lines(doc) + [""] + _table(doc) + _ranged_lines(doc)
    key = doc["measure"]
    unit = {"iops": "IOPS", "latency_p99_us": "latency p99", "throughput_gbps": "throughput"}[key]
    changes = [o for o in doc["options"] if "against_now" in o]
    if changes:
        lines += ["", f"against now ({now['policy']}):"]
        for o in changes:
            c = o["against_now"]
            m = "" if c["measure_pct"] is None else f"{_signed(c['measure_pct'])} % {unit}, "
            lines += wrap(f"{m}CPU busy {c['cpu_busy_points']:+.1f} points, exposure {c['exposure']}", "    ",
                          f"  {o['option']}: ")
    r = doc["recommendation"]
    lines += [""] + wrap(f"recommendation: {r['option']} ({r['cmdline']}): {r['why']}" if r["option"] else
                         f"recommendation: none: {r['why']}")
    lines += _sure_lines(doc)
    for f in r["flags"]:
        lines += wrap(f"  flagged: {f}", "    ")
    for t in r["validation"]:
        if not t["ok"]:
            lines += wrap(f"  validation: {t['id']} misses: model {t['model']:.3g} against {t['published']:.3g} "
                          f"published ({100 * t['error']:+.0f} %, tolerance {100 * t['tolerance']:.0f} %; one seed "
                          f"of {t['scenario']}, on this profile; iommulab validate {t['id']} runs five)", "    ")
    lines += wrap(f"rule: {r['rule']}")
    warn = sorted({f"{o['option']}: {x}" for o in doc["options"] for x in o.get("warnings") or []})
    if doc["caveats"] or warn:
        lines += ["", "caveats:"]
        for c in doc["caveats"] + [f"warning: {x}" for x in warn]:
            lines += _caveat_lines(c)
    return "\n".join(lines) + "\n"


def _ranged_lines(doc: dict[str, Any]) -> list[str]:
    """Each option's figures over the sampled machines: median [5th – 95th percentile]."""
    r = doc["recommendation"]
    if not r.get("samples"):
        return []
    names = {key: (fig, name) for fig, (key, name) in RANGED.items()}
    lines = ["", *wrap(f"over {r['samples']} sampled machines (the profile's ranged constants drawn at once; "
                       "median [5th – 95th percentile]; docs/ranges.md):")]
    for o in doc["options"]:
        parts = [f"{names[k][1]} {fmt(*names[k], p['p50'])} [{fmt(*names[k], p['p5'])} – {fmt(*names[k], p['p95'])}]"
                 for k, p in (o.get("ranges") or {}).items() if k in names]
        lines += wrap(" · ".join(parts), "    ", f"  {o['option']}: ")
    return lines


def _sure_lines(doc: dict[str, Any]) -> list[str]:
    """Whether the verdict holds over the sampled machines, and where not what decides it."""
    r = doc["recommendation"]
    if r.get("robust") is None:
        return []
    held = f"{round(r['agreement'] * r['samples'])} of {r['samples']} sampled machines"
    others = ", ".join(f"{v if v != 'None' else 'none'} on {c}" for v, c in r["sampled_verdicts"].items()
                       if v != str(r["option"]))
    if r["robust"]:
        return wrap(f"  robust: the rule chooses {r['option']} on {held}" + (f" ({others})" if others else ""),
                    "    ")
    lines = wrap(f"  not robust: the rule chooses {r['option']} on {held} only; {others}", "    ")
    d = r.get("decided_by")
    if not d:
        return lines + wrap("  no single ranged constant tells those machines apart", "    ")
    rng = " – ".join(f"{x:g}" for x in d["range"])
    at = (f"{d['direction']} {d['flips_at']:g} it is {d['flips_to'] or 'none'}" if d["flips_at"] is not None else
          f"alone it does not flip the verdict within its range: it does so with others, {d['direction']} the "
          "profile's value")
    lines += wrap(f"  decided by {d['constant']} (the profile's {d['value']:g}, range {rng}): {at}", "    ")
    return lines + wrap(f"  measure it: {d['how_to_measure']}", "    ")


def _caveat_lines(caveat: str) -> list[str]:
    """A caveat wrapped, the explain command it names on lines of its own, split between words with a
    backslash as a shell continues a line, so that it runs as printed."""
    if "(iommulab explain " not in caveat or not caveat.endswith(" says why)"):
        return wrap(f"  - {caveat}", "    ")
    text, command = caveat[:-len(" says why)")].split(" (iommulab explain ", 1)
    return wrap(f"  - {text}; this says why:", "    ") + command_lines(f"iommulab explain {command}", "      ")
