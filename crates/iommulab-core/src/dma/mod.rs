//! The OS DMA-mapping layer: the IOVA allocator, iommu-dma map/unmap, and the domain's invalidation policy.
//!
//! [`DmaCore`] holds what every policy shares (the IOMMU, the IOVA domain, the costs) and implements the
//! common iommu-dma paths; a [`DmaPolicy`] decides what happens around them — one file per policy.

pub mod attack;
pub mod blocks;
pub mod chunks;
pub mod default_domain;
pub mod fands;
pub mod flush_queue;
pub mod fns;
pub mod iova;
pub mod locality;
pub mod passthrough;
pub mod pte_lines;
pub mod safety;
pub mod strict;
pub mod swiotlb;
pub mod xsmmu;

use crate::hw::{DomainId, Iommu, IotlbGather, Translation};
use crate::scenario::{CpuProfile, PolicyName};
use crate::sim::Time;
use iova::{IovaCosts, IovaDomain};

/// Counters of the DMA API as the kernel would see them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DmaStats {
    pub maps: u64,
    pub unmaps: u64,
    pub pages_mapped: u64,
    /// IOVA pages whose PTEs were cleared (intel_iommu_unmap's count: size >> VTD_PAGE_SHIFT).
    pub iova_pages_unmapped: u64,
    pub map_failures: u64,
    /// Flush-queue flushes from a full per-CPU ring (synchronous in queue_iova) and from the timer.
    pub fq_flush_full: u64,
    pub fq_flush_timer: u64,
    /// CPU time in the DMA API (map, unmap, batch end, flush timer), its lock spins and invalidation waits
    /// included.
    pub cpu_ns: u64,
}

impl DmaStats {
    /// Add another domain's counts.
    pub fn add(&mut self, o: &DmaStats) {
        self.maps += o.maps;
        self.unmaps += o.unmaps;
        self.pages_mapped += o.pages_mapped;
        self.iova_pages_unmapped += o.iova_pages_unmapped;
        self.map_failures += o.map_failures;
        self.fq_flush_full += o.fq_flush_full;
        self.fq_flush_timer += o.fq_flush_timer;
        self.cpu_ns += o.cpu_ns;
    }
}

/// What all policies share.
pub struct DmaCore {
    pub iommu: Box<dyn Iommu>,
    pub iovad: IovaDomain,
    pub dom: DomainId,
    pub costs: CpuProfile,
    pub stats: DmaStats,
    /// Device DMA mask in IOVA granules (64-bit capable device, limited by the page table's input size).
    dma_limit: u64,
    /// 4 KiB pages per IOVA granule (iovad->granule: the IOMMU's smallest page size).
    granule: u64,
    /// dev->iommu->pci_32bit_workaround: try below 4 GiB first until that fails once.
    pci_32bit_workaround: bool,
    /// log2 of the 4 KiB pages one leaf table maps.
    leaf_table_shift: u32,
    /// The driver has map_pages/unmap_pages (`Iommu::map_pages_since`): one walk per leaf table a call
    /// spans, not one per page.
    pub map_pages: bool,
    /// A timer the policy armed, for the engine to schedule: (expiry, CPU that armed it).
    pub timer_request: Option<(Time, usize)>,
    /// IOVAs come from a replayed trace (the traced kernel's allocator), not from `iovad`: freeing them is
    /// not this allocator's business.
    pub iova_from_trace: bool,
    /// When unmapped ranges went back to their owners and when invalidations covered them.
    pub safety: safety::SafetyLog,
    /// Walk-cache locality of the IOVAs handed out.
    pub locality: locality::ReuseDistance,
    /// Walk-cache locality of the device's data-page accesses.
    pub dma_locality: locality::ReuseDistance,
    /// Which core wrote each line of the leaf page tables last.
    pub pte_lines: pte_lines::PteLines,
}

/// 4 GiB in 4 KiB pages: the first try for PCI devices (iommu_dma_alloc_iova, DMA_BIT_MASK(32)).
const PFN_4G: u64 = 1 << 20;

impl DmaCore {
    pub fn new(iommu: Box<dyn Iommu>, cpus: usize, costs: &CpuProfile) -> Self {
        let ic = IovaCosts {
            rcache_ns: costs.iova_rcache_ns,
            rbtree_ns: costs.iova_rbtree_ns,
            lock_ns: costs.lock_ns,
            coh: costs.coherence(),
            depot_line_shared: false,
        };
        let fmt = *iommu.translator().format();
        DmaCore {
            iommu,
            iovad: IovaDomain::new(1, cpus, ic),
            dom: 1,
            costs: costs.clone(),
            stats: DmaStats::default(),
            dma_limit: fmt.max_gpfn(),
            granule: fmt.granule_pages(),
            pci_32bit_workaround: true,
            leaf_table_shift: fmt.walk_entry_shift(),
            map_pages: true,
            timer_request: None,
            iova_from_trace: false,
            safety: safety::SafetyLog::default(),
            locality: locality::ReuseDistance::new(fmt.walk_entry_shift()),
            dma_locality: locality::ReuseDistance::new(fmt.walk_entry_shift()),
            pte_lines: pte_lines::PteLines::new(costs.coherence()),
        }
    }

    /// dma_set_mask(DMA_BIT_MASK(bits)): IOVAs from below 2^bits (iommu_dma_alloc_iova's dma_limit), the
    /// 32-bit first try only where the mask reaches above 4 GiB.
    pub fn set_dma_mask_bits(&mut self, bits: u32) {
        let pages = 1u128 << bits.min(64).saturating_sub(12);
        let limit = (pages / self.granule as u128).saturating_sub(1);
        self.dma_limit = self.dma_limit.min(limit.min(u64::MAX as u128) as u64);
    }

    /// The stall of `cpu` writing the leaf entries of `n` granules at `iova` (4 KiB pages): a transfer for each
    /// of their lines another core wrote last. A call that wrote another count of entries than granules
    /// used block entries, whose lines are not tracked.
    fn leaf_lines(&mut self, cpu: usize, iova: u64, n: u64, entries: u64) -> u64 {
        if entries != n {
            return 0;
        }
        self.pte_lines.write(cpu, iova / self.granule, n)
    }

    /// The page-table walks of a map or unmap of `len` pages at `iova` that wrote or cleared `entries` leaf
    /// entries: map_pages/unmap_pages (`Iommu::map_pages_since`) walk down once per leaf table the range
    /// spans (arm_lpae_map_pages' loop over __arm_lpae_map); before them, once per entry.
    fn pgtable_walks(&self, iova: u64, len: u64, entries: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        if !self.map_pages {
            // One driver call, and one walk, per entry.
            return entries.max(1);
        }
        let s = self.leaf_table_shift;
        let tables = ((iova + len - 1) >> s) - (iova >> s) + 1;
        tables.min(entries.max(1))
    }

    /// iova_offset / iova_align: [pfn, pfn + pages) as whole granules: (first 4 KiB pfn, offset, granules).
    fn granules(&self, pfn: u64, pages: u64) -> (u64, u64, u64) {
        let off = pfn % self.granule;
        (pfn - off, off, (pages + off).div_ceil(self.granule))
    }

    /// iommu_dma_alloc_iova(): PCI devices first try below 4 GiB without flushing the rcaches. Sizes and
    /// results in granules.
    fn alloc_iova(&mut self, now: Time, cpu: usize, granules: u64) -> (Option<u64>, Time) {
        let mut t = now;
        let limit_32 = PFN_4G / self.granule - 1;
        if self.pci_32bit_workaround && self.dma_limit > limit_32 {
            let (p, t2) = self.iovad.alloc_fast(t, cpu, granules, limit_32, false);
            if p.is_some() {
                return (p, t2);
            }
            t = t2;
            self.pci_32bit_workaround = false;
        }
        self.iovad
            .alloc_fast(t, cpu, granules, self.dma_limit, true)
    }

    /// iommu_dma_free_iova() → free_iova_fast() for a range handed out by [`DmaCore::iommu_map`].
    pub fn free_iova(&mut self, now: Time, cpu: usize, iova_pfn: u64, pages: u64) -> Time {
        if self.iova_from_trace {
            return now;
        }
        let (base, _, n) = self.granules(iova_pfn, pages);
        self.iovad.free_fast(now, cpu, base / self.granule, n)
    }

    /// __iommu_dma_map(): allocate IOVA, write the PTEs, iotlb_sync_map. The physical range is widened to
    /// whole granules (with a 16K or 64K granule the device reaches the neighbours of a 4K buffer too).
    /// Returns (iova pfn of `phys_pfn`, release time).
    pub fn iommu_map(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        self.map_with(now, cpu, phys_pfn, pages, |core, t, cpu, n| {
            core.alloc_iova(t, cpu, n)
        })
    }

    /// __iommu_dma_map() with the IOVA from `alloc` (granules wanted → first granule, time): widen to whole
    /// granules, write the PTEs (iommu_map_atomic), iotlb_sync_map. Returns (iova pfn of `phys_pfn`, release
    /// time); None, counted as a map failure, when `alloc` found no IOVA.
    fn map_with(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
        alloc: impl FnOnce(&mut Self, Time, usize, u64) -> (Option<u64>, Time),
    ) -> Option<(u64, Time)> {
        let t = now + self.costs.dma_iommu_op_ns;
        let (phys_base, off, n) = self.granules(phys_pfn, pages);
        let (iova, t) = alloc(self, t, cpu, n);
        let Some(iova) = iova else {
            self.stats.map_failures += 1;
            return None;
        };
        let iova = iova * self.granule;
        let len = n * self.granule;
        let written = self.iommu.map_pages(self.dom, iova, phys_base, len);
        let walks = self.pgtable_walks(iova, len, written);
        let t = t
            + self.costs.pgtable_map_ns
            + walks * self.costs.pgtable_walk_ns
            + written * self.costs.pte_ns
            + self.leaf_lines(cpu, iova, n, written);
        let t = self.iommu.iotlb_sync_map(t, cpu, self.dom, iova, len);
        self.stats.maps += 1;
        self.stats.pages_mapped += len;
        self.locality.allocated(iova);
        Some((iova + off, t))
    }

    /// FANDS' mlx5e_alloc_rx_mpwqe() + dma_map_page_attrs_iova(): one IOVA block for `phys` (4 KiB pages,
    /// not contiguous), each page mapped into it by its own call, the first one syncing the whole block
    /// (iotlb_sync_map over size * pages). Returns (iova pfn of the block, release time).
    pub fn iommu_map_block(&mut self, now: Time, cpu: usize, phys: &[u64]) -> Option<(u64, Time)> {
        let n = phys.len() as u64;
        assert!(
            self.granule == 1,
            "IOVA blocks of 4 KiB pages need a 4 KiB granule"
        );
        let (iova, mut t) = self.alloc_iova(now, cpu, n);
        let Some(iova) = iova else {
            self.stats.map_failures += 1;
            return None;
        };
        for (i, &p) in phys.iter().enumerate() {
            let written = self.iommu.map_pages(self.dom, iova + i as u64, p, 1);
            t += self.costs.dma_iommu_op_ns
                + self.costs.pgtable_map_ns
                + self.costs.pgtable_walk_ns
                + written * self.costs.pte_ns
                + self.leaf_lines(cpu, iova + i as u64, 1, written);
            if i == 0 {
                t = self.iommu.iotlb_sync_map(t, cpu, self.dom, iova, n);
            }
            self.stats.maps += 1;
            self.locality.allocated(iova + i as u64);
        }
        self.stats.pages_mapped += n;
        Some((iova, t))
    }

    /// iommu_unmap_fast(): clear the PTEs into a gather. Returns the gather, the time, and the unmap's ticket in
    /// the safety log (for a policy that releases the pages later).
    pub fn unmap_ptes(
        &mut self,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> (IotlbGather, Time, safety::Ticket) {
        let mut g = IotlbGather::new();
        let (base, _, n) = self.granules(iova_pfn, pages);
        let t = now + self.costs.dma_iommu_op_ns;
        let before = self.iommu.counters().ptes_cleared;
        let (un, t) = self
            .iommu
            .unmap_pages(t, cpu, self.dom, base, n * self.granule, &mut g);
        self.stats.unmaps += 1;
        self.stats.iova_pages_unmapped += un;
        let ptes = self.iommu.counters().ptes_cleared - before;
        // iommu_dma_unmap_page() first looks the range up (iommu_iova_to_phys: one walk), then unmap_pages.
        let walks = 1 + self.pgtable_walks(base, n * self.granule, ptes);
        let t = t
            + walks * self.costs.pgtable_walk_ns
            + ptes * self.costs.pte_ns
            + self.leaf_lines(cpu, base, n, ptes);
        let ticket = self.safety.unmapped(base, n * self.granule, t);
        (g, t, ticket)
    }

    /// A buffer of `bytes` was mapped at `iova_pfn` over `pages` pages at `t`: log the bytes of other data
    /// its granules let the device reach.
    pub fn shared_buffer(&mut self, iova_pfn: u64, pages: u64, bytes: u64, t: Time) {
        let (base, _, n) = self.granules(iova_pfn, pages);
        let reach = n * self.granule * crate::hw::PAGE_SIZE;
        if reach > bytes {
            self.safety.shared_buffer(base, reach - bytes, t);
        }
    }

    /// The pages of the range unmapped at `iova_pfn` went back to their owner at `t`.
    pub fn release(&mut self, iova_pfn: u64, t: Time) {
        let (base, _, _) = self.granules(iova_pfn, 1);
        self.safety.released(base, t);
    }

    /// iommu_iotlb_sync(): invalidate the gathered range and wait.
    pub fn iotlb_sync(&mut self, now: Time, cpu: usize, g: &IotlbGather) -> Time {
        let t = self.iommu.iotlb_sync(now, cpu, self.dom, g);
        if !g.is_empty() {
            self.safety.invalidated(Some((g.start, g.end)), t);
        }
        t
    }

    /// iommu_flush_iotlb_all(): invalidate the whole domain and wait.
    pub fn flush_iotlb_all(&mut self, now: Time, cpu: usize) -> Time {
        let t = self.iommu.flush_iotlb_all(now, cpu, self.dom);
        self.safety.invalidated(None, t);
        t
    }
}

/// A DMA-mapping policy: what dma_map/dma_unmap do around the shared iommu-dma paths.
pub trait DmaPolicy: Send + Sync {
    fn name(&self) -> PolicyName;
    /// Whether the device's DMA goes through IOMMU translation (false for an identity domain).
    fn translated(&self) -> bool {
        true
    }
    /// dma_map_page(): the DMA address (pfn) and the time the CPU is released.
    fn map(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        core.iommu_map(now, cpu, phys_pfn, pages)
    }
    /// dma_unmap_page(): returns the time the CPU is released.
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time;
    /// A timer this policy armed (through `core.timer_request`) fired on `cpu`. Returns the release time.
    fn timer(&mut self, _core: &mut DmaCore, now: Time, _cpu: usize) -> Time {
        now
    }
    /// The driver gives each RX multi-packet WQE one contiguous IOVA block and does not recycle its pages
    /// (FANDS).
    fn rx_wqe_iova_blocks(&self) -> bool {
        false
    }
    /// The policy keeps unmapped pages from their owner until it has invalidated them (it calls
    /// `core.release` itself); otherwise a page goes back when dma_unmap returns.
    fn holds_pages(&self) -> bool {
        false
    }
    /// The driver ended a batch of unmaps on `cpu` (a NAPI poll, a TX completion batch). Returns the
    /// release time.
    fn batch_end(&mut self, _core: &mut DmaCore, now: Time, _cpu: usize) -> Time {
        now
    }
    /// The driver unmaps every segment of one completed descriptor (mlx5e_tx_dma_unmap over a WQE's
    /// segments): by default one dma_unmap each.
    fn unmap_desc(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        segs: &[(u64, u64)],
    ) -> Time {
        segs.iter().fold(now, |t, &(iova, pages)| {
            self.unmap(core, t, cpu, iova, pages)
        })
    }
    /// The policy's kernel makes VT-d page-selective invalidations carry IH (see [`Iommu::honour_psi_ih`]).
    /// The period of a timer the policy runs (the flush queue's fq_timeout), if any.
    fn timer_period_ns(&self) -> Option<u64> {
        None
    }
    fn psi_ih(&self) -> bool {
        false
    }
    /// The policy's own shared locks and lines (the flush queue's), by name.
    fn lock_stats(&self) -> Vec<(&'static str, crate::sim::LockStats)> {
        Vec::new()
    }
}

/// The DMA layer of one device: shared state plus its domain's policy.
pub struct DmaLayer {
    pub core: DmaCore,
    pub policy: Box<dyn DmaPolicy>,
    /// A malicious device replaying the IOVAs it saw (off unless the scenario asks).
    pub attack: Option<attack::Replay>,
    /// The device's streaming mappings bounce through swiotlb (dma-direct with `is_swiotlb_force_bounce`:
    /// a confidential guest, `swiotlb=force`); None: they map as the policy says.
    pub swiotlb: Option<swiotlb::Swiotlb>,
    /// Converting a coherent buffer's pages from private to shared (set_memory_decrypted), per 4 KiB page
    /// (a confidential guest only).
    pub decrypt_page_ns: u64,
}

/// What every unmap of a layer does around `policy`'s: the malicious device learns the ranges, and pages the
/// policy does not hold go back to their owners when it returns.
fn unmap_by(
    policy: &mut dyn DmaPolicy,
    core: &mut DmaCore,
    attack: &mut Option<attack::Replay>,
    now: Time,
    cpu: usize,
    segs: &[(u64, u64)],
) -> Time {
    if let Some(a) = attack.as_mut() {
        for &(iova, pages) in segs {
            a.unmapped(iova, pages);
        }
    }
    let t = policy.unmap_desc(core, now, cpu, segs);
    core.stats.cpu_ns += t - now;
    if !policy.holds_pages() {
        for &(iova, _) in segs {
            core.release(iova, t);
        }
    }
    t
}

impl DmaLayer {
    /// `fq`: the flush queue the device gets if the domain is lazy.
    pub fn new(
        core: DmaCore,
        policy: PolicyName,
        cpus: usize,
        hz: u32,
        fq: flush_queue::FqOptions,
    ) -> Self {
        let policy: Box<dyn DmaPolicy> = match policy {
            PolicyName::Passthrough => Box::new(passthrough::Passthrough),
            PolicyName::Strict => Box::new(strict::Strict),
            PolicyName::Lazy => Box::new(flush_queue::FlushQueue::with_options(cpus, hz, fq)),
            PolicyName::Xsmmu => Box::new(xsmmu::Xsmmu::new(cpus)),
            PolicyName::Fands => Box::new(fands::Fands),
            PolicyName::Fns => Box::new(fns::Fns::new(cpus)),
            PolicyName::Blocks => Box::new(blocks::Blocks::new(cpus)),
            PolicyName::Auto => unreachable!("resolved before the host is built"),
        };
        let mut core = core;
        if policy.psi_ih() {
            core.iommu.honour_psi_ih();
        }
        DmaLayer {
            core,
            policy,
            attack: None,
            swiotlb: None,
            decrypt_page_ns: 0,
        }
    }
    /// Whether a streaming mapping bounces: dma-direct (an identity domain or no IOMMU) with swiotlb forced.
    fn bounces(&self) -> bool {
        self.swiotlb.is_some() && !self.policy.translated()
    }
    /// dma_map_page_attrs() of `bytes` at byte `offset` of page `phys_pfn` for direction `dir`: (DMA pfn,
    /// pages, release time). Through the policy, or bounced through swiotlb (swiotlb_map) where dma-direct
    /// bounces; None when it failed (no IOVA space; "swiotlb buffer is full"). `skip_cpu_sync`:
    /// DMA_ATTR_SKIP_CPU_SYNC (page_pool_dma_map, mlx5e's RX pages): the driver syncs what it reads
    /// (`sync_for_cpu`), and the unmap copies nothing back.
    #[allow(clippy::too_many_arguments)]
    pub fn map_attrs(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        offset: u64,
        bytes: u64,
        dir: crate::scenario::MapDir,
        skip_cpu_sync: bool,
    ) -> Option<(u64, u64, Time)> {
        if self.bounces() {
            return self.bounce(now, cpu, offset, bytes, dir, skip_cpu_sync);
        }
        // dma_map_single(): the pages the buffer spans, what else they hold logged as sub-page exposure.
        let pages = crate::hw::pages_spanned(offset, bytes);
        let (iova, t) = self.map_policy(now, cpu, phys_pfn, pages)?;
        if self.policy.translated() {
            self.core.shared_buffer(iova, pages, bytes, t);
        }
        Some((iova, pages, t))
    }
    /// dma_sync_single_for_cpu() of `bytes` the device wrote: a bounced mapping's copy back (nothing to do
    /// for a coherent device otherwise). Returns the release time.
    pub fn sync_for_cpu(&mut self, now: Time, bytes: u64) -> Time {
        if !self.bounces() {
            return now;
        }
        let t = self
            .swiotlb
            .as_mut()
            .expect("bounces")
            .sync_for_cpu(now, bytes);
        self.core.stats.cpu_ns += t - now;
        t
    }
    /// swiotlb_map(): a copy of the buffer in the pool's slots.
    fn bounce(
        &mut self,
        now: Time,
        cpu: usize,
        offset: u64,
        bytes: u64,
        dir: crate::scenario::MapDir,
        skip_cpu_sync: bool,
    ) -> Option<(u64, u64, Time)> {
        let sw = self.swiotlb.as_mut().expect("bounces");
        let t0 = now + self.core.costs.dma_direct_op_ns;
        match sw.map(t0, cpu, offset, bytes, dir, skip_cpu_sync) {
            Ok((dma, slots, t)) => {
                let pages = crate::hw::pages_spanned(offset, bytes);
                let st = &mut self.core.stats;
                st.maps += 1;
                st.pages_mapped += pages;
                st.cpu_ns += t - now;
                // The copy in overwrites what earlier mappings left in these slots.
                self.core
                    .safety
                    .invalidated(Some((dma, dma + slots - 1)), t);
                Some((dma, pages, t))
            }
            Err((_, t)) => {
                self.core.stats.map_failures += 1;
                self.core.stats.cpu_ns += t - now;
                None
            }
        }
    }
    /// dma_alloc_coherent()'s mapping of `pages` at `phys_pfn` (rings, descriptors): not bounced; in a
    /// confidential guest dma-direct converts them to shared first (dma_set_decrypted), and the device
    /// reaches them at their physical address. Elsewhere mapped as the policy says.
    pub fn alloc_coherent(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        if !self.bounces() {
            return self.map_policy(now, cpu, phys_pfn, pages);
        }
        let t = now + self.core.costs.dma_direct_op_ns + pages * self.decrypt_page_ns;
        self.core.stats.maps += 1;
        self.core.stats.pages_mapped += pages;
        self.core.stats.cpu_ns += t - now;
        Some((phys_pfn, t))
    }
    /// swiotlb_tbl_unmap_single() of a bounced mapping: the copy back for a device-written buffer, the slots
    /// freed. Their data stays in shared memory, reachable, until a later mapping overwrites it. None if
    /// `dma` is no bounce slot (a coherent buffer's address).
    fn unbounce(&mut self, now: Time, cpu: usize, dma: u64) -> Option<Time> {
        let sw = self.swiotlb.as_mut()?;
        let (t, slots) = sw.unmap(now + self.core.costs.dma_direct_op_ns, cpu, dma)?;
        self.core.stats.unmaps += 1;
        self.core.safety.unmapped(dma, slots, t);
        self.core.safety.released(dma, t);
        Some(t)
    }
    /// dma_map_page() of whole pages, both directions (a bounced one copies them in and back).
    pub fn map(&mut self, now: Time, cpu: usize, phys_pfn: u64, pages: u64) -> Option<(u64, Time)> {
        if self.bounces() {
            let bytes = pages * crate::hw::PAGE_SIZE;
            let r = self.bounce(
                now,
                cpu,
                0,
                bytes,
                crate::scenario::MapDir::Bidirectional,
                false,
            );
            return r.map(|(dma, _, t)| (dma, t));
        }
        self.map_policy(now, cpu, phys_pfn, pages)
    }
    fn map_policy(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        let r = self.policy.map(&mut self.core, now, cpu, phys_pfn, pages);
        if let Some((iova, t)) = r {
            self.core.stats.cpu_ns += t - now;
            if let Some(a) = self.attack.as_mut() {
                a.mapped(iova, pages);
            }
        }
        r
    }
    /// FANDS' block mapping of `phys` into one IOVA range.
    pub fn map_block(&mut self, now: Time, cpu: usize, phys: &[u64]) -> Option<(u64, Time)> {
        let r = self.core.iommu_map_block(now, cpu, phys);
        if let Some((iova, t)) = r {
            self.core.stats.cpu_ns += t - now;
            if let Some(a) = self.attack.as_mut() {
                a.mapped(iova, phys.len() as u64);
            }
        }
        r
    }
    pub fn unmap(&mut self, now: Time, cpu: usize, iova_pfn: u64, pages: u64) -> Time {
        self.unmap_desc(now, cpu, &[(iova_pfn, pages)])
    }
    /// The segments `(iova, pages)` of one completed descriptor (one segment: a plain dma_unmap).
    pub fn unmap_desc(&mut self, now: Time, cpu: usize, segs: &[(u64, u64)]) -> Time {
        if self.bounces() {
            let t = segs
                .iter()
                .fold(now, |t, &(dma, pages)| match self.unbounce(t, cpu, dma) {
                    Some(t) => t,
                    None => self.policy.unmap(&mut self.core, t, cpu, dma, pages),
                });
            self.core.stats.cpu_ns += t - now;
            return t;
        }
        unmap_by(
            self.policy.as_mut(),
            &mut self.core,
            &mut self.attack,
            now,
            cpu,
            segs,
        )
    }
    pub fn batch_end(&mut self, now: Time, cpu: usize) -> Time {
        let t = self.policy.batch_end(&mut self.core, now, cpu);
        self.core.stats.cpu_ns += t - now;
        t
    }
    /// dma_iova_unlink() then dma_iova_free() of a range the IOVA API mapped: __iommu_dma_iova_unlink() with
    /// free_iova false clears it and syncs the IOTLB at once, in a lazy domain too. (dma_iova_destroy() in
    /// one call, free_iova true, queues it in a lazy domain as any unmap.) Other policies unmap it as they
    /// unmap anything.
    pub fn iova_unlink_free(&mut self, now: Time, cpu: usize, iova_pfn: u64, pages: u64) -> Time {
        if self.policy.name() != PolicyName::Lazy {
            return self.unmap(now, cpu, iova_pfn, pages);
        }
        let segs = [(iova_pfn, pages)];
        unmap_by(
            &mut strict::Strict,
            &mut self.core,
            &mut self.attack,
            now,
            cpu,
            &segs,
        )
    }
    /// The malicious device, if any, replays `n` IOVAs at `now`.
    pub fn replay(&mut self, n: u64, now: Time) {
        if let Some(mut a) = self.attack.take() {
            for _ in 0..n {
                a.probe(self, now);
            }
            self.attack = Some(a);
        }
    }
    pub fn timer(&mut self, now: Time, cpu: usize) -> Time {
        let t = self.policy.timer(&mut self.core, now, cpu);
        self.core.stats.cpu_ns += t - now;
        t
    }
    /// The device reads or writes the data page at `iova_pfn` (its translation follows): counted for
    /// the walk-cache locality of accesses, when the IOMMU translates.
    pub fn data_access(&mut self, iova_pfn: u64) {
        if self.policy.translated() {
            self.core.dma_locality.accessed(iova_pfn);
        }
    }

    /// Device side: translate one page at `now`, or None when the domain is identity (no translation).
    pub fn translate(&mut self, now: Time, iova_pfn: u64) -> Option<Translation> {
        if self.policy.translated() {
            Some(self.core.iommu.translate(now, self.core.dom, iova_pfn))
        } else {
            None
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// DMA-layer costs for unit tests.
    pub(crate) fn costs(cpus: usize) -> CpuProfile {
        CpuProfile {
            cores: cpus as u32,
            stack_ns_per_packet: 0,
            stack_ns_per_skb: 0,
            copy_ns_per_byte: 0.0,
            wakeup_ns: 0,
            page_alloc_ns: 0,
            dma_iommu_op_ns: 50,
            dma_direct_op_ns: 10,
            pte_ns: 10,
            iova_rcache_ns: 20,
            iova_rbtree_ns: 100,
            lock_ns: 10,
            cluster_cores: cpus as u32,
            socket_cores: cpus as u32,
            line_cluster_ns: 0,
            line_socket_ns: 0,
            line_remote_ns: 0,
            fq_entry_ns: 10,
            tx_packet_ns: 0,
            nvme_submit_ns: 0,
            nvme_complete_ns: 0,
            pmd_packet_ns: 0,
            memset_ns_per_byte: 0.0,
            pgtable_walk_ns: 0,
            pgtable_map_ns: 0,
            swiotlb_op_ns: 0,
            swiotlb_slot_ns: 0,
        }
    }

    #[test]
    fn sixty_four_k_granule_maps_whole_granules() {
        let mut io = crate::hw::smmuv3::tests::cfg(true, false);
        io.granule_kb = 64;
        io.pwc_entries = vec![4, 28];
        let mut c = DmaCore::new(
            Box::new(crate::hw::smmuv3::tests::smmu(&io, 1)),
            1,
            &costs(1),
        );
        let (iova, _) = c.iommu_map(0, 0, 17, 1).unwrap();
        assert_eq!(
            iova % 16,
            1,
            "iova_offset keeps the page's place in its 64K granule"
        );
        assert_eq!(c.iommu.iova_to_phys(c.dom, iova), Some(17));
        // The device reaches the 15 neighbours sharing the granule too.
        assert_eq!(c.iommu.iova_to_phys(c.dom, iova - 1), Some(16));
        assert_eq!(c.iommu.iova_to_phys(c.dom, iova + 14), Some(31));
        assert_eq!(c.stats.pages_mapped, 16);
        let (g, _, _) = c.unmap_ptes(0, 0, iova, 1);
        assert_eq!(
            (g.start, g.pages(), c.stats.iova_pages_unmapped),
            (iova - 1, 16, 16)
        );
        let t = c.free_iova(0, 0, iova, 1);
        let (again, _) = c.iommu_map(t, 0, 40, 1).unwrap();
        assert_eq!(
            again,
            iova - 1 + 8,
            "the freed granule comes back from the rcache"
        );
    }

    #[test]
    fn a_map_walks_once_per_leaf_table_and_writes_each_entry() {
        // 4 KiB granule: a leaf table maps 512 pages. 256 pages inside one table take one walk and 256 entry
        // writes; 256 pages across a table boundary take two walks; an unmap adds the iova_to_phys lookup.
        let io = crate::hw::smmuv3::tests::cfg(true, false);
        let mut costs = costs(1);
        (
            costs.dma_iommu_op_ns,
            costs.iova_rcache_ns,
            costs.iova_rbtree_ns,
            costs.lock_ns,
        ) = (0, 0, 0, 0);
        (costs.pgtable_walk_ns, costs.pte_ns, costs.pgtable_map_ns) = (60, 2, 300);
        let mut c = DmaCore::new(Box::new(crate::hw::smmuv3::tests::smmu(&io, 1)), 1, &costs);
        assert_eq!(c.pgtable_walks(512, 256, 256), 1);
        assert_eq!(c.pgtable_walks(384, 256, 256), 2);
        assert_eq!(c.pgtable_walks(0, 1, 1), 1);
        let (iova, t) = c.iommu_map(0, 0, 1 << 20, 256).unwrap();
        let walks = c.pgtable_walks(iova, 256, 256);
        // iommu_map()'s own per-call cost comes once per map; the unmap path has none.
        assert_eq!(t, 300 + walks * 60 + 256 * 2);
        let (_, t, _) = c.unmap_ptes(0, 0, iova, 256);
        assert_eq!(t, (1 + walks) * 60 + 256 * 2);
        // Before the driver had map_pages (arm-smmu-v3 before 5.14), iommu_map() called it per page: a walk
        // each.
        assert_eq!(
            c.iommu.map_pages_since(),
            crate::kernel::KernelVersion(5, 14)
        );
        c.map_pages = false;
        let (iova, t) = c.iommu_map(0, 0, 1 << 20, 256).unwrap();
        assert_eq!(t, 300 + 256 * 60 + 256 * 2);
        let (_, t, _) = c.unmap_ptes(0, 0, iova, 256);
        assert_eq!(t, (1 + 256) * 60 + 256 * 2);
    }

    #[test]
    fn cpus_writing_neighbouring_entries_move_their_line() {
        // Two CPUs of different clusters (transfer 70 ns); every other cost zero. The rbtree hands out IOVAs
        // top-down, so CPU 0's page and CPU 1's next one below it share a line of leaf entries.
        let io = crate::hw::smmuv3::tests::cfg(true, false);
        let mut costs = costs(2);
        (costs.dma_iommu_op_ns, costs.pte_ns) = (0, 0);
        (costs.iova_rcache_ns, costs.iova_rbtree_ns, costs.lock_ns) = (0, 0, 0);
        (costs.cluster_cores, costs.socket_cores) = (1, 2);
        (
            costs.line_cluster_ns,
            costs.line_socket_ns,
            costs.line_remote_ns,
        ) = (30, 70, 150);
        let mut c = DmaCore::new(Box::new(crate::hw::smmuv3::tests::smmu(&io, 2)), 2, &costs);
        let lines = |c: &DmaCore| (c.pte_lines.stats.transfers, c.pte_lines.stats.transfer_ns);
        // The first map takes its entry's line from nobody.
        let (a, _) = c.iommu_map(0, 0, 100, 1).unwrap();
        assert_eq!(lines(&c), (0, 0));
        let (b, _) = c.iommu_map(1000, 1, 200, 1).unwrap();
        assert_eq!(a / 8, b / 8, "{a} and {b} share a line of entries");
        // CPU 1 takes the entries' line from CPU 0.
        assert_eq!(lines(&c), (1, 70));
        // CPU 0 clears its entry: the line comes back, and the clear's time has it.
        let (_, t, _) = c.unmap_ptes(2000, 0, a, 1);
        assert_eq!((lines(&c), t - 2000), ((2, 140), 70));
        // CPU 0's next page comes from the same line, now its own: no transfer.
        let (d, _) = c.iommu_map(3000, 0, 300, 1).unwrap();
        assert_eq!((d / 8, lines(&c)), (a / 8, (2, 140)));
        assert_eq!(c.pte_lines.stats.acquisitions, 4);
        // A 1 MiB range: 32 lines, all CPU 0's, then written by CPU 1: ten at a time, four rounds.
        let (r, _) = c.iommu_map(4000, 0, 1 << 20, 256).unwrap();
        let (_, t, _) = c.unmap_ptes(5000, 1, r, 256);
        assert_eq!(t - 5000, 4 * 70);
    }

    mod props {
        use super::super::*;
        use crate::hw::InvClass;
        use crate::hw::LATER;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        #[derive(Debug, Clone)]
        enum Op {
            Map { cpu: usize, pages: u64 },
            Unmap(usize),
            Tick(u64),
            Translate(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0usize..2, 1u64..5).prop_map(|(cpu, pages)| Op::Map { cpu, pages }),
                4 => any::<usize>().prop_map(Op::Unmap),
                1 => (1u64..20_000_000).prop_map(Op::Tick),
                2 => any::<usize>().prop_map(Op::Translate),
            ]
        }

        fn layer(policy: PolicyName) -> DmaLayer {
            let io = crate::hw::vtd::tests::cfg();
            let core = DmaCore::new(
                Box::new(crate::hw::vtd::tests::vtd(&io)),
                2,
                &tests::costs(2),
            );
            DmaLayer::new(
                core,
                policy,
                2,
                250,
                flush_queue::FqOptions::for_device(false),
            )
        }

        fn policy() -> impl Strategy<Value = PolicyName> {
            prop_oneof![
                Just(PolicyName::Strict),
                Just(PolicyName::Lazy),
                Just(PolicyName::Xsmmu),
                Just(PolicyName::Fands),
                Just(PolicyName::Fns),
                Just(PolicyName::Blocks),
            ]
        }

        /// Drivers end a batch (a NAPI poll) now and then; timers run when due.
        #[derive(Debug, Clone)]
        enum SOp {
            Op(Op),
            BatchEnd(usize),
        }

        proptest! {
            /// Safety accounting: strict, xSMMU, FANDS, F&S and blocks never release a page before an invalidation covering
            /// it completed; lazy releases at once and its window ends with the flush queue's flush (a full
            /// ring or the timer: at most the timeout plus the timer wheel's rounding).
            #[test]
            fn no_release_before_invalidation_except_lazy(
                policy in policy(),
                ops in proptest::collection::vec(prop_oneof![
                    8 => op().prop_map(SOp::Op),
                    1 => (0usize..2).prop_map(SOp::BatchEnd),
                ], 1..400),
            ) {
                let mut d = layer(policy);
                let mut now: Time = 0;
                let mut timers: Vec<(Time, usize)> = vec![];
                let mut live: Vec<(u64, u64)> = vec![];
                let mut phys = 1000;
                for o in ops {
                    match o {
                        SOp::Op(Op::Map { cpu, pages }) => {
                            if let Some((iova, t)) = d.map(now, cpu, phys, pages) {
                                now = now.max(t);
                                phys += pages;
                                live.push((iova, pages));
                            }
                        }
                        SOp::Op(Op::Unmap(i)) => {
                            if live.is_empty() { continue; }
                            let (iova, pages) = live.swap_remove(i % live.len());
                            now = now.max(d.unmap(now, i % 2, iova, pages));
                            if let Some(t) = d.core.timer_request.take() { timers.push(t); }
                        }
                        SOp::Op(Op::Tick(dt)) => {
                            now += dt;
                            timers.sort();
                            while let Some(&(t, cpu)) = timers.first() {
                                if t > now { break; }
                                timers.remove(0);
                                now = now.max(d.timer(t, cpu));
                                if let Some(t) = d.core.timer_request.take() { timers.push(t); }
                            }
                        }
                        SOp::Op(Op::Translate(i)) => {
                            // The device's own DMA to a live buffer never meets a stale translation: an IOVA
                            // is handed out again only after an invalidation covering it (xSMMU excepted: it
                            // frees the IOVA before its DSI).
                            if live.is_empty() { continue; }
                            let (iova, pages) = live[i % live.len()];
                            let tr = d.translate(LATER, iova + (i as u64) % pages).unwrap();
                            if policy != PolicyName::Xsmmu {
                                prop_assert!(!tr.stale, "stale translation of a live buffer under {:?}", policy);
                            }
                        }
                        SOp::BatchEnd(cpu) => now = now.max(d.batch_end(now, cpu)),
                    }
                    if policy != PolicyName::Lazy {
                        prop_assert_eq!(d.core.safety.exposed_open(now), 0);
                    }
                }
                let s = &d.core.safety.stats;
                if policy == PolicyName::Lazy {
                    // IOVA_DEFAULT_FQ_TIMEOUT (10 ms) rounded up by the timer wheel at HZ=250, plus the flush.
                    prop_assert!(s.window.max() <= 10_000_000 + 2 * 4_000_000 + 1_000_000, "{}", s.window.max());
                } else {
                    prop_assert_eq!(s.pages_exposed, 0);
                }
            }
        }

        proptest! {
            /// An IOVA is never handed out twice while mapped or waiting in a flush queue; after a strict unmap
            /// returns no stale translation remains; under lazy an IOVA is handed out again only after a
            /// whole-domain flush issued after it was queued.
            #[test]
            fn iova_safety(lazy in any::<bool>(), ops in proptest::collection::vec(op(), 1..400)) {
                let policy = if lazy { PolicyName::Lazy } else { PolicyName::Strict };
                let mut d = layer(policy);
                let mut now: Time = 0;
                let mut timers: Vec<(Time, usize)> = vec![];
                let mut live: Vec<(u64, u64)> = vec![];           // mapped: (iova pfn, pages)
                let mut queued: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // unmapped: pfn → (pages, DSIs then)
                let mut phys = 1000;
                for o in ops {
                    match o {
                        Op::Map { cpu, pages } => {
                            let Some((iova, t)) = d.map(now, cpu, phys, pages) else { continue };
                            now = now.max(t);
                            phys += pages;
                            for &(a, n) in &live {
                                prop_assert!(iova + pages <= a || a + n <= iova, "{iova:#x}+{pages} overlaps live {a:#x}+{n}");
                            }
                            let dsi = d.core.iommu.counters().class(InvClass::Domain);
                            for (&a, &(n, dsi_then)) in &queued {
                                if iova < a + n && a < iova + pages {
                                    prop_assert!(lazy, "strict frees at unmap; nothing stays queued");
                                    prop_assert!(dsi > dsi_then, "{iova:#x} reused before a flush after its unmap");
                                }
                            }
                            queued.retain(|&a, &mut (n, _)| iova + pages <= a || a + n <= iova);
                            live.push((iova, pages));
                        }
                        Op::Unmap(i) => {
                            if live.is_empty() { continue; }
                            let (iova, pages) = live.swap_remove(i % live.len());
                            now = now.max(d.unmap(now, 0, iova, pages));
                            if let Some(t) = d.core.timer_request.take() { timers.push(t); }
                            if lazy {
                                queued.insert(iova, (pages, d.core.iommu.counters().class(InvClass::Domain)));
                            } else {
                                for p in iova..iova + pages {
                                    prop_assert!(!d.translate(LATER, p).unwrap().stale, "stale after strict unmap");
                                }
                            }
                        }
                        Op::Tick(dt) => {
                            now += dt;
                            timers.sort();
                            while let Some(&(t, cpu)) = timers.first() {
                                if t > now { break; }
                                timers.remove(0);
                                d.timer(t, cpu);
                                if let Some(t) = d.core.timer_request.take() { timers.push(t); }
                            }
                        }
                        Op::Translate(i) => {
                            if let Some(&(iova, pages)) = live.get(i % live.len().max(1)) {
                                let t = d.translate(LATER, iova + (i as u64 % pages)).unwrap();
                                prop_assert!(!t.stale && t.phys.is_some());
                            }
                        }
                    }
                }
            }
        }
    }
}
