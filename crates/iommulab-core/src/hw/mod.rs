//! IOMMU hardware: page tables, IOTLB and paging-structure caches, and the invalidation interface.
//!
//! The [`Iommu`] trait mirrors the kernel's `struct iommu_domain_ops` (map_pages, unmap_pages with an iotlb
//! gather, iotlb_sync_map, iotlb_sync, flush_iotlb_all) plus the hardware side the device sees (translate).
//! A vendor is one file implementing it.

pub mod amdvi;
pub mod cache;
pub mod driver;
pub mod emul;
pub mod pgtable;
pub mod platform;
pub mod ranges;
pub mod riscv;
pub mod s390;
pub mod smmuv3;
pub mod translator;
pub mod virtio;
pub mod vtd;

use crate::kernel::KernelVersion;
use crate::sim::{self, LockStats, Time};
pub use driver::{Driver, KernelDriver};
pub use pgtable::PtFormat;
pub use platform::{
    CpuProfile, HypervisorProfile, IommuProfile, KvmProfile, MemoryProfile, PcieProfile, Platform,
    Vendor,
};

pub type DomainId = u16;

/// iommu.c iommu_pgsize(): for [iova, iova + size) mapped to paddr (all in pages of 2^0), the page size to
/// use (as a shift, bit k of `pgsize_bitmap` = pages of 2^k are supported) and how many pages of it before a
/// larger supported size could take over.
pub fn iommu_pgsize(pgsize_bitmap: u64, iova: u64, paddr: u64, size: u64) -> (u32, u64) {
    let addr_merge = iova | paddr;
    // Page sizes supported and small enough for `size`, then no larger than the alignment allows.
    let mut pgsizes = pgsize_bitmap & low_bits(63 - size.leading_zeros());
    if addr_merge != 0 {
        pgsizes &= low_bits(addr_merge.trailing_zeros());
    }
    assert!(
        pgsizes != 0,
        "no page size fits: the smallest must divide every address"
    );
    let idx = 63 - pgsizes.leading_zeros();
    let mut size = size;
    // The next larger supported size, if iova and paddr sit alike inside it.
    let larger = pgsize_bitmap & !low_bits(idx);
    if larger != 0 {
        let next = 1u64 << larger.trailing_zeros();
        if (iova ^ paddr) & (next - 1) == 0 {
            let offset = next - (addr_merge & (next - 1));
            if offset + next <= size {
                size = offset;
            }
        }
    }
    (idx, size >> idx)
}

/// GENMASK(n, 0).
fn low_bits(n: u32) -> u64 {
    if n >= 63 {
        u64::MAX
    } else {
        (1u64 << (n + 1)) - 1
    }
}

/// Every IOMMU iommulab models.
pub fn drivers() -> &'static [&'static dyn Driver] {
    &[
        &vtd::VtdDriver,
        &smmuv3::Smmuv3Driver,
        &virtio::VirtioDriver,
        &amdvi::AmdViDriver,
        &riscv::RiscvDriver,
    ]
}

/// Every kernel driver `explain` knows: the modelled ones and those it explains only.
pub fn kernel_drivers() -> Vec<&'static dyn KernelDriver> {
    let mut v: Vec<&'static dyn KernelDriver> = drivers().iter().map(|&d| d as _).collect();
    v.push(&s390::S390Driver);
    v
}

/// The kernel driver named `name`.
pub fn kernel_driver(name: &str) -> Option<&'static dyn KernelDriver> {
    kernel_drivers().into_iter().find(|d| d.name() == name)
}

/// The modelled IOMMU named `name`.
pub fn driver(name: &str) -> Option<&'static dyn Driver> {
    drivers().iter().copied().find(|d| d.name() == name)
}

impl Vendor {
    /// The vendor's driver.
    pub fn driver(self) -> &'static dyn Driver {
        *drivers()
            .iter()
            .find(|d| d.vendor() == self)
            .expect("every vendor has a driver")
    }
    pub fn as_str(self) -> &'static str {
        self.driver().name()
    }
}

/// Build the platform's IOMMU for a kernel (MAJOR, MINOR); the scenario was validated, so the format is valid.
/// `vfio`: the device is a VFIO-assigned one (on a guest platform, QEMU shadows its mappings unless nested).
pub fn build(p: &Platform, cpus: usize, kernel: (u32, u32), vfio: bool) -> Box<dyn Iommu> {
    let kernel = KernelVersion::from(kernel);
    let d = p.vendor.driver();
    let fmt = d.pt_format(&p.iommu).expect("validated platform");
    let ats = p.pcie.ats && d.enables_ats(&p.iommu, kernel);
    let atc = ats.then_some((p.pcie.atc_entries, p.pcie.atc_ways));
    let mut tr = translator::Translator::new(&p.iommu, fmt, atc);
    // An IOMMU QEMU emulates caches translations in its own hash (hardware's, under nesting).
    if let Some(h) = p.hypervisor.as_ref().filter(|h| !h.nested) {
        tr = tr.emulated_iotlb(d.qemu_iotlb(h, p.iommu.iotlb_entries));
    }
    let emu = driver::Emulation {
        // A guest's doorbells trap unless its command queue is a hardware one (vCMDQ).
        trap: p
            .hypervisor
            .as_ref()
            .filter(|h| !h.vcmdq)
            .map(|h| emul::Trap::new(h, p.host_kvm())),
        shadow: p
            .hypervisor
            .as_ref()
            .filter(|h| vfio && !h.nested)
            .map(|_| emul::Shadow::new(p.host_kvm())),
    };
    d.build(p, cpus, kernel, tr, emu)
}

/// What a DMA layer holds while another domain's layer has the host's IOMMU (`Host::lend`): an IOMMU of
/// the same platform that is never driven.
pub fn stand_in(p: &Platform, cpus: usize, kernel: (u32, u32)) -> Box<dyn Iommu> {
    build(p, cpus, kernel, false)
}

/// A driver's lock per domain (VT-d's dmar_domain->cache_lock, AMD-Vi's protection_domain->lock), made as
/// domains appear.
pub struct DomainLocks {
    locks: Vec<sim::SpinLock>,
    coh: sim::Coherence,
}

impl DomainLocks {
    pub fn new(coh: sim::Coherence) -> Self {
        DomainLocks {
            locks: Vec::new(),
            coh,
        }
    }
    pub fn get(&mut self, dom: DomainId) -> &mut sim::SpinLock {
        let i = dom as usize;
        if self.locks.len() <= i {
            let coh = self.coh;
            self.locks.resize_with(i + 1, || sim::SpinLock::new(coh));
        }
        &mut self.locks[i]
    }
    /// Every domain's lock summed, one entry per domain slot of `tr`.
    pub fn stats(&self, tr: &translator::Translator) -> LockStats {
        LockStats::sum_of(self.locks.iter().map(|l| &l.stats), tr.domain_slots())
    }
}

pub const PAGE_SHIFT: u32 = 12;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

/// 4 KiB pages spanned by `bytes` starting `offset` bytes into a page (at least one).
pub fn pages_spanned(offset: u64, bytes: u64) -> u64 {
    (offset % PAGE_SIZE + bytes).div_ceil(PAGE_SIZE).max(1)
}

/// After `struct iommu_iotlb_gather` (include/linux/iommu.h): the range an unmap touched and the page-table
/// pages it freed, handed to `iotlb_sync`.
#[derive(Debug, Clone, Default)]
pub struct IotlbGather {
    /// First and last IOVA pfn unmapped (inclusive); `start > end` means empty.
    pub start: u64,
    pub end: u64,
    /// Page-table pages freed by the unmap (their walk-cache entries must go: no IH).
    pub freed_tables: u32,
    /// log2 bytes of the leaf pages unmapped (gather->pgsize; the largest when sizes were mixed).
    pub pgsize_shift: u32,
}

impl IotlbGather {
    pub fn new() -> Self {
        IotlbGather {
            start: u64::MAX,
            end: 0,
            freed_tables: 0,
            pgsize_shift: 0,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.start > self.end
    }
    /// Pages from start to end (0 when empty).
    pub fn pages(&self) -> u64 {
        if self.is_empty() {
            0
        } else {
            self.end - self.start + 1
        }
    }
    /// iommu_iotlb_gather_add_range(): widen to cover [pfn, pfn + n).
    pub fn add_range(&mut self, pfn: u64, n: u64) {
        self.start = self.start.min(pfn);
        self.end = self.end.max(pfn + n - 1);
    }
    /// iommu_iotlb_gather_is_disjoint(): `other` neither overlaps nor touches this non-empty range (the
    /// caller syncs what it gathered before adding it).
    pub fn is_disjoint(&self, other: &IotlbGather) -> bool {
        !self.is_empty()
            && !other.is_empty()
            && (other.end + 1 < self.start || other.start > self.end + 1)
    }
    /// Add another unmap's gather (range, freed tables, page size).
    pub fn merge(&mut self, other: &IotlbGather) {
        if other.is_empty() {
            return;
        }
        self.add_range(other.start, other.pages());
        self.freed_tables += other.freed_tables;
        self.pgsize_shift = self.pgsize_shift.max(other.pgsize_shift);
    }
}

/// What one device-side translation did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Translation {
    /// Served by the device's ATS cache (no request reached the IOMMU).
    pub atc_hit: bool,
    /// The device missed its ATS cache and sent a translation request to the IOMMU.
    pub ats_request: bool,
    pub iotlb_hit: bool,
    /// Page-walk memory reads needed (0 on an IOTLB hit).
    pub walk_reads: u32,
    /// Which levels those reads were at: bit L set = an entry of level L was read (level 1 = leaf PTEs).
    pub walk_levels: u8,
    /// The physical pfn the DMA reaches (None: it faults).
    pub phys: Option<u64>,
    /// The translation came from a cached entry the page table no longer holds (unmapped or remapped
    /// but not yet invalidated): through the IOTLB or ATC the device reached `phys`, a page it should
    /// not; through a walk cache it read a cleared table page (`phys` None).
    pub stale: bool,
}

impl Translation {
    pub fn fault(&self) -> bool {
        self.phys.is_none()
    }
}

/// What an invalidation command does, whatever the vendor calls it: the core counts and compares by this, and
/// reports each vendor's commands by their own names ([`InvKind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvClass {
    /// IOTLB entries of an address range in one domain (VT-d PSI, SMMUv3 TLBI by VA or IPA, virtio-iommu UNMAP).
    Range,
    /// Every IOTLB entry of one domain (VT-d DSI, SMMUv3 TLBI by ASID or VMID).
    Domain,
    /// Every IOTLB entry of every domain.
    Global,
    /// A device's ATS translation cache (VT-d device-TLB, SMMUv3 ATC).
    DevTlb,
    /// A device's cached configuration (VT-d context entry, SMMUv3 STE and CD, virtio-iommu ATTACH).
    Config,
    /// The write buffer (VT-d RWBF).
    WriteBuffer,
    /// A new mapping told to the IOMMU (virtio-iommu MAP): no invalidation.
    Map,
}

pub const INV_CLASSES: usize = 7;

impl InvClass {
    /// IOMMU TLB invalidations (counted in `invalidations.total`); device-side ATC or device-TLB ones,
    /// configuration-cache, write-buffer flushes and map requests are not.
    pub fn is_iotlb(self) -> bool {
        matches!(self, InvClass::Range | InvClass::Domain | InvClass::Global)
    }
}

/// One of a vendor's invalidation commands (or requests), named as its specification and Linux driver name
/// it; declared by the vendor's file, counted in its IOMMU's `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvKind {
    pub name: &'static str,
    pub class: InvClass,
    pub slot: u8,
}

/// Invalidation kinds an IOMMU may declare.
pub const INV_SLOTS: usize = 8;

impl InvKind {
    pub const fn new(slot: u8, name: &'static str, class: InvClass) -> Self {
        assert!((slot as usize) < INV_SLOTS);
        InvKind { name, class, slot }
    }
}

/// Invalidations by type, synchronisations, and the cache counters behind translations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IommuCounters {
    /// Invalidation descriptors/commands, by the vendor's `InvKind::slot`.
    pub inv: [u64; INV_SLOTS],
    /// The same, by what they do.
    pub by_class: [u64; INV_CLASSES],
    /// Synchronisations waited for: VT-d wait descriptors, SMMUv3 CMD_SYNCs.
    pub syncs: u64,
    /// Submissions to the hardware queue (qi_submit_sync calls, command-list issues).
    pub submissions: u64,
    /// Time CPUs spent waiting for invalidation completion: from the request to its completion, less
    /// `cmdq_insert_ns`.
    pub inv_wait_ns: u64,
    /// Of an invalidation the CPU waits for, the time until the hardware can see its commands: a shared
    /// command queue's insertion (SMMUv3's arm_smmu_cmdq_issue_cmdlist() before its CMD_SYNC poll: the llq
    /// cmpxchg loop, the shared lock, valid_map, the owner's wait, gather and doorbell; before 5.4
    /// cmdq.lock and the command writes). Zero where the model does not split it out (VT-d, AMD-Vi,
    /// RISC-V, virtio-iommu: their whole wait is in `inv_wait_ns`). The two sum to the time from the request
    /// to its completion.
    pub cmdq_insert_ns: u64,
    pub translations: u64,
    /// Device ATS-cache hits and misses (zero without ATS).
    pub atc_hits: u64,
    pub atc_misses: u64,
    /// IOTLB lookups that missed (hits = lookups - misses; lookups = translations - ATC hits).
    pub iotlb_misses: u64,
    /// Paging-structure-cache hits and misses per non-leaf level, top level first (F&S PTcache-L1, L2, L3).
    pub pwc_hits: [u64; 4],
    pub pwc_misses: [u64; 4],
    pub walk_reads: u64,
    pub faults: u64,
    /// Translations served from an entry the page table no longer holds.
    pub stale_hits: u64,
    /// A lock-free shared command queue (SMMUv3's arm_smmu_cmdq_issue_cmdlist): cmpxchg attempts on the
    /// producer index, and the ones that reserved slots (zero where a lock serialises the queue).
    pub cas_attempts: u64,
    pub cas_successes: u64,
    /// Submissions whose commands another CPU's doorbell write carried (a lock-free queue's owner gathers
    /// the others'): doorbells = submissions - gathered.
    pub gathered: u64,
    /// Leaf entries (pages or blocks) cleared by unmaps.
    pub ptes_cleared: u64,
    /// Leaf entries a map wrote over while they were still present (iommu_map() refuses that with -EEXIST;
    /// only a replayed trace's domains mixed up, or its unmaps lost, make one).
    pub leaves_replaced: u64,
    /// Page-table pages allocated and freed by map/unmap.
    pub table_pages_allocated: u64,
    pub table_pages_freed: u64,
}

impl IommuCounters {
    pub fn count(&mut self, k: InvKind, n: u64) {
        self.inv[k.slot as usize] += n;
        self.by_class[k.class as usize] += n;
    }
    pub fn get(&self, k: InvKind) -> u64 {
        self.inv[k.slot as usize]
    }
    /// Commands of one class, whatever the vendor calls them.
    pub fn class(&self, c: InvClass) -> u64 {
        self.by_class[c as usize]
    }
    /// IOMMU TLB invalidations of every type.
    pub fn invalidations(&self) -> u64 {
        [InvClass::Range, InvClass::Domain, InvClass::Global]
            .iter()
            .map(|&c| self.class(c))
            .sum()
    }
}

/// An IOMMU as the DMA layer and the device see it. Times: the caller passes `now` and gets back the time it
/// is released (it spins on completion in between).
pub trait Iommu: Send + Sync {
    fn name(&self) -> &'static str;
    /// The invalidation types this IOMMU issues (reported, zeros included, in this order).
    fn inv_kinds(&self) -> &'static [InvKind];
    /// The translation side (page tables, IOTLB, walk caches, counters) the vendor's commands act on.
    fn translator(&self) -> &translator::Translator;
    fn translator_mut(&mut self) -> &mut translator::Translator;
    /// Install `n` 4 KiB leaf PTEs. Returns the number of PTEs written.
    fn map_pages(&mut self, dom: DomainId, iova_pfn: u64, phys_pfn: u64, n: u64) -> u64 {
        self.translator_mut().map(dom, iova_pfn, phys_pfn, n)
    }
    /// Install mappings made before the simulation could see them (a replayed trace's unmap of a range mapped
    /// before tracing began): the state a map would leave, without counting or costing any request.
    fn map_untraced(&mut self, dom: DomainId, iova_pfn: u64, phys_pfn: u64, n: u64) {
        self.translator_mut().map(dom, iova_pfn, phys_pfn, n);
    }
    /// Clear `n` leaf PTEs, freeing emptied table pages, and record the range in `gather`. Returns pages
    /// unmapped and the release time (io-pgtable-arm flushes freed tables right here: tlb_flush_walk).
    fn unmap_pages(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> (u64, Time);
    /// After a map: needed only where hardware may cache non-present entries (caching mode) or has RWBF.
    fn iotlb_sync_map(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
    ) -> Time;
    /// After an unmap (strict): invalidate the gathered range and wait for completion.
    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, gather: &IotlbGather) -> Time;
    /// The driver's page-selective invalidations carry the hint that only leaf entries changed whenever the
    /// unmap freed no table (the F&S dmar.c fix on VT-d). SMMUv3's iotlb_sync already sends Leaf = 1, and
    /// virtio-iommu has no hint, so only VT-d changes.
    fn honour_psi_ih(&mut self) {}
    /// The first kernel whose driver has map_pages/unmap_pages, one call walking the table once per leaf
    /// table; before, iommu_map() called it once per page, each call walking down again. VT-d: "iommu/vt-d:
    /// Implement map/unmap_pages() iommu_ops callback" (5.15).
    fn map_pages_since(&self) -> KernelVersion {
        KernelVersion(5, 15)
    }
    /// Whole-domain invalidation and wait (the flush queue's flush_iotlb_all).
    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time;
    /// attach_dev: install the device's context (VT-d context/PASID entry, SMMUv3 STE and CD) pointing at
    /// `dom` and invalidate what the hardware may have cached of the old one.
    fn attach_dev(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time;
    /// 4 KiB pages per translation granule (the IOVA granule of the DMA layer).
    fn granule_pages(&self) -> u64 {
        self.translator().format().granule_pages()
    }
    /// Device side: translate one 4 KiB page of IOVA at `now`, after the invalidations processed by then.
    fn translate(&mut self, now: Time, dom: DomainId, iova_pfn: u64) -> Translation {
        let tr = self.translator_mut();
        tr.settle(now);
        tr.translate(dom, iova_pfn)
    }
    /// Physical pfn mapped at `iova_pfn`, if any (iova_to_phys).
    fn iova_to_phys(&self, dom: DomainId, iova_pfn: u64) -> Option<u64> {
        self.translator().lookup(dom, iova_pfn)
    }
    fn counters(&self) -> &IommuCounters {
        &self.translator().c
    }
    /// The shared lines and locks of the invalidation path, by name, with what they cost their users.
    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        Vec::new()
    }
    /// An emulated IOMMU's exits to the hypervisor (None on bare metal).
    fn exit_stats(&self) -> Option<emul::ExitStats> {
        None
    }
    /// A device's MSI write goes through the IOMMU's translation (SMMUv3: the ITS doorbell is an IOVA
    /// iommu_dma_prepare_msi() mapped); VT-d's interrupt range and virtio-iommu's reserved MSI region
    /// bypass it.
    fn translates_msi(&self) -> bool {
        false
    }
    /// An emulated IOMMU's handler runs under QEMU's big lock (the BQL), which QEMU's own device models
    /// take too: the server both queue on.
    fn bql(&mut self) -> Option<&mut sim::FifoServer> {
        None
    }
}

/// In tests: a time after every invalidation handed over has been processed.
#[cfg(test)]
pub(crate) const LATER: Time = Time::MAX;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Map(u64, u64),
        Unmap(u64, u64),
        Sync,
        FlushAll,
        Translate(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..64, 1u64..4).prop_map(|(p, n)| Op::Map(p, n)),
            // Aligned 2 MiB regions: superpages / blocks where the format has them.
            (1u64..4).prop_map(|k| Op::Map(k * 512, 512)),
            (0u64..64, 1u64..4).prop_map(|(p, n)| Op::Unmap(p, n)),
            (0u64..2048, 1u64..600).prop_map(|(p, n)| Op::Unmap(p, n)),
            Just(Op::Sync),
            Just(Op::FlushAll),
            (0u64..67).prop_map(Op::Translate),
            (0u64..2048).prop_map(Op::Translate),
        ]
    }

    /// An IOMMU of each vendor, in one of the table formats, with or without a device ATC.
    fn iommu(kind: u8, ats: bool) -> Box<dyn Iommu> {
        let atc = ats.then_some(16);
        let k612 = crate::kernel::KernelVersion(6, 12);
        match kind {
            4 => Box::new(amdvi::tests::amd_with(&amdvi::tests::cfg(false), atc, k612)),
            5 => Box::new(amdvi::tests::amd_with(&amdvi::tests::cfg(true), atc, k612)),
            // The RISC-V driver enables no ATS (RiscvDriver::enables_ats).
            6 => Box::new(riscv::tests::riscv_with(&riscv::tests::cfg(), None)),
            0 => Box::new(vtd::tests::vtd_with(&vtd::tests::cfg(), atc)),
            1 => Box::new(smmuv3::tests::smmu_with(
                &smmuv3::tests::cfg(true, false),
                1,
                atc,
            )),
            2 => Box::new(smmuv3::tests::smmu_with(
                &smmuv3::tests::cfg(false, false),
                1,
                atc,
            )),
            _ => {
                let mut c = smmuv3::tests::cfg(true, false);
                c.granule_kb = 64;
                c.pwc_entries = vec![4, 28];
                Box::new(smmuv3::tests::smmu_with(&c, 1, atc))
            }
        }
    }

    proptest! {
        /// Once an invalidation covering an IOVA has completed, no translation of it hits a stale IOTLB,
        /// walk-cache or ATC entry; a stale hit happens only for an IOVA unmapped (or remapped) since its
        /// last covering invalidation, and every one is counted.
        #[test]
        fn no_stale_hit_after_covering_invalidation(kind in 0u8..7, ats in any::<bool>(), ops in proptest::collection::vec(op(), 1..300)) {
            let mut v = iommu(kind, ats);
            let g = v.granule_pages();
            let mut phys_next = 4096;
            let mut pending: Option<IotlbGather> = None; // unmapped, not yet synced
            let mut unsynced = std::collections::BTreeSet::new();
            let mut stale_seen = 0;
            for o in ops {
                match o {
                    Op::Map(p, n) => {
                        let (lo, hi) = (p / g * g, (p + n).div_ceil(g) * g);
                        if (lo..hi).all(|x| v.iova_to_phys(1, x).is_none()) {
                            // Physical address with the IOVA's offset inside 2 MiB, so blocks can form.
                            let phys = phys_next + lo % 512;
                            v.map_pages(1, lo, phys, hi - lo);
                            phys_next += 1024;
                        }
                    }
                    Op::Unmap(p, n) => {
                        let gather = pending.get_or_insert_with(IotlbGather::new);
                        let mut one = IotlbGather::new();
                        v.unmap_pages(0, 0, 1, p, n, &mut one);
                        if !one.is_empty() {
                            unsynced.extend(one.start..=one.end);
                            gather.add_range(one.start, one.pages());
                            gather.freed_tables += one.freed_tables;
                            gather.pgsize_shift = gather.pgsize_shift.max(one.pgsize_shift);
                        }
                    }
                    Op::Sync => {
                        if let Some(gather) = pending.take() {
                            v.iotlb_sync(0, 0, 1, &gather);
                        }
                        unsynced.clear();
                    }
                    Op::FlushAll => {
                        v.flush_iotlb_all(0, 0, 1);
                        pending = None;
                        unsynced.clear();
                    }
                    Op::Translate(p) => {
                        let t = v.translate(LATER, 1, p);
                        if t.stale {
                            stale_seen += 1;
                            prop_assert!(unsynced.contains(&p), "stale hit on {} after its invalidation", p);
                        } else if let Some(ph) = t.phys {
                            prop_assert_eq!(Some(ph), v.iova_to_phys(1, p));
                        } else {
                            prop_assert_eq!(v.iova_to_phys(1, p), None);
                        }
                    }
                }
            }
            prop_assert_eq!(v.counters().stale_hits, stale_seen);
        }

        /// A sync's completion (VT-d's wait descriptor, SMMUv3's CMD_SYNC, AMD-Vi's COMPLETION_WAIT, the RISC-V
        /// IOFENCE.C) orders every invalidation queued before it: at the instant the CPU is released, no page
        /// the sync covered translates from a stale entry, though each was cached just before the unmap.
        #[test]
        fn a_sync_orders_what_was_queued_before_it(kind in 0u8..7, ats in any::<bool>(),
                                                   ranges in proptest::collection::vec((0u64..2048, 1u64..600), 1..20)) {
            let mut v = iommu(kind, ats);
            let g = v.granule_pages();
            v.map_pages(1, 0, 4096, 2048);
            let mut now: Time = 0;
            for (p, n) in ranges {
                let (lo, hi) = (p / g * g, (p + n).min(2048).div_ceil(g) * g);
                for x in lo..hi {
                    v.translate(now, 1, x);
                }
                let mut gather = IotlbGather::new();
                let (_, t) = v.unmap_pages(now, 0, 1, lo, hi - lo, &mut gather);
                let t = v.iotlb_sync(t, 0, 1, &gather);
                for x in lo..hi {
                    let tr = v.translate(t, 1, x);
                    prop_assert!(!tr.stale, "kind {} page {} stale at the sync's release {}", kind, x, t);
                }
                v.map_pages(1, lo, 4096 + lo, hi - lo);
                now = v.iotlb_sync_map(t, 0, 1, lo, hi - lo) + 1;
            }
        }
    }
}
