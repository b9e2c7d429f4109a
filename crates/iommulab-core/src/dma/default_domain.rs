//! Default-domain resolution as drivers/iommu/iommu.c iommu_subsys_init() does it: the arch's Kconfig default,
//! then `iommu.passthrough=`, `iommu=pt|nopt` (x86) and `iommu.strict=` on the command line, then caching mode
//! forcing strict (intel/iommu.c: "IOMMU batching disallowed due to virtualization").

use crate::scenario::{Arch, PolicyName};

/// The resolved policy and the kernel-log-style reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub policy: PolicyName,
    pub reason: String,
}

/// kstrtobool(): 1/y/Y/on → true, 0/n/N/off → false.
fn kstrtobool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "y" | "yes" | "on" | "true" => Some(true),
        "0" | "n" | "no" | "off" | "false" => Some(false),
        _ => None,
    }
}

pub fn resolve(arch: Arch, cmdline: &str, caching_mode: bool) -> Resolved {
    // CONFIG_IOMMU_DEFAULT_DMA_LAZY on X86 and S390, STRICT elsewhere (drivers/iommu/Kconfig).
    let mut strict = arch != Arch::X86_64;
    let mut passthrough = false;
    let mut type_src = "(set via Kconfig default)";
    let mut strict_src = "";
    for tok in cmdline.split_whitespace() {
        let (k, v) = tok.split_once('=').unwrap_or((tok, ""));
        match k {
            "iommu.passthrough" => {
                if let Some(b) = kstrtobool(v) {
                    passthrough = b;
                    type_src = "(set via kernel command line)";
                }
            }
            "iommu" if arch == Arch::X86_64 => {
                for opt in v.split(',') {
                    match opt {
                        "pt" => {
                            passthrough = true;
                            type_src = "(set via kernel command line)";
                        }
                        "nopt" => {
                            passthrough = false;
                            type_src = "(set via kernel command line)";
                        }
                        _ => {}
                    }
                }
            }
            "iommu.strict" => {
                if let Some(b) = kstrtobool(v) {
                    strict = b;
                    strict_src = " (set via kernel command line)";
                }
            }
            _ => {}
        }
    }
    if passthrough {
        return Resolved {
            policy: PolicyName::Passthrough,
            reason: format!("Default domain type: Passthrough {type_src}"),
        };
    }
    if caching_mode && !strict {
        return Resolved {
            policy: PolicyName::Strict,
            reason: "IOMMU batching disallowed due to virtualization; DMA domain TLB invalidation policy: strict mode".into(),
        };
    }
    let mode = if strict { "strict" } else { "lazy" };
    Resolved {
        policy: if strict { PolicyName::Strict } else { PolicyName::Lazy },
        reason: format!("Default domain type: Translated {type_src}; DMA domain TLB invalidation policy: {mode} mode{strict_src}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn arch_defaults_and_cmdline() {
        assert_eq!(resolve(Arch::X86_64, "", false).policy, PolicyName::Lazy);
        assert_eq!(resolve(Arch::Arm64, "", false).policy, PolicyName::Strict);
        assert_eq!(
            resolve(Arch::Arm64, "quiet iommu.strict=0", false).policy,
            PolicyName::Lazy
        );
        assert_eq!(
            resolve(Arch::X86_64, "iommu=pt", false).policy,
            PolicyName::Passthrough
        );
        assert_eq!(
            resolve(Arch::Arm64, "iommu=pt", false).policy,
            PolicyName::Strict,
            "iommu=pt is x86 only"
        );
        assert_eq!(
            resolve(Arch::Arm64, "iommu.strict=0 iommu.passthrough=1", false).policy,
            PolicyName::Passthrough
        );
        let r = resolve(Arch::X86_64, "iommu.strict=0", true);
        assert_eq!(r.policy, PolicyName::Strict);
        assert!(r.reason.contains("virtualization"));
    }
}
