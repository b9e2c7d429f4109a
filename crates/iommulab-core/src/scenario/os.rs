//! `[os]`: the kernel (version, architecture, command line, CONFIG_HZ) and the DMA policy.

#[allow(unused_imports)]
use super::*;

/// The DMA-mapping policy of the device's default domain.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// Identity domain: dma-direct, no translation, no protection.
    Passthrough,
    /// DMA domain: invalidate on every unmap before the IOVA is freed.
    Strict,
    /// DMA-FQ domain: unmaps queue on a per-CPU flush queue, flushed whole-domain by timer or when full.
    Lazy,
    /// xSMMU (seed 002 §3.2): unmap without sync, pages held per queue until one domain-wide invalidation
    /// at the end of each NAPI poll or TX completion batch.
    Xsmmu,
    /// FANDS (seed 002 §3.1): one contiguous IOVA block per RX multi-packet WQE, invalidated once at
    /// unmap; no RX page recycling under the IOMMU; strict elsewhere.
    Fands,
    /// F&S (SOSP'24 §3): contiguous 64-page IOVA chunks (per RX multi-packet WQE, and packed across
    /// descriptors for single mappings), one invalidation per descriptor, with IH so walk caches survive.
    Fns,
    /// Block batching with recycling: mappings packed into per-CPU IOVA chunks with per-chunk reference
    /// counts; unmapped pages held until one range invalidation per chunk at the end of each batch.
    Blocks,
    /// Resolve from `os.arch` and `os.cmdline` as iommu_subsys_init() does.
    Auto,
}

impl PolicyName {
    /// Every policy a run can pin, cheapest protection first (what `compare` runs).
    pub const BY_PROTECTION: [PolicyName; 7] = [
        PolicyName::Passthrough,
        PolicyName::Lazy,
        PolicyName::Xsmmu,
        PolicyName::Blocks,
        PolicyName::Fns,
        PolicyName::Fands,
        PolicyName::Strict,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Passthrough => "passthrough",
            PolicyName::Strict => "strict",
            PolicyName::Lazy => "lazy",
            PolicyName::Xsmmu => "xsmmu",
            PolicyName::Fands => "fands",
            PolicyName::Fns => "fns",
            PolicyName::Blocks => "blocks",
            PolicyName::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Os {
    /// Kernel version, `MAJOR.MINOR`. Left out: 6.12, or the IOMMU driver's first kernel after it.
    #[serde(default = "default_kernel")]
    pub kernel: String,
    /// The kernel's architecture (an IOMMU's vendor must match it). Left out: the IOMMU driver's (a guest's:
    /// its host profile's).
    #[serde(default = "default_arch")]
    pub arch: Arch,
    pub policy: PolicyName,
    /// Kernel command line; read when `policy = "auto"`.
    #[serde(default)]
    pub cmdline: String,
    /// CONFIG_HZ: the flush-queue timer is rounded to jiffies.
    #[serde(default = "default_hz")]
    pub hz: u32,
    /// CFS wakeup granularity (µs): how far a waking task or ksoftirqd must be behind the running one to
    /// preempt it (`sim::sched`). Default: the kernel's 1 ms scaled by 1 + log2(min(cores, 8)).
    #[serde(default)]
    pub sched_wakeup_granularity_us: Option<u32>,
    /// A confidential guest's technology: its private memory is closed to devices, so every streaming DMA
    /// mapping bounces through swiotlb (force_dma_unencrypted) and coherent buffers are converted to shared.
    #[serde(default)]
    pub coco: Coco,
    /// swiotlb's pool and options (`swiotlb=` on the command line, the kernel's config).
    #[serde(default)]
    pub swiotlb: SwiotlbOpts,
}

/// `os.coco`: the confidential-computing technology a guest runs under.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Coco {
    /// An ordinary guest or host.
    #[default]
    None,
    /// AMD SEV-SNP (x86): private pages encrypted with the guest's key, shared ones with the C-bit clear.
    SevSnp,
    /// Intel TDX (x86): private memory of a trust domain; shared pages through MapGPA.
    Tdx,
    /// Arm CCA realm (arm64): protected IPA space; shared through the RSI.
    Cca,
    /// pKVM protected VM (arm64): memory donated to the guest; shared through pKVM's hypercalls.
    Pkvm,
}

impl Coco {
    pub fn as_str(self) -> &'static str {
        match self {
            Coco::None => "none",
            Coco::SevSnp => "sev-snp",
            Coco::Tdx => "tdx",
            Coco::Cca => "cca",
            Coco::Pkvm => "pkvm",
        }
    }
    /// The architecture its guests run on.
    pub fn arch(self) -> Option<Arch> {
        match self {
            Coco::None => None,
            Coco::SevSnp | Coco::Tdx => Some(Arch::X86_64),
            Coco::Cca | Coco::Pkvm => Some(Arch::Arm64),
        }
    }
    /// The first kernel whose guests run under it (docs/swiotlb.md).
    pub fn first_kernel(self) -> (u32, u32) {
        match self {
            Coco::None => KERNEL_OLDEST,
            // "x86/sev: Add SEV-SNP guest support" and "x86/tdx: ..." guest series, both 5.19.
            Coco::SevSnp | Coco::Tdx => (5, 19),
            // "arm64: Enforce bounce buffers for realm DMA" (fbf979a01375, 6.13).
            Coco::Cca => (6, 13),
            // "drivers/virt: pkvm: Add initial support for running as a protected guest" (arm64, 6.12).
            Coco::Pkvm => (6, 12),
        }
    }
    /// The architecture enlarges swiotlb's pool for it: x86's mem_encrypt_setup_arch (SEV and TDX guests),
    /// 6 % of memory within [64 MiB, 1 GiB].
    pub fn sizes_swiotlb(self) -> bool {
        matches!(self, Coco::SevSnp | Coco::Tdx)
    }
    /// Its devices bounce through a restricted-dma-pool of their own (a device-tree reserved-memory node,
    /// rmem_swiotlb_device_init: one area) rather than the default pool: a pKVM protected guest, whose
    /// force_dma_unencrypted() is false.
    pub fn restricted_pool(self) -> bool {
        self == Coco::Pkvm
    }
}

/// `[os.swiotlb]`: the bounce-buffer pool (kernel/dma/swiotlb.c) and who bounces.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SwiotlbOpts {
    /// `swiotlb=<slabs>`: the pool's 2 KiB slots (rounded up to a segment of 128). Left out: 64 MiB
    /// (32768), or in an x86 confidential guest 6 % of its memory within [64 MiB, 1 GiB].
    #[serde(default)]
    pub slabs: Option<u64>,
    /// `swiotlb=<slabs>,<areas>`: areas, each with its own lock (6.0+). 0: one per CPU.
    #[serde(default)]
    pub areas: u32,
    /// `swiotlb=force`: every dma-direct mapping bounces.
    #[serde(default)]
    pub force: bool,
    /// CONFIG_SWIOTLB_DYNAMIC (6.6+): grow the pool instead of failing when it is full. Off in Debian's
    /// configs.
    #[serde(default)]
    pub dynamic: bool,
    /// CONFIG_DEBUG_FS (on in Debian's configs): every map and unmap updates the pool's used-slots
    /// counters, one line all CPUs write.
    #[serde(default = "default_true")]
    pub debugfs: bool,
}

impl Default for SwiotlbOpts {
    fn default() -> Self {
        SwiotlbOpts {
            slabs: None,
            areas: 0,
            force: false,
            dynamic: false,
            debugfs: true,
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_kernel() -> String {
    "6.12".into()
}
fn default_arch() -> Arch {
    Arch::X86_64
}

/// The `[os]` keys a scenario leaves out, from its (merged) platform: a profile implies its architecture and a
/// kernel that has its driver. `os.arch`: the first the IOMMU's driver runs on (a guest's: its host profile's,
/// where the guest's driver runs there too, so virtio-guest-arm64 is arm64). `os.kernel`: 6.12, or where the
/// driver came later the first kernel after it that has it (the RISC-V IOMMU's 6.13). A key the scenario
/// or `--set` gives is kept (and checked against the platform as written). Without `[os]` or a vendor the
/// serde defaults stand and deserialising says what is missing.
pub fn with_platform_defaults(table: &mut toml::Table) {
    let Some(drv) = table
        .get("platform")
        .and_then(|p| p.get("vendor"))
        .and_then(|v| v.as_str())
        .and_then(crate::hw::driver)
    else {
        return;
    };
    let host_arch = table
        .get("platform")
        .and_then(|p| p.get("hypervisor"))
        .and_then(|h| h.get("host_profile"))
        .and_then(|h| h.as_str())
        .and_then(builtin_platform)
        .map(|h| h.vendor.driver().archs()[0])
        .filter(|a| drv.archs().contains(a));
    let Some(toml::Value::Table(os)) = table.get_mut("os") else {
        return;
    };
    if !os.contains_key("arch") {
        let arch = host_arch.unwrap_or(drv.archs()[0]);
        os.insert("arch".into(), toml::Value::String(arch.as_str().into()));
    }
    if !os.contains_key("kernel") {
        let arch = os
            .get("arch")
            .and_then(|a| a.as_str())
            .and_then(Arch::parse)
            .unwrap_or(drv.archs()[0]);
        let first =
            kernels_from(parse_kernel(&default_kernel()).expect("validated: 6.12 is in range"))
                .find(|&k| drv.check_kernel(k.into(), arch).is_ok());
        if let Some((a, b)) = first {
            os.insert("kernel".into(), toml::Value::String(format!("{a}.{b}")));
        }
    }
}

/// Kernel versions from `k` to KERNEL_NEWEST, in order (no Linux minor passes 20, 4.20's: then the next .0).
fn kernels_from(k: (u32, u32)) -> impl Iterator<Item = (u32, u32)> {
    std::iter::successors(Some(k), |&(a, b)| {
        Some(if b < 20 { (a, b + 1) } else { (a + 1, 0) })
    })
    .take_while(|&k| k <= KERNEL_NEWEST)
}
fn default_hz() -> u32 {
    250
}

/// `"6.12"` → (6, 12): a kernel a scenario can run (KERNEL_OLDEST to KERNEL_NEWEST).
pub fn parse_kernel(v: &str) -> Result<(u32, u32), String> {
    kernel_in(v, KERNEL_OLDEST, KERNEL_NEWEST, "")
}

/// The rules replay and the default-domain rules follow for kernel `v`: its own, or KERNEL_NEWEST's for a
/// kernel after it up to KERNEL_CHECKED (what reaches the IOMMU did not change on the paths checked).
pub fn rules_kernel(v: &str) -> Result<(u32, u32), String> {
    let (n, c) = (KERNEL_NEWEST, KERNEL_CHECKED);
    let why = format!(
        " (kernels after {}.{} follow {}.{}'s rules, checked on Linux {}.{})",
        n.0, n.1, n.0, n.1, c.0, c.1
    );
    kernel_in(v, KERNEL_RULES_OLDEST, KERNEL_CHECKED, &why).map(|k| k.min(KERNEL_NEWEST))
}

fn kernel_in(
    v: &str,
    oldest: (u32, u32),
    newest: (u32, u32),
    why: &str,
) -> Result<(u32, u32), String> {
    let mut it = v.trim().splitn(3, '.');
    let maj = it.next().and_then(|s| s.parse::<u32>().ok());
    let min = it.next().and_then(|s| {
        s.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u32>()
            .ok()
    });
    match (maj, min) {
        (Some(a), Some(b)) if (oldest..=newest).contains(&(a, b)) => Ok((a, b)),
        (Some(a), Some(b)) => Err(format!(
            "kernel {a}.{b}: expected {}.{} to {}.{}, the kernels whose DMA-layer rules the model follows{why}",
            oldest.0, oldest.1, newest.0, newest.1
        )),
        _ => Err(format!(
            "expected a kernel version like \"6.12\", got \"{v}\""
        )),
    }
}

/// The oldest kernel a scenario runs: 4.19, the oldest longterm kernel with arm64's lazy mode
/// (`iommu.strict=0`, "iommu/arm-smmu-v3: Add support for non-strict mode"). What changed since on the paths
/// the model follows is in kernel.rs and the drivers' models (docs/virtualization.md, "Older guests").
pub const KERNEL_OLDEST: (u32, u32) = (4, 19);
/// The oldest kernel whose default-domain rules (`os.policy = "auto"`, `explain`) and replay the model
/// follows: 5.15 introduced the DMA-FQ domain type (IOMMU_DOMAIN_DMA_FQ) and the strict/lazy Kconfig
/// defaults they read.
pub const KERNEL_RULES_OLDEST: (u32, u32) = (5, 15);
/// The newest kernel whose changes the model knows (the qi_desc_iotlb IH fix, kernel.rs).
pub const KERNEL_NEWEST: (u32, u32) = (6, 18);
/// The newest kernel replay and the default-domain rules were checked on, with KERNEL_NEWEST's rules: Linux 7.3
/// (Debian trixie-backports 7.3.4) under QEMU, 2026-11-26: VT-d strict, caching mode and lazy with two devices
/// at once, virtio-iommu lazy, SMMUv3 strict and lazy with NVMe (whose IOVA-API unlinks, 6.17+, replay takes
/// from the capture's dma_iova_unlink kprobe), as QEMU's counts (docs/replay.md). Scenarios stop at KERNEL_NEWEST: the
/// workload models follow 6.x drivers (7.3's virtio-net, for one, unmaps a twelfth as often as 6.12's).
pub const KERNEL_CHECKED: (u32, u32) = (7, 3);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_stop_at_the_newest_kernel_known_and_replay_at_the_newest_checked() {
        assert_eq!(parse_kernel("6.12.95+deb12-amd64"), Ok((6, 12)));
        assert!(parse_kernel("7.3").is_err() && parse_kernel("4.14").is_err());
        assert_eq!(parse_kernel("4.19.0-27-amd64"), Ok((4, 19)));
        assert!(rules_kernel("5.10").unwrap_err().contains("5.15"));
        // After 6.18, the rules of 6.18, up to the newest kernel checked.
        assert_eq!(rules_kernel("6.1"), Ok((6, 1)));
        assert_eq!(rules_kernel("7.3.4+deb13-amd64"), Ok(KERNEL_NEWEST));
        let e = rules_kernel("7.4").unwrap_err();
        assert!(e.contains("7.3") && e.contains("6.18"), "{e}");
    }

    fn os_of(profile: &str, os: &str, workload: &str) -> Result<(Arch, String), String> {
        let text = format!(
            "[run]\nduration_ms = 1\n[platform]\nprofile = \"{profile}\"\n[os]\npolicy = \"strict\"\n{os}{workload}"
        );
        let v = load(
            Source::Text {
                name: "t",
                text: &text,
            },
            &[],
        )
        .map_err(|e| e.to_string())?;
        Ok((v[0].scenario.os.arch, v[0].scenario.os.kernel.clone()))
    }

    /// Issue 64: a scenario naming riscv-server or smmuv3-server and no `[os]` arch or kernel ran as x86_64 on
    /// 6.12 and was refused for it: a profile implies its architecture and a kernel that has its driver.
    #[test]
    fn a_profile_implies_its_arch_and_a_kernel_with_its_driver() {
        let nic = "[workload.nic_rx]\nline_rate_gbps = 10\nqueues = 2\nflows = 2\nmtu = 4096\nring_size = 64\n";
        let guest_net =
            "[workload.virtio_net]\nline_rate_gbps = 10\ndirection = \"rx\"\nmtu = 1500\n";
        assert_eq!(
            os_of("vtd-server", "", nic),
            Ok((Arch::X86_64, "6.12".into()))
        );
        assert_eq!(
            os_of("smmuv3-server", "", nic),
            Ok((Arch::Arm64, "6.12".into()))
        );
        assert_eq!(
            os_of("riscv-server", "", nic),
            Ok((Arch::Riscv64, "6.13".into()))
        );
        // A guest's virtio-iommu runs on x86 and arm64: its host's decides.
        assert_eq!(
            os_of("virtio-guest-arm64", "", guest_net),
            Ok((Arch::Arm64, "6.12".into()))
        );
        assert_eq!(
            os_of("virtio-guest", "", guest_net),
            Ok((Arch::X86_64, "6.12".into()))
        );
        // What the scenario says is kept, and checked.
        assert_eq!(
            os_of("riscv-server", "kernel = \"6.15\"\n", nic),
            Ok((Arch::Riscv64, "6.15".into()))
        );
        let e = os_of("riscv-server", "kernel = \"6.12\"\n", nic).unwrap_err();
        assert!(e.contains("os.kernel") && e.contains("6.13"), "{e}");
        let e = os_of("smmuv3-server", "arch = \"x86_64\"\n", nic).unwrap_err();
        assert!(e.contains("os.arch") && e.contains("arm64"), "{e}");
    }
}
