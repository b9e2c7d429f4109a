//! `[platform]`: the platform profile a scenario names (built-in or a file) and the keys it may override:
//! the IOMMU, PCIe, memory, CPU costs and, for a guest, the hypervisor.

use super::amdvi::AmdViProfile;
use super::riscv::RiscvProfile;
use super::smmuv3::Smmuv3Profile;
use super::virtio::VirtioProfile;
use super::vtd::VtdProfile;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Vendor {
    /// Intel VT-d: second-level page table, queued invalidation (PSI/DSI/global + wait descriptor).
    Vtd,
    /// Arm SMMUv3: LPAE page table, command queue (TLBI by VA or range, by ASID/VMID, CMD_SYNC).
    Smmuv3,
    /// virtio-iommu: MAP/UNMAP requests on a virtqueue to the host (a paravirtual IOMMU in a guest).
    Virtio,
    /// AMD-Vi: v1 or v2 page table, command buffer (INVALIDATE_IOMMU_PAGES, COMPLETION_WAIT).
    Amdvi,
    /// The RISC-V IOMMU: Sv39/48/57 table, command queue (IOTINVAL.VMA, IOFENCE.C).
    Riscv,
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
    /// The host's own IOMMU is one iommulab does not model (why): the profile serves as the host of a guest's
    /// emulated devices only, and its `[iommu]` keys go unused (no bare-metal run, no VFIO device on it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmodelled_iommu: Option<String>,
    /// A host: what its KVM, QEMU and vhost cost a guest (a guest platform holds its host's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvm: Option<KvmProfile>,
    /// Where each number comes from: `"section.key" = "source"`.
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
    /// How far each constant may be from its value, and why (`hw::ranges`): what a ranged run samples. A
    /// profile's own: a scenario cannot set it, and a key a scenario sets loses its range (docs/ranges.md).
    #[serde(default)]
    pub ranges: BTreeMap<String, super::ranges::ConstRange>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IommuProfile {
    /// IOTLB entries and associativity (VT-d and SMMUv3; virtio-iommu keeps none: absent there).
    #[serde(default)]
    pub iotlb_entries: u32,
    /// IOTLB ways (entries / ways sets).
    #[serde(default)]
    pub iotlb_ways: u32,
    /// Entries of each paging-structure (walk) cache, top level first: one per non-leaf level; LRU (VT-d
    /// and SMMUv3; virtio-iommu walks no table: absent there).
    #[serde(default)]
    pub pwc_entries: Vec<u32>,
    /// Associativity of the walk caches (0 = fully associative).
    #[serde(default)]
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
    /// AMD-Vi command buffer (required when `vendor = "amdvi"`).
    #[serde(default)]
    pub amdvi: Option<AmdViProfile>,
    /// RISC-V IOMMU command queue (required when `vendor = "riscv"`).
    #[serde(default)]
    pub riscv: Option<RiscvProfile>,
}

impl IommuProfile {
    /// Entries of the last walk cache (the one holding level-2 entries: F&S's PTcache-L3).
    pub fn last_walk_cache_entries(&self) -> u64 {
        self.pwc_entries.last().map_or(0, |&n| n as u64)
    }
}

/// The hypervisor a guest platform runs under (KVM with QEMU as the VMM): which host, which QEMU, how a
/// VFIO device is translated. What the host's KVM, QEMU and vhost cost is the host's (`[kvm]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HypervisorProfile {
    /// The bare-metal profile of the host the guest runs on (built-in): its IOMMU hardware translates a
    /// VFIO-assigned device's DMA, through shadow mappings or, with `nested`, two stages.
    pub host_profile: String,
    /// Nested translation (a VFIO device): the guest's IOMMU tables are stage 1 in the host's hardware over
    /// the host's stage 2; no shadowing, but a two-dimensional walk on a miss.
    #[serde(default)]
    pub nested: bool,
    /// With `nested`: page-table reads of the stage-2 translation each stage-1 access needs after the
    /// stage-2 caches (a 4-level by 4-level walk needs up to 24 reads in all with nothing cached).
    pub nested_s2_reads: u32,
    /// With `nested` on SMMUv3: the guest's command queue is a hardware one (NVIDIA's CMDQV, tegra241-cmdqv.c)
    /// and its invalidations do not trap.
    #[serde(default)]
    pub vcmdq: bool,
    /// The QEMU that emulates the IOMMU and the virtio devices, "MAJOR.MINOR" (what the model changes
    /// with it: docs/virtualization.md).
    #[serde(default = "default_qemu")]
    pub qemu: String,
}

/// What a host's KVM, QEMU and vhost cost a guest (a bare-metal profile's `[kvm]`; a guest takes its host's,
/// and its own `[kvm]` keys go over them).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KvmProfile {
    /// Round trip of an MMIO write the VMM handles in user space: VM exit, KVM's return to the VMM,
    /// dispatch to the device's handler and back, re-entry (without the handler's own work).
    pub mmio_exit_ns: u64,
    /// Round trip of a virtqueue notification KVM completes in the kernel (ioeventfd): exit, eventfd
    /// signal, re-entry.
    pub kick_exit_ns: u64,
    /// From the device's interrupt (irqfd) to the guest vCPU running its handler.
    pub irq_inject_ns: u64,
    /// The host posts a device's interrupt to a running vCPU without an exit (x86's APICv posted
    /// interrupts: vmx_deliver_posted_interrupt). Without them (arm64's vgic for an irqfd) KVM kicks the
    /// vCPU out to load it: an in-kernel exit, priced as `kick_exit_ns`.
    #[serde(default)]
    pub posted_interrupts: bool,
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
    /// vhost keeps the translations of each virtqueue's rings (vhost_vq_meta_prefetch: `vq->meta_iotlb`,
    /// looked up in O(1) by vhost_get_avail/used helpers); without it every ring access is a device-IOTLB
    /// lookup like a buffer's.
    #[serde(default = "default_true")]
    pub vhost_meta_cache: bool,
    /// A DPDK vhost-user backend's work per packet it enqueues to or dequeues from a guest, besides the
    /// buffer's translation and copy (rte_vhost_enqueue_burst, rte_vhost_dequeue_burst: the descriptor,
    /// the used ring, the mbuf).
    #[serde(default = "default_vhost_user_packet_ns")]
    pub vhost_user_packet_ns: u64,
    /// The vhost-user backend's device-IOTLB lookup on a hit (vhost_user_iotlb_cache_find), besides its
    /// walk of the sorted entry list.
    #[serde(default = "default_vhost_user_iotlb_lookup_ns")]
    pub vhost_user_iotlb_lookup_ns: u64,
    /// Each IOTLB entry vhost_user_iotlb_cache_find steps over before the one it wants (a linked list kept
    /// in IOVA order, lib/vhost/iotlb.c), the list longer than the L1 data cache holds.
    #[serde(default = "default_vhost_user_iotlb_entry_ns")]
    pub vhost_user_iotlb_entry_ns: u64,
    /// The same step with the list in the L1 data cache.
    #[serde(default = "default_vhost_user_iotlb_entry_l1_ns")]
    pub vhost_user_iotlb_entry_l1_ns: f64,
    /// VFIO_IOMMU_MAP_DMA: the ioctl, and per 4 KiB page the pin (pin_user_pages) and the host's iommu_map.
    pub vfio_map_ns: u64,
    /// VFIO_IOMMU_MAP_DMA per 4 KiB page (pin and host map).
    pub vfio_map_page_ns: u64,
    /// VFIO_IOMMU_UNMAP_DMA: the ioctl with the host IOMMU's invalidation and wait, and per page the unpin.
    pub vfio_unmap_ns: u64,
    /// VFIO_IOMMU_UNMAP_DMA per 4 KiB page (unpin).
    pub vfio_unmap_page_ns: u64,
    /// With `nested`: the VMM forwarding one trapped invalidation batch to the host (iommufd
    /// IOMMU_HWPT_INVALIDATE, the host driver's commands and their wait).
    pub nested_inv_ns: u64,
    /// QEMU's scan of one entry of its IOTLB hash when an invalidation walks it (VT-d's
    /// vtd_iotlb_page_invalidate and domain invalidation: g_hash_table_foreach_remove with its callback).
    #[serde(default = "default_iotlb_scan_ns")]
    pub qemu_iotlb_scan_ns: u64,
    /// A confidential guest converting one 4 KiB page of a coherent buffer from private to shared
    /// (set_memory_decrypted: the page-state change through the hypervisor or firmware, the page-table
    /// update and TLB flush).
    #[serde(default = "default_coco_share_page_ns")]
    pub coco_share_page_ns: u64,
    /// A confidential guest's bounce copy between private and shared memory, relative to a plain copy
    /// (`cpu.copy_ns_per_byte`): what memory encryption adds to it.
    #[serde(default = "default_coco_copy_factor")]
    pub coco_copy_factor: f64,
}

/// The QEMU of the testbed (Debian 12's 7.2), whose traces the emulator's counts are held to.
pub const DEFAULT_QEMU: &str = "7.2";

/// The estimate the built-in host profiles give (their [sources]).
fn default_iotlb_scan_ns() -> u64 {
    10
}
fn default_coco_share_page_ns() -> u64 {
    vtd_server::COCO_SHARE_PAGE_NS
}
fn default_coco_copy_factor() -> f64 {
    vtd_server::COCO_COPY_FACTOR
}
fn default_swiotlb_op_ns() -> u64 {
    vtd_server::SWIOTLB_OP_NS
}
fn default_swiotlb_slot_ns() -> u64 {
    vtd_server::SWIOTLB_SLOT_NS
}

/// The built-in vtd-server's values of keys a host profile written before them may leave out (its
/// [sources] say where each comes from).
mod vtd_server {
    pub const COCO_SHARE_PAGE_NS: u64 = 4000;
    pub const COCO_COPY_FACTOR: f64 = 1.0;
    pub const SWIOTLB_OP_NS: u64 = 100;
    pub const SWIOTLB_SLOT_NS: u64 = 2;
}

/// vtd-server's (a host profile written before these keys takes them): see its [sources].
fn default_vhost_user_packet_ns() -> u64 {
    50
}
fn default_vhost_user_iotlb_lookup_ns() -> u64 {
    10
}
fn default_vhost_user_iotlb_entry_ns() -> u64 {
    7
}
fn default_vhost_user_iotlb_entry_l1_ns() -> f64 {
    1.5
}
fn default_pmd_packet_ns() -> u64 {
    40
}

fn default_qemu() -> String {
    DEFAULT_QEMU.into()
}

impl Platform {
    /// A guest's host costs (validated: a guest platform has its host's `[kvm]`).
    pub fn host_kvm(&self) -> &KvmProfile {
        self.kvm
            .as_ref()
            .expect("validated: a guest platform has its host's [kvm]")
    }
}

impl HypervisorProfile {
    /// `qemu` as (major, minor), if it reads as one.
    pub fn qemu_version(&self) -> Option<(u32, u32)> {
        let (a, b) = self.qemu.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryProfile {
    /// One page-walk memory read by the IOMMU (VT-d and SMMUv3; virtio-iommu walks no table: absent there).
    #[serde(default)]
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
    /// One walk down the I/O page table to a leaf table (io-pgtable's __arm_lpae_map/__arm_lpae_unmap,
    /// VT-d's pfn_to_dma_pte): once per leaf table a map or unmap spans (map_pages/unmap_pages), and once
    /// more for the iova_to_phys lookup that begins an unmap.
    pub pgtable_walk_ns: u64,
    /// iommu_map()'s own cost per call beyond its walks and PTEs: __iommu_map's iommu_pgsize() split and the
    /// driver's map_pages entry (drivers/iommu/iommu.c). 0 where an estimate folds it into dma_iommu_op_ns.
    #[serde(default)]
    pub pgtable_map_ns: u64,
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
    /// A DPDK poll-mode driver forwarding one packet: received (virtio_recv_pkts and its refill from the
    /// mempool cache), its MAC addresses swapped, sent (virtio_xmit_pkts and its cleanup).
    #[serde(default = "default_pmd_packet_ns")]
    pub pmd_packet_ns: u64,
    /// Completing one block I/O: the interrupt, nvme_irq()/blk_mq_complete_request() and the application's
    /// reap, without the DMA unmapping.
    pub nvme_complete_ns: u64,
    /// memset() of a buffer, per byte (the DMA map benchmark fills its buffer before each map).
    pub memset_ns_per_byte: f64,
    /// swiotlb_map() and swiotlb_tbl_map_single() without the slot search and the copy (the checks, the
    /// area lock, the bookkeeping); as much again for the release (kernel/dma/swiotlb.c).
    #[serde(default = "default_swiotlb_op_ns")]
    pub swiotlb_op_ns: u64,
    /// One swiotlb slot looked at by the search or written by the allocation or the release.
    #[serde(default = "default_swiotlb_slot_ns")]
    pub swiotlb_slot_ns: u64,
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

fn default_true() -> bool {
    true
}
