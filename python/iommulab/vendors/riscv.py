"""The RISC-V IOMMU: /sys/class/iommu/riscv-iommu@DEVICE (riscv_iommu_init's iommu_device_sysfs_add, a virtual
device with only the generic devices/ links: nothing more to read)."""

from __future__ import annotations

NAME = "riscv"
QEMU_DEVICE = "-device riscv-iommu-pci"
LEGEND = "iotinval_vma: IOTINVAL.VMA commands (a page, or the whole PSCID) · iofence: IOFENCE.C commands"


def claims(name: str) -> bool:
    return name.startswith("riscv-iommu@")
