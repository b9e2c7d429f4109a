//! What changed between kernel versions in what reaches the IOMMU, and in the stack paths that decide it. Each
//! predicate names the change.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The kernel's architecture (`os.arch`): an IOMMU driver serves the ones it is built for.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    X86_64,
    Arm64,
    S390,
    Riscv64,
}

impl Arch {
    pub const ALL: [Arch; 4] = [Arch::X86_64, Arch::Arm64, Arch::S390, Arch::Riscv64];
    /// The name or one of the kernel's, Debian's or GNU's other names for it.
    pub fn parse(s: &str) -> Option<Arch> {
        match s {
            "x86_64" | "x86" | "amd64" => Some(Arch::X86_64),
            "arm64" | "aarch64" => Some(Arch::Arm64),
            "s390" | "s390x" => Some(Arch::S390),
            "riscv64" | "riscv" => Some(Arch::Riscv64),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Arm64 => "arm64",
            Arch::S390 => "s390",
            Arch::Riscv64 => "riscv64",
        }
    }
    /// CONFIG_IOMMU_DMA, the DMA API over IOMMU domains: drivers/iommu/Kconfig `def_bool ARM64 || X86 ||
    /// S390` (through 7.3). Without it iommu_get_default_domain_type() forces identity domains.
    pub fn iommu_dma(self) -> bool {
        self != Arch::Riscv64
    }
}

/// A kernel version, MAJOR.MINOR (upstream semantics; stable backports are not tracked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion(pub u32, pub u32);

impl KernelVersion {
    /// intel/cache.c (6.10): per-domain cache tags, flushed under `dmar_domain->cache_lock`, held across
    /// `qi_submit_sync()` and its wait. Before, `iommu_flush_iotlb_psi()` ran under no domain lock.
    pub fn vtd_cache_tags(self) -> bool {
        self >= KernelVersion(6, 10)
    }

    /// "iommu/vt-d: Add qi_batch for dmar_domain" (6.12): IOTLB and device-TLB descriptors of one flush go in
    /// one submission (up to 16) with one wait descriptor. Before, each had its own `qi_submit_sync()`.
    pub fn vtd_qi_batch(self) -> bool {
        self >= KernelVersion(6, 12)
    }

    /// "iommu/vt-d: Use iova over first level" (Lu Baolu, posted 2019-12, 5.6): with scalable mode and
    /// ECAP.FLTS, DMA domains use first-stage tables (first_level_by_default), whose maps need no
    /// invalidation under caching mode (__mapping_notify_one, cache_tag_flush_range_np from 6.10). Before,
    /// DMA domains were always second-stage.
    pub fn vtd_first_stage_dma(self) -> bool {
        self >= KernelVersion(5, 6)
    }

    /// 6.10 to 6.16: `intel_iommu_iotlb_sync_map()` walks the domain's cache tags under its cache_lock on every
    /// map even when nothing needs flushing; commit 12724ce3fe1a ("iommu/vt-d: Optimize iotlb_sync_map for
    /// non-caching/non-RWBF modes", 6.17, also in later 6.12.y stable) skips it.
    pub fn vtd_sync_map_walk(self) -> bool {
        self.vtd_cache_tags() && self < KernelVersion(6, 17)
    }

    /// "iommu/vt-d: Fix unused invalidation hint in qi_desc_iotlb" (posted October 2025, during 6.18; also in
    /// later 6.12.y stable): until then the queued-invalidation descriptor was built with IH = 0 whatever the
    /// caller asked (`int ih = 0` in qi_flush_iotlb() / qi_desc_iotlb()), so every page-selective invalidation
    /// also dropped the paging-structure caches. The release that first carries it is taken as 6.18.
    pub fn vtd_psi_ih(self) -> bool {
        self >= KernelVersion(6, 18)
    }

    /// "iommu/iova: Make the rcache depot scale better" (6.7): the depot became a list under each size class's
    /// `rcache->lock`, and `struct iova_rcache` shrank so that `cpu_rcaches` (read by every rcache get and
    /// insert) sits in the lock's cache line. Before, a 32-entry depot array lay between them. Read from the
    /// BTF of Debian's 6.1 and 6.12 builds (tools/struct_layouts.py).
    pub fn iova_depot_shares_line(self) -> bool {
        self >= KernelVersion(6, 7)
    }

    /// The same change: the depot is a list trimmed by a delayed work (iova_depot_work_func, one magazine per
    /// IOVA_DEPOT_DELAY while it holds more than one per CPU). Before 6.7 it was an array of MAX_GLOBAL_MAGS
    /// magazines with no worker: __iova_rcache_insert() freed a full CPU magazine's IOVAs back to the tree
    /// itself when the depot was full (`mag_to_free`).
    pub fn iova_depot_list(self) -> bool {
        self >= KernelVersion(6, 7)
    }

    /// "tcp: get rid of sysctl_tcp_adv_win_scale" (commit dfa2f0483360, 6.6): tcp_win_from_space() scales
    /// buffer space by the payload/truesize ratio measured on the flow's skbs (tp->scaling_ratio), not by
    /// tcp_adv_win_scale's fixed half.
    pub fn tcp_scaling_ratio(self) -> bool {
        self >= KernelVersion(6, 6)
    }

    /// virtio-net's `napi_tx` module parameter defaults on from "virtio_net: enable napi_tx by default"
    /// (commit 31c03aef9bc2, applied to net-next 2019-06-14, so 5.3). Before, the parameter ("virtio-net:
    /// transmit napi", 4.12) defaulted off: start_xmit() orphans each skb once it is on the ring
    /// (`if (!use_napi) skb_orphan(skb)`), so the socket's memory comes back at once and neither TCP Small
    /// Queues nor autocorking ever holds a write back; TX interrupts stay off (skb_xmit_done() disables the
    /// callback; start_xmit() arms virtqueue_enable_cb_delayed() only when the ring is nearly full) and
    /// used skbs are freed by the next start_xmit() (free_old_xmit_skbs).
    pub fn virtio_net_napi_tx(self) -> bool {
        self >= KernelVersion(5, 3)
    }

    /// virtio-net's premapped RX buffers, 6.6 to 6.10: "virtio_net: merge dma operations when filling
    /// mergeable buffers" (commit 295525e29a5b, 6.6) maps each page_frag chunk once (virtnet_rq_alloc, on its
    /// first buffer) and carves the mergeable buffers from that mapping; the chunk is unmapped when its last
    /// buffer is used and a newer chunk has been taken (virtnet_rq_unmap, `dma->ref`). Big-packets buffers
    /// stay mapped one by one (virtnet_rq_set_premapped: "disable for big mode"). "virtio_net: disable
    /// premapped mode by default" (commit 111fc9f517cb, 6.11-rc7) turned it off; 6.12's source never sets
    /// `rq->do_dma`. Later kernels are not checked.
    pub fn virtio_net_rx_premapped(self) -> bool {
        self >= KernelVersion(6, 6) && self < KernelVersion(6, 11)
    }

    /// "iommu/arm-smmu-v3: Reduce contention during command-queue insertion" (5.4): commands go in as batches
    /// (arm_smmu_cmdq_issue_cmdlist), lock-free, one PROD write per batch. Before, arm_smmu_cmdq_issue_cmd()
    /// inserted each command under `cmdq.lock` and wrote PROD for it (queue_inc_prod), and a CMD_SYNC
    /// without MSI was polled with the lock held (__arm_smmu_cmdq_issue_sync).
    pub fn smmuv3_cmdq_batched(self) -> bool {
        self >= KernelVersion(5, 4)
    }

    /// "iommu/virtio: Add virtio-iommu driver" (5.3): the first kernel with a virtio-iommu driver.
    pub fn virtio_iommu(self) -> bool {
        self >= KernelVersion(5, 3)
    }

    /// "ACPI: Add driver for the VIOT table" (5.14): before it an x86 guest finds no virtio-iommu (x86 has
    /// no device tree to describe it).
    pub fn virtio_iommu_acpi(self) -> bool {
        self >= KernelVersion(5, 14)
    }

    /// "iommu/virtio: Add ops->flush_iotlb_all and enable deferred flush" (6.8).
    pub fn virtio_deferred_flush(self) -> bool {
        self >= KernelVersion(6, 8)
    }

    /// AMD-Vi, "iommu/amd: Page-specific invalidations for more than one page" (5.13): a multi-page flush
    /// is one INVALIDATE_IOMMU_PAGES over the aligned block around it. Before, amd_iommu_iotlb_sync() flushed
    /// the whole domain.
    pub fn amd_page_selective(self) -> bool {
        self >= KernelVersion(5, 13)
    }

    /// AMD-Vi, N. Amit's "iommu/amd: Enable page-selective flushes" series (5.15): "Do not use flush-queue
    /// when NpCache is on" (an IOMMU with NpCache makes every DMA domain strict: "Using strict mode due to
    /// virtualization") and "Use only natural aligned flushes in a VM" (its flushes split into naturally
    /// aligned ranges).
    pub fn amd_np_cache_strict(self) -> bool {
        self >= KernelVersion(5, 15)
    }

    /// AMD-Vi, "iommu/amd: Enable PCI features based on attached domain capability" (6.9, inferred from the
    /// SVA series it came with): ATS only for a domain that could do SVA (v2 or identity), so a v1 DMA domain's
    /// device neither caches translations nor gets INVALIDATE_IOTLB_PAGES.
    pub fn amd_ats_sva_domains_only(self) -> bool {
        self >= KernelVersion(6, 9)
    }

    /// AMD-Vi, "iommu/amd: move wait_on_sem() out of spinlock" (d2a0cac10597; in the 6.19 stable review
    /// series of 2026-02, so 6.19, inferred): the CPU polls its COMPLETION_WAIT without iommu->lock. Before,
    /// every other CPU's command waited behind the poll.
    pub fn amd_wait_outside_lock(self) -> bool {
        self >= KernelVersion(6, 19)
    }

    /// AMD-Vi, "iommu/amd: Don't split flush for amd_iommu_domain_flush_all()" (backported to 6.12.75 in
    /// 2026-03, so 7.0, inferred): under NpCache a whole-domain flush stays one command. Before, the
    /// natural-alignment loop cut the all-pages size into 63 pieces.
    pub fn amd_flush_all_whole(self) -> bool {
        self >= KernelVersion(7, 0)
    }

    /// "iommu/riscv: Add RISC-V IOMMU platform device driver" and its series (6.13): the RISC-V IOMMU's first
    /// kernel.
    pub fn riscv_iommu(self) -> bool {
        self >= KernelVersion(6, 13)
    }

    /// "swiotlb: split up the global swiotlb lock" (6.0): areas, each with its own lock, one per possible
    /// CPU rounded up to a power of two; before, one `io_tlb_lock` for the whole pool.
    pub fn swiotlb_areas(self) -> bool {
        self >= KernelVersion(6, 0)
    }

    /// "swiotlb: add a flag whether SWIOTLB is allowed to grow" / CONFIG_SWIOTLB_DYNAMIC (6.6): transient
    /// pools and pools added in the background when the default pool is full.
    pub fn swiotlb_dynamic(self) -> bool {
        self >= KernelVersion(6, 6)
    }
}

impl From<(u32, u32)> for KernelVersion {
    fn from((a, b): (u32, u32)) -> Self {
        KernelVersion(a, b)
    }
}
