//! The scenario schema: one TOML file with `[run]`, `[platform]`, `[os]`, `[workload.*]` and an optional
//! `[compare]` table whose arrays turn one scenario into several runs.
//!
//! Every struct rejects unknown keys. `[platform]` names a profile (built-in or a file) and may override any of
//! its keys; see `data/profiles/*.toml` for the profile format and the source of every number.

use crate::input::{self, InputError, SourceDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod l2fwd;
mod load;
mod map_benchmark;
mod nic_rx;
mod nic_tx;
mod nvme;
mod os;
mod rr;
mod virtio_net;
pub use crate::hw::platform::*;
pub use crate::kernel::Arch;
pub use l2fwd::*;
pub use load::*;
pub use map_benchmark::*;
pub use nic_rx::*;
pub use nic_tx::*;
pub use nvme::*;
pub use os::*;
pub use rr::*;
pub use virtio_net::*;

pub const BUILTIN_SCENARIOS: &[(&str, &str)] = &[
    ("default", include_str!("../../data/scenarios/default.toml")),
    ("c1", include_str!("../../data/scenarios/c1.toml")),
    ("c2", include_str!("../../data/scenarios/c2.toml")),
    ("c3", include_str!("../../data/scenarios/c3.toml")),
    ("nvme", include_str!("../../data/scenarios/nvme.toml")),
    (
        "map-benchmark",
        include_str!("../../data/scenarios/map-benchmark.toml"),
    ),
    (
        "iotlb-sync-map",
        include_str!("../../data/scenarios/iotlb-sync-map.toml"),
    ),
    (
        "guest-x86",
        include_str!("../../data/scenarios/guest-x86.toml"),
    ),
    (
        "guest-arm",
        include_str!("../../data/scenarios/guest-arm.toml"),
    ),
    (
        "guest-dpdk",
        include_str!("../../data/scenarios/guest-dpdk.toml"),
    ),
    ("nested", include_str!("../../data/scenarios/nested.toml")),
    (
        "coco-net",
        include_str!("../../data/scenarios/coco-net.toml"),
    ),
    ("tx", include_str!("../../data/scenarios/tx.toml")),
    ("rr", include_str!("../../data/scenarios/rr.toml")),
];
/// Names built-ins had before (`seed…` read as the random seed, and meant nothing to a user), each with its
/// new name: refused with a one-line error naming the new one (`load`), never run.
pub const RENAMED_BUILTINS: &[(&str, &str)] = &[
    ("seed004", "iotlb-sync-map"),
    ("seed001-x86", "guest-x86"),
    ("seed001-arm", "guest-arm"),
];

/// The built-in scenario `name`: its name and text.
pub fn builtin_scenario(name: &str) -> Option<(&'static str, &'static str)> {
    BUILTIN_SCENARIOS.iter().find(|(n, _)| *n == name).copied()
}

pub const BUILTIN_PROFILES: &[(&str, &str)] = &[
    (
        "vtd-server",
        include_str!("../../data/profiles/vtd-server.toml"),
    ),
    (
        "amdvi-server",
        include_str!("../../data/profiles/amdvi-server.toml"),
    ),
    (
        "riscv-server",
        include_str!("../../data/profiles/riscv-server.toml"),
    ),
    (
        "haswell-ep",
        include_str!("../../data/profiles/haswell-ep.toml"),
    ),
    (
        "thunderx",
        include_str!("../../data/profiles/thunderx.toml"),
    ),
    (
        "smmuv3-server",
        include_str!("../../data/profiles/smmuv3-server.toml"),
    ),
    (
        "kunpeng920",
        include_str!("../../data/profiles/kunpeng920.toml"),
    ),
    ("morello", include_str!("../../data/profiles/morello.toml")),
    (
        "snapdragon-x",
        include_str!("../../data/profiles/snapdragon-x.toml"),
    ),
    (
        "virtio-guest",
        include_str!("../../data/profiles/virtio-guest.toml"),
    ),
    (
        "kvm-vtd-guest",
        include_str!("../../data/profiles/kvm-vtd-guest.toml"),
    ),
    (
        "kvm-amdvi-guest",
        include_str!("../../data/profiles/kvm-amdvi-guest.toml"),
    ),
    (
        "kvm-smmuv3-guest",
        include_str!("../../data/profiles/kvm-smmuv3-guest.toml"),
    ),
    (
        "virtio-guest-arm64",
        include_str!("../../data/profiles/virtio-guest-arm64.toml"),
    ),
];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The scenario's name (results and tables show it).
    #[serde(default)]
    pub name: String,
    /// One line on what the scenario is.
    #[serde(default)]
    pub description: String,
    pub run: Run,
    pub platform: Platform,
    pub os: Os,
    pub workload: Workload,
    /// A malicious device replaying the IOVAs it has seen (off by default).
    #[serde(default)]
    pub attack: Attack,
    /// Consumed by the loader (see [`load`]); always empty in a loaded scenario.
    #[serde(default, skip_serializing)]
    #[schemars(with = "BTreeMap<String, serde_json::Value>")]
    pub compare: toml::Table,
    /// Where a setting's value comes from, for settings a scenario sets beyond its profile: dotted key to
    /// `"source: …"`, `"assumed: …"` (no source gives it) or `"fitted: TARGET …"`. `validate` marks targets whose
    /// scenario carries an assumed or fitted setting as not independent. A `--set` or `[compare]` value for a
    /// key drops its entry (the value is no longer the one described).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub provenance: BTreeMap<String, String>,
}

/// The scenario's schema as JSON Schema (from the types above: their fields, serde defaults and doc comments),
/// from which docs/scenario-reference.md is generated.
pub fn json_schema() -> String {
    serde_json::to_string_pretty(&schemars::schema_for!(Scenario)).expect("schema serialises")
}

/// The kinds of `[provenance]` entry.
pub const PROVENANCE_KINDS: &[&str] = &["source", "assumed", "fitted"];

/// Every `[provenance]` key names a setting the scenario holds, and every value starts with its kind.
fn check_provenance(table: &toml::Table) -> Result<(), (Vec<String>, String)> {
    let expected = "expected a table of `\"dotted.key\" = \"source|assumed|fitted: why\"`";
    let Some(prov) = input::optional_table(table, "provenance", expected)? else {
        return Ok(());
    };
    for (k, v) in prov {
        let at = vec!["provenance".to_string(), k.clone()];
        let path = input::split_key(k).map_err(|m| (at.clone(), m))?;
        if !input::has_path(table, &path) || path[0] == "provenance" || path[0] == "compare" {
            return Err((at, format!("`{k}` is not a setting of this scenario")));
        }
        let kind = v
            .as_str()
            .and_then(|s| s.split_once(':'))
            .map(|(kind, why)| (kind, why.trim()));
        match kind {
            Some((kind, why)) if PROVENANCE_KINDS.contains(&kind) && !why.is_empty() => {}
            _ => {
                return Err((
                    at,
                    format!("expected \"{}: why\"", PROVENANCE_KINDS.join("|")),
                ))
            }
        }
    }
    Ok(())
}

/// A new value for `path` drops what `[provenance]` said about the old one.
fn forget_provenance(table: &mut toml::Table, path: &[String]) {
    if let Some(toml::Value::Table(p)) = table.get_mut("provenance") {
        p.remove(&path.join("."));
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Run {
    /// Simulated time measured, after the warm-up.
    pub duration_ms: f64,
    /// Simulated time run before counters start (rings and pools fill, caches warm).
    #[serde(default = "default_warmup_ms")]
    pub warmup_ms: f64,
    /// Seed of every random choice (arrivals, RSS hashing, reader delays): same scenario and seed, same result.
    #[serde(default = "default_seed")]
    pub seed: u64,
}
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Attack {
    /// IOVA pages probed per second, round robin over every IOVA the device was ever handed (0: off).
    #[serde(default)]
    pub replay_per_sec: f64,
    /// Replay only the last `recent` IOVA pages handed out, newest kept (0: every IOVA ever seen).
    #[serde(default)]
    pub recent: u32,
}

fn default_warmup_ms() -> f64 {
    10.0
}
fn default_seed() -> u64 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub nic_rx: Option<NicRx>,
    pub nic_tx: Option<NicTx>,
    pub rr: Option<Rr>,
    pub nvme: Option<Nvme>,
    pub virtio_net: Option<VirtioNet>,
    pub l2fwd: Option<L2fwd>,
    pub dma_map_benchmark: Option<MapBenchmark>,
}

/// Estimate: a round trip between hosts in one rack (two NIC and one switch traversals, the peer's stack).
fn default_rtt_us() -> f64 {
    10.0
}
fn default_irq_usecs() -> u32 {
    64
}
fn default_irq_frames() -> u32 {
    64
}

/// mlx5 en.h MLX5E_PARAMS_DEFAULT_LOG_RQ_SIZE: 1024 RX descriptors.
fn default_tx_rx_ring() -> u32 {
    1024
}
fn default_tsq_bytes() -> u64 {
    16 * 65536
}
fn default_gro_max_u64() -> u64 {
    65536
}
fn default_gro_max() -> u32 {
    65536
}
fn default_budget() -> u32 {
    64
}
fn default_true() -> bool {
    true
}
/// A semantic check: Ok, or the dotted key and what was expected.
fn check(ok: bool, key: &str, msg: impl Into<String>) -> Result<(), (Vec<String>, String)> {
    if ok {
        Ok(())
    } else {
        Err((key.split('.').map(String::from).collect(), msg.into()))
    }
}

fn check_rtt(rtt_us: f64, key: &str) -> Result<(), (Vec<String>, String)> {
    check(
        (0.0..=1e6).contains(&rtt_us),
        key,
        "expected 0..=1000000 µs",
    )
}

impl Scenario {
    /// Semantic checks serde cannot express. Errors name the key.
    fn validate(&self) -> Result<(), (Vec<String>, String)> {
        let finite_pos = |x: f64| x > 0.0 && x.is_finite();
        let r = &self.run;
        check(
            finite_pos(r.duration_ms),
            "run.duration_ms",
            "expected a positive number of milliseconds",
        )?;
        check(
            r.warmup_ms >= 0.0 && r.warmup_ms.is_finite(),
            "run.warmup_ms",
            "expected zero or a positive number of milliseconds",
        )?;
        check(
            r.duration_ms + r.warmup_ms <= 60_000.0,
            "run.duration_ms",
            "expected at most 60000 ms of simulated time (warm-up included)",
        )?;
        check(
            (0.0..=1e9).contains(&self.attack.replay_per_sec),
            "attack.replay_per_sec",
            "expected 0 (off) to 1e9 probes per second",
        )?;
        let io = &self.platform.iommu;
        let drv = self.platform.vendor.driver();
        let iommu_key = |k: &str| -> Vec<String> {
            ["platform", "iommu"]
                .into_iter()
                .chain(k.split('.'))
                .map(String::from)
                .collect()
        };
        // An IOMMU that keeps no IOTLB and walks no table (virtio-iommu) may leave them out (a VFIO device
        // behind it takes the host's).
        let caches = drv.walks_tables() || io.iotlb_entries > 0 || !io.pwc_entries.is_empty();
        check(
            !caches || (1..=MAX_CACHE_ENTRIES).contains(&io.iotlb_entries),
            "platform.iommu.iotlb_entries",
            format!("expected 1..={MAX_CACHE_ENTRIES} entries"),
        )?;
        check(
            !caches || (io.iotlb_ways > 0 && io.iotlb_entries.is_multiple_of(io.iotlb_ways)),
            "platform.iommu.iotlb_ways",
            "expected iotlb_entries to be a non-zero multiple of iotlb_ways",
        )?;
        check(
            !drv.walks_tables() || self.platform.memory.walk_read_ns > 0,
            "platform.memory.walk_read_ns",
            "expected the IOMMU's page-walk read latency in ns (at least 1)",
        )?;
        check(
            io.pwc_ways == 0 || io.pwc_entries.iter().all(|n| n % io.pwc_ways == 0),
            "platform.iommu.pwc_ways",
            "expected 0 (fully associative) or a divisor of every pwc_entries count",
        )?;
        let fmt = drv.pt_format(io).map_err(|(k, m)| (iommu_key(k), m))?;
        check(
            !caches
                || io.pwc_entries.len() == fmt.levels as usize - 1
                && io
                    .pwc_entries
                    .iter()
                    .all(|n| (0..=MAX_PWC_ENTRIES).contains(n)),
            "platform.iommu.pwc_entries",
            format!(
                "expected one entry count (0..={MAX_PWC_ENTRIES}; 0: no such cache) per non-leaf level of the {}-level table: {} values",
                fmt.levels,
                fmt.levels - 1
            ),
        )?;
        let guest = self.platform.hypervisor.is_some();
        drv.check(io, guest).map_err(|(k, m)| (iommu_key(k), m))?;
        let pcie = &self.platform.pcie;
        check(
            (1..=65536).contains(&pcie.translation_slots),
            "platform.pcie.translation_slots",
            "expected 1..=65536",
        )?;
        if pcie.ats {
            check(
                (1..=MAX_CACHE_ENTRIES).contains(&pcie.atc_entries),
                "platform.pcie.atc_entries",
                format!("expected 1..={MAX_CACHE_ENTRIES} entries"),
            )?;
            check(
                pcie.atc_ways > 0 && pcie.atc_entries.is_multiple_of(pcie.atc_ways),
                "platform.pcie.atc_ways",
                "expected atc_entries to be a non-zero multiple of atc_ways",
            )?;
        }
        check(
            (MIN_LINE_RATE_GBPS..=1e6).contains(&pcie.link_gbps),
            "platform.pcie.link_gbps",
            format!("expected a bandwidth in [{MIN_LINE_RATE_GBPS}, 1000000] Gbps"),
        )?;
        let cpu = &self.platform.cpu;
        check(
            (1..=MAX_CPUS).contains(&cpu.cores),
            "platform.cpu.cores",
            format!("expected 1..={MAX_CPUS} cores"),
        )?;
        check(
            (1..=cpu.cores.max(1)).contains(&cpu.cluster_cores),
            "platform.cpu.cluster_cores",
            format!(
                "expected 1..={} cores per cluster (platform.cpu.cores)",
                cpu.cores
            ),
        )?;
        check(
            cpu.socket_cores >= cpu.cluster_cores
                && cpu.socket_cores.is_multiple_of(cpu.cluster_cores),
            "platform.cpu.socket_cores",
            "expected a multiple of platform.cpu.cluster_cores",
        )?;
        check(
            cpu.copy_ns_per_byte >= 0.0 && cpu.copy_ns_per_byte.is_finite(),
            "platform.cpu.copy_ns_per_byte",
            "expected a finite cost >= 0",
        )?;
        check(
            cpu.memset_ns_per_byte >= 0.0 && cpu.memset_ns_per_byte.is_finite(),
            "platform.cpu.memset_ns_per_byte",
            "expected a finite cost >= 0",
        )?;
        check(
            (1..=10_000).contains(&self.os.hz),
            "os.hz",
            "expected CONFIG_HZ in 1..=10000 (e.g. 100, 250, 1000)",
        )?;
        check(
            self.os.sched_wakeup_granularity_us.is_none_or(|g| g >= 1),
            "os.sched_wakeup_granularity_us",
            "expected a granularity of at least 1 µs",
        )?;
        let kernel =
            parse_kernel(&self.os.kernel).map_err(|m| (vec!["os".into(), "kernel".into()], m))?;
        check(
            self.os.policy != PolicyName::Auto || kernel >= KERNEL_RULES_OLDEST,
            "os.policy",
            format!(
                "expected strict, lazy or passthrough for kernel {}.{}: the default-domain rules `auto` \
                 follows start at {}.{}",
                kernel.0, kernel.1, KERNEL_RULES_OLDEST.0, KERNEL_RULES_OLDEST.1
            ),
        )?;
        let k = crate::kernel::KernelVersion::from(kernel);
        if let Err(m) = drv.check_kernel(k, self.os.arch) {
            check(false, "os.kernel", m)?;
        }
        check(
            drv.archs().contains(&self.os.arch),
            "os.arch",
            drv.arch_expected(),
        )?;
        check(
            guest || !drv.paravirtual(),
            "platform.hypervisor",
            format!(
                "expected a [hypervisor] section: a {} platform is a guest (its kick is an exit)",
                drv.title()
            ),
        )?;
        if let Some(why) = self
            .platform
            .unmodelled_iommu
            .as_ref()
            .filter(|_| self.platform.hypervisor.is_none())
        {
            let msg = format!(
                "`{}` serves only as a guest's host (platform.hypervisor.host_profile): {why}",
                self.platform.profile
            );
            check(false, "platform.profile", msg)?;
        }
        if self.platform.hypervisor.is_some() {
            // virtio-iommu's requests keep their own costs ([iommu.virtio]); QEMU's VT-d and SMMUv3 trap.
            let Some(k) = &self.platform.kvm else {
                return Err((
                    vec!["platform".into(), "kvm".into()],
                    "expected the host's [kvm] costs: a guest takes them from its host profile \
                     (platform.hypervisor.host_profile), or sets them itself"
                        .into(),
                ));
            };
            check(
                k.mmio_exit_ns <= 10_000_000,
                "platform.kvm.mmio_exit_ns",
                "expected at most 10 ms",
            )?;
        }
        let w = &self.workload;
        let sections = w.nic_rx.is_some() as u32
            + w.nic_tx.is_some() as u32
            + w.rr.is_some() as u32
            + w.nvme.is_some() as u32
            + w.virtio_net.is_some() as u32
            + w.l2fwd.is_some() as u32
            + w.dma_map_benchmark.is_some() as u32;
        check(
            sections == 1,
            "workload",
            format!(
                "expected exactly one workload section ([workload.nic_rx], [workload.nic_tx], \
                 [workload.rr], [workload.nvme], [workload.virtio_net], [workload.l2fwd] or \
                 [workload.dma_map_benchmark]), \
                 found {sections}"
            ),
        )?;
        // A physical device behind an emulated VT-d or SMMUv3 is VFIO's, every guest mapping shadowed into
        // the host IOMMU: not modelled yet. virtio-iommu's requests already stand for the host's work.
        let hw_device =
            w.nic_rx.is_some() || w.nic_tx.is_some() || w.rr.is_some() || w.nvme.is_some();
        if let Some(h) = &self.platform.hypervisor {
            let host = builtin_platform(&h.host_profile).filter(|p| p.hypervisor.is_none());
            let Some(host) = host else {
                return Err((
                    vec![
                        "platform".into(),
                        "hypervisor".into(),
                        "host_profile".into(),
                    ],
                    format!(
                        "expected a built-in bare-metal profile, not `{}`",
                        h.host_profile
                    ),
                ));
            };
            if let Some(why) = host.unmodelled_iommu.as_ref().filter(|_| hw_device) {
                let msg = format!(
                    "`{}` cannot take a VFIO-assigned device: {why}",
                    h.host_profile
                );
                check(false, "platform.hypervisor.host_profile", msg)?;
            }
            check(
                drv.paravirtual() || host.vendor == self.platform.vendor,
                "platform.hypervisor.host_profile",
                format!(
                    "expected a host with the guest's IOMMU ({}): QEMU's vIOMMU passes a VFIO device to the \
                     host's own",
                    self.platform.vendor.as_str()
                ),
            )?;
            check(
                h.qemu_version().is_some_and(|(a, _)| (2..=11).contains(&a)),
                "platform.hypervisor.qemu",
                format!(
                    "expected a QEMU version MAJOR.MINOR (2.0 to 11.x), not `{}`",
                    h.qemu
                ),
            )?;
            let emulated = !drv.paravirtual() && !h.nested;
            let vhost = w.virtio_net.as_ref().is_some_and(|v| v.vhost) || w.l2fwd.is_some();
            if let (true, Some(q)) = (emulated, h.qemu_version()) {
                if let Err((key, m)) = drv.emulation_refuses(q, hw_device, vhost) {
                    check(false, key, m)?;
                }
            }
            // QEMU refuses vfio-pci behind intel-iommu without caching-mode=on: it must see every map.
            let sees_maps = drv.caching_mode(io);
            let cm_key = format!(
                "platform.iommu.{}",
                drv.caching_mode_key().unwrap_or("caching_mode")
            );
            check(
                !(hw_device && emulated && !sees_maps),
                &cm_key,
                "expected true for a VFIO-assigned device behind an emulated IOMMU: QEMU shadows the \
                 guest's mappings only if the driver invalidates after each map (or set \
                 platform.hypervisor.nested)",
            )?;
            check(
                !(h.nested && drv.paravirtual()),
                "platform.hypervisor.nested",
                format!(
                    "expected false for {}: nesting puts an emulated IOMMU's tables in hardware",
                    drv.title()
                ),
            )?;
            check(
                !(h.nested && (w.virtio_net.is_some() || w.l2fwd.is_some())),
                "platform.hypervisor.nested",
                "expected false with [workload.virtio_net] or [workload.l2fwd]: QEMU's and vhost's software \
                 device cannot use hardware nested translation",
            )?;
            check(
                !h.vcmdq || (h.nested && drv.hardware_guest_queue()),
                "platform.hypervisor.vcmdq",
                format!(
                    "expected true only with nested = true on an IOMMU with a hardware command queue a \
                     guest owns ({} has none)",
                    drv.title()
                ),
            )?;
        }
        for (key, section) in [
            ("workload.virtio_net", w.virtio_net.is_some()),
            ("workload.l2fwd", w.l2fwd.is_some()),
        ] {
            check(
                !section || self.platform.hypervisor.is_some(),
                key,
                format!(
                    "expected a guest platform (a profile with [hypervisor], e.g. kvm-vtd-guest): \
                     profile {} is bare metal",
                    self.platform.profile
                ),
            )?;
        }
        if let Some(vn) = &w.virtio_net {
            vn.validate()?;
        }
        if let Some(l2) = &w.l2fwd {
            l2.validate()?;
        }
        if let Some(nic) = &w.nic_rx {
            nic.validate(cpu.cores)?;
            let blocks = matches!(self.os.policy, PolicyName::Fands | PolicyName::Fns)
                && nic.rq == RqKind::Mlx5Striding;
            check(
                !blocks || io.granule_kb == 4,
                "os.policy",
                format!(
                    "expected a 4 KiB IOMMU granule for \"{}\" with a striding RQ: its WQE blocks map \
                     4 KiB pages one by one (platform.iommu.granule_kb is {})",
                    self.os.policy.as_str(),
                    io.granule_kb
                ),
            )?;
        }
        if let Some(nic) = &w.nic_tx {
            nic.validate(cpu.cores)?;
        }
        if let Some(rr) = &w.rr {
            rr.validate(cpu.cores)?;
        }
        if let Some(nvme) = &w.nvme {
            nvme.validate(cpu.cores)?;
        }
        if let Some(mb) = &w.dma_map_benchmark {
            mb.validate(cpu.cores, cpu.socket_cores, self.run.warmup_ms)?;
        }
        self.validate_swiotlb(guest, kernel)
    }

    /// `os.coco` and `[os.swiotlb]`: a confidential guest is a guest of its architecture and kernels, with no
    /// vIOMMU; the pool's options are the kernel's.
    fn validate_swiotlb(
        &self,
        guest: bool,
        kernel: (u32, u32),
    ) -> Result<(), (Vec<String>, String)> {
        let coco = self.os.coco;
        if let Some(arch) = coco.arch() {
            let name = coco.as_str();
            check(
                guest,
                "os.coco",
                format!(
                    "expected a guest platform (a profile with [hypervisor], e.g. virtio-guest): a {name} \
                     guest runs under a hypervisor; profile {} is bare metal",
                    self.platform.profile
                ),
            )?;
            check(
                self.os.arch == arch,
                "os.coco",
                format!(
                    "expected os.arch = \"{}\" for a {name} guest",
                    arch.as_str()
                ),
            )?;
            let f = coco.first_kernel();
            check(
                kernel >= f,
                "os.coco",
                format!(
                    "expected kernel {}.{} or later for a {name} guest (os.kernel is {}.{})",
                    f.0, f.1, kernel.0, kernel.1
                ),
            )?;
            check(
                self.os.policy == PolicyName::Passthrough,
                "os.coco",
                format!(
                    "expected os.policy = \"passthrough\" (a guest without a vIOMMU): through an IOMMU \
                     the device would be handed private pages it cannot read, and dma-iommu bounces \
                     only untrusted devices (dev_use_swiotlb); os.policy is \"{}\"",
                    self.os.policy.as_str()
                ),
            )?;
        }
        let sw = &self.os.swiotlb;
        let w = &self.workload;
        check(
            !sw.force || matches!(self.os.policy, PolicyName::Passthrough | PolicyName::Auto),
            "os.swiotlb.force",
            format!(
                "expected os.policy = \"passthrough\": swiotlb=force bounces dma-direct's mappings, and \
                 dma-iommu bounces only untrusted devices (dev_use_swiotlb); os.policy is \"{}\"",
                self.os.policy.as_str()
            ),
        )?;
        if coco != Coco::None || sw.force {
            check(
                self.attack.replay_per_sec == 0.0,
                "attack.replay_per_sec",
                "expected 0 where DMA bounces: the replaying device would reach swiotlb's shared slots, which \
                 dma::attack does not model",
            )?;
            check(
                w.l2fwd.is_none(),
                "workload.l2fwd",
                "expected a kernel driver's workload where DMA bounces: DPDK's l2fwd maps its mempool \
                 through VFIO, not the DMA API swiotlb serves",
            )?;
            if let Some(n) = &w.nvme {
                check(
                    n.same_bridge || n.drives == 1,
                    "workload.nvme.same_bridge",
                    "expected one IOMMU group where DMA bounces: the model gives each domain's device a \
                     swiotlb pool, where the kernel's drives share its one pool",
                )?;
                check(
                    n.bs_kb <= 252,
                    "workload.nvme.bs_kb",
                    format!(
                        "expected at most 252 KiB where DMA bounces: nvme limits its I/O to \
                         dma_max_mapping_size() (swiotlb_max_mapping_size, a 256 KiB segment less the \
                         4 KiB min_align_mask), so the block layer splits larger ones, which the model \
                         does not; bs_kb is {}",
                        n.bs_kb
                    ),
                )?;
            }
        }
        check(
            sw.slabs.is_none_or(|n| (1..=1 << 22).contains(&n)),
            "os.swiotlb.slabs",
            "expected 1 to 4194304 slots of 2 KiB (8 GiB)",
        )?;
        check(
            sw.areas <= 1024,
            "os.swiotlb.areas",
            "expected 0 (one per CPU) to 1024 areas",
        )?;
        check(
            !sw.dynamic || crate::kernel::KernelVersion::from(kernel).swiotlb_dynamic(),
            "os.swiotlb.dynamic",
            format!(
                "expected kernel 6.6 or later: CONFIG_SWIOTLB_DYNAMIC came in 6.6 (os.kernel is {}.{})",
                kernel.0, kernel.1
            ),
        )?;
        Ok(())
    }
}

/// What every NIC workload section checks: line rate, one CPU per queue, NAPI budget, RX moderation.
/// The slowest link a NIC scenario takes: 1 Mbit/s, where a jumbo frame already takes 72 µs of wire time.
/// Slower links carry no traffic a run of at most a minute could measure; the model's wire clock is kept in
/// picoseconds, which a slot of hours would overflow.
pub const MIN_LINE_RATE_GBPS: f64 = 0.001;

fn check_nic(
    section: &str,
    line_rate_gbps: f64,
    queues: u32,
    cores: u32,
    napi_budget: u32,
    irq_usecs: u32,
    irq_frames: u32,
) -> Result<(), (Vec<String>, String)> {
    let key = |k: &str| format!("{section}.{k}");
    check(
        (MIN_LINE_RATE_GBPS..=3200.0).contains(&line_rate_gbps),
        &key("line_rate_gbps"),
        format!("expected a line rate in [{MIN_LINE_RATE_GBPS}, 3200] Gbps"),
    )?;
    check(
        queues >= 1 && queues <= cores,
        &key("queues"),
        format!("expected 1..={cores} queues (one CPU each, platform.cpu.cores)"),
    )?;
    check(napi_budget >= 1, &key("napi_budget"), "expected at least 1")?;
    check(
        irq_usecs <= 1_000_000,
        &key("irq_usecs"),
        "expected 0..=1000000 µs",
    )?;
    check(irq_frames >= 1, &key("irq_frames"), "expected at least 1")
}

/// Bounds that keep a typo from allocating the machine away.
const MAX_CACHE_ENTRIES: u32 = 1 << 20;
const MAX_PWC_ENTRIES: u32 = 1 << 16;
const MAX_CPUS: u32 = 4096;
/// page_pool ptr_ring limit: net/core/page_pool.c page_pool_init() ring_qsize = min(pool_size, 16384).
const PP_MAX_POOL_SIZE: u32 = 16384;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Hypervisor costs for unit tests across the crate.
    pub(crate) fn hypervisor() -> HypervisorProfile {
        HypervisorProfile {
            host_profile: "vtd-server".into(),
            nested: false,
            nested_s2_reads: 1,
            vcmdq: false,
            qemu: DEFAULT_QEMU.into(),
        }
    }

    /// Host costs for unit tests across the crate.
    pub(crate) fn kvm() -> KvmProfile {
        KvmProfile {
            mmio_exit_ns: 5000,
            kick_exit_ns: 1000,
            irq_inject_ns: 2000,
            posted_interrupts: true,
            qemu_packet_ns: 2000,
            vhost_packet_ns: 1000,
            qemu_translate_ns: 100,
            vhost_iotlb_lookup_ns: 100,
            vhost_iotlb_miss_ns: 10000,
            vhost_invalidate_ns: 1000,
            vhost_iotlb_entries: 2048,
            vhost_meta_cache: true,
            vhost_user_packet_ns: 50,
            vhost_user_iotlb_lookup_ns: 10,
            vhost_user_iotlb_entry_ns: 7,
            vhost_user_iotlb_entry_l1_ns: 1.5,
            vfio_map_ns: 2000,
            vfio_map_page_ns: 300,
            vfio_unmap_ns: 4000,
            vfio_unmap_page_ns: 100,
            nested_inv_ns: 3000,
            qemu_iotlb_scan_ns: 10,
            coco_share_page_ns: 4000,
            coco_copy_factor: 1.0,
        }
    }

    fn text(s: &str) -> Result<Vec<Variant>, InputError> {
        load(
            Source::Text {
                name: "t.toml",
                text: s,
            },
            &[],
        )
    }
    const MIN: &str = "[run]\nduration_ms = 1\n[platform]\nprofile = \"vtd-server\"\n[os]\npolicy = \"strict\"\n[workload.nic_rx]\nline_rate_gbps = 10\nqueues = 2\nflows = 2\nmtu = 4096\nring_size = 64\n";

    #[test]
    fn builtin_default_loads_and_compares_three_policies() {
        let v = load(Source::Builtin("default"), &[]).unwrap();
        let pols: Vec<_> = v.iter().map(|v| v.scenario.os.policy).collect();
        assert!(v
            .iter()
            .any(|v| !v.scenario.workload.nic_rx.as_ref().unwrap().page_pool));
        assert!(
            pols.contains(&PolicyName::Passthrough)
                && pols.contains(&PolicyName::Lazy)
                && pols.contains(&PolicyName::Strict)
        );
    }

    #[test]
    fn minimal_scenario_loads() {
        let v = text(MIN).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].scenario.platform.iommu.ias_bits, 48);
    }

    #[test]
    fn unknown_key_names_line_and_key() {
        let e = text(&MIN.replace("queues = 2", "queues = 2\nqueuez = 3")).unwrap_err();
        assert_eq!(e.origin, "t.toml:10:1", "{e}");
        assert!(
            e.msg.contains("queuez") && e.msg.contains("expected"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_line_and_expectation() {
        let e = text(&MIN.replace("queues = 2", "queues = \"two\"")).unwrap_err();
        assert_eq!(e.origin, "t.toml:9:1", "{e}");
        assert!(
            e.msg.contains("workload.nic_rx.queues") && e.msg.contains("u32"),
            "{e}"
        );
    }

    #[test]
    fn missing_key_names_section() {
        let e = text(&MIN.replace("mtu = 4096\n", "")).unwrap_err();
        assert!(e.msg.contains("missing field `mtu`"), "{e}");
        assert!(e.origin.starts_with("t.toml:7:"), "{e}");
    }

    #[test]
    fn set_overrides_and_blames_the_flag() {
        let ov = vec![("workload.nic_rx.queues".to_string(), "4".to_string())];
        let v = load(
            Source::Text {
                name: "t.toml",
                text: MIN,
            },
            &ov,
        )
        .unwrap();
        assert_eq!(v[0].scenario.workload.nic_rx.as_ref().unwrap().queues, 4);
        let ov = vec![("os.polcy".to_string(), "lazy".to_string())];
        let e = load(
            Source::Text {
                name: "t.toml",
                text: MIN,
            },
            &ov,
        )
        .unwrap_err();
        assert_eq!(e.origin, "--set os.polcy=lazy", "{e}");
    }

    #[test]
    fn a_set_value_read_as_a_number_where_text_is_expected_is_taken_as_written() {
        let set = |k: &str, v: &str| {
            load(
                Source::Text {
                    name: "t.toml",
                    text: MIN,
                },
                &[(k.to_string(), v.to_string())],
            )
        };
        // TOML reads 6.10 as the float 6.1; the kernel is the text as written.
        assert_eq!(
            set("os.kernel", "6.10").unwrap()[0].scenario.os.kernel,
            "6.10"
        );
        assert_eq!(
            set("os.kernel", "6.0").unwrap()[0].scenario.os.kernel,
            "6.0"
        );
        // A number where a number is expected still has to be one of the right kind.
        let e = set("workload.nic_rx.queues", "4.5").unwrap_err();
        assert_eq!(e.origin, "--set workload.nic_rx.queues=4.5", "{e}");
        // A named choice given a number is read as that name, so the error lists the choices.
        let e = set("os.policy", "1").unwrap_err();
        assert!(e.msg.contains("unknown variant `1`"), "{e}");
    }

    #[test]
    fn platform_keys_override_profile_and_profile_errors_point_at_override() {
        let v = text(&MIN.replace(
            "profile = \"vtd-server\"",
            "profile = \"vtd-server\"\niommu.iotlb_entries = 256",
        ))
        .unwrap();
        assert_eq!(v[0].scenario.platform.iommu.iotlb_entries, 256);
        let e = text(&MIN.replace("profile = \"vtd-server\"", "profile = \"nope\"")).unwrap_err();
        assert!(
            e.origin.starts_with("t.toml:4:") && e.msg.contains("vtd-server"),
            "{e}"
        );
    }

    #[test]
    fn provenance_names_settings_and_their_kind_and_a_new_value_drops_it() {
        let prov = |body: &str| format!("{MIN}[provenance]\n{body}\n");
        let v = text(&prov(
            "\"workload.nic_rx.queues\" = \"assumed: one per flow\"",
        ))
        .unwrap();
        assert_eq!(
            v[0].scenario.provenance["workload.nic_rx.queues"],
            "assumed: one per flow"
        );
        // A profile key the scenario inherits is a setting too.
        assert!(text(&prov(
            "\"platform.pcie.link_gbps\" = \"source: PCIe 3.0 x16\""
        ))
        .is_ok());
        let e = text(&prov("\"workload.nic_rx.queue\" = \"assumed: x\"")).unwrap_err();
        assert!(
            e.to_string().contains("provenance") && e.msg.contains("not a setting"),
            "{e}"
        );
        let e = text(&prov("\"workload.nic_rx.queues\" = \"guessed: x\"")).unwrap_err();
        assert!(e.msg.contains("source|assumed|fitted"), "{e}");
        let e = text(&prov("\"workload.nic_rx.queues\" = \"assumed:\"")).unwrap_err();
        assert!(e.msg.contains("source|assumed|fitted"), "{e}");
        let set = vec![("workload.nic_rx.queues".to_string(), "4".to_string())];
        let src = prov("\"workload.nic_rx.queues\" = \"assumed: one per flow\"");
        let v = load(
            Source::Text {
                name: "t.toml",
                text: &src,
            },
            &set,
        )
        .unwrap();
        assert!(v[0].scenario.provenance.is_empty());
        let cmp = format!("{src}[compare]\n\"workload.nic_rx.queues\" = [1, 2]\n");
        assert!(text(&cmp)
            .unwrap()
            .iter()
            .all(|v| v.scenario.provenance.is_empty()));
    }

    #[test]
    fn builtin_scenarios_say_where_every_platform_override_comes_from() {
        for (name, body) in BUILTIN_SCENARIOS {
            let t: toml::Table = toml::from_str(body).unwrap();
            let mut keys = vec![];
            if let Some(toml::Value::Table(p)) = t.get("platform") {
                setting_keys(p, "platform", &mut keys);
            }
            let prov = t.get("provenance").and_then(|p| p.as_table());
            for k in keys.iter().filter(|k| *k != "platform.profile") {
                assert!(
                    prov.is_some_and(|p| p.contains_key(k)),
                    "scenario {name}: {k} overrides its profile without a [provenance] entry"
                );
            }
        }
    }

    #[test]
    fn compare_expands_in_order_and_set_pins_an_axis() {
        let s = format!("{MIN}[compare]\n\"os.policy\" = [\"lazy\", \"strict\"]\n\"workload.nic_rx.queues\" = [1, 2]\n");
        let v = text(&s).unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(v[0].label, "policy=lazy queues=1");
        let ov = vec![("os.policy".to_string(), "passthrough".to_string())];
        let v = load(
            Source::Text {
                name: "t.toml",
                text: &s,
            },
            &ov,
        )
        .unwrap();
        assert_eq!(v.len(), 2);
        assert!(v
            .iter()
            .all(|x| x.scenario.os.policy == PolicyName::Passthrough));
        let bad = format!("{MIN}[compare]\n\"os.policy\" = [\"lazy\", \"fast\"]\n");
        let e = text(&bad).unwrap_err();
        assert!(
            e.origin.starts_with("t.toml:14:") && e.msg.contains("fast"),
            "{e}"
        );
    }

    #[test]
    fn semantic_checks_name_the_key() {
        let e = text(&MIN.replace("queues = 2", "queues = 0")).unwrap_err();
        assert!(e.msg.contains("workload.nic_rx.queues"), "{e}");
        let e = text(&MIN.replace("duration_ms = 1", "duration_ms = -1")).unwrap_err();
        assert!(e.msg.contains("run.duration_ms"), "{e}");
    }

    #[test]
    fn missing_file_is_one_line() {
        let e = load(Source::File(Path::new("/nonexistent/x.toml")), &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "/nonexistent/x.toml: cannot read: no such file"
        );
    }

    /// Every number, capability flag or array of numbers in a profile, as its dotted key.
    fn setting_keys(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    out.push(key)
                }
                toml::Value::Array(a) if a.iter().all(|x| x.is_integer() || x.is_float()) => {
                    out.push(key)
                }
                // A named choice inside a section (the top level's description and vendor are not settings).
                toml::Value::String(_) if !prefix.is_empty() => out.push(key),
                toml::Value::Table(inner) if key != "sources" && key != "ranges" => {
                    setting_keys(inner, &key, out)
                }
                _ => {}
            }
        }
    }

    #[test]
    fn builtin_profiles_cite_a_source_for_every_number_and_flag() {
        for (name, text) in BUILTIN_PROFILES {
            let t: toml::Table = toml::from_str(text).unwrap();
            let sources = t
                .get("sources")
                .and_then(|s| s.as_table())
                .cloned()
                .unwrap_or_default();
            let mut keys = vec![];
            setting_keys(&t, "", &mut keys);
            assert!(keys.len() > 10, "{name}: {keys:?}");
            let missing: Vec<_> = keys
                .iter()
                .filter(|k| {
                    sources
                        .get(*k)
                        .and_then(|s| s.as_str())
                        .is_none_or(|s| s.len() <= 10)
                })
                .collect();
            assert!(
                missing.is_empty(),
                "profile {name}: no source for {missing:?}"
            );
            // A figure taken from a simulator's defaults or another machine is an estimate for this one.
            let borrowed: Vec<_> = sources
                .iter()
                .filter_map(|(k, v)| Some((k, v.as_str()?)))
                .filter(|(_, v)| {
                    (v.contains("gem5") || v.contains("borrowed") || v.contains("reused"))
                        && !v.starts_with("estimate")
                })
                .collect();
            assert!(
                borrowed.is_empty(),
                "profile {name}: borrowed figures not marked as estimates: {borrowed:?}"
            );
            let extra: Vec<_> = sources.keys().filter(|k| !keys.contains(k)).collect();
            assert!(
                extra.is_empty(),
                "profile {name}: sources for keys it does not have: {extra:?}"
            );
        }
    }

    const GUEST_NET: &str =
        "[workload.virtio_net]\nline_rate_gbps = 10\ndirection = \"rx\"\nmtu = 1500\n";

    #[test]
    fn every_builtin_profile_runs_the_minimal_scenario() {
        for (name, _) in BUILTIN_PROFILES {
            let arch = if name.contains("smmuv3") || name.contains("arm64") {
                "arm64"
            } else {
                builtin_platform(name).map_or("x86_64", |p| p.vendor.driver().archs()[0].as_str())
            };
            // The kernel: the default 6.12, or the driver's first where it came later (the RISC-V IOMMU's 6.13).
            let drv = builtin_platform(name).map(|p| p.vendor.driver());
            let arch_v = Arch::parse(arch).unwrap();
            let kernel = if drv.is_some_and(|d| {
                d.check_kernel(crate::kernel::KernelVersion(6, 12), arch_v)
                    .is_err()
            }) {
                "6.13"
            } else {
                "6.12"
            };
            let mut sc = MIN.replace("vtd-server", name).replace(
                "[os]\n",
                &format!("[os]\narch = \"{arch}\"\nkernel = \"{kernel}\"\n"),
            );
            if name.starts_with("kvm-") {
                // A guest with an emulated IOMMU runs a virtio device; strict, its first NAPI poll unmaps
                // with an exit per buffer, so the window is longer.
                let at = sc.find("[workload.nic_rx]").unwrap();
                sc.truncate(at);
                sc.push_str(GUEST_NET);
                sc = sc.replace("duration_ms = 1\n", "duration_ms = 5\n");
            }
            if builtin_platform(name).is_some_and(|p| p.unmodelled_iommu.is_some()) {
                // A host whose IOMMU is not modelled runs no bare-metal scenario; it hosts guests.
                let e = text(&sc).unwrap_err().to_string();
                assert!(e.contains("platform.profile") && e.contains("host"), "{e}");
                continue;
            }
            let v = text(&sc).unwrap();
            assert_eq!(v[0].scenario.platform.profile, *name);
            // ... and simulates it: traffic flows (strict behind QEMU's AMD IOMMU, four exits a buffer: ~0.9
            // of the 10 Gbps).
            let r = crate::run::run_variant(&v[0]);
            assert!(
                r.throughput_gbps > 0.5,
                "profile {name}: {} Gbps",
                r.throughput_gbps
            );
            assert!(r.sim_seconds > 0.0, "profile {name}");
        }
    }
}
