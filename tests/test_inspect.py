"""`iommulab inspect` on the trees real guests saved (tests/data/inspect: what testbed/guest-init.sh copies out of
a guest booted by testbed/boot.py, the files inspect reads) and on trees rebuilt from the older captures' sysfs
dumps (IOMMU groups and their types, /sys/class/iommu, VT-d capability registers, the kernel command line and
version): x86 VT-d strict, lazy, caching mode and passthrough, virtio-iommu, arm64 SMMUv3 strict, lazy and
passthrough, and machines without an IOMMU."""

import json
import pathlib
import re
import tarfile

import pytest

import iommulab
from conftest import cli
from iommulab import hostinfo

DATA = pathlib.Path(__file__).parent / "data"


def tree_from_capture(cap: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """The files inspect reads, written from a capture's dumps of the guest's /proc and /sys."""
    def put(rel, text):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    dmesg = (cap / "dmesg.txt").read_text()
    release = re.search(r"Linux version (\S+)", dmesg).group(1)
    put("dev/kmsg", dmesg)  # the kernel log as `dmesg` printed it in the guest
    put("proc/sys/kernel/osrelease", release + "\n")
    put("proc/sys/kernel/arch", ("aarch64" if "aarch64" in (cap / "cmd.txt").read_text() else "x86_64") + "\n")
    put("proc/cmdline", (cap / "cmdline.txt").read_text())
    for line in (cap / "iommu-groups.txt").read_text().splitlines():
        g, typ, devs = re.match(r"(\d+) type=(\S+) devs=(.*)", line).groups()
        put(f"sys/kernel/iommu_groups/{g}/type", typ + "\n")
        for d in devs.split():
            (root / f"sys/kernel/iommu_groups/{g}/devices/{d}").mkdir(parents=True)
    for dump in ("intel-iommu-sysfs.txt", "iommu-sysfs.txt"):
        f = cap / dump
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            m = re.match(r"/sys/class/iommu/(.+?):(.*)", line)
            if m:  # path:value
                put(f"sys/class/iommu/{m.group(1)}", m.group(2) + "\n")
            m = re.match(r"l\S+\s.*\s(\S+) -> ", line)
            if m:  # `ls -l /sys/class/iommu`
                (root / f"sys/class/iommu/{m.group(1)}").mkdir(parents=True, exist_ok=True)
    (root / "sys/class/iommu").mkdir(parents=True, exist_ok=True)
    return root


CAPTURES = {
    "x86-vtd-lazy": DATA / "testbed-mix/k6.12-intel-cmoff-lazy-smp1-mix",
    "x86-vtd-strict": DATA / "testbed-mix/k6.12-intel-cmoff-strict-smp4-mix",
    "arm-smmuv3-strict": DATA / "testbed-arm/k6.1-smmuv3-strict",
    "arm-smmuv3-lazy": DATA / "testbed-arm/k6.12-smmuv3-lazy",
    "arm-smmuv3-pt": DATA / "testbed-arm/k6.1-smmuv3-pt",
}
EXPECT = {"x86-vtd-lazy": ("vtd", "lazy"), "x86-vtd-strict": ("vtd", "strict"),
          "arm-smmuv3-strict": ("smmuv3", "strict"), "arm-smmuv3-lazy": ("smmuv3", "lazy"),
          "arm-smmuv3-pt": ("smmuv3", "passthrough")}


# Trees saved inside real guests (testbed/boot.py on 2026-11-25): Debian 6.1 behind QEMU's VT-d, 6.12 behind
# virtio-iommu, arm64 6.1 / 6.12 behind its SMMUv3, and 6.12 on a q35 machine with no IOMMU; and on 2026-11-26
# Debian's 7.3 behind VT-d. Name: vendor-config, -kVERSION for 7.3.
SAVED = sorted((DATA / "inspect").glob("*.tar.gz"))
GROUP_TYPE_MODE = {"DMA": "strict", "DMA-FQ": "lazy", "identity": "passthrough"}


def saved_tree(tgz: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    with tarfile.open(tgz) as t:
        t.extractall(dest, filter="tar")  # the drivers' links point where sysfs had them, outside the tree
    return dest


@pytest.mark.parametrize("tgz", SAVED, ids=[p.name.split(".")[0] for p in SAVED])
def test_inspect_of_a_tree_a_real_guest_saved_names_the_mode_its_groups_report(tgz, tmp_path):
    root = saved_tree(tgz, tmp_path)
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    text = cli("inspect", "--root", str(root), check_rc=0).stdout
    vendor, config = tgz.name.removesuffix(".tar.gz").split("-", 1)
    config, _, kernel = config.partition("-k")  # a tree of a kernel after the newest modelled: -k7.3
    if vendor == "no":
        assert res["iommus"] == [] and res["devices"] == [] and "No IOMMU is visible" in text
        return
    assert [i["vendor"] for i in res["iommus"]] == [vendor]
    # Every device the guest put in a group, with the mode its group's type says, and the default-domain rules
    # (given the guest's own kernel, command line and IOMMU) predict that type.
    groups = {int(g.name): GROUP_TYPE_MODE[(g / "type").read_text().strip()]
              for g in (root / "sys/kernel/iommu_groups").iterdir()}
    in_groups = sorted(d.name for g in (root / "sys/kernel/iommu_groups").iterdir() for d in (g / "devices").iterdir())
    assert sorted(d["device"] for d in res["devices"]) == in_groups
    for d in res["devices"]:
        assert d["mode"] == groups[d["group"]] == d["predicted"], d
    want = {"strict": "strict", "lazy": "lazy", "passthrough": "passthrough", "caching-mode": "strict"}[config]
    assert set(groups.values()) == {want}
    # virtio-pci and nvme drivers, read from the saved links.
    assert {d["driver"] for d in res["devices"]} >= {"virtio-pci"}
    assert not any("kernel log says" in n for n in res["notes"])
    # Linux 7.3: the newest modelled kernel's rules stand in, and inspect says so.
    assert any("the newest kernel whose changes the model knows" in n for n in res["notes"]) == bool(kernel)


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_inspect_names_each_devices_mode_as_the_guest_reported_it(name, tmp_path):
    root = tree_from_capture(CAPTURES[name], tmp_path)
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    vendor, mode = EXPECT[name]
    assert [i["vendor"] for i in res["iommus"]] == [vendor]
    assert res["devices"] and all(d["mode"] == mode for d in res["devices"]), res["devices"]
    # The default-domain rules, given the guest's own command line, predict what sysfs shows.
    assert all(d["predicted"] == mode and "sysfs shows" not in d["why"] for d in res["devices"])
    text = cli("inspect", "--root", str(root), check_rc=0).stdout
    assert f"({vendor})" in text and mode in text
    # The guest's own kernel log says the same as the rules (no disagreement noted), and inspect shows its
    # IOMMU lines: the domain type, and the driver's own (DMAR / arm-smmu-v3).
    seen = res["kernel_log_seen"]
    dt = "iommu: Default domain type: " + ("Passthrough" if mode == "passthrough" else "Translated")
    assert any(l.startswith(dt) for l in seen), seen
    assert any(l.startswith(("DMAR:", "arm-smmu-v3")) for l in seen) and not any("iommu group" in l for l in seen)
    assert not any("kernel log says" in n for n in res["notes"])
    assert "kernel log, IOMMU lines:" in text


def test_a_kernel_log_that_disagrees_with_the_rules_is_pointed_out(tmp_path):
    root = tree_from_capture(CAPTURES["x86-vtd-lazy"], tmp_path)
    log = root / "dev/kmsg"
    log.write_text(log.read_text().replace("lazy mode (set via kernel command line)", "strict mode"))
    res, _ = hostinfo.inspect(root)
    assert any("kernel log says \"iommu: DMA domain TLB invalidation policy: strict mode\"" in n
               for n in res["notes"]), res["notes"]
    # Without a readable log, the text says so and shows what the rules predict it would say.
    log.unlink()
    res, _ = hostinfo.inspect(root)
    assert res["kernel_log_seen"] is None
    assert "kernel log not readable" in hostinfo.format_inspect(res)


def test_kmsg_records_are_read_as_dmesg_lines():
    recs = "6,339,870418,-;iommu: Default domain type: Translated\n SUBSYSTEM=pci\n6,340,1,-;eth0: link up\n"
    assert hostinfo._log_lines(recs) == ["iommu: Default domain type: Translated"]


def test_vtd_capabilities_are_decoded():
    root = CAPTURES["x86-vtd-lazy"]
    cap = (root / "intel-iommu-sysfs.txt").read_text()
    assert "cap:d2008c22260206" in cap


def test_vtd_registers_say_physical_or_virtual(tmp_path):
    root = tree_from_capture(CAPTURES["x86-vtd-lazy"], tmp_path)
    res, _ = hostinfo.inspect(root)
    dmar = res["iommus"][0]
    # QEMU's intel-iommu without caching-mode=on: CM clear, PSI set, MAMV 18 (VTD_MAMV).
    assert (dmar["caching_mode"], dmar["page_selective"], dmar["mamv"]) == (False, True, 18)
    # Caching mode set (as QEMU's caching-mode=on): a virtual IOMMU, and the rules take it in.
    capf = root / "sys/class/iommu/dmar0/intel-iommu/cap"
    capf.write_text(f"{int(capf.read_text(), 16) | 1 << 7:x}\n")
    res, _ = hostinfo.inspect(root)
    assert res["iommus"][0]["caching_mode"] and any("virtual IOMMU" in n for n in res["notes"])


def test_a_group_type_the_rules_do_not_predict_is_pointed_out(tmp_path):
    root = tree_from_capture(CAPTURES["x86-vtd-strict"], tmp_path)
    (root / "sys/kernel/iommu_groups/1/type").write_text("identity\n")
    res, _ = hostinfo.inspect(root)
    d = next(d for d in res["devices"] if d["group"] == 1)
    assert d["mode"] == "passthrough" and "sysfs shows identity" in d["why"]


def test_no_iommu_is_said_in_plain_words(tmp_path):
    root = tree_from_capture(DATA / "testbed-arm/k6.12-noiommu", tmp_path)
    p = cli("inspect", "--root", str(root), check_rc=0)
    assert "No IOMMU is visible" in p.stdout


def test_save_copies_exactly_what_was_read_and_reads_back_the_same(tmp_path):
    root = tree_from_capture(CAPTURES["arm-smmuv3-lazy"], tmp_path / "guest")
    saved = tmp_path / "saved"
    first = json.loads(cli("inspect", "--root", str(root), "--save", str(saved), "--json", check_rc=0).stdout)
    again = json.loads(cli("inspect", "--root", str(saved), "--json", check_rc=0).stdout)
    assert first == again
    # Nothing is overwritten.
    p = cli("inspect", "--root", str(root), "--save", str(saved), check_rc=2)
    assert "--save" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_scenario_skeleton_loads_and_is_never_overwritten(tmp_path):
    root = tree_from_capture(CAPTURES["x86-vtd-lazy"], tmp_path / "guest")
    out = tmp_path / "host.toml"
    cli("inspect", "--root", str(root), "--scenario", str(out), check_rc=0)
    v = iommulab.load(str(out), {"run.duration_ms": 1})
    sc = json.loads(v[0].scenario_json())
    assert sc["platform"]["profile"] == "vtd-server" and sc["os"]["policy"] == "lazy" and sc["os"]["kernel"] == "6.12"
    p = cli("inspect", "--root", str(root), "--scenario", str(out), check_rc=2)
    assert "exists" in p.stderr


def test_ats_is_read_from_the_extended_capabilities():
    cfg = bytearray(4096)
    # Extended capabilities at 0x100: AER (0x0001) → 0x140: ATS (0x000F), end of list.
    cfg[0x100:0x104] = (0x0001 | 1 << 16 | 0x140 << 20).to_bytes(4, "little")
    cfg[0x140:0x144] = (0x000F | 1 << 16).to_bytes(4, "little")
    assert hostinfo._ats(bytes(cfg)) is True
    cfg[0x140:0x144] = (0x0019 | 1 << 16).to_bytes(4, "little")
    assert hostinfo._ats(bytes(cfg)) is False
    assert hostinfo._ats(bytes(64)) is None  # only the first 64 bytes: not root
