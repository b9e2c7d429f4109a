"""Intel VT-d: /sys/class/iommu/dmarN, whose intel-iommu/cap and ecap registers inspect reads."""

from __future__ import annotations

from typing import Any

NAME = "vtd"
# Capability register fields (VT-d spec §11.4.2) and extended capability fields (§11.4.3).
CAP_CM, CAP_RWBF, CAP_PSI = 7, 4, 39
ECAP_DT, ECAP_PT = 2, 6
# QEMU's emulation (hw/i386/intel_iommu.c); caching-mode=on for a VFIO device.
QEMU_DEVICE = "-device intel-iommu"
LEGEND = "iotlb_psi/dsi/global: IOTLB invalidations · wait: wait descriptors · devtlb: device-TLB invalidations"


def _bit(v: int, b: int) -> bool:
    return bool((v >> b) & 1)


def claims(name: str) -> bool:
    return name.startswith("dmar")


def read(tree: Any, name: str) -> dict[str, Any]:
    d: dict[str, Any] = {}
    c = tree.hex(f"sys/class/iommu/{name}/intel-iommu/cap")
    e = tree.hex(f"sys/class/iommu/{name}/intel-iommu/ecap")
    if c is not None:
        d |= {"cap": f"{c:x}", "caching_mode": _bit(c, CAP_CM), "rwbf": _bit(c, CAP_RWBF),
              "page_selective": _bit(c, CAP_PSI), "mamv": (c >> 48) & 0x3F}
    if e is not None:
        d |= {"ecap": f"{e:x}", "device_tlb": _bit(e, ECAP_DT), "pass_through": _bit(e, ECAP_PT)}
    return d


def caching_mode(i: dict[str, Any]) -> bool:
    return bool(i.get("caching_mode"))


def describe(i: dict[str, Any]) -> str:
    if "cap" not in i:
        return ""
    s = (f": caching mode {'on' if i['caching_mode'] else 'off'}, RWBF {'on' if i['rwbf'] else 'off'}, "
         f"page-selective {'yes' if i['page_selective'] else 'no'}, MAMV {i['mamv']}")
    if "device_tlb" in i:
        s += f", device-TLB {'yes' if i['device_tlb'] else 'no'}"
    return s


def profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    if caching_mode(i):
        return "kvm-vtd-guest", "VT-d with caching mode: QEMU's emulated VT-d"
    return "vtd-server", "VT-d on bare metal"


def guest_profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return "kvm-vtd-guest", f"QEMU's emulated VT-d, caching mode {'on' if caching_mode(i) else 'off'}"


def scenario_iommu(i: dict[str, Any]) -> dict[str, Any]:
    return {"vtd": {"caching_mode": True}} if caching_mode(i) else {}
