"""Make the edited trees: a guest's saved tree (../NAME.tar.gz) with every sign of its VM taken out of its kernel
log and a server's firmware and CPU put in, so that advise can be tested on bare metal with the kernel, command
line and IOMMU groups a real kernel wrote. Run from this directory: python make.py. What is changed:

- the kernel log: QEMU's DMI name, its ACPI tables' OEM (BOCHS, BXPC) and the arm virt board's machine model
  become a Dell PowerEdge R650's (x86_64) or a Huawei TaiShan 200's (arm64); QEMU's TCG CPU and "PMU not
  available due to virtualization" become an Ice Lake Xeon's lines;
- proc/cpuinfo (absent from the guests' trees) is added: one Xeon Gold 6338 or Kunpeng 920 CPU, no hypervisor flag.
"""

import gzip
import io
import pathlib
import re
import tarfile

HERE = pathlib.Path(__file__).parent
TREES = {"vtd-metal-strict": "vtd-strict", "vtd-metal-lazy": "vtd-lazy", "vtd-metal-passthrough": "vtd-passthrough",
         "smmuv3-metal-strict": "smmuv3-strict", "no-iommu-metal": "no-iommu"}
X86 = [(r"DMI: QEMU Standard PC .*", "DMI: Dell Inc. PowerEdge R650/0PYXKY, BIOS 1.6.5 04/15/2022"),
       (r"\(v00 BOCHS \)", "(v02 DELL  )"),
       (r"\(v0(\d) BOCHS  BXPC     00000001 BXPC 00000001\)", r"(v0\1 DELL   PE_SC3   00000000 INTL 20200925)"),
       (r"AMD QEMU TCG CPU version 2\.5\+ \(family: 0xf, model: 0x6b, stepping: 0x1\)",
        "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz (family: 0x6, model: 0x6a, stepping: 0x6)"),
       (r"PMU not available due to virtualization, using software events only\.",
        "PEBS fmt4+-baseline,  AnyThread deprecated, Icelake events, 32-deep LBR, full-width counters, Intel PMU "
        "driver.")]
ARM = [(r"Machine model: linux,dummy-virt", "DMI: Huawei TaiShan 200 (Model 2280)/BC82AMDD, BIOS 1.35 04/30/2020")]
CPUINFO = {"x86_64": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ "
                     "2.00GHz\nflags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov\n",
           "aarch64": "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
                    "CPU implementer\t: 0x48\nCPU part\t: 0xd01\n"}


def edit(name: str, src: str) -> None:
    with tarfile.open(HERE.parent / f"{src}.tar.gz") as t:
        members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]
    arch = next(d for m, d in members if m.name.endswith("proc/sys/kernel/arch")).decode().strip()
    out = io.BytesIO()
    # mtime 0: the same trees give the same bytes.
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as z, tarfile.open(fileobj=z, mode="w",
                                                                             format=tarfile.GNU_FORMAT) as t:
        for m, data in members:
            if m.name.endswith("dev/kmsg"):
                text = data.decode()
                for pat, rep in (X86 if arch == "x86_64" else ARM):
                    text = re.sub(pat, rep, text)
                data = text.encode()
                m.size = len(data)
            t.addfile(m, io.BytesIO(data) if data is not None else None)
            if m.name.endswith("proc/sys/kernel/arch"):
                info = tarfile.TarInfo(m.name.replace("sys/kernel/arch", "cpuinfo"))
                body = CPUINFO[arch].encode()
                info.size, info.mode = len(body), 0o644
                t.addfile(info, io.BytesIO(body))
    (HERE / f"{name}.tar.gz").write_bytes(out.getvalue())


if __name__ == "__main__":
    for name, src in TREES.items():
        edit(name, src)
