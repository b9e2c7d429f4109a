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
use crate::scenario::{Arch, PolicyName, Vendor};
use serde::Serialize;

/// The resolved policy and the kernel-log-style reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub policy: PolicyName,
    pub reason: String,
}

/// The IOMMU driver in charge (its capabilities change the outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Vtd,
    Smmuv3,
    Virtio,
    /// drivers/iommu/s390-iommu.c (zPCI); explain only.
    S390,
}

impl Driver {
    pub fn of(v: Vendor) -> Self {
        match v {
            Vendor::Vtd => Driver::Vtd,
            Vendor::Smmuv3 => Driver::Smmuv3,
            Vendor::Virtio => Driver::Virtio,
        }
    }
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
    driver: Driver,
) -> Explained {
    // CONFIG_IOMMU_DEFAULT_DMA_LAZY on X86 and S390, STRICT elsewhere (drivers/iommu/Kconfig).
    let mut strict = !matches!(arch, Arch::X86_64 | Arch::S390);
    let mut passthrough = false;
    let mut type_cmdline = false;
    let mut strict_cmdline = false;
    let mut log = Vec::new();
    let mut iommu_off = false;
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
            // intel/iommu.c intel_iommu_setup(): "strict" is deprecated but still sets strict; "off".
            "intel_iommu" if driver == Driver::Vtd => {
                for opt in v.split(',') {
                    match opt {
                        "strict" => {
                            log.push(
                                "DMAR: intel_iommu=strict deprecated; use iommu.strict=1".into(),
                            );
                            strict = true;
                        }
                        "off" => iommu_off = true,
                        _ => {}
                    }
                }
            }
            // s390-iommu.c s390_iommu_setup().
            "s390_iommu" if driver == Driver::S390 && v == "strict" => {
                log.push("s390_iommu=strict deprecated; use iommu.strict=1 instead".into());
                strict = true;
            }
            _ => {}
        }
    }
    if iommu_off {
        log.push("DMAR: IOMMU disabled".into());
        let why = "intel_iommu=off: no IOMMU, DMA goes through dma-direct untranslated".to_string();
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
    // intel_iommu_init(): a caching-mode IOMMU makes every DMA domain strict (after the lines above).
    let mut trusted = default;
    let mut why = log
        .last()
        .map(|l| l.trim_start_matches("iommu: ").to_string())
        .unwrap_or_default();
    if driver == Driver::Vtd && caching_mode {
        log.push("DMAR: IOMMU batching disallowed due to virtualization".into());
        if trusted == PolicyName::Lazy {
            trusted = PolicyName::Strict;
            why = "caching mode (a virtual VT-d): IOMMU batching disallowed due to virtualization"
                .into();
        }
    }
    // iommu_dma_init_domain(): DMA-FQ needs IOMMU_CAP_DEFERRED_FLUSH; virtio-iommu has it from 6.8.
    if trusted == PolicyName::Lazy && driver == Driver::Virtio && kernel < (6, 8) {
        trusted = PolicyName::Strict;
        why = "virtio-iommu before 6.8 lacks IOMMU_CAP_DEFERRED_FLUSH: the DMA-FQ domain falls back to DMA (strict)".into();
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
    if driver == Driver::S390 && trusted == PolicyName::Lazy {
        devices.push(DeviceMode {
            device: "zPCI (tlb_refresh)",
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
    driver: Driver,
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
    #[test]
    fn arch_defaults_and_cmdline() {
        assert_eq!(
            resolve(Arch::X86_64, (6, 12), "", false, Driver::Vtd).policy,
            PolicyName::Lazy
        );
        assert_eq!(
            resolve(Arch::Arm64, (6, 12), "", false, Driver::Smmuv3).policy,
            PolicyName::Strict
        );
        assert_eq!(
            resolve(
                Arch::Arm64,
                (6, 12),
                "quiet iommu.strict=0",
                false,
                Driver::Smmuv3
            )
            .policy,
            PolicyName::Lazy
        );
        assert_eq!(
            resolve(Arch::X86_64, (6, 12), "iommu=pt", false, Driver::Vtd).policy,
            PolicyName::Passthrough
        );
        assert_eq!(
            resolve(Arch::Arm64, (6, 12), "iommu=pt", false, Driver::Smmuv3).policy,
            PolicyName::Strict,
            "iommu=pt is x86 only"
        );
        assert_eq!(
            resolve(
                Arch::Arm64,
                (6, 12),
                "iommu.strict=0 iommu.passthrough=1",
                false,
                Driver::Smmuv3
            )
            .policy,
            PolicyName::Passthrough
        );
        let r = resolve(Arch::X86_64, (6, 12), "iommu.strict=0", true, Driver::Vtd);
        assert_eq!(r.policy, PolicyName::Strict);
        assert!(r.reason.contains("virtualization"));
        assert_eq!(
            resolve(
                Arch::X86_64,
                (6, 12),
                "intel_iommu=on,strict",
                false,
                Driver::Vtd
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
            Driver::Vtd,
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
            Driver::Vtd,
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
        let old = explain(Arch::X86_64, (6, 1), "", false, Driver::Virtio);
        let new = explain(Arch::X86_64, (6, 8), "", false, Driver::Virtio);
        assert_eq!(
            (old.devices[0].sysfs, new.devices[0].sysfs),
            ("DMA", "DMA-FQ")
        );
        // Caching mode is a VT-d matter only.
        assert_eq!(
            explain(Arch::X86_64, (6, 12), "", true, Driver::Smmuv3).devices[0].sysfs,
            "DMA-FQ"
        );
    }

    #[test]
    fn s390_is_lazy_by_default_and_shadowing_devices_get_the_single_queue() {
        let e = explain(Arch::S390, (6, 12), "", false, Driver::S390);
        assert_eq!(e.devices[0].policy, PolicyName::Lazy);
        let z = &e.devices[1];
        assert_eq!((z.device, z.sysfs), ("zPCI (tlb_refresh)", "DMA-FQ"));
        assert!(
            z.why.contains("32768") && z.why.contains("1000 ms"),
            "{}",
            z.why
        );
        let e = explain(
            Arch::S390,
            (6, 12),
            "s390_iommu=strict",
            false,
            Driver::S390,
        );
        assert_eq!(e.devices[0].policy, PolicyName::Strict);
        assert_eq!(e.devices.len(), 2, "no flush queue to describe when strict");
        assert!(e.kernel_log[0].contains("deprecated"));
    }
}
