"""Arm SMMUv3: /sys/class/iommu/smmu3.0x<base>."""

from __future__ import annotations

from typing import Any

NAME = "smmuv3"
QEMU_DEVICE = "-machine virt,iommu=smmuv3"
LEGEND = ("tlbi_nh_va / tlbi_nh_asid: TLBI by address / by ASID (VMID at stage 2) · cmd_sync: CMD_SYNCs · "
          "atc_inv: ATC invalidations · doorbells: CMDQ_PROD writes")


def claims(name: str) -> bool:
    return "smmu" in name


def profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return "smmuv3-server", "an Arm SMMUv3"


def guest_profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return "kvm-smmuv3-guest", "QEMU's emulated SMMUv3"
