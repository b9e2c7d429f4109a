//! Default-domain resolution as the kernel does it: drivers/iommu/iommu.c iommu_subsys_init() takes the
//! arch's Kconfig default, then `iommu.passthrough=`, `iommu=pt|nopt` (x86) and `iommu.strict=` from the
//! command line; the VT-d driver forces strict under caching mode (intel/iommu.c: "IOMMU batching disallowed
//! due to virtualization"); iommu_get_default_domain_type() gives untrusted PCI devices a strict DMA domain
//! whatever was asked; and iommu_dma_init_domain() falls back from DMA-FQ to DMA when the driver lacks
//! IOMMU_CAP_DEFERRED_FLUSH (virtio-iommu before 6.8).

use super::flush_queue::{
    IOVA_DEFAULT_FQ_SIZE, IOVA_DEFAULT_FQ_TIMEOUT_MS, IOVA_SINGLE_FQ_SIZE,
    IOVA_SINGLE_FQ_TIMEOUT_MS,
};
use crate::hw::driver::{KernelDriver, Switch};
use crate::kernel::{Arch, KernelVersion};
use crate::scenario::PolicyName;
use serde::Serialize;

/// The resolved policy and the kernel-log-style reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub policy: PolicyName,
    pub reason: String,
}

/// What a kind of device ends up with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceMode {
    pub device: &'static str,
    /// /sys/kernel/iommu_groups/*/type: identity, DMA or DMA-FQ.
    pub sysfs: &'static str,
    pub policy: PolicyName,
    pub why: String,
}

/// The kernel's own log lines about the choice, and the outcome per kind of device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explained {
    pub kernel_log: Vec<String>,
    pub devices: Vec<DeviceMode>,
}

/// kstrtobool(): 1/y/Y/on → true, 0/n/N/off → false.
fn kstrtobool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "y" | "yes" | "on" | "true" => Some(true),
        "0" | "n" | "no" | "off" | "false" => Some(false),
        _ => None,
    }
}

fn sysfs(p: PolicyName) -> &'static str {
    match p {
        PolicyName::Passthrough => "identity",
        PolicyName::Strict
        | PolicyName::Xsmmu
        | PolicyName::Fands
        | PolicyName::Fns
        | PolicyName::Blocks => "DMA",
        PolicyName::Lazy | PolicyName::Auto => "DMA-FQ",
    }
}

/// Resolve the default domain of a trusted and an untrusted PCI device. `kernel` is (major, minor).
pub fn explain(
    arch: Arch,
    kernel: (u32, u32),
    cmdline: &str,
    caching_mode: bool,
    driver: &dyn KernelDriver,
) -> Explained {
    let kver = KernelVersion::from(kernel);
    // CONFIG_IOMMU_DEFAULT_DMA_LAZY on X86 and S390, STRICT elsewhere (drivers/iommu/Kconfig).
    let mut strict = !matches!(arch, Arch::X86_64 | Arch::S390);
    let mut passthrough = false;
    let mut type_cmdline = false;
    let mut strict_cmdline = false;
    let mut log = Vec::new();
    let mut iommu_off = None;
    for tok in cmdline.split_whitespace() {
        let (k, v) = tok.split_once('=').unwrap_or((tok, ""));
        match k {
            "iommu.passthrough" => {
                if let Some(b) = kstrtobool(v) {
                    passthrough = b;
                    type_cmdline = true;
                }
            }
            // arch/x86/kernel/pci-dma.c iommu_setup(): iommu=pt / iommu=nopt.
            "iommu" if arch == Arch::X86_64 => {
                for opt in v.split(',') {
                    match opt {
                        "pt" | "nopt" => {
                            passthrough = opt == "pt";
                            type_cmdline = true;
                        }
                        _ => {}
                    }
                }
            }
            "iommu.strict" => {
                if let Some(b) = kstrtobool(v) {
                    strict = b;
                    strict_cmdline = true;
                }
            }
            // The driver's own parameter (intel_iommu=, s390_iommu=): comma-separated options.
            _ if driver.param() == Some(k) => {
                for opt in v.split(',') {
                    match driver.switch(opt, kver) {
                        Some(Switch::Strict(line)) => {
                            log.push(line.into());
                            strict = true;
                        }
                        Some(Switch::Off(line)) => iommu_off = Some((line, format!("{k}={opt}"))),
                        Some(Switch::Log(line)) => log.push(line.into()),
                        None => {}
                    }
                }
            }
            _ => {}
        }
    }
    if let Some((line, switch)) = iommu_off {
        log.extend(line.map(String::from));
        let why = format!("{switch}: no IOMMU, DMA goes through dma-direct untranslated");
        return Explained {
            kernel_log: log,
            devices: vec![
                DeviceMode {
                    device: "PCI device",
                    sysfs: "none",
                    policy: PolicyName::Passthrough,
                    why: why.clone(),
                },
                DeviceMode {
                    device: "untrusted PCI device",
                    sysfs: "none",
                    policy: PolicyName::Passthrough,
                    why,
                },
            ],
        };
    }
    let cl = |set: bool| {
        if set {
            " (set via kernel command line)"
        } else {
            ""
        }
    };
    let default = if passthrough {
        PolicyName::Passthrough
    } else if strict {
        PolicyName::Strict
    } else {
        PolicyName::Lazy
    };
    log.push(format!(
        "iommu: Default domain type: {}{}",
        if passthrough {
            "Passthrough"
        } else {
            "Translated"
        },
        cl(type_cmdline)
    ));
    if !passthrough {
        log.push(format!(
            "iommu: DMA domain TLB invalidation policy: {} mode{}",
            if strict { "strict" } else { "lazy" },
            cl(strict_cmdline)
        ));
    }
    let mut trusted = default;
    let mut why = log
        .last()
        .map(|l| l.trim_start_matches("iommu: ").to_string())
        .unwrap_or_default();
    // intel_iommu_init(): a caching-mode IOMMU makes every DMA domain strict (after the lines above).
    if let Some((line, reason)) = driver
        .strict_under_caching_mode(kver)
        .filter(|_| caching_mode)
    {
        log.push(line.into());
        if trusted == PolicyName::Lazy {
            trusted = PolicyName::Strict;
            why = reason.into();
        }
    }
    // iommu_dma_init_domain(): DMA-FQ needs IOMMU_CAP_DEFERRED_FLUSH.
    if let Err(reason) = driver.deferred_flush(kver) {
        if trusted == PolicyName::Lazy {
            trusted = PolicyName::Strict;
            why = reason.into();
        }
    }
    // iommu_get_default_domain_type(): without CONFIG_IOMMU_DMA (riscv64) every group is identity, whatever
    // the lines above said: the DMA API does not use IOMMU domains.
    if !arch.iommu_dma() {
        let why = format!(
            "{} kernels have no IOMMU_DMA (drivers/iommu/Kconfig: def_bool ARM64 || X86 || S390): \
             iommu_get_default_domain_type() forces an identity domain",
            arch.as_str()
        );
        let identity = |device| DeviceMode {
            device,
            sysfs: "identity",
            policy: PolicyName::Passthrough,
            why: why.clone(),
        };
        return Explained {
            kernel_log: log,
            devices: vec![identity("PCI device"), identity("untrusted PCI device")],
        };
    }
    let untrusted = PolicyName::Strict;
    let mut devices = vec![DeviceMode {
        device: "PCI device",
        sysfs: sysfs(trusted),
        policy: trusted,
        why,
    }];
    // s390_iommu_probe_device(): a zPCI function that needs TLB refreshes (z/VM, KVM) sets shadow_on_flush,
    // and iommu_dma_init_options() gives its DMA-FQ domain one large queue instead of per-CPU rings.
    if let Some(device) = driver
        .shadow_on_flush()
        .filter(|_| trusted == PolicyName::Lazy)
    {
        devices.push(DeviceMode {
            device,
            sysfs: sysfs(trusted),
            policy: trusted,
            why: format!(
                "shadow_on_flush: one flush queue of {IOVA_SINGLE_FQ_SIZE} entries with a {IOVA_SINGLE_FQ_TIMEOUT_MS} ms timer instead of per-CPU rings of {IOVA_DEFAULT_FQ_SIZE} with {IOVA_DEFAULT_FQ_TIMEOUT_MS} ms"
            ),
        });
    }
    devices.push(DeviceMode {
        device: "untrusted PCI device",
        sysfs: sysfs(untrusted),
        policy: untrusted,
        why: "untrusted (external-facing) PCI devices always get a strict DMA domain (iommu_get_default_domain_type)".into(),
    });
    Explained {
        kernel_log: log,
        devices,
    }
}

/// The policy of an ordinary (trusted) PCI device behind the platform's IOMMU, with the kernel log's words.
pub fn resolve(
    arch: Arch,
    kernel: (u32, u32),
    cmdline: &str,
    caching_mode: bool,
    driver: &dyn KernelDriver,
) -> Resolved {
    let e = explain(arch, kernel, cmdline, caching_mode, driver);
    let d = &e.devices[0];
    let policy = d.policy;
    Resolved {
        policy,
        reason: e
            .kernel_log
            .iter()
            .map(|l| l.split_once(": ").map_or(l.as_str(), |(_, m)| m))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drv(name: &str) -> &'static dyn KernelDriver {
        crate::hw::kernel_driver(name).unwrap()
    }
    #[test]
    fn arch_defaults_and_cmdline() {
        assert_eq!(
            resolve(Arch::X86_64, (6, 12), "", false, drv("vtd")).policy,
            PolicyName::Lazy
        );
        assert_eq!(
            resolve(Arch::Arm64, (6, 12), "", false, drv("smmuv3")).policy,
            PolicyName::Strict
        );
        assert_eq!(
            resolve(
                Arch::Arm64,
                (6, 12),
                "quiet iommu.strict=0",
                false,
                drv("smmuv3")
            )
            .policy,
            PolicyName::Lazy
        );
        assert_eq!(
            resolve(Arch::X86_64, (6, 12), "iommu=pt", false, drv("vtd")).policy,
            PolicyName::Passthrough
        );
        assert_eq!(
            resolve(Arch::Arm64, (6, 12), "iommu=pt", false, drv("smmuv3")).policy,
            PolicyName::Strict,
            "iommu=pt is x86 only"
        );
        assert_eq!(
            resolve(
                Arch::Arm64,
                (6, 12),
                "iommu.strict=0 iommu.passthrough=1",
                false,
                drv("smmuv3")
            )
            .policy,
            PolicyName::Passthrough
        );
        let r = resolve(Arch::X86_64, (6, 12), "iommu.strict=0", true, drv("vtd"));
        assert_eq!(r.policy, PolicyName::Strict);
        assert!(r.reason.contains("virtualization"));
        assert_eq!(
            resolve(
                Arch::X86_64,
                (6, 12),
                "intel_iommu=on,strict",
                false,
                drv("vtd")
            )
            .policy,
            PolicyName::Strict
        );
    }

    #[test]
    fn kernel_log_lines_match_the_kernels_words() {
        // The testbed's 6.12 guest with iommu.strict=0 logged exactly these two lines.
        let e = explain(
            Arch::X86_64,
            (6, 12),
            "quiet iommu.strict=0",
            false,
            drv("vtd"),
        );
        assert_eq!(
            e.kernel_log,
            vec![
                "iommu: Default domain type: Translated",
                "iommu: DMA domain TLB invalidation policy: lazy mode (set via kernel command line)"
            ]
        );
        assert_eq!((e.devices[0].sysfs, e.devices[1].sysfs), ("DMA-FQ", "DMA"));
        let e = explain(
            Arch::X86_64,
            (6, 12),
            "iommu.passthrough=1",
            false,
            drv("vtd"),
        );
        assert_eq!(
            e.kernel_log,
            vec!["iommu: Default domain type: Passthrough (set via kernel command line)"]
        );
        assert_eq!(
            (e.devices[0].sysfs, e.devices[1].sysfs),
            ("identity", "DMA")
        );
    }

    #[test]
    fn virtio_iommu_gets_deferred_flush_in_6_8() {
        let old = explain(Arch::X86_64, (6, 1), "", false, drv("virtio"));
        let new = explain(Arch::X86_64, (6, 8), "", false, drv("virtio"));
        assert_eq!(
            (old.devices[0].sysfs, new.devices[0].sysfs),
            ("DMA", "DMA-FQ")
        );
        // Caching mode is a VT-d matter only.
        assert_eq!(
            explain(Arch::X86_64, (6, 12), "", true, drv("smmuv3")).devices[0].sysfs,
            "DMA-FQ"
        );
    }

    #[test]
    fn s390_is_lazy_by_default_and_shadowing_devices_get_the_single_queue() {
        let e = explain(Arch::S390, (6, 12), "", false, drv("s390"));
        assert_eq!(e.devices[0].policy, PolicyName::Lazy);
        let z = &e.devices[1];
        assert_eq!((z.device, z.sysfs), ("zPCI (tlb_refresh)", "DMA-FQ"));
        assert!(
            z.why.contains("32768") && z.why.contains("1000 ms"),
            "{}",
            z.why
        );
        let e = explain(Arch::S390, (6, 12), "s390_iommu=strict", false, drv("s390"));
        assert_eq!(e.devices[0].policy, PolicyName::Strict);
        assert_eq!(e.devices.len(), 2, "no flush queue to describe when strict");
        assert!(e.kernel_log[0].contains("deprecated"));
    }

    #[test]
    fn riscv64_kernels_give_every_device_an_identity_domain() {
        let e = explain(Arch::Riscv64, (7, 2), "iommu.strict=1", false, drv("riscv"));
        // The kernel still logs a translated, strict default: only the groups show identity.
        assert!(
            e.kernel_log.iter().any(|l| l.contains("strict mode")),
            "{e:?}"
        );
        assert!(e
            .devices
            .iter()
            .all(|d| d.policy == PolicyName::Passthrough && d.sysfs == "identity"));
    }
}
