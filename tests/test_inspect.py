"""`iommulab inspect` on the trees real guests saved (tests/data/inspect: what testbed/guest-init.sh copies out of
a guest booted by testbed/boot.py, the files inspect reads) and on trees rebuilt from the older captures' sysfs
dumps (IOMMU groups and their types, /sys/class/iommu, VT-d capability registers, the kernel command line and
version): x86 VT-d strict, lazy, caching mode and passthrough, virtio-iommu, arm64 SMMUv3 strict, lazy and
passthrough, and machines without an IOMMU."""

import contextlib
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import tarfile
import tempfile

import pytest
from hypothesis import given, settings, strategies as st

import iommulab
from conftest import cli, one_line_error
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


def vtd_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tree a real VT-d guest saved (6.1, lazy; six groups, group 3 holding 0000:00:03.0)."""
    return saved_tree(DATA / "inspect/vtd-lazy.tar.gz", tmp_path / "tree")


def test_files_of_a_tree_that_lead_to_dev_zero_or_are_huge_are_read_to_a_bound(tmp_path):
    # Issue 4: a link to /dev/zero (13.8 GB read) or a 1 GB file in the tree was read whole, and --save copied
    # it. Run bounded, so that a regression fails here fast.
    root = vtd_tree(tmp_path)
    (root / "proc/cmdline").unlink()
    (root / "proc/cmdline").symlink_to("/dev/zero")
    with open(root / "sys/class/iommu/dmar0/intel-iommu/ecap", "r+b") as f:
        f.truncate(1 << 30)  # sparse: nothing is written
    saved = tmp_path / "saved"
    p = cli("inspect", "--root", str(root), "--save", str(saved), bounded=True, timeout=60, check_rc=0)
    assert "Not used: proc/cmdline: leads out of the tree (to /dev/zero); not followed" in p.stdout
    assert ("Not used: sys/class/iommu/dmar0/intel-iommu/ecap: larger than 4096 bytes; expected a sysfs attribute"
            in p.stdout)
    assert not (saved / "sys/class/iommu/dmar0/intel-iommu/ecap").exists()
    assert (saved / "sys/class/iommu/dmar0/intel-iommu/cap").read_text().strip() == "d2008c22260206"


def test_a_fifo_in_the_tree_is_not_opened(tmp_path):
    # Issue 5: inspect hung for ever on a FIFO as proc/cmdline or dev/kmsg.
    root = vtd_tree(tmp_path)
    for rel in ("proc/cmdline", "dev/kmsg"):
        (root / rel).unlink()
        os.mkfifo(root / rel)
    res = json.loads(cli("inspect", "--root", str(root), "--json", timeout=60, check_rc=0).stdout)
    assert "Not used: proc/cmdline: a FIFO; expected a /proc file" in res["notes"]
    assert "Not used: dev/kmsg: a FIFO; expected the kernel log" in res["notes"]
    assert res["cmdline"] == "" and res["kernel_log_seen"] is None and len(res["devices"]) == 8


def test_links_out_of_the_tree_are_not_followed_and_links_inside_it_are(tmp_path):
    # Issue 5: a saved tree's link was followed wherever it led (here to a file beside the tree).
    root = vtd_tree(tmp_path)
    want = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    # As on a live system: the IOMMU's class entry and each group's devices are relative links into
    # sys/devices, and a device's sys/bus entry too.
    dmar = root / "sys/devices/virtual/iommu/dmar0"
    dmar.parent.mkdir(parents=True)
    (root / "sys/class/iommu/dmar0").rename(dmar)
    (root / "sys/class/iommu/dmar0").symlink_to("../../devices/virtual/iommu/dmar0")
    for dev in (root / "sys/kernel/iommu_groups").glob("*/devices/*"):
        real = root / "sys/devices/pci0000:00" / dev.name
        real.mkdir(parents=True)
        for f in (root / "sys/bus/pci/devices" / dev.name).iterdir():
            f.rename(real / f.name)
        (root / "sys/bus/pci/devices" / dev.name).rmdir()
        (root / "sys/bus/pci/devices" / dev.name).symlink_to(f"../../../devices/pci0000:00/{dev.name}")
        dev.rmdir()
        dev.symlink_to(f"../../../../devices/pci0000:00/{dev.name}")
    assert json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout) == want
    # A link out of the tree is not read, and it says so.
    secret = tmp_path / "secret.txt"
    secret.write_text("iommu=pt outside-the-tree\n")
    (root / "proc/cmdline").unlink()
    (root / "proc/cmdline").symlink_to(os.path.relpath(secret, root / "proc"))
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert res["cmdline"] == "" and "outside-the-tree" not in json.dumps(res)
    assert f"Not used: proc/cmdline: leads out of the tree (to {secret}); not followed" in res["notes"]


def test_a_tree_that_cannot_be_read_is_an_error_not_no_iommu(tmp_path):
    # Issue 5: a tree that could not be read was reported as a machine without an IOMMU. Tests may run as root,
    # where chmod does not stop a read: a directory replaced by a file (ENOTDIR) cannot be listed by anyone.
    root = vtd_tree(tmp_path)
    shutil.rmtree(root / "sys")
    (root / "sys").write_text("")
    err = one_line_error(cli("inspect", "--root", str(root)))
    assert err == f"iommulab: error: {root}/sys/class/iommu: cannot read: Not a directory", err
    # A directory that is not a saved tree at all.
    empty = tmp_path / "empty"
    empty.mkdir()
    err = one_line_error(cli("inspect", "--root", str(empty)))
    assert err == f"iommulab: error: --root {empty}: no proc/ or sys/ in it; expected a tree inspect --save wrote"


def test_a_group_whose_devices_cannot_be_listed_is_named(tmp_path):
    # Issue 5: an unreadable group directory dropped its devices without a word (simulated as above).
    root = vtd_tree(tmp_path)
    shutil.rmtree(root / "sys/kernel/iommu_groups/3/devices")
    (root / "sys/kernel/iommu_groups/3/devices").write_text("")
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert ("Not used: sys/kernel/iommu_groups/3/devices: cannot read: Not a directory; the devices of IOMMU group "
            "3 are not shown") in res["notes"]
    assert len(res["devices"]) == 7 and "0000:00:03.0" not in {d["device"] for d in res["devices"]}


def test_garbage_registers_and_group_names_are_named_and_the_rest_is_reported(tmp_path):
    # Issue 11: a cap, ecap or class that is not hex, or a group named 3², was a traceback. The user of a broken
    # tree is shown the rest of it, and which files were not used.
    root = vtd_tree(tmp_path)
    (root / "sys/class/iommu/dmar0/intel-iommu/cap").write_text("zz\n")
    (root / "sys/bus/pci/devices/0000:00:02.0/class").write_bytes(b"0x\xff\n")
    (root / "sys/kernel/iommu_groups/3").rename(root / "sys/kernel/iommu_groups/3\u00b2")
    p = cli("inspect", "--root", str(root), check_rc=0)
    assert "Not used: sys/class/iommu/dmar0/intel-iommu/cap: 'zz' is not a hexadecimal number" in p.stdout
    assert "Not used: sys/bus/pci/devices/0000:00:02.0/class: '0x\ufffd' is not a hexadecimal number" in p.stdout
    assert "Not used: sys/kernel/iommu_groups/3\u00b2: not an IOMMU group number" in p.stdout
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert "cap" not in res["iommus"][0] and res["iommus"][0]["device_tlb"] is False
    assert len(res["devices"]) == 7 and all(d["mode"] == "lazy" for d in res["devices"])


def add_nic(root: pathlib.Path, speed: str, rx: int = 4, tx: int = 4, name: str = "eth0") -> None:
    """A PCI NIC port in the tree: its device link, `speed` file and queues."""
    net = root / "sys/class/net" / name
    (net / "queues").mkdir(parents=True)
    for q in [f"rx-{i}" for i in range(rx)] + [f"tx-{i}" for i in range(tx)]:
        (net / "queues" / q).mkdir()
    (net / "speed").write_text(speed)
    (net / "device").symlink_to("../../../devices/pci0000:00/0000:00:03.0")


@pytest.mark.parametrize("speed", ["\u00b2\n", "25 Gb/s\n", "1e5\n", "\u0661\u0660\n", "99999999999999999999\n"])
def test_a_nic_speed_that_is_not_a_number_is_noted_not_a_traceback(speed, tmp_path):
    # Issue 64 (item 14): a NIC's speed file holding "²" passed str.isdigit() and int() raised a traceback.
    root = vtd_tree(tmp_path)
    add_nic(root, speed)
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert res["hardware"]["nics"][0]["speed_gbps"] is None
    assert any(n.startswith("Not used: sys/class/net/eth0/speed: ") and "is not a speed in Mb/s" in n
               for n in res["notes"]), res["notes"]
    # A link that is down (-1) is no speed, and not a problem.
    (root / "sys/class/net/eth0/speed").write_text("-1\n")
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert res["hardware"]["nics"][0]["speed_gbps"] is None and not any("speed" in n for n in res["notes"])


EDITED = sorted((DATA / "inspect/edited").glob("*.tar.gz"))


@pytest.mark.parametrize("tgz", SAVED + EDITED, ids=[p.name.split(".")[0] for p in SAVED + EDITED])
def test_a_guest_is_told_from_bare_metal_by_its_kernel_log(tgz, tmp_path):
    # Issue 64 (item 1): every saved tree is a QEMU guest's (its ACPI tables are BOCHS/BXPC, or its machine
    # QEMU's arm virt board), and only the CPU's hypervisor flag, which no saved tree holds, was looked at. The
    # edited trees (tests/data/inspect/edited/make.py) are the same trees with a server's firmware in the log.
    hw = hostinfo.inspect(saved_tree(tgz, tmp_path))[0]["hardware"]
    if tgz in EDITED:
        assert hw["guest"] is False and hw["vmm"] is None, hw
    else:
        assert hw["guest"] is True and hw["vmm"] == "QEMU" and "QEMU" in hw["guest_evidence"], hw


def test_a_guest_is_told_by_the_cpus_flag_or_the_hypervisor_the_log_names(tmp_path):
    root = saved_tree(DATA / "inspect/edited/vtd-metal-lazy.tar.gz", tmp_path / "a")
    (root / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu hypervisor\n")
    assert hostinfo.inspect(root)[0]["hardware"]["guest"] is True
    (root / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu\n")
    with open(root / "dev/kmsg", "a") as f:
        f.write("[    0.000000] Hypervisor detected: Microsoft Hyper-V\n")
    hw = hostinfo.inspect(root)[0]["hardware"]
    assert hw["guest"] is True and hw["vmm"] == "Microsoft Hyper-V", hw


def test_an_iommu_on_an_architecture_it_cannot_be_on_is_said(tmp_path):
    # Issue 64 (item 16): VT-d in a tree whose kernel says aarch64 went by without a word.
    root = vtd_tree(tmp_path)
    (root / "proc/sys/kernel/arch").write_text("aarch64\n")
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert any(n.startswith("Intel VT-d cannot be on arm64 (its driver is built for x86_64 only)")
               for n in res["notes"]), res["notes"]


def test_outputs_are_checked_before_anything_is_written(tmp_path):
    # Issue 5: --scenario was written before --save was checked, and written through a dangling link.
    root = vtd_tree(tmp_path)
    sc, full = tmp_path / "host.toml", tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    err = one_line_error(cli("inspect", "--root", str(root), "--scenario", str(sc), "--save", str(full)))
    assert "--save" in err and "not an empty directory" in err and not sc.exists()
    # Issue 11: --save where no directory can be made (under a file) is one line, and nothing else is written.
    err = one_line_error(cli("inspect", "--root", str(root), "--scenario", str(sc), "--save", str(sc / "saved")))
    assert err == f"iommulab: error: --save {sc}/saved: cannot write in {sc}: not a directory" and not sc.exists()
    link, target = tmp_path / "link.toml", tmp_path / "elsewhere.toml"
    link.symlink_to(target)
    err = one_line_error(cli("inspect", "--root", str(root), "--scenario", str(link)))
    assert f"--scenario {link}: a link to {target}, which does not exist" in err and not target.exists()
    cli("inspect", "--root", str(root), "--scenario", str(link), "--force", check_rc=0)
    assert "[platform]" in target.read_text()


# The files inspect reads, and names like them.
TREE_FILES = ["proc/cmdline", "proc/sys/kernel/osrelease", "proc/sys/kernel/arch", "proc/config.gz",
              "boot/config-6.12.0", "dev/kmsg", "sys/class/iommu/dmar0/intel-iommu/cap",
              "sys/class/iommu/dmar0/intel-iommu/ecap", "sys/class/iommu/smmu3.0x0/x", "sys/class/iommu/ivhd0/x",
              "sys/kernel/iommu_groups/0/type", "sys/kernel/iommu_groups/1/type",
              "sys/kernel/iommu_groups/3\u00b2/type",
              "sys/kernel/iommu_groups/0/devices/0000:00:01.0/x", "sys/kernel/iommu_groups/1/devices/0000:00:02.0/x",
              "sys/bus/pci/devices/0000:00:01.0/class", "sys/bus/pci/devices/0000:00:01.0/config",
              "sys/bus/pci/devices/0000:00:01.0/untrusted", "sys/bus/pci/devices/0000:00:01.0/driver",
              "sys/bus/pci/devices/0000:00:02.0/class", "sys/devices/system/cpu/cpu0/x", "sys", "proc", "sys/kernel",
              "sys/class/net/eth0/speed", "sys/class/net/eth0/device", "sys/class/net/eth0/queues/rx-0/x",
              "proc/cpuinfo"]
TREE_TEXT = ["DMA\n", "DMA-FQ\n", "identity\n", "d2008c22260206\n", "f00f4a", "0x020000\n", "0x010802", "zz", "",
             "6.12.0\n", "7.3.4\n", "x86_64\n", "aarch64", "1\n", "quiet iommu.strict=0 intel_iommu=on\n",
             "iommu: Default domain type: Translated\n", "CONFIG_IOMMU_DEFAULT_DMA_LAZY=y\n", "../x/../../..",
             "\u00b2\n", "25000\n", "-1\n", "flags\t: fpu hypervisor\n", "[    0.0] Hypervisor detected: KVM\n"]
# What each file of a random tree is: text, bytes, a directory, a FIFO, a link inside the tree, out of it
# (to an endless device, to a file beside the tree, to /) or to nothing.
ENTRY = st.one_of(st.tuples(st.just("text"), st.sampled_from(TREE_TEXT)),
                  st.tuples(st.just("bytes"), st.binary(max_size=64)),
                  st.tuples(st.just("dir"), st.just(None)), st.tuples(st.just("fifo"), st.just(None)),
                  st.tuples(st.just("link"), st.sampled_from(TREE_FILES + ["../..", "../../../..", "."])),
                  st.tuples(st.just("out"), st.sampled_from(["/dev/zero", "/dev/urandom", "{beside}", "/"])),
                  st.tuples(st.just("dangling"), st.just("nothing-here")))
NAMES = st.one_of(st.sampled_from(TREE_FILES), st.sampled_from([b"sys/kernel/iommu_groups/\xff",
                                                                 b"sys/class/iommu/dmar\xfe"]))


def build_tree(root: pathlib.Path, entries: list) -> None:
    """Write `entries` (name, (kind, arg)) under `root`; an entry that cannot be made is left out."""
    beside = root.parent / "beside.txt"
    beside.write_text("secret\n")
    for name, (kind, arg) in entries:
        p = os.path.join(os.fsencode(root), os.fsencode(name))
        try:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            if os.path.lexists(p):
                continue
            if kind == "text":
                pathlib.Path(os.fsdecode(p)).write_text(arg)
            elif kind == "bytes":
                pathlib.Path(os.fsdecode(p)).write_bytes(arg)
            elif kind == "dir":
                os.mkdir(p)
            elif kind == "fifo":
                os.mkfifo(p)
            elif kind == "link":
                os.symlink(os.path.relpath(os.path.join(os.fsencode(root), os.fsencode(arg)), os.path.dirname(p)), p)
            else:
                os.symlink(str(beside) if arg == "{beside}" else arg, p)
        except OSError:  # its directory is a file, or a link to nothing
            continue


@contextlib.contextmanager
def bounded(seconds: float, extra_bytes: int):
    """A SIGALRM after `seconds` and an address-space limit `extra_bytes` above what the process has: a hang or
    an endless read fails the example instead of stalling the suite or filling the machine's memory."""
    def timeout(*_):
        raise TimeoutError(f"inspect took over {seconds} s")
    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    old = resource.getrlimit(resource.RLIMIT_AS)
    handler = signal.signal(signal.SIGALRM, timeout)
    resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes, old[1]))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, old)
        signal.signal(signal.SIGALRM, handler)


@settings(deadline=5000)
@given(entries=st.lists(st.tuples(NAMES, ENTRY), max_size=12))
def test_any_small_tree_gives_a_report_or_one_scenario_error(entries):
    # Whatever a saved tree holds (the names inspect reads, with garbage, FIFOs, links in and out of the tree,
    # names that are not UTF-8), inspect and --save answer with a report or a one-line ScenarioError, quickly and
    # in bounded memory; the report prints as UTF-8 text and as JSON.
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "tree"
        root.mkdir()
        build_tree(root, entries)
        with bounded(20, 512 << 20):
            try:
                res, tree = hostinfo.inspect(root)
                hostinfo.format_inspect(res).encode("utf-8")
                json.dumps(res, ensure_ascii=False).encode("utf-8")
                hostinfo.save(tree, pathlib.Path(tmp) / "saved")
            except iommulab.ScenarioError as e:
                assert "\n" not in str(e)


def test_a_riscv_guests_groups_are_identity_as_the_rules_predict(tmp_path):
    # A RISC-V IOMMU (riscv-iommu@DEVICE, nothing but its devices/ links): Linux on riscv64 has no IOMMU_DMA, so
    # every group is identity although the kernel logs a translated, strict default. The tree is an x86 guest's,
    # rewritten as the riscv64 guest the testbed research booted (Debian 7.2.11 behind QEMU 10.0's
    # riscv-iommu-pci) showed it.
    root = saved_tree(DATA / "inspect" / "amdvi-strict.tar.gz", tmp_path)
    iommu = root / "sys/class/iommu"
    for d in iommu.iterdir():
        shutil.rmtree(d)
    (iommu / "riscv-iommu@0000:00:01.0" / "devices").mkdir(parents=True)
    (root / "proc/sys/kernel/arch").write_text("riscv64\n")
    (root / "proc/sys/kernel/osrelease").write_text("7.2.11+deb13-riscv64\n")
    (root / "proc/cmdline").write_text("console=ttyS0\n")
    for g in (root / "sys/kernel/iommu_groups").iterdir():
        (g / "type").write_text("identity\n")
    (root / "dev/kmsg").write_text("6,1,100,-;iommu: Default domain type: Translated\n"
                                   "6,2,101,-;iommu: DMA domain TLB invalidation policy: strict mode\n")
    res = json.loads(cli("inspect", "--root", str(root), "--json", check_rc=0).stdout)
    assert [i["vendor"] for i in res["iommus"]] == ["riscv"]
    assert res["devices"] and all(d["mode"] == "passthrough" == d["predicted"] for d in res["devices"])
    assert "IOMMU_DMA" in res["devices"][0]["why"]
    assert not any("kernel log says" in n for n in res["notes"])


# --- issue 64 item 10: --root takes the committed .tar.gz trees as they are ---

@pytest.mark.parametrize("tgz", sorted((DATA / "inspect").glob("*.tar.gz")), ids=lambda p: p.name)
def test_root_reads_a_tar_gz_tree_as_the_directory_it_holds(tgz, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    packed = cli("inspect", "--root", str(tgz), "--json", check_rc=0, env={"TMPDIR": str(tmp)})
    unpacked = cli("inspect", "--root", str(saved_tree(tgz, tmp_path / "tree")), "--json", check_rc=0)
    assert json.loads(packed.stdout) == json.loads(unpacked.stdout)
    assert list(tmp.iterdir()) == [], "the unpacked tree is removed"


def test_advise_reads_a_tar_gz_tree():
    doc = json.loads(cli("advise", "--root", str(DATA / "inspect" / "vtd-lazy.tar.gz"), "--json", "--no-ranges",
                         check_rc=0).stdout)
    assert doc["host"]["guest"] is True and doc["recommendation"]["option"]


def _archive(path: pathlib.Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> pathlib.Path:
    with tarfile.open(path, "w:gz") as t:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            t.addfile(info, None if data is None else __import__("io").BytesIO(data))
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    if size is not None:
        info.size = size
    return info


@pytest.mark.parametrize("member, data, why", [
    (_member("/etc/passwd"), b"x", "a path outside the tree"),
    (_member("../escape"), b"x", "a path outside the tree"),
    (_member("proc/../../escape"), b"x", "a path outside the tree"),
    (_member("sys/out", tarfile.SYMTYPE, "../../etc"), None, "a link leading out of the tree"),
    (_member("sys/abs", tarfile.SYMTYPE, "/etc/passwd"), None, "a link leading out of the tree"),
    (_member("sys/hard", tarfile.LNKTYPE, "proc/cmdline"), None, "a hard link"),
    (_member("dev/null", tarfile.CHRTYPE), None, "a device or FIFO"),
    (_member("dev/fifo", tarfile.FIFOTYPE), None, "a device or FIFO"),
])
def test_an_archive_member_that_could_reach_outside_is_refused(member, data, why, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tgz = _archive(tmp_path / "bad.tar.gz", (_member("proc/cmdline"), b"quiet\n"), (member, data))
    err = one_line_error(cli("inspect", "--root", str(tgz), env={"TMPDIR": str(tmp)}))
    assert why in err and "bad.tar.gz" in err, err
    assert list(tmp.iterdir()) == [], "the unpacked tree is removed on an error too"
    assert not (tmp_path / "escape").exists()


def test_an_oversized_archive_member_is_refused_before_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(hostinfo, "ARCHIVE_MEMBER_BYTES", 1000)
    tgz = _archive(tmp_path / "big.tar.gz", (_member("proc/cmdline"), b"quiet\n"), (_member("dev/kmsg"), b"x" * 1001))
    with pytest.raises(iommulab.ScenarioError, match="1001 bytes; expected at most 1000"):
        hostinfo.inspect(tgz)


def test_an_interrupted_read_of_an_archive_leaves_nothing_behind(tmp_path, monkeypatch):
    seen = []

    def interrupted(root):
        seen.append(root)
        raise KeyboardInterrupt

    monkeypatch.setattr(hostinfo, "_inspect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hostinfo.inspect(DATA / "inspect" / "vtd-lazy.tar.gz")
    assert seen and not os.path.exists(seen[0])


def test_sigterm_while_an_archive_is_unpacked_removes_it(tmp_path, monkeypatch):
    # SIGTERM's default ends the process at once, skipping the removal: while a tree is unpacked it raises.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit):
        with hostinfo._unpacked(DATA / "inspect" / "vtd-lazy.tar.gz") as d:
            assert os.path.isdir(os.path.join(d, "proc"))
            os.kill(os.getpid(), signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
