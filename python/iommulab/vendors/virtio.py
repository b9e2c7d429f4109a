"""virtio-iommu: registered under its virtio device's bus name, which for virtio-iommu-pci is the PCI function's
(virtio-iommu.c viommu_probe → virtio_bus_name): the only IOMMU named like a device."""

from __future__ import annotations

import re
from typing import Any

NAME = "virtio"
QEMU_DEVICE = "-device virtio-iommu-pci"
LEGEND = "virtio_map / virtio_unmap: MAP and UNMAP requests"


def claims(name: str) -> bool:
    return (name.startswith("virtio") or "viommu" in name
            or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", name) is not None)


def profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return ("virtio-guest" if arch == "x86_64" else "virtio-guest-arm64"), "a virtio-iommu guest"


def guest_profile(i: dict[str, Any], arch: str) -> tuple[str, str]:
    return profile(i, arch)
