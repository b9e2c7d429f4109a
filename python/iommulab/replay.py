"""Replay of real kernel DMA traces (ftrace text with iommu:map / iommu:unmap events)."""

from __future__ import annotations

import json
import lzma
import os
import queue
import threading
from typing import IO, Any, Callable

from . import _core, vendors
from ._core import ScenarioError
from .inputs import open_trace, shown, utf8
from .report import fit, right, wrap

CHUNK = 1 << 20
# Chunks read and decompressed ahead of the replay at most.
READ_AHEAD = 4
# The traced kernel when none is given: Debian 13's (6.12), or for a driver that came later its first kernel.
DEFAULT_KERNEL = "6.12"


def default_kernel(iommu: str) -> str:
    """The kernel a replay through `iommu` assumes when none is given: DEFAULT_KERNEL where that kernel has the
    driver, else the first after it that has it (the RISC-V IOMMU's 6.13), as the core's own check decides."""
    major, minor = (int(x) for x in DEFAULT_KERNEL.split("."))
    newest = tuple(int(x) for x in _core.KERNEL_NEWEST.split("."))
    while (major, minor) <= newest:
        try:
            _core.Replay("-", iommu, False, False, f"{major}.{minor}", "", None, 250, None, [])
            return f"{major}.{minor}"
        except ScenarioError:
            # No Linux minor passes 20 (4.20): then the next major's .0.
            major, minor = (major, minor + 1) if minor < 20 else (major + 1, 0)
    return DEFAULT_KERNEL


def replay(trace: str | os.PathLike, *, iommu: str = vendors.names(modelled=True)[0], caching_mode: bool = False, ats: bool = False,
           kernel: str | None = None, cmdline: str = "", mode: str | None = None, hz: int = 250,
           tick_phase_us: float | None = None, ats_phases: list[str] | None = None,
           progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Replay TRACE through the DMA layer and the IOMMU model (`progress(bytes_read, file_size)` after each
    chunk of the file); returns
    ``{"iommu", "kernel", "policy", "policy_reason", "hz", "lines", "anomalies", "iova_locality",
    "domains": {..., "devices": {DOMAIN: [DEVICE, ...]}}, "phases": {NAME: {"counts": {...},
    "by_domain": {DOMAIN: {...}}}}, "warnings": [...]}`` (docs/replay.md).
    In lazy mode the scheduler tick's phase on the trace clock is inferred per phase unless given.
    ``ats`` gives every traced device ATS; ``ats_phases`` only the devices whose traffic fills those phases.
    ``kernel`` None: 6.12, or the first kernel after it that has the driver (:func:`default_kernel`)."""
    if not isinstance(trace, (str, os.PathLike)):
        raise ScenarioError(f"trace {trace!r}: expected a path (or - for standard input)")
    name = shown(trace)
    if kernel is None and isinstance(iommu, str):
        kernel = default_kernel(iommu)
    for arg, v in [("iommu", iommu), ("kernel", kernel), ("cmdline", cmdline)]:
        if not isinstance(v, str):
            raise ScenarioError(f"{arg} {v!r}: expected a string")
        utf8(v, f"--{arg}")
    if isinstance(ats_phases, str):
        raise ScenarioError(f"ats_phases {ats_phases!r}: expected a list of phase names, e.g. [{ats_phases!r}]")
    for ph in ats_phases or []:
        if not isinstance(ph, str):
            raise ScenarioError(f"ats_phases {ats_phases!r}: expected a list of phase names")
        utf8(ph, "--ats-phases")
    if isinstance(hz, bool) or not isinstance(hz, int) or not 1 <= hz <= 10_000:
        raise ScenarioError(f"--hz {hz}: expected CONFIG_HZ in 1..=10000 (e.g. 100, 250, 1000)")
    if tick_phase_us is not None and not (tick_phase_us >= 0 and tick_phase_us < 1e9):
        raise ScenarioError(f"--tick-phase-us {tick_phase_us}: expected a time in µs >= 0")
    phase_ns = None if tick_phase_us is None else int(round(tick_phase_us * 1000))
    r = _core.Replay(name, iommu, caching_mode, ats, kernel, cmdline, mode, hz, phase_ns, list(ats_phases or []))
    f, raw = open_trace(trace)
    size = os.fstat(raw.fileno()).st_size if raw is not None else 0
    try:
        for chunk, pos in _read_ahead(f, raw, name):
            r.feed(chunk)
            if progress and raw is not None:
                progress(pos, size)
    finally:
        if raw is not None:
            f.close()
            raw.close()
    return json.loads(r.finish())


def _read_ahead(f: IO[bytes], raw: IO[bytes] | None, name: str):
    """The chunks of `f` with the position in the file under it, read (and decompressed) on a thread of their
    own a few chunks ahead, so that decompression overlaps the replay (both release the GIL)."""
    chunks: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                chunk = f.read(CHUNK)
                chunks.put((chunk, raw.tell() if raw is not None else 0))
                if not chunk:
                    return
        except (OSError, EOFError, lzma.LZMAError, ValueError) as e:
            chunks.put(ScenarioError(f"{name}: cannot read: {e}"))
        except Exception as e:  # anything else reaches the caller as it is
            chunks.put(e)

    t = threading.Thread(target=reader, name="iommulab-replay-read", daemon=True)
    t.start()
    try:
        while True:
            item = chunks.get()
            if isinstance(item, Exception):
                raise item
            if not item[0]:
                return
            yield item
    finally:
        # Stop the reader (it may be waiting for room in the queue) before the caller closes the file.
        stop.set()
        while t.is_alive():
            try:
                chunks.get_nowait()
            except queue.Empty:
                t.join(0.01)


def format_replay(res: dict[str, Any]) -> str:
    """The per-phase table the CLI prints, under the replay's warnings."""
    keys = next((list(d["counts"]) for d in res["phases"].values()),
                ["map_events", "unmap_events", "map_syncs"] + vendors.DRIVERS[res["iommu"]]["replay_columns"])
    lines = wrap(f"iommu {res['iommu']} · kernel {res['kernel']} · HZ {res['hz']} · policy {res['policy']} "
                 f"({res['policy_reason']})")
    lines += wrap(f"lines {res['lines']['total']} · events {res['lines']['events']} · unreadable "
                  f"{res['lines']['bad']}")
    lines += [x for e in res["lines"]["bad_examples"] for x in wrap(f"unreadable line {e}", "    ", "  ")]
    dom = res.get("domains", {})
    rt = res.get("recorded_timer") or {}
    if dom.get("labelled_events"):
        lines += wrap(f"domains: {dom['count']} named by the trace's labels ({dom['labelled_events']} events "
                      f"placed by a label, {dom['inferred_events']} by inference)")
    elif res.get("anomalies", {}).get("maps_over_live") and res["policy"] == "lazy" and rt.get("firings"):
        lines += wrap("domains: the trace names none and is replayed as one, but it maps IOVA still mapped: it has "
                      "several, each with its own flush queue and timer. Every recorded firing of their timers "
                      "flushes that one queue.")
    lines += [x for w in res.get("warnings", []) for x in wrap(f"warning: {w}")]
    lines.append("")
    phases = list(res["phases"])
    # Each count right-aligned in at least 8 columns after a space, as the phase column is 10 wide.
    cols = [right(k, [str(res["phases"][ph]["counts"][k]) for ph in phases] or [""]) for k in keys]
    cols = [[x.rjust(9) for x in c] for c in cols]
    lines += fit(["phase".ljust(10)] + phases, cols)
    fits = [f"{ph} {d['tick_fit']['tick_phase_us']:g} µs ({d['tick_fit']['early_reuses']} early reuses)"
            for ph, d in res["phases"].items() if "tick_fit" in d]
    lines += _timer_lines(rt, fits)
    lines += _bounce_lines(res)
    lines.append("")
    terms = ["map_syncs: iotlb_sync_map calls (one per map_sg)"] + vendors.legend(res["iommu"]).split(" · ")
    lines += [x for t in terms if t for x in wrap(t)]
    return "\n".join(lines) + "\n"


def _bounce_lines(res: dict[str, Any]) -> list[str]:
    """Where the trace bounces: the model's swiotlb pool beside what the kernel recorded, per phase."""
    s = res.get("swiotlb")
    if not s:
        return []
    k = s.get("kernel_pool_slots")
    out = [""] + wrap(f"swiotlb: a pool of {s['pool_slots']} slots in {s['areas']} area"
                      f"{'s' if s['areas'] != 1 else ''}{', dynamic' if s['dynamic'] else ''}"
                      f"{f' (the kernel reported {k})' if k is not None else ''}; {s['from']}")
    phases = [(ph, d["swiotlb"]) for ph, d in res["phases"].items() if d.get("swiotlb")]
    if not phases:
        return out
    opt = lambda v: "-" if v is None else str(v)  # noqa: E731
    rows = {
        "bounces": [str(b["model"]["bounces"]) for _, b in phases],
        "kernel": [str(b["guest"]["swiotlb_bounced"]) for _, b in phases],
        "full": [str(b["model"]["full_events"]) for _, b in phases],
        "kernel_full": [str(b["guest"]["map_errors"]) for _, b in phases],
        "same_slot": [f"{b['slots_same']}/{b['slots_compared']}" for _, b in phases],
        "high_water": [opt(b["model"].get("high_water_slots")) for _, b in phases],
        "kernel_hw": [opt(b["guest"].get("high_water_slots")) for _, b in phases],
    }
    cols = [[x.rjust(9) for x in right(name, v)] for name, v in rows.items()]
    out += fit(["phase".ljust(10)] + [ph for ph, _ in phases], cols)
    out += wrap("bounces: the model's swiotlb_map calls · kernel: swiotlb_bounced events · full: found no slots · "
                "kernel_full: maps that returned DMA_MAPPING_ERROR · same_slot: bounces put in the slot the kernel "
                "chose · high_water, kernel_hw: most slots in use in the capture (io_tlb_used_hiwater)")
    return out


def _timer_lines(rt: dict[str, Any], fits: list[str]) -> list[str]:
    """Where the lazy flush timer came from: the trace's record of it (`rt`), the model's own with the tick
    phase inferred per phase (`fits`), or both, domain by domain."""
    out = []
    if rt.get("firings"):
        how = ("each flushing the domain its pointer was tied to: the device whose unmaps armed that timer" if rt.get("tied")
               else "each flushing the domain its flush named" if rt.get("by_domain") else "")
        out += wrap(f"lazy flush timer: as the trace recorded it ({rt['firings']} firings of fq_flush_timeout"
                    + (f", {how})" if how else ")"))
    elif rt:
        out += wrap("lazy flush timer: each domain its own timer (the model's): the trace recorded "
                    f"{rt['ignored']} firings of fq_flush_timeout and none could be given its domain")
    if fits and (not rt.get("firings") or rt.get("own_timer_domains")):
        out += wrap("lazy flush timer: tick phase inferred per phase from when queued IOVAs are mapped again:")
        out += [f"  {f}" for f in fits]
    return [""] + out if out else []
