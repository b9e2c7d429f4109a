"""The Rust core's layers only look down: each top-level module of crates/iommulab-core/src imports (outside its
tests) only modules below it, so there is no import cycle between layers."""

import pathlib
import re
from collections import defaultdict

SRC = pathlib.Path(__file__).parent.parent / "crates/iommulab-core/src"
# Bottom to top; modules on one rank do not import each other. The hardware (hw, with the platform profile it
# is built from) sits on the shared constants; the scenario schema above it asks each IOMMU's driver to check its
# own profile section, and configures the layers above.
RANKS = [["sim"], ["kernel", "net", "input"], ["hw"], ["scenario"], ["dma"], ["host"], ["workload"], ["metrics"],
         ["replay"], ["run"]]
# Known edges up the stack, each with what it would take to remove it.
KNOWN: set[tuple[str, str]] = set()


def imports() -> dict[str, set[str]]:
    deps: dict[str, set[str]] = defaultdict(set)
    for f in SRC.rglob("*.rs"):
        top = f.relative_to(SRC).parts[0].removesuffix(".rs")
        code = f.read_text().split("#[cfg(test)]")[0]
        deps[top] |= {m for m in re.findall(r"crate::(\w+)", code) if m != top}
    return deps


def test_every_module_has_a_layer():
    mods = {f.relative_to(SRC).parts[0].removesuffix(".rs") for f in SRC.iterdir()} - {"lib"}
    assert mods == {m for r in RANKS for m in r}


def test_layers_only_look_down():
    rank = {m: i for i, r in enumerate(RANKS) for m in r}
    up = sorted((a, b) for a, bs in imports().items() for b in bs if rank[b] >= rank[a] and (a, b) not in KNOWN)
    assert not up, f"imports that do not look down: {up}"
    # The known exceptions are still there (else remove them from KNOWN).
    deps = imports()
    assert all(b in deps[a] for a, b in KNOWN)


def submodule_imports(layer: str) -> dict[str, set[str]]:
    """Within one layer directory: which of its submodules each imports (outside tests)."""
    deps: dict[str, set[str]] = defaultdict(set)
    d = SRC / layer
    for f in d.rglob("*.rs"):
        sub = f.relative_to(d).parts[0].removesuffix(".rs")
        if sub == "mod":
            continue
        code = f.read_text().split("#[cfg(test)]")[0]
        depth = len(f.relative_to(d).parts) - (1 if f.name != "mod.rs" else 2)
        sup = "super::" * (depth + 1)
        found = set(re.findall(rf"crate::{layer}::(\w+)", code))
        found |= set(re.findall(rf"(?<!\w){re.escape(sup)}(\w+)", code)) if depth == 0 else set()
        subs = {p.name.removesuffix(".rs") for p in d.iterdir()} - {"mod"}
        deps[sub] |= {m for m in found if m in subs and m != sub}
    return deps


def _cycle(deps: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(deps.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        path.pop()
        return None

    for n in sorted(deps):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_cycles_between_a_layers_submodules():
    for layer in sorted(p.name for p in SRC.iterdir() if p.is_dir()):
        assert _cycle(submodule_imports(layer)) is None, f"{layer}: {_cycle(submodule_imports(layer))}"


def test_cargo_doc_builds_without_warnings():
    import os
    import shutil
    import subprocess

    import pytest

    if not shutil.which("cargo"):
        pytest.skip("no cargo on PATH")
    p = subprocess.run(["cargo", "doc", "--no-deps", "-q"], cwd=SRC.parent.parent.parent, capture_output=True,
                       text=True, env={**os.environ, "RUSTDOCFLAGS": "-D warnings"}, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]


def _code(f: pathlib.Path) -> str:
    return f.read_text().split("#[cfg(test)]")[0]


def test_no_code_outside_hw_names_a_vendor():
    """A vendor is its driver's file in hw/ (and its module in python/iommulab/vendors/): the rest of the core
    asks the driver (`Vendor::driver()`, `hw::drivers()`) and never matches on a vendor or reaches into one."""
    vendor_files = {p.stem for p in (SRC / "hw").glob("*.rs")} - {"mod", "driver", "platform", "cache", "emul",
                                                                  "pgtable", "translator", "ranges"}
    # A vendor's type, module, or profile section (`p.iommu.vtd`) named outside it.
    named = re.compile(r"Vendor::[A-Z]\w*|\bhw::(" + "|".join(sorted(vendor_files)) + r")::|\.iommu\.("
                       + "|".join(sorted(vendor_files)) + r")\b")
    found = [f"{f.relative_to(SRC)}: {m.group(0)}" for f in sorted(SRC.rglob("*.rs"))
             if f.parent.name != "hw" and f.name != "tests.rs"
             for m in named.finditer(_code(f))]
    py = SRC.parent.parent / "iommulab-py/src/lib.rs"
    found += [f"{py.name}: {m.group(0)}" for m in named.finditer(py.read_text())]
    assert not found, f"code outside hw/ that names a vendor: {found}"


def test_python_takes_every_vendor_and_policy_list_from_the_core():
    """Outside python/iommulab/vendors/, no Python compares with a vendor's name or lists policies: adding a
    vendor or a policy touches no Python list."""
    from iommulab import _core, vendors

    names = sorted(vendors.DRIVERS)
    pkg = SRC.parent.parent.parent / "python/iommulab"
    lit = re.compile(r"""["'](""" + "|".join(names) + r""")["']""")
    # PCI base class 0x00/0xff is what virtio devices report (a device class, not the IOMMU).
    allowed = {'(0x00, 0xff): "virtio"}'}
    found = [f"{f.name}:{i}: {line.strip()}" for f in sorted(pkg.glob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if lit.search(line) and not any(a in line for a in allowed)]
    assert not found, f"vendor names outside python/iommulab/vendors/: {found}"
    assert set(vendors.MODULES) >= set(vendors.names(modelled=True)), "a modelled IOMMU without its Python module"
    # The kernel's three domain modes (strict, lazy, passthrough) are the kernel's words; the policies the
    # simulator has beyond them come from the core only.
    pol = re.compile(r"""["'](""" + "|".join(_core.policies()) + r""")["']""")
    found = [f"{f.name}:{i}" for f in sorted(pkg.glob("*.py")) for i, line in enumerate(f.read_text().splitlines(), 1)
             if len(set(pol.findall(line))) > 3]
    assert not found, f"a policy list outside the core: {found}"
