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

pub const BUILTIN_SCENARIOS: &[(&str, &str)] = &[
    ("default", include_str!("../data/scenarios/default.toml")),
    ("c1", include_str!("../data/scenarios/c1.toml")),
    ("c2", include_str!("../data/scenarios/c2.toml")),
    ("c3", include_str!("../data/scenarios/c3.toml")),
    ("nvme", include_str!("../data/scenarios/nvme.toml")),
    ("seed004", include_str!("../data/scenarios/seed004.toml")),
    (
        "seed001-x86",
        include_str!("../data/scenarios/seed001-x86.toml"),
    ),
    (
        "seed001-arm",
        include_str!("../data/scenarios/seed001-arm.toml"),
    ),
    ("nested", include_str!("../data/scenarios/nested.toml")),
    ("tx", include_str!("../data/scenarios/tx.toml")),
    ("rr", include_str!("../data/scenarios/rr.toml")),
];
pub const BUILTIN_PROFILES: &[(&str, &str)] = &[
    (
        "vtd-server",
        include_str!("../data/profiles/vtd-server.toml"),
    ),
    (
        "smmuv3-server",
        include_str!("../data/profiles/smmuv3-server.toml"),
    ),
    (
        "virtio-guest",
        include_str!("../data/profiles/virtio-guest.toml"),
    ),
    (
        "kvm-vtd-guest",
        include_str!("../data/profiles/kvm-vtd-guest.toml"),
    ),
    (
        "kvm-smmuv3-guest",
        include_str!("../data/profiles/kvm-smmuv3-guest.toml"),
    ),
    (
        "virtio-guest-arm64",
        include_str!("../data/profiles/virtio-guest-arm64.toml"),
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
    let Some(prov) = table.get("provenance") else {
        return Ok(());
    };
    let Some(prov) = prov.as_table() else {
        return Err((
            vec!["provenance".into()],
            "expected a table of `\"dotted.key\" = \"source|assumed|fitted: why\"`".into(),
        ));
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

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Vendor {
    /// Intel VT-d: second-level page table, queued invalidation (PSI/DSI/global + wait descriptor).
    Vtd,
    /// Arm SMMUv3: LPAE page table, command queue (TLBI by VA or range, by ASID/VMID, CMD_SYNC).
    Smmuv3,
    /// virtio-iommu: MAP/UNMAP requests on a virtqueue to the host (a paravirtual IOMMU in a guest).
    Virtio,
}

impl Vendor {
    pub fn as_str(self) -> &'static str {
        match self {
            Vendor::Vtd => "vtd",
            Vendor::Smmuv3 => "smmuv3",
            Vendor::Virtio => "virtio",
        }
    }
}

/// A hardware platform: the IOMMU, memory, PCIe path and CPU costs. Loaded from a profile file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Platform {
    /// Built-in profile name or a path (relative to the scenario file).
    pub profile: String,
    /// One line on what the profile is.
    #[serde(default)]
    pub description: String,
    /// The IOMMU's kind, which decides the driver model and the page-table format.
    pub vendor: Vendor,
    pub iommu: IommuProfile,
    pub memory: MemoryProfile,
    pub pcie: PcieProfile,
    pub cpu: CpuProfile,
    /// A guest: its IOMMU is emulated by the hypervisor, and the CPUs are vCPUs (absent: bare metal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<HypervisorProfile>,
    /// Where each number comes from: `"section.key" = "source"`.
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IommuProfile {
    /// IOTLB entries and associativity.
    pub iotlb_entries: u32,
    /// IOTLB ways (entries / ways sets).
    pub iotlb_ways: u32,
    /// Entries of each paging-structure (walk) cache, top level first: one per non-leaf level; LRU.
    pub pwc_entries: Vec<u32>,
    /// Associativity of the walk caches (0 = fully associative).
    pub pwc_ways: u32,
    /// Input address bits of the DMA domain's page table (VT-d address width: 48 → 4 levels, 57 → 5;
    /// LPAE IAS); with the granule it decides the levels a walk reads.
    pub ias_bits: u32,
    /// Translation granule in KiB: 4 (VT-d; LPAE), 16 or 64 (LPAE).
    pub granule_kb: u32,
    /// Superpages / block mappings (VT-d CAP.SLLPS 2M and 1G; LPAE blocks of the granule).
    pub large_pages: bool,
    /// dev->iommu->shadow_on_flush: a hypervisor shadows the IOTLB flushes (s390 zPCI under z/VM or KVM), so
    /// a lazy domain gets one 32768-entry flush queue with a 1 s timer instead of per-CPU rings of 256.
    #[serde(default)]
    pub shadow_on_flush: bool,
    /// Intel VT-d queued invalidation (required when `vendor = "vtd"`).
    pub vtd: Option<VtdProfile>,
    /// Arm SMMUv3 command queue (required when `vendor = "smmuv3"`).
    pub smmuv3: Option<Smmuv3Profile>,
    /// virtio-iommu request queue (required when `vendor = "virtio"`).
    #[serde(default)]
    pub virtio: Option<VirtioProfile>,
}

impl IommuProfile {
    /// Entries of the last walk cache (the one holding level-2 entries: F&S's PTcache-L3).
    pub fn last_walk_cache_entries(&self) -> u64 {
        self.pwc_entries.last().map_or(0, |&n| n as u64)
    }
}

/// The hypervisor a guest platform runs under (KVM with QEMU as the VMM).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HypervisorProfile {
    /// Round trip of an MMIO write the VMM handles in user space: VM exit, KVM's return to the VMM,
    /// dispatch to the device's handler and back, re-entry (without the handler's own work).
    pub mmio_exit_ns: u64,
    /// Round trip of a virtqueue notification KVM completes in the kernel (ioeventfd): exit, eventfd
    /// signal, re-entry.
    pub kick_exit_ns: u64,
    /// From the device's interrupt (irqfd) to the guest vCPU running its handler.
    pub irq_inject_ns: u64,
    /// Device-thread CPU per packet (one GSO skb), besides translation and copying: QEMU's virtio-net
    /// (virtqueue_pop, the tap read or write) and vhost-net (handle_rx/handle_tx, the socket call).
    pub qemu_packet_ns: u64,
    /// vhost-net's per-packet device-thread CPU (as `qemu_packet_ns`).
    pub vhost_packet_ns: u64,
    /// QEMU's translation of one guest page through the vIOMMU on a hit in its IOTLB (address_space_map
    /// through the IOMMU region, the IOTLB hash lookup).
    pub qemu_translate_ns: u64,
    /// vhost's device-IOTLB lookup on a hit (vhost_iotlb_itree_first), per page.
    pub vhost_iotlb_lookup_ns: u64,
    /// A vhost device-IOTLB miss: VHOST_IOTLB_MISS read by QEMU, its translation, VHOST_IOTLB_UPDATE
    /// written back, vhost resuming (the walk's reads are added at `memory.walk_read_ns`, which on a guest
    /// platform is the emulator's software read of one guest page-table entry).
    pub vhost_iotlb_miss_ns: u64,
    /// QEMU writing one VHOST_IOTLB_INVALIDATE to vhost (its IOMMU notifier, per invalidated range).
    pub vhost_invalidate_ns: u64,
    /// vhost's device-IOTLB capacity (drivers/vhost/vhost.c max_iotlb_entries).
    pub vhost_iotlb_entries: u32,
    /// The bare-metal profile of the host the guest runs on (built-in): its IOMMU hardware translates a
    /// VFIO-assigned device's DMA, through shadow mappings or, with `nested`, two stages.
    pub host_profile: String,
    /// VFIO_IOMMU_MAP_DMA: the ioctl, and per 4 KiB page the pin (pin_user_pages) and the host's iommu_map.
    pub vfio_map_ns: u64,
    /// VFIO_IOMMU_MAP_DMA per 4 KiB page (pin and host map).
    pub vfio_map_page_ns: u64,
    /// VFIO_IOMMU_UNMAP_DMA: the ioctl with the host IOMMU's invalidation and wait, and per page the unpin.
    pub vfio_unmap_ns: u64,
    /// VFIO_IOMMU_UNMAP_DMA per 4 KiB page (unpin).
    pub vfio_unmap_page_ns: u64,
    /// Nested translation (a VFIO device): the guest's IOMMU tables are stage 1 in the host's hardware over
    /// the host's stage 2; no shadowing, but a two-dimensional walk on a miss.
    #[serde(default)]
    pub nested: bool,
    /// With `nested`: the VMM forwarding one trapped invalidation batch to the host (iommufd
    /// IOMMU_HWPT_INVALIDATE, the host driver's commands and their wait).
    pub nested_inv_ns: u64,
    /// With `nested`: page-table reads of the stage-2 translation each stage-1 access needs after the
    /// stage-2 caches (a 4-level by 4-level walk needs up to 24 reads in all with nothing cached).
    pub nested_s2_reads: u32,
    /// With `nested` on SMMUv3: the guest's command queue is a hardware one (NVIDIA's CMDQV, tegra241-cmdqv.c)
    /// and its invalidations do not trap.
    #[serde(default)]
    pub vcmdq: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VirtioProfile {
    /// Guest CPU time to add one request to the request virtqueue (under viommu->request_lock).
    pub add_req_ns: u64,
    /// Host time to process one MAP or UNMAP request (and write its status).
    pub req_ns: u64,
    /// Smallest page in the device's page_size_mask, in KiB; every larger power of two is supported too
    /// (QEMU's default mask, ~(target page - 1)).
    pub min_page_kb: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VtdProfile {
    /// Hardware time to process one IOTLB invalidation descriptor.
    pub inv_desc_ns: u64,
    /// Hardware time to process a wait descriptor (status write back).
    pub inv_wait_ns: u64,
    /// CPU time to write one descriptor into the queue under the queue lock.
    pub submit_desc_ns: u64,
    /// Largest PSI address mask (CAP.MAMV); larger ranges fall back to DSI.
    pub mamv: u32,
    /// CAP.CM: caching mode (virtual IOMMUs): maps need an invalidation too.
    pub caching_mode: bool,
    /// CAP.RWBF: the write buffer must be flushed after a map when no invalidation is required.
    pub rwbf: bool,
    /// Hardware time of one write-buffer flush (GCMD.WBF until GSTS.WBFS clears).
    pub wbf_ns: u64,
    /// CPU time per cache tag when a flush walks the domain's tags under its cache_lock (6.10+).
    pub cache_tag_ns: u64,
    /// What a page-selective invalidation with IH=0 drops from the paging-structure caches.
    #[serde(default)]
    pub psi_nonleaf: PsiNonLeaf,
}

/// The paging-structure-cache entries a PSI with IH=0 invalidates (VT-d spec §6.5.2.3, IOTLB Invalidate
/// Descriptor, IH; an implementation may invalidate at a coarser granularity than requested).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PsiNonLeaf {
    /// Only the non-leaf entries used to translate the ADDR/AM range (what the spec requires).
    #[default]
    Range,
    /// Every non-leaf entry of the domain, the leaf entries of the range only (Intel server IIO).
    Domain,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Smmuv3Profile {
    /// CPU time to insert one 16-byte command (slot reservation on the shared producer index, copy).
    pub submit_cmd_ns: u64,
    /// SMMU time to consume one TLBI command.
    pub cmd_ns: u64,
    /// SMMU time a CMD_SYNC holds its queue: the commands before it complete (SMMUv3 §4.7.3).
    pub sync_ns: u64,
    /// What a CMD_SYNC's round trip adds outside the queue: the doorbell reaching the SMMU, the command
    /// fetch, the MSI write and the polling CPU seeing it (the time of a CMD_SYNC on an empty queue).
    #[serde(default)]
    pub sync_signal_ns: u64,
    /// IDR3.RIL: range invalidation commands.
    pub ril: bool,
    /// Per-CPU enhanced command queues (SMMUv3.3 ECMDQ) instead of one shared queue.
    pub ecmdq: bool,
    /// The SMMU consumes its ECMDQs in parallel (one consumer per queue) rather than one after another.
    #[serde(default)]
    pub ecmdq_parallel: bool,
    /// Translation stage of DMA domains: 1 (TLBI_NH_*, by ASID) or 2 (TLBI_S2_IPA / S12_VMALL, by VMID).
    pub stage: u32,
    /// A "caching mode" for an emulated SMMUv3 (E. Auger's vSMMUv3 series, a firmware quirk): the driver
    /// also invalidates after every map, so the VMM sees new mappings (for VFIO). No hardware has it.
    #[serde(default)]
    pub caching_mode: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryProfile {
    /// One page-walk memory read by the IOMMU.
    pub walk_read_ns: u64,
    /// Physical pages the simulated kernel can hand out.
    pub pages: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PcieProfile {
    /// Fixed latency of one DMA write through the root complex with an IOTLB hit.
    pub dma_base_ns: u64,
    /// DMA writes whose translation may be outstanding at once.
    pub translation_slots: u32,
    /// Link bandwidth after encoding.
    pub link_gbps: f64,
    /// Device on-chip receive buffer; packets beyond it are dropped.
    pub device_buffer_bytes: u64,
    /// The device uses PCIe ATS: it caches translations in its own ATC and must be invalidated too.
    pub ats: bool,
    /// ATC entries and associativity (used when `ats`).
    pub atc_entries: u32,
    /// ATC ways (atc_entries / ways sets).
    pub atc_ways: u32,
    /// Round trip of an ATS translation request on an ATC miss, before the IOMMU's own lookup.
    pub ats_request_ns: u64,
    /// Time until the device completes an ATS invalidation request (its ATC drained, response sent).
    pub ats_inv_ns: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CpuProfile {
    /// Cores available to the workloads (one CPU each).
    pub cores: u32,
    /// Per packet off the wire: the driver's RX completion, skb build and GRO merge
    /// (mlx5e_handle_rx_cqe_mpwrq, napi_gro_receive).
    pub stack_ns_per_packet: u64,
    /// Per skb up the stack after GRO: netif_receive_skb → ip_rcv → tcp_v4_rcv → tcp_rcv_established →
    /// tcp_data_queue → sk_data_ready, and the skb's free after the copy. A pure ACK or a small request is
    /// one packet and one skb; a GRO skb carries up to 64 KiB of a flow's segments.
    pub stack_ns_per_skb: u64,
    /// recvmsg copy to user space per byte.
    pub copy_ns_per_byte: f64,
    /// Scheduler wake-up of a reader blocked on a socket.
    pub wakeup_ns: u64,
    /// alloc_page / put_page.
    pub page_alloc_ns: u64,
    /// Fixed iommu-dma map or unmap path cost (iommu_dma_map_page / __iommu_dma_unmap).
    pub dma_iommu_op_ns: u64,
    /// dma-direct map or unmap (identity domain).
    pub dma_direct_op_ns: u64,
    /// Write or clear one leaf PTE (plus its cache-line flush where not coherent).
    pub pte_ns: u64,
    /// IOVA allocation or free served by the per-CPU rcache.
    pub iova_rcache_ns: u64,
    /// IOVA allocation or free on the rbtree (under the domain's iova_rbtree_lock).
    pub iova_rbtree_ns: u64,
    /// Uncontended spinlock acquire + release on a line this core already holds.
    pub lock_ns: u64,
    /// Cores sharing a cluster (an LLC slice group or mesh cluster) and cores per socket: CPU i sits in
    /// cluster i / cluster_cores of socket i / socket_cores.
    pub cluster_cores: u32,
    /// Cores per socket (a multiple of cluster_cores).
    pub socket_cores: u32,
    /// One cache-line transfer (the stall of an atomic or a lock acquire on a line another core wrote last)
    /// from a core of the same cluster, of another cluster of the socket, of another socket.
    pub line_cluster_ns: u64,
    /// One cache-line transfer from another cluster of the same socket.
    pub line_socket_ns: u64,
    /// One cache-line transfer from another socket.
    pub line_remote_ns: u64,
    /// queue_iova(): append to this CPU's flush-queue ring.
    pub fq_entry_ns: u64,
    /// Sending one small packet (a TCP ACK) down the stack and driver, without its DMA mapping.
    pub tx_packet_ns: u64,
    /// Submitting one block I/O: the application's submission (io_uring/libaio), blk-mq, nvme_queue_rq() and
    /// the doorbell, without the DMA mapping.
    pub nvme_submit_ns: u64,
    /// Completing one block I/O: the interrupt, nvme_irq()/blk_mq_complete_request() and the application's
    /// reap, without the DMA unmapping.
    pub nvme_complete_ns: u64,
}
impl CpuProfile {
    /// What moving a line between two of these cores costs.
    pub fn coherence(&self) -> crate::sim::Coherence {
        crate::sim::Coherence {
            cluster_cores: self.cluster_cores,
            socket_cores: self.socket_cores,
            cluster_ns: self.line_cluster_ns,
            socket_ns: self.line_socket_ns,
            remote_ns: self.line_remote_ns,
        }
    }
    /// Receiving one packet that GRO does not merge (a pure ACK, a small request): one packet, one skb.
    pub fn rx_lone_packet_ns(&self) -> u64 {
        self.stack_ns_per_packet + self.stack_ns_per_skb
    }
}

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

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    X86_64,
    Arm64,
    S390,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Os {
    /// Kernel version, `MAJOR.MINOR`.
    #[serde(default = "default_kernel")]
    pub kernel: String,
    /// The kernel's architecture (an IOMMU's vendor must match it).
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
}
fn default_kernel() -> String {
    "6.12".into()
}
fn default_arch() -> Arch {
    Arch::X86_64
}
fn default_hz() -> u32 {
    250
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub nic_rx: Option<NicRx>,
    pub nic_tx: Option<NicTx>,
    pub rr: Option<Rr>,
    pub nvme: Option<Nvme>,
    pub virtio_net: Option<VirtioNet>,
}

/// Which way a guest's TCP stream runs, from the guest's side.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// The guest receives (netperf TCP_MAERTS / iperf3 -R from the guest's view).
    Rx,
    /// The guest sends (netperf TCP_STREAM).
    Tx,
}

/// A guest's virtio-net device (virtio-net-pci with VIRTIO_F_ACCESS_PLATFORM, so its buffers go through
/// the guest's DMA API and the vIOMMU) carrying one bulk TCP stream to or from a peer host. The device is
/// the VMM's (QEMU's virtio-net, vhost = false) or the host kernel's (vhost-net, vhost = true). Needs a
/// guest platform (a profile with `[hypervisor]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VirtioNet {
    /// The peer's link (the host's NIC).
    pub line_rate_gbps: f64,
    pub direction: Direction,
    /// vhost-net does the device's work in a host kernel thread, translating through its own device
    /// IOTLB; without it QEMU's virtio-net does, translating through the vIOMMU's emulated translation.
    #[serde(default)]
    pub vhost: bool,
    /// Descriptors per virtqueue (QEMU's rx_queue_size / tx_queue_size default: 256).
    #[serde(default = "default_virtqueue_size")]
    pub queue_size: u32,
    /// TSO/GRO size: the guest's largest TSO skb, and the host's GRO'd skbs handed to the tap.
    #[serde(default = "default_gro_max")]
    pub gso_max_bytes: u32,
    /// The guest's MTU.
    pub mtu: u32,
    /// TCP Small Queues budget of the guest's sending socket (direction tx), as `workload.nic_tx`.
    #[serde(default = "default_tsq_bytes")]
    pub tsq_bytes: u64,
    /// The receiver ACKs once per this many bytes (about once per GRO skb).
    #[serde(default = "default_gro_max_u64")]
    pub ack_bytes: u64,
    /// From the guest's data leaving the host's NIC to the peer's ACK arriving, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
}
/// QEMU hw/net/virtio-net.c VIRTIO_NET_RX_QUEUE_DEFAULT_SIZE / VIRTIO_NET_TX_QUEUE_DEFAULT_SIZE.
fn default_virtqueue_size() -> u32 {
    256
}

/// Request/response over TCP (memcached- or HTTP-like): small requests in, a server thread per queue sends
/// each response (mapped per send, unmapped on TX completion); closed loop or a fixed rate as wrk2.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rr {
    /// The NIC's line rate.
    pub line_rate_gbps: f64,
    /// NIC queues; queue q's NAPI and server thread run on CPU q.
    pub queues: u32,
    /// Client connections; connection c is steered to queue c % queues.
    pub connections: u32,
    /// Packet size on the wire.
    #[serde(default = "default_rr_mtu")]
    pub mtu: u32,
    /// Request payload (one segment).
    #[serde(default = "default_request_bytes")]
    pub request_bytes: u32,
    /// Response payload: one segment (head and frag mapped) or a TSO skb (frags mapped).
    #[serde(default = "default_response_bytes")]
    pub response_bytes: u32,
    /// Requests per second over all connections, due at a constant rate (wrk2 -R); latency counts from when
    /// each was due. 0: closed loop, each connection sends its next request when its response arrives.
    #[serde(default)]
    pub rate_rps: f64,
    /// The server application's own CPU per request besides the network stack and the send (parse, look
    /// up, build), ns: part of the workload, as fio's think time is.
    pub service_ns: u64,
    /// Client-to-server round trip outside the host (wire, switch, the client's stack), µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
    /// Kept-mapped RX pages the requests land in, one per request in turn.
    #[serde(default = "default_tx_rx_ring")]
    pub rx_ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// RX completion-event moderation (CQE period mode). Default: mlx5's static 3 µs / 32 packets (en.h
    /// MLX5E_PARAMS_DEFAULT_RX_CQ_MODERATION_USEC_FROM_CQE, _PKTS), DIM off as latency-tuned servers run.
    #[serde(default = "default_rr_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_rr_irq_frames")]
    pub irq_frames: u32,
}
fn default_rr_mtu() -> u32 {
    1500
}
fn default_request_bytes() -> u32 {
    128
}
fn default_response_bytes() -> u32 {
    1024
}
fn default_rr_irq_usecs() -> u32 {
    3
}
fn default_rr_irq_frames() -> u32 {
    32
}

/// A multi-queue NIC sending bulk TCP (iperf3 client): TSO skbs whose data sits in page frags, each frag
/// mapped per send and unmapped on TX completion; the peer's ACKs come back through a kept-mapped RX ring.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NicTx {
    /// The NIC's line rate.
    pub line_rate_gbps: f64,
    /// TX queues (XPS): queue q's completions, and the senders of its flows, run on CPU q.
    pub queues: u32,
    /// TCP flows, flow f on queue f % queues.
    pub flows: u32,
    /// Packet size on the wire.
    pub mtu: u32,
    /// The largest TSO skb (GSO_MAX_SIZE: 64 KiB without BIG TCP).
    #[serde(default = "default_gro_max")]
    pub tso_max_bytes: u32,
    /// TCP Small Queues: bytes a socket may have queued below TCP (qdisc, driver, NIC) before it waits for
    /// TX completions (net.ipv4.tcp_limit_output_bytes, 1 MiB since Linux 5.0).
    #[serde(default = "default_tsq_bytes")]
    pub tsq_bytes: u64,
    /// Size of the socket's page-frag chunks that hold the data (sk_page_frag: SKB_FRAG_PAGE_ORDER 3 = 32 KiB).
    #[serde(default = "default_frag_kb")]
    pub frag_kb: u32,
    /// The peer sends one ACK per this many bytes received (a Linux receiver ACKs about once per GRO skb).
    #[serde(default = "default_gro_max_u64")]
    pub peer_ack_bytes: u64,
    /// From a segment leaving the wire to the peer's ACK arriving, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
    /// RX pages the ACKs land in, one per ACK in turn; page_pool keeps them mapped.
    #[serde(default = "default_tx_rx_ring")]
    pub rx_ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// RX (ACK) completion-event moderation, as `workload.nic_rx`; TX completions use mlx5's defaults.
    #[serde(default = "default_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_irq_frames")]
    pub irq_frames: u32,
}
fn default_tsq_bytes() -> u64 {
    16 * 65536
}
fn default_frag_kb() -> u32 {
    (crate::net::SKB_FRAG_PAGE_BYTES / 1024) as u32
}
fn default_gro_max_u64() -> u64 {
    65536
}
/// Estimate: a round trip between hosts in one rack (two NIC and one switch traversals, the peer's stack).
fn default_rtt_us() -> f64 {
    10.0
}
/// mlx5 en.h MLX5E_PARAMS_DEFAULT_LOG_RQ_SIZE: 1024 RX descriptors.
fn default_tx_rx_ring() -> u32 {
    1024
}

/// fio against NVMe drives (O_DIRECT, closed loop): every I/O maps its buffer with one dma_map_sg() when it
/// is submitted and unmaps it when it completes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Nvme {
    /// Drives.
    pub drives: u32,
    /// The drives sit behind one PCIe bridge without ACS (a dual-port drive): one IOMMU group, so one
    /// default domain for all of them. False: each on its own root port, in a domain of its own.
    #[serde(default = "default_true")]
    pub same_bridge: bool,
    /// fio numjobs: one submitting thread per CPU; job j drives drive j % drives through its own queue pair.
    pub jobs: u32,
    /// fio iodepth: I/Os each job keeps in flight.
    pub iodepth: u32,
    /// fio bs, in KiB (a multiple of 4).
    pub bs_kb: u32,
    /// fio rw. Reads: the drive writes host memory; writes: it reads it. Both translate every page.
    #[serde(default = "default_rw")]
    pub rw: NvmeRw,
    /// Media latency of one I/O inside the drive, µs (overlaps across the I/Os in flight).
    pub latency_us: f64,
    /// Data bandwidth of one drive, Gbps (its PCIe link and media, whichever is lower).
    pub drive_gbps: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NvmeRw {
    Read,
    Randread,
    Write,
    Randwrite,
}
fn default_rw() -> NvmeRw {
    NvmeRw::Randread
}

/// A multi-queue NIC receiving bulk TCP (iperf3-like) into page_pool-backed rings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NicRx {
    /// The NIC's line rate (the senders' aggregate).
    pub line_rate_gbps: f64,
    /// RSS queues; queue q's interrupt and NAPI run on CPU q.
    pub queues: u32,
    /// Channels the driver opens (`ethtool -L combined`); omitted: one per queue. Those past `queues`
    /// carry no flows, but their rings are allocated and filled when the interface comes up, taking IOVAs
    /// between the busy queues' (mlx5's default is one channel per CPU: en_main.c mlx5e_build_nic_params).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels: Option<u32>,
    /// How the rings are filled when the interface comes up; omitted: `napi` with `rq = "mlx5_striding"`,
    /// else `in_turn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_fill: Option<RingFill>,
    /// TCP flows, hashed onto queues by RSS (collisions happen, as on real NICs).
    pub flows: u32,
    /// Packet size on the wire; one RX buffer of 4 KiB pages per packet.
    pub mtu: u32,
    /// RX descriptors per queue.
    pub ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// Keep pages mapped in a page_pool and recycle them (false: map on refill, unmap on every packet).
    #[serde(default = "default_true")]
    pub page_pool: bool,
    /// page_pool ptr_ring size.
    #[serde(default = "default_pool_size")]
    pub pool_size: u32,
    /// The reader copies this much per recvmsg() (iperf3's default read length is 128 KiB).
    #[serde(default = "default_read_bytes")]
    pub read_bytes: u32,
    /// The most window a flow's socket offers: tcp_win_from_space(sk_rcvbuf), half of the buffer before Linux
    /// 6.6 (tcp_adv_win_scale = 1), so half of `tcp_rmem[2]`; from 6.6 the buffer scaled by the measured
    /// payload/truesize. The socket holds up to the whole buffer in skb truesize (tcp_space()), so before 6.6
    /// the payload it holds depends on the RX layout (`nic_rx::tcp`).
    #[serde(default = "default_rcvbuf")]
    pub rcvbuf_bytes: u64,
    /// RX queue layout: `cyclic` (one page per descriptor, ring_size pages) or `mlx5_striding` (mlx5
    /// multi-packet WQEs of 64 pages, frames packed on stride boundaries; ring_size counts frames as
    /// `ethtool -G rx` does).
    #[serde(default)]
    pub rq: RqKind,
    /// Pages of the driver's own RX page cache in front of page_pool, which then does no DMA mapping
    /// (mlx5 in Linux 6.0: MLX5E_CACHE_SIZE = 256). 0: none (page_pool keeps pages mapped).
    #[serde(default)]
    pub driver_page_cache: u32,
    /// TCP ACKs go back out through the NIC (each mapped when sent and unmapped on TX completion).
    #[serde(default = "default_true")]
    pub acks: bool,
    /// GRO's largest merged skb (GRO_MAX_SIZE: 64 KiB without BIG TCP).
    #[serde(default = "default_gro_max")]
    pub gro_max_bytes: u32,
    /// RX completion-event moderation (CQE period mode): the interrupt fires this long after the latest
    /// completion, or at `irq_frames` pending. Used when `dim` is false, with TX completions at mlx5's static
    /// 16 µs / 32 (EQE mode). Default: DIM's top CQE-mode RX profile, 64 µs / 64 packets (lib/dim/net_dim.c
    /// rx_profile), a stand-in for DIM settled under a bulk stream. mlx5 with DIM off
    /// (`ethtool -C adaptive-rx off`): 3 µs / 32 (en.h MLX5E_PARAMS_DEFAULT_RX_CQ_MODERATION_USEC_FROM_CQE,
    /// _PKTS).
    #[serde(default = "default_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_irq_frames")]
    pub irq_frames: u32,
    /// DIM's adaptation (lib/dim/net_dim.c) tunes the RX and TX completion queues' moderation, as mlx5 does
    /// by default (en_main.c mlx5e_build_nic_params sets rx_dim_enabled and tx_dim_enabled); false: the
    /// static moderation above.
    #[serde(default = "default_true")]
    pub dim: bool,
    /// Where each flow's reader runs: on its queue's CPU (aRFS steers the flow to the reader's CPU), or on
    /// a CPU of its own past the queues' (IRQs and applications kept apart; RSS hashes the flow).
    #[serde(default)]
    pub readers: Readers,
    /// The peers' senders: `window` sends whenever the receive window allows, hears each ACK at once and
    /// resends a dropped segment at once without backing off; `dctcp` keeps a congestion window (DCTCP
    /// without ECN marks: slow start, additive increase, halving on loss), hears ACKs and losses `rtt_us`
    /// late, and segments arriving before a loss's retransmission wait in the out-of-order queue.
    #[serde(default)]
    pub sender: SenderModel,
    /// The round trip outside the receiving host (wire, switch, the senders' stack and NIC): with
    /// `sender = "dctcp"`, ACKs and losses reach the senders this long after the receiver's device sent or
    /// dropped them, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SenderModel {
    #[default]
    Window,
    Dctcp,
}
fn default_irq_usecs() -> u32 {
    64
}
fn default_irq_frames() -> u32 {
    64
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Readers {
    #[default]
    Queue,
    Own,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RqKind {
    #[default]
    Cyclic,
    Mlx5Striding,
}
/// How a NIC fills its RX rings when the interface comes up.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RingFill {
    /// Every channel's NAPI posts its own ring, all at once, each on its CPU (mlx5e_activate_channels
    /// triggering each NAPI): the channels' dma_map calls take IOVAs in turn, so their rings interleave.
    Napi,
    /// The bring-up refills the rings one after another (ENA: ena_up_complete, ena_refill_all_rx_bufs).
    InTurn,
}

impl NicRx {
    /// The ring fill in force (`ring_fill`, or the driver's own).
    pub fn ring_fill(&self) -> RingFill {
        self.ring_fill.unwrap_or(match self.rq {
            RqKind::Mlx5Striding => RingFill::Napi,
            RqKind::Cyclic => RingFill::InTurn,
        })
    }
}

/// mlx5's upper bound on channels (en.h MLX5E_MAX_NUM_CHANNELS, 6.12).
pub const MAX_CHANNELS: u32 = 256;
fn default_gro_max() -> u32 {
    65536
}
fn default_budget() -> u32 {
    64
}
fn default_true() -> bool {
    true
}
fn default_pool_size() -> u32 {
    1024
}
fn default_read_bytes() -> u32 {
    128 * 1024
}
fn default_rcvbuf() -> u64 {
    6 * 1024 * 1024
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
        check(
            (1..=MAX_CACHE_ENTRIES).contains(&io.iotlb_entries),
            "platform.iommu.iotlb_entries",
            format!("expected 1..={MAX_CACHE_ENTRIES} entries"),
        )?;
        check(
            io.iotlb_ways > 0 && io.iotlb_entries.is_multiple_of(io.iotlb_ways),
            "platform.iommu.iotlb_ways",
            "expected iotlb_entries to be a non-zero multiple of iotlb_ways",
        )?;
        check(
            io.pwc_ways == 0 || io.pwc_entries.iter().all(|n| n % io.pwc_ways == 0),
            "platform.iommu.pwc_ways",
            "expected 0 (fully associative) or a divisor of every pwc_entries count",
        )?;
        let fmt = crate::hw::pt_format(self.platform.vendor, io)
            .map_err(|(k, m)| (vec!["platform".into(), "iommu".into(), k.into()], m))?;
        check(
            io.pwc_entries.len() == fmt.levels as usize - 1
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
        match self.platform.vendor {
            Vendor::Vtd => {
                let Some(v) = &io.vtd else {
                    return check(
                        false,
                        "platform.iommu.vtd",
                        "expected an [iommu.vtd] section for vendor \"vtd\"",
                    );
                };
                check(
                    v.mamv <= 63,
                    "platform.iommu.vtd.mamv",
                    "expected an address-mask limit of 0..=63",
                )?;
            }
            Vendor::Virtio => {
                let Some(v) = &io.virtio else {
                    return check(
                        false,
                        "platform.iommu.virtio",
                        "expected an [iommu.virtio] section for vendor \"virtio\"",
                    );
                };
                check(
                    v.min_page_kb.is_power_of_two() && v.min_page_kb >= 4,
                    "platform.iommu.virtio.min_page_kb",
                    "expected a power of two of at least 4 KiB",
                )?;
            }
            Vendor::Smmuv3 => {
                let Some(v) = &io.smmuv3 else {
                    return check(
                        false,
                        "platform.iommu.smmuv3",
                        "expected an [iommu.smmuv3] section for vendor \"smmuv3\"",
                    );
                };
                check(
                    v.stage == 1 || v.stage == 2,
                    "platform.iommu.smmuv3.stage",
                    "expected stage 1 or 2",
                )?;
            }
        }
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
            (1..=10_000).contains(&self.os.hz),
            "os.hz",
            "expected CONFIG_HZ in 1..=10000 (e.g. 100, 250, 1000)",
        )?;
        check(
            self.os.sched_wakeup_granularity_us.is_none_or(|g| g >= 1),
            "os.sched_wakeup_granularity_us",
            "expected a granularity of at least 1 µs",
        )?;
        parse_kernel(&self.os.kernel).map_err(|m| (vec!["os".into(), "kernel".into()], m))?;
        // VT-d is an x86 IOMMU and SMMUv3 an Arm one; virtio-iommu serves any guest.
        let arch_ok = match self.platform.vendor {
            Vendor::Vtd => self.os.arch == Arch::X86_64,
            Vendor::Smmuv3 => self.os.arch == Arch::Arm64,
            Vendor::Virtio => self.os.arch != Arch::S390,
        };
        check(
            arch_ok,
            "os.arch",
            match self.platform.vendor {
                Vendor::Vtd => "expected x86_64: the platform's IOMMU is Intel VT-d",
                Vendor::Smmuv3 => "expected arm64: the platform's IOMMU is an Arm SMMUv3",
                Vendor::Virtio => "expected x86_64 or arm64 for a virtio-iommu guest",
            },
        )?;
        check(
            self.platform.hypervisor.is_some() || self.platform.vendor != Vendor::Virtio,
            "platform.hypervisor",
            "expected a [hypervisor] section: a virtio-iommu platform is a guest (its kick is an exit)",
        )?;
        check(
            self.platform.hypervisor.is_some()
                || !io.smmuv3.as_ref().is_some_and(|s| s.caching_mode),
            "platform.iommu.smmuv3.caching_mode",
            "expected false on bare metal: only an emulated SMMUv3 has the caching-mode quirk",
        )?;
        if let Some(h) = &self.platform.hypervisor {
            // virtio-iommu's requests keep their own costs ([iommu.virtio]); QEMU's VT-d and SMMUv3 trap.
            check(
                !io.smmuv3.as_ref().is_some_and(|s| s.ecmdq),
                "platform.iommu.smmuv3.ecmdq",
                "expected false in a guest: QEMU's SMMUv3 emulates no ECMDQ",
            )?;
            check(
                h.mmio_exit_ns <= 10_000_000,
                "platform.hypervisor.mmio_exit_ns",
                "expected at most 10 ms",
            )?;
        }
        let w = &self.workload;
        let sections = w.nic_rx.is_some() as u32
            + w.nic_tx.is_some() as u32
            + w.rr.is_some() as u32
            + w.nvme.is_some() as u32
            + w.virtio_net.is_some() as u32;
        check(
            sections == 1,
            "workload",
            format!(
                "expected exactly one workload section ([workload.nic_rx], [workload.nic_tx], \
                 [workload.rr], [workload.nvme] or [workload.virtio_net]), found {sections}"
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
            check(
                self.platform.vendor == Vendor::Virtio || host.vendor == self.platform.vendor,
                "platform.hypervisor.host_profile",
                format!(
                    "expected a host with the guest's IOMMU ({}): QEMU's vIOMMU passes a VFIO device to the \
                     host's own",
                    self.platform.vendor.as_str()
                ),
            )?;
            let emulated = self.platform.vendor != Vendor::Virtio && !h.nested;
            // QEMU refuses vfio-pci behind intel-iommu without caching-mode=on: it must see every map.
            let sees_maps = match self.platform.vendor {
                Vendor::Vtd => io.vtd.as_ref().is_some_and(|v| v.caching_mode),
                Vendor::Smmuv3 => io.smmuv3.as_ref().is_some_and(|s| s.caching_mode),
                Vendor::Virtio => true,
            };
            check(
                !(hw_device && emulated && !sees_maps),
                match self.platform.vendor {
                    Vendor::Vtd => "platform.iommu.vtd.caching_mode",
                    _ => "platform.iommu.smmuv3.caching_mode",
                },
                "expected true for a VFIO-assigned device behind an emulated IOMMU: QEMU shadows the \
                 guest's mappings only if the driver invalidates after each map (or set \
                 platform.hypervisor.nested)",
            )?;
            check(
                !(h.nested && self.platform.vendor == Vendor::Virtio),
                "platform.hypervisor.nested",
                "expected false for virtio-iommu: nesting puts an emulated VT-d or SMMUv3's tables in hardware",
            )?;
            check(
                !(h.nested && w.virtio_net.is_some()),
                "platform.hypervisor.nested",
                "expected false with [workload.virtio_net]: QEMU's and vhost's software device cannot use \
                 hardware nested translation",
            )?;
            check(
                !h.vcmdq || (h.nested && self.platform.vendor == Vendor::Smmuv3),
                "platform.hypervisor.vcmdq",
                "expected true only with nested = true on an SMMUv3 guest (a hardware command queue the \
                 guest owns)",
            )?;
        }
        if let Some(vn) = &w.virtio_net {
            check(
                self.platform.hypervisor.is_some(),
                "workload.virtio_net",
                format!(
                    "expected a guest platform (a profile with [hypervisor], e.g. kvm-vtd-guest): \
                     profile {} is bare metal",
                    self.platform.profile
                ),
            )?;
            vn.validate()?;
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
        Ok(())
    }
}

impl VirtioNet {
    fn validate(&self) -> Result<(), (Vec<String>, String)> {
        check(
            self.line_rate_gbps.is_finite()
                && (MIN_LINE_RATE_GBPS..=1e6).contains(&self.line_rate_gbps),
            "workload.virtio_net.line_rate_gbps",
            format!("expected {MIN_LINE_RATE_GBPS}..=1000000 Gbps"),
        )?;
        check(
            self.queue_size.is_power_of_two() && (2..=1024).contains(&self.queue_size),
            "workload.virtio_net.queue_size",
            "expected a power of two from 2 to 1024 (a split virtqueue; QEMU's VIRTQUEUE_MAX_SIZE)",
        )?;
        check(
            (68..=65535).contains(&self.mtu),
            "workload.virtio_net.mtu",
            "expected an MTU of 68..=65535 bytes",
        )?;
        check(
            self.gso_max_bytes >= self.mtu && self.gso_max_bytes <= 65536,
            "workload.virtio_net.gso_max_bytes",
            "expected at least one MTU and at most 65536 (GSO_MAX_SIZE)",
        )?;
        check(
            self.tsq_bytes >= self.gso_max_bytes as u64 && self.tsq_bytes <= 1 << 30,
            "workload.virtio_net.tsq_bytes",
            "expected at least gso_max_bytes and at most 1 GiB",
        )?;
        check(
            self.ack_bytes >= 1,
            "workload.virtio_net.ack_bytes",
            "expected at least 1 byte",
        )?;
        check_rtt(self.rtt_us, "workload.virtio_net.rtt_us")
    }
}

impl Nvme {
    fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        check(
            (1..=1024).contains(&self.drives),
            "workload.nvme.drives",
            "expected 1..=1024 drives",
        )?;
        check(
            self.jobs >= 1 && self.jobs <= cores,
            "workload.nvme.jobs",
            format!("expected 1..={cores} jobs (one CPU each, platform.cpu.cores)"),
        )?;
        check(
            (1..=65536).contains(&self.iodepth),
            "workload.nvme.iodepth",
            "expected 1..=65536 I/Os in flight per job",
        )?;
        check(
            self.bs_kb >= 4 && self.bs_kb.is_multiple_of(4) && self.bs_kb <= 16384,
            "workload.nvme.bs_kb",
            "expected a block size in KiB, a multiple of 4 from 4 to 16384",
        )?;
        check(
            self.latency_us >= 0.0 && self.latency_us.is_finite(),
            "workload.nvme.latency_us",
            "expected a finite latency >= 0",
        )?;
        check(
            (MIN_LINE_RATE_GBPS..=3200.0).contains(&self.drive_gbps),
            "workload.nvme.drive_gbps",
            format!("expected a bandwidth in [{MIN_LINE_RATE_GBPS}, 3200] Gbps"),
        )
    }
}

impl NicRx {
    fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        let nic = self;
        check_nic(
            "workload.nic_rx",
            nic.line_rate_gbps,
            nic.queues,
            cores,
            nic.napi_budget,
            nic.irq_usecs,
            nic.irq_frames,
        )?;
        check(
            nic.channels
                .is_none_or(|c| (nic.queues..=MAX_CHANNELS).contains(&c)),
            "workload.nic_rx.channels",
            format!(
                "expected {}..={MAX_CHANNELS} channels (at least one per queue)",
                nic.queues
            ),
        )?;
        check(
            (1..=65536).contains(&nic.flows),
            "workload.nic_rx.flows",
            "expected 1..=65536 flows",
        )?;
        check(
            (64..=65536).contains(&nic.mtu),
            "workload.nic_rx.mtu",
            "expected an MTU of 64..=65536 bytes",
        )?;
        // Drivers size rings in powers of two: mlx5e_ethtool_set_ringparam() takes order_base_2 of the
        // request, ENA's ena_set_ringparam() rounds down to a power of two.
        check(
            (2..=65536).contains(&nic.ring_size) && nic.ring_size.is_power_of_two(),
            "workload.nic_rx.ring_size",
            "expected a power of two from 2 to 65536 descriptors (drivers size rings in powers of two)",
        )?;
        check(
            (1..=PP_MAX_POOL_SIZE).contains(&nic.pool_size),
            "workload.nic_rx.pool_size",
            format!("expected 1..={PP_MAX_POOL_SIZE} (page_pool's ptr_ring limit)"),
        )?;
        check(
            nic.read_bytes >= 1,
            "workload.nic_rx.read_bytes",
            "expected at least 1 byte",
        )?;
        check(
            nic.driver_page_cache == 0
                || (nic.page_pool
                    && nic.driver_page_cache.is_power_of_two()
                    && (2..=65536).contains(&nic.driver_page_cache)),
            "workload.nic_rx.driver_page_cache",
            "expected 0, or a power of two in 2..=65536 with page_pool = true",
        )?;
        check(
            nic.gro_max_bytes >= nic.mtu,
            "workload.nic_rx.gro_max_bytes",
            "expected at least one MTU",
        )?;
        check(
            nic.rcvbuf_bytes >= nic.mtu as u64,
            "workload.nic_rx.rcvbuf_bytes",
            "expected at least one MTU",
        )?;
        check_rtt(nic.rtt_us, "workload.nic_rx.rtt_us")?;
        check(
            nic.readers == Readers::Queue || cores > nic.queues,
            "workload.nic_rx.readers",
            format!(
                "expected \"queue\", or \"own\" with more cores than queues ({cores} cores, {} queues)",
                nic.queues
            ),
        )?;
        Ok(())
    }
}

impl NicTx {
    fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        let nic = self;
        check_nic(
            "workload.nic_tx",
            nic.line_rate_gbps,
            nic.queues,
            cores,
            nic.napi_budget,
            nic.irq_usecs,
            nic.irq_frames,
        )?;
        check(
            (1..=65536).contains(&nic.flows),
            "workload.nic_tx.flows",
            "expected 1..=65536 flows",
        )?;
        check(
            (128..=65536).contains(&nic.mtu),
            "workload.nic_tx.mtu",
            "expected an MTU of 128..=65536 bytes",
        )?;
        check(
            nic.tso_max_bytes >= nic.mtu && nic.tso_max_bytes <= 512 * 1024,
            "workload.nic_tx.tso_max_bytes",
            "expected at least one MTU and at most 512 KiB",
        )?;
        check(
            nic.tsq_bytes >= 1 && nic.tsq_bytes <= 1 << 30,
            "workload.nic_tx.tsq_bytes",
            "expected 1 byte to 1 GiB",
        )?;
        check(
            nic.frag_kb.is_power_of_two() && (4..=1024).contains(&nic.frag_kb),
            "workload.nic_tx.frag_kb",
            "expected a power of two from 4 to 1024 KiB",
        )?;
        check(
            nic.peer_ack_bytes >= 1,
            "workload.nic_tx.peer_ack_bytes",
            "expected at least 1 byte",
        )?;
        check_rtt(nic.rtt_us, "workload.nic_tx.rtt_us")?;
        check(
            (1..=65536).contains(&nic.rx_ring_size),
            "workload.nic_tx.rx_ring_size",
            "expected 1..=65536 pages",
        )?;
        Ok(())
    }
}

impl Rr {
    fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        check_nic(
            "workload.rr",
            self.line_rate_gbps,
            self.queues,
            cores,
            self.napi_budget,
            self.irq_usecs,
            self.irq_frames,
        )?;
        check(
            (1..=1 << 20).contains(&self.connections),
            "workload.rr.connections",
            "expected 1..=1048576 connections",
        )?;
        check(
            (128..=65536).contains(&self.mtu),
            "workload.rr.mtu",
            "expected an MTU of 128..=65536 bytes",
        )?;
        check(
            self.request_bytes >= 1
                && self.request_bytes as u64 <= crate::net::mss(self.mtu),
            "workload.rr.request_bytes",
            "expected 1 byte up to one segment (the MTU less 52 bytes of headers)",
        )?;
        check(
            (1..=16 << 20).contains(&self.response_bytes),
            "workload.rr.response_bytes",
            "expected 1 byte to 16 MiB",
        )?;
        check(
            self.rate_rps >= 0.0 && self.rate_rps <= 1e9,
            "workload.rr.rate_rps",
            "expected 0 (closed loop) or a rate up to 1e9 requests per second",
        )?;
        check(
            self.service_ns <= 1_000_000_000,
            "workload.rr.service_ns",
            "expected 0..=1e9 ns",
        )?;
        check_rtt(self.rtt_us, "workload.rr.rtt_us")?;
        check(
            (1..=65536).contains(&self.rx_ring_size),
            "workload.rr.rx_ring_size",
            "expected 1..=65536 pages",
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

/// `"6.12"` → (6, 12).
pub fn parse_kernel(v: &str) -> Result<(u32, u32), String> {
    let mut it = v.trim().splitn(3, '.');
    let maj = it.next().and_then(|s| s.parse::<u32>().ok());
    let min = it.next().and_then(|s| {
        s.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u32>()
            .ok()
    });
    match (maj, min) {
        (Some(a), Some(b)) if (KERNEL_OLDEST..=KERNEL_NEWEST).contains(&(a, b)) => Ok((a, b)),
        (Some(a), Some(b)) => Err(format!(
            "kernel {a}.{b}: expected {}.{} to {}.{}, the kernels whose DMA-layer rules the model follows",
            KERNEL_OLDEST.0, KERNEL_OLDEST.1, KERNEL_NEWEST.0, KERNEL_NEWEST.1
        )),
        _ => Err(format!(
            "expected a kernel version like \"6.12\", got \"{v}\""
        )),
    }
}

/// The oldest kernel modelled: 5.15 introduced the DMA-FQ domain type (IOMMU_DOMAIN_DMA_FQ) that the
/// default-domain rules and the flush queue follow.
pub const KERNEL_OLDEST: (u32, u32) = (5, 15);
/// The newest kernel whose changes the model knows (the qi_desc_iotlb IH fix, kernel.rs).
pub const KERNEL_NEWEST: (u32, u32) = (6, 18);

/// Where a scenario comes from.
pub enum Source<'a> {
    Builtin(&'a str),
    File(&'a Path),
    /// TOML text with a display name (used for errors).
    Text {
        name: &'a str,
        text: &'a str,
    },
}

/// One concrete run of a loaded scenario: the `[compare]` values that produced it, and the scenario.
#[derive(Debug, Clone)]
pub struct Variant {
    pub label: String,
    pub overrides: Vec<(String, toml::Value)>,
    pub scenario: Scenario,
}

struct Origins<'a> {
    doc: &'a SourceDoc,
    profile: Option<&'a SourceDoc>,
    overrides: &'a [(String, String)],
}

impl Origins<'_> {
    /// Attribute an error at key `path` to the `--set` flag, scenario line or profile line that wrote it.
    fn error(&self, path: &[String], msg: &str) -> InputError {
        let key = path.join(".");
        for (k, v) in self.overrides.iter().rev() {
            let kp = input::split_key(k).unwrap_or_default();
            let n = kp.len().min(path.len());
            if n > 0 && kp[..n] == path[..n] {
                return InputError::new(format!("--set {k}={v}"), format!("key `{key}`: {msg}"));
            }
        }
        let (loc, full) = self.doc.locate(path);
        if !full && path.first().map(String::as_str) == Some("platform") {
            if let Some(p) = self.profile {
                let (ploc, pfull) = p.locate(&path[1..]);
                if pfull {
                    return InputError::new(ploc, format!("key `{}`: {msg}", path[1..].join(".")));
                }
            }
        }
        let key = if key.is_empty() {
            "(top level)".to_string()
        } else {
            format!("`{key}`")
        };
        InputError::new(loc, format!("key {key}: {msg}"))
    }
}

fn read_named(path: &Path) -> Result<String, InputError> {
    std::fs::read(path)
        .map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".to_string(),
                _ => e.to_string(),
            };
            InputError::new(path.display().to_string(), format!("cannot read: {why}"))
        })
        .and_then(|b| {
            String::from_utf8(b).map_err(|_| {
                InputError::new(path.display().to_string(), "expected UTF-8 TOML text")
            })
        })
}

/// A built-in profile as a platform (the host a guest profile names).
pub fn builtin_platform(name: &str) -> Option<Platform> {
    let (n, text) = BUILTIN_PROFILES.iter().find(|(n, _)| *n == name)?;
    let mut t: toml::Table = toml::from_str(text).ok()?;
    t.insert("profile".into(), toml::Value::String(n.to_string()));
    toml::Value::Table(t).try_into().ok()
}

fn load_profile(name: &str, base: Option<&Path>) -> Result<SourceDoc, InputError> {
    if let Some((n, text)) = BUILTIN_PROFILES.iter().find(|(n, _)| *n == name) {
        return SourceDoc::parse(&format!("profile:{n}"), text);
    }
    let p = PathBuf::from(name);
    let p = match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p,
    };
    if !p.exists() {
        let names: Vec<_> = BUILTIN_PROFILES.iter().map(|(n, _)| *n).collect();
        return Err(InputError::new(
            "platform.profile",
            format!(
                "no built-in profile or file `{name}` (built-in: {})",
                names.join(", ")
            ),
        ));
    }
    SourceDoc::parse(&p.display().to_string(), &read_named(&p)?)
}

/// Flatten `[compare]` into (key path, values) axes. Arrays are leaves; tables nest (`[compare.os] policy = [..]`
/// and `[compare] "os.policy" = [..]` mean the same).
fn compare_axes(
    t: &toml::Table,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Vec<toml::Value>)>,
) -> Result<(), (Vec<String>, String)> {
    for (k, v) in t {
        let mut path = prefix.to_vec();
        path.extend(input::split_key(k).map_err(|m| (prefix.to_vec(), m))?);
        match v {
            // A named axis: `[[compare.NAME]]` tables, each a `label` and the keys it sets.
            toml::Value::Array(a) if !a.is_empty() && a.iter().all(|x| x.is_table()) => {
                let mut labels = std::collections::BTreeSet::new();
                for (i, x) in a.iter().enumerate() {
                    let mut at = vec!["compare".to_string()];
                    at.extend(path.iter().cloned());
                    at.push(i.to_string());
                    let tbl = x.as_table().expect("checked");
                    let label = tbl.get("label").and_then(|l| l.as_str());
                    let Some(label) =
                        label.filter(|l| !l.is_empty() && !l.contains(char::is_whitespace))
                    else {
                        at.push("label".into());
                        return Err((at, "expected a label: one word naming this setting".into()));
                    };
                    if !labels.insert(label.to_string()) {
                        at.push("label".into());
                        return Err((at, format!("label `{label}` is used twice")));
                    }
                    if tbl.len() < 2 {
                        return Err((
                            at,
                            "expected at least one `\"key.path\" = value` besides label".into(),
                        ));
                    }
                    for k in tbl.keys().filter(|k| *k != "label") {
                        input::split_key(k).map_err(|m| (at.clone(), m))?;
                    }
                }
                out.push((path, a.clone()))
            }
            toml::Value::Array(a) if !a.is_empty() => out.push((path, a.clone())),
            toml::Value::Table(sub) => compare_axes(sub, &path, out)?,
            _ => {
                let mut full = vec!["compare".to_string()];
                full.extend(path);
                return Err((
                    full,
                    "expected a non-empty array of values to compare".into(),
                ));
            }
        }
    }
    Ok(())
}

/// A VFIO-assigned device (a hardware workload) on a guest profile translates through the host's IOMMU:
/// take the host profile's IOMMU caches and table format, walk latency and PCIe path (and, nested, its
/// command costs: the hardware executes the guest's commands) into the guest's platform `profile`, before
/// the scenario's own platform keys `own` go over them.
fn with_host(profile: &mut toml::Table, own: &toml::Table, workload: Option<&toml::Value>) {
    let hardware = workload.and_then(|w| w.as_table()).is_some_and(|w| {
        ["nic_rx", "nic_tx", "rr", "nvme"]
            .iter()
            .any(|k| w.contains_key(*k))
    });
    let hyp = |t: &toml::Table, k: &str| t.get("hypervisor").and_then(|h| h.get(k)).cloned();
    let Some(host_name) = hyp(own, "host_profile").or_else(|| hyp(profile, "host_profile")) else {
        return;
    };
    let host = host_name
        .as_str()
        .and_then(|n| BUILTIN_PROFILES.iter().find(|(b, _)| *b == n))
        .and_then(|(_, text)| toml::from_str::<toml::Table>(text).ok());
    let (true, Some(host)) = (hardware, host) else {
        return;
    };
    let nested = hyp(own, "nested")
        .or_else(|| hyp(profile, "nested"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    for section in ["pcie"] {
        if let Some(v) = host.get(section) {
            profile.insert(section.into(), v.clone());
        }
    }
    let mut copy = |path: &[&str]| {
        let p: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let mut cur = Some(&host);
        for seg in &p[..p.len() - 1] {
            cur = cur.and_then(|t| t.get(seg)).and_then(|v| v.as_table());
        }
        if let Some(v) = cur.and_then(|t| t.get(&p[p.len() - 1])) {
            let _ = input::set_path(profile, &p, v.clone());
        }
    };
    copy(&["memory", "walk_read_ns"]);
    for k in [
        "iotlb_entries",
        "iotlb_ways",
        "pwc_entries",
        "pwc_ways",
        "ias_bits",
        "granule_kb",
        "large_pages",
    ] {
        copy(&["iommu", k]);
    }
    if nested {
        for k in ["vtd", "smmuv3"] {
            if let Some(v) = host.get("iommu").and_then(|i| i.get(k)) {
                let _ = input::set_path(profile, &["iommu".into(), k.into()], v.clone());
            }
        }
    }
}

/// The part of `over` whose keys `base` has (tables recursively; `profile` always).
fn shared_keys(over: &toml::Table, base: &toml::Table) -> toml::Table {
    let mut out = toml::Table::new();
    for (k, v) in over {
        match (v, base.get(k)) {
            (toml::Value::Table(o), Some(toml::Value::Table(b))) => {
                out.insert(k.clone(), toml::Value::Table(shared_keys(o, b)));
            }
            (v, Some(_)) => {
                out.insert(k.clone(), v.clone());
            }
            (v, None) if k == "profile" => {
                out.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
    out
}

fn deserialize(table: toml::Table) -> Result<Scenario, (Vec<String>, String)> {
    check_provenance(&table)?;
    let de = toml::Value::Table(table);
    let sc: Scenario = serde_path_to_error::deserialize(de).map_err(|e| {
        let path: Vec<String> = e
            .path()
            .iter()
            .filter_map(|s| match s {
                serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                _ => None,
            })
            .collect();
        (path, e.into_inner().message().to_string())
    })?;
    sc.validate()?;
    Ok(sc)
}

fn value_label(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The text of the `--set` flag that wrote key `path` when TOML read it as a number or boolean but the key
/// expects a string (`msg` is the deserializer's complaint), so it can be taken as written. The last flag for
/// a key is the value the key holds (profile keys too: overrides are merged over the profile).
fn set_as_written(path: &[String], msg: &str, overrides: &[(String, String)]) -> Option<String> {
    // serde's complaint for a plain string key, and toml's for a named choice (an enum).
    if !(msg.contains("expected a string") || msg.contains("expected string only")) {
        return None;
    }
    let (_, raw) = overrides
        .iter()
        .rev()
        .find(|(k, _)| input::split_key(k).is_ok_and(|kp| kp == path))?;
    matches!(
        input::parse_value(raw),
        toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_)
    )
    .then(|| raw.trim().to_string())
}

/// Load a scenario, apply `--set key=value` overrides, merge its platform profile and expand `[compare]`.
pub fn load(
    source: Source<'_>,
    overrides: &[(String, String)],
) -> Result<Vec<Variant>, InputError> {
    let (name, text, base) = match source {
        Source::Builtin(n) => {
            let Some((_, t)) = BUILTIN_SCENARIOS.iter().find(|(b, _)| *b == n) else {
                let names: Vec<_> = BUILTIN_SCENARIOS.iter().map(|(n, _)| *n).collect();
                return Err(InputError::new(
                    "scenario",
                    format!(
                        "no built-in scenario `{n}` (built-in: {})",
                        names.join(", ")
                    ),
                ));
            };
            (format!("builtin:{n}"), t.to_string(), None)
        }
        Source::File(p) => (
            p.display().to_string(),
            read_named(p)?,
            p.parent().map(Path::to_path_buf),
        ),
        Source::Text { name, text } => (name.to_string(), text.to_string(), None),
    };
    let doc = SourceDoc::parse(&name, &text)?;
    let mut table = doc.table()?;

    for (k, raw) in overrides {
        let path =
            input::split_key(k).map_err(|m| InputError::new(format!("--set {k}={raw}"), m))?;
        input::set_path(&mut table, &path, input::parse_value(raw))
            .map_err(|m| InputError::new(format!("--set {k}={raw}"), m))?;
        forget_provenance(&mut table, &path);
        // Pinning a key on the command line removes it from the comparison.
        if path.first().map(String::as_str) != Some("compare") {
            if let Some(toml::Value::Table(c)) = table.get_mut("compare") {
                c.remove(&path.join("."));
                let quoted = path
                    .iter()
                    .map(|s| {
                        if s.contains('.') {
                            format!("\"{s}\"")
                        } else {
                            s.clone()
                        }
                    })
                    .collect::<Vec<_>>();
                input::remove_path(c, &quoted);
            }
        }
    }

    let mut origins = Origins {
        doc: &doc,
        profile: None,
        overrides,
    };
    let profile_doc;
    // The scenario's own [platform] keys (with --set's), to merge over another profile a variant names.
    let mut own_platform = toml::Table::new();
    match table
        .get("platform")
        .and_then(|p| p.as_table())
        .map(|p| p.get("profile"))
    {
        Some(Some(toml::Value::String(pname))) => {
            let pname = pname.clone();
            profile_doc = load_profile(&pname, base.as_deref()).map_err(|e| {
                if e.origin == "platform.profile" {
                    origins.error(&["platform".into(), "profile".into()], &e.msg)
                } else {
                    e
                }
            })?;
            let mut merged = profile_doc.table()?;
            if let Some(toml::Value::Table(p)) = table.remove("platform") {
                own_platform = p.clone();
                with_host(&mut merged, &p, table.get("workload"));
                input::merge(&mut merged, p);
            }
            table.insert("platform".into(), toml::Value::Table(merged));
            origins.profile = Some(&profile_doc);
        }
        Some(Some(_)) => {
            return Err(origins.error(
                &["platform".into(), "profile".into()],
                "expected a profile name or path (a string)",
            ))
        }
        _ => {
            return Err(origins.error(
                &["platform".into()],
                "expected `profile = \"NAME\"` in [platform] (built-in: vtd-server)",
            ))
        }
    }

    let mut axes = Vec::new();
    match table.remove("compare") {
        Some(toml::Value::Table(c)) => {
            compare_axes(&c, &[], &mut axes).map_err(|(p, m)| origins.error(&p, &m))?
        }
        Some(_) => {
            return Err(origins.error(
                &["compare".into()],
                "expected a table of `key.path = [values…]`",
            ))
        }
        None => {}
    }

    let base_sc = loop {
        match deserialize(table.clone()) {
            Ok(sc) => break sc,
            Err((p, m)) => match set_as_written(&p, &m, overrides) {
                // `--set os.kernel=6.10`: TOML reads a number, the key wants text; take it as written.
                Some(raw) => input::set_path(&mut table, &p, toml::Value::String(raw))
                    .map_err(|e| origins.error(&p, &e))?,
                None => return Err(origins.error(&p, &m)),
            },
        }
    };
    if axes.is_empty() {
        return Ok(vec![Variant {
            label: base_sc.os.policy.as_str().into(),
            overrides: vec![],
            scenario: base_sc,
        }]);
    }
    // Cartesian product of the axes, in the order written.
    let mut combos: Vec<Vec<(usize, usize)>> = vec![vec![]];
    for (ai, (_, vals)) in axes.iter().enumerate() {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                (0..vals.len()).map(move |vi| {
                    let mut c = c.clone();
                    c.push((ai, vi));
                    c
                })
            })
            .collect();
    }
    if combos.len() > 4096 {
        return Err(origins.error(
            &["compare".into()],
            &format!("expected at most 4096 combinations, got {}", combos.len()),
        ));
    }
    let mut out = Vec::with_capacity(combos.len());
    for combo in combos {
        let mut t = table.clone();
        let mut ov = Vec::new();
        // Label parts, in axis order: a named setting's label, or (key, value).
        let mut parts: Vec<Result<String, (String, toml::Value)>> = Vec::new();
        for (ai, vi) in combo {
            let (path, vals) = &axes[ai];
            let cp = || {
                let mut cp = vec!["compare".to_string()];
                cp.extend(path.iter().cloned());
                cp
            };
            if let toml::Value::Table(named) = &vals[vi] {
                for (k, v) in named.iter().filter(|(k, _)| *k != "label") {
                    let kp = input::split_key(k).map_err(|m| origins.error(&cp(), &m))?;
                    // A key pinned with --set keeps the user's value.
                    if overrides
                        .iter()
                        .any(|(o, _)| input::split_key(o).is_ok_and(|op| op == kp))
                    {
                        continue;
                    }
                    input::set_path(&mut t, &kp, v.clone())
                        .map_err(|m| origins.error(&cp(), &m))?;
                    forget_provenance(&mut t, &kp);
                    ov.push((k.clone(), v.clone()));
                }
                parts.push(Ok(named["label"].as_str().unwrap_or_default().to_string()));
                continue;
            }
            input::set_path(&mut t, path, vals[vi].clone())
                .map_err(|m| origins.error(&cp(), &m))?;
            forget_provenance(&mut t, path);
            ov.push((path.join("."), vals[vi].clone()));
            parts.push(Err((path.join("."), vals[vi].clone())));
        }
        // A variant naming another profile: that profile, under the scenario's own platform keys and the
        // variant's.
        let profile_of = |t: &toml::Table| {
            t.get("platform")
                .and_then(|p| p.get("profile"))
                .and_then(|p| p.as_str())
                .map(str::to_string)
        };
        if let Some(pname) = profile_of(&t).filter(|n| Some(n) != profile_of(&table).as_ref()) {
            let doc = load_profile(&pname, base.as_deref()).map_err(|e| {
                InputError::new(
                    doc.locate(&["compare".into()]).0,
                    format!("platform.profile {pname}: {}", e.msg),
                )
            })?;
            let mut merged = doc.table()?;
            // The scenario's platform keys the named profile has; one it lacks configures another vendor
            // (an [iommu.smmuv3] key beside a virtio-iommu variant) and is left out of that variant.
            with_host(&mut merged, &own_platform, t.get("workload"));
            let shared = shared_keys(&own_platform, &merged);
            input::merge(&mut merged, shared);
            let mut fresh = t.clone();
            fresh.insert("platform".into(), toml::Value::Table(merged));
            for (k, v) in ov.iter().filter(|(k, _)| k.starts_with("platform.")) {
                let kp = input::split_key(k).map_err(|m| InputError::new("compare", m))?;
                input::set_path(&mut fresh, &kp, v.clone())
                    .map_err(|m| InputError::new("compare", m))?;
            }
            // What [provenance] said of keys the variant's profile lacks goes with them.
            let gone: Vec<Vec<String>> = fresh
                .get("provenance")
                .and_then(|p| p.as_table())
                .map(|p| {
                    p.keys()
                        .filter_map(|k| input::split_key(k).ok())
                        .filter(|kp| kp[0] == "platform" && !input::has_path(&fresh, kp))
                        .collect()
                })
                .unwrap_or_default();
            for kp in gone {
                forget_provenance(&mut fresh, &kp);
            }
            t = fresh;
        }
        // Named settings lead the label ("strict-cm rx vhost=on").
        parts.sort_by_key(|p| p.is_err());
        let sc = deserialize(t).map_err(|(p, m)| {
            let axis = ov.iter().find(|(k, _)| p.join(".").starts_with(k.as_str()));
            match axis {
                Some((k, v)) => {
                    let mut cp = vec!["compare".to_string()];
                    cp.extend(input::split_key(k).unwrap_or_default());
                    let (qloc, qfull) = doc.locate(&["compare".into(), k.clone()]);
                    let loc = if qfull { qloc } else { doc.locate(&cp).0 };
                    InputError::new(loc, format!("compare `{k}` value {v}: {m}"))
                }
                None => origins.error(&p, &m),
            }
        })?;
        // With a named axis: its labels, names as they are, flags as key=on|off, numbers as key=value
        // ("strict-cm rx vhost=on"). Otherwise one axis of names (policies, kernels) reads as its value; a
        // flag or a number needs its key.
        let label = if parts.iter().any(|p| p.is_ok()) {
            parts
                .iter()
                .map(|p| match p {
                    Ok(l) => l.clone(),
                    Err((_, toml::Value::String(v))) => v.clone(),
                    Err((k, v)) => {
                        let k = k.rsplit('.').next().unwrap_or(k);
                        match v.as_bool() {
                            Some(b) => format!("{k}={}", if b { "on" } else { "off" }),
                            None => format!("{k}={}", value_label(v)),
                        }
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        } else if ov.len() == 1 && ov[0].1.is_str() {
            value_label(&ov[0].1)
        } else {
            ov.iter()
                .map(|(k, v)| format!("{}={}", k.rsplit('.').next().unwrap_or(k), value_label(v)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        out.push(Variant {
            label,
            overrides: ov,
            scenario: sc,
        });
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Hypervisor costs for unit tests across the crate.
    pub(crate) fn hypervisor() -> HypervisorProfile {
        HypervisorProfile {
            mmio_exit_ns: 5000,
            kick_exit_ns: 1000,
            irq_inject_ns: 2000,
            qemu_packet_ns: 2000,
            vhost_packet_ns: 1000,
            qemu_translate_ns: 100,
            vhost_iotlb_lookup_ns: 100,
            vhost_iotlb_miss_ns: 10000,
            vhost_invalidate_ns: 1000,
            vhost_iotlb_entries: 2048,
            host_profile: "vtd-server".into(),
            vfio_map_ns: 2000,
            vfio_map_page_ns: 300,
            vfio_unmap_ns: 4000,
            vfio_unmap_page_ns: 100,
            nested: false,
            nested_inv_ns: 3000,
            nested_s2_reads: 1,
            vcmdq: false,
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
                toml::Value::Table(inner) if key != "sources" => setting_keys(inner, &key, out),
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
            assert!(keys.len() > 20, "{name}: {keys:?}");
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
            let arch = if name.contains("smmuv3") {
                "arm64"
            } else {
                "x86_64"
            };
            let mut sc = MIN
                .replace("vtd-server", name)
                .replace("[os]\n", &format!("[os]\narch = \"{arch}\"\n"));
            if name.starts_with("kvm-") {
                // A guest with an emulated IOMMU runs a virtio device.
                let at = sc.find("[workload.nic_rx]").unwrap();
                sc.truncate(at);
                sc.push_str(GUEST_NET);
            }
            let v = text(&sc).unwrap();
            assert_eq!(v[0].scenario.platform.profile, *name);
            // ... and simulates it: traffic flows.
            let r = crate::run::run_variant(&v[0]);
            assert!(
                r.throughput_gbps > 1.0,
                "profile {name}: {} Gbps",
                r.throughput_gbps
            );
            assert!(r.sim_seconds > 0.0, "profile {name}");
        }
    }
}
