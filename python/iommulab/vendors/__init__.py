"""Each IOMMU's Python side, one module per vendor: how a host shows it in sysfs, what `inspect` reads of it, the
built-in profile that stands for it and the words of its replay columns. The names, their order and what the
core models come from the core (`_core.drivers()`); a module is found by its `NAME`, so adding a vendor is
adding a module here and its driver in the core's `hw/`, and touches no list.

A vendor module defines `NAME` and `claims(name)` (the /sys/class/iommu entry is this vendor's), and may define
`read(tree, name)` (what its sysfs tells, merged into the IOMMU's record), `caching_mode(iommu)`,
`describe(iommu)` (words after the name in `inspect`), `profile(iommu, arch)` ((built-in profile, why)),
`guest_profile(iommu, arch)` (the same for a guest, whose IOMMU is the VMM's emulation), `QEMU_DEVICE` (how
QEMU's command line asks for it),
`scenario_iommu(iommu)` (`[platform.iommu]` keys a scenario for this host sets) and `LEGEND` (its replay
columns, for people)."""

from __future__ import annotations

import importlib
import json
import pkgutil
from types import ModuleType
from typing import Any

from .. import _core

DRIVERS: dict[str, dict[str, Any]] = {d["name"]: d for d in json.loads(_core.drivers())}
MODULES: dict[str, ModuleType] = {}
for _m in pkgutil.iter_modules(__path__):
    _mod = importlib.import_module(f"{__name__}.{_m.name}")
    MODULES[_mod.NAME] = _mod


def names(*, modelled: bool | None = None, arch: str | None = None) -> list[str]:
    """Driver names in the core's order: only the modelled ones (or only the others), only those on `arch`."""
    return [n for n, d in DRIVERS.items()
            if (modelled is None or d["modelled"] == modelled) and (arch is None or arch in d["archs"])]


def identify(sysfs_name: str) -> str:
    """The vendor of the /sys/class/iommu entry `sysfs_name` ("unknown" if no module claims it)."""
    return next((n for n, m in MODULES.items() if m.claims(sysfs_name)), "unknown")


def first(vendors: list[str] | set[str]) -> str | None:
    """Of the vendors seen, the one the rules and the profile follow: the first modelled one in the core's order."""
    return next((v for v in names(modelled=True) if v in vendors), None)


def _call(vendor: str, fn: str, *args: Any, default: Any = None) -> Any:
    f = getattr(MODULES.get(vendor), fn, None)
    return f(*args) if f else default


def read(tree: Any, vendor: str, name: str) -> dict[str, Any]:
    return _call(vendor, "read", tree, name, default={})


def caching_mode(iommu: dict[str, Any]) -> bool:
    return bool(_call(iommu["vendor"], "caching_mode", iommu, default=False))


def with_caching_mode(iommus: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first IOMMU with caching mode set (a virtual one), if any."""
    return next((i for i in iommus if caching_mode(i)), None)


def describe(iommu: dict[str, Any]) -> str:
    return _call(iommu["vendor"], "describe", iommu, default="")


def profile(iommu: dict[str, Any], arch: str) -> tuple[str, str]:
    """The built-in profile for a host with this IOMMU (the driver's replay profile unless the module says)."""
    p = _call(iommu["vendor"], "profile", iommu, arch)
    return p or (DRIVERS[iommu["vendor"]]["replay_profile"], DRIVERS[iommu["vendor"]]["title"])


def guest_profile(iommu: dict[str, Any], arch: str) -> tuple[str, str] | None:
    """The built-in profile for a guest with this (virtual) IOMMU, when the model has one."""
    return _call(iommu["vendor"], "guest_profile", iommu, arch)


def qemu_offers(arch: str) -> list[str]:
    """The virtual IOMMUs QEMU offers an `arch` guest, as its command line names them (each module's
    QEMU_DEVICE)."""
    return [f"{DRIVERS[n]['title']} ({MODULES[n].QEMU_DEVICE})" for n in names(modelled=True, arch=arch)
            if getattr(MODULES.get(n), "QEMU_DEVICE", None)]


def scenario_iommu(iommu: dict[str, Any]) -> dict[str, Any]:
    return _call(iommu["vendor"], "scenario_iommu", iommu, default={}) or {}


def legend(vendor: str) -> str:
    return getattr(MODULES.get(vendor), "LEGEND", "")


def stand_in(arch: str) -> tuple[str, str]:
    """The profile of a host whose IOMMU the model lacks (or that has none): the first hardware IOMMU of its
    architecture, else of x86_64."""
    for a in (arch, "x86_64"):
        hw = [n for n in names(modelled=True, arch=a) if not DRIVERS[n].get("paravirtual")]
        if hw:
            d = DRIVERS[hw[0]]
            return d["replay_profile"], d["title"]
    raise AssertionError("the core models no hardware IOMMU")
