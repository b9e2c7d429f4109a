"""AMD-Vi: /sys/class/iommu/ivhdN (one per IVHD block of the ACPI IVRS table), whose amd-iommu/cap and
amd-iommu/features inspect reads."""

from __future__ import annotations

from typing import Any

NAME = "amdvi"
# The capability header's NpCache bit (AMD I/O Virtualization Technology spec §3.3.1; IOMMU_CAP_NPCACHE in
# drivers/iommu/amd/amd_iommu_types.h): only virtual IOMMUs set it.
CAP_NPCACHE = 26
QEMU_DEVICE = "-device amd-iommu"
LEGEND = ("inv_iommu_pages: INVALIDATE_IOMMU_PAGES (a range or the whole domain) · inv_iotlb_pages: ATS "
          "invalidations · inv_iommu_all: INVALIDATE_IOMMU_ALL · completion_wait: COMPLETION_WAITs")


def claims(name: str) -> bool:
    return name.startswith("ivhd")


def read(tree: Any, name: str) -> dict[str, Any]:
    d: dict[str, Any] = {}
    c = tree.hex(f"sys/class/iommu/{name}/amd-iommu/cap")
    # amd_iommu_show_features(): "EFR:EFR2" in hex.
    f = (tree.text(f"sys/class/iommu/{name}/amd-iommu/features") or "").strip()
    if c is not None:
        d |= {"cap": f"{c:x}", "caching_mode": bool((c >> CAP_NPCACHE) & 1)}
    if f:
        d["features"] = f
    return d


def caching_mode(i: dict[str, Any]) -> bool:
    return bool(i.get("caching_mode"))


def describe(i: dict[str, Any]) -> str:
    if "cap" not in i:
        return ""
    return f": NpCache {'on' if i['caching_mode'] else 'off'}" + (f", features {i['features']}" if "features" in i
                                                                  else "")


def profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    if caching_mode(i):
        return "kvm-amdvi-guest", "AMD-Vi with NpCache: QEMU's emulated AMD IOMMU"
    return "amdvi-server", "AMD-Vi on bare metal"


def guest_profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return "kvm-amdvi-guest", f"QEMU's emulated AMD IOMMU, NpCache {'on' if caching_mode(i) else 'off'}"


def scenario_iommu(i: dict[str, Any]) -> dict[str, Any]:
    return {"amdvi": {"np_cache": True}} if caching_mode(i) else {}
