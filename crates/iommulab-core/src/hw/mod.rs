//! IOMMU hardware: page tables, IOTLB and paging-structure caches, and the invalidation interface.
//!
//! The [`Iommu`] trait mirrors the kernel's `struct iommu_domain_ops` (map_pages, unmap_pages with an iotlb
//! gather, iotlb_sync_map, iotlb_sync, flush_iotlb_all) plus the hardware side the device sees (translate).
//! A vendor is one file implementing it.

pub mod cache;
pub mod pgtable;
pub mod smmuv3;
pub mod translator;
pub mod vtd;

use crate::sim::Time;

pub type DomainId = u16;

pub const PAGE_SHIFT: u32 = 12;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

/// After `struct iommu_iotlb_gather` (include/linux/iommu.h): the range an unmap touched and the page-table
/// pages it freed, handed to `iotlb_sync`.
#[derive(Debug, Clone, Default)]
pub struct IotlbGather {
    /// First and last IOVA pfn unmapped (inclusive); `start > end` means empty.
    pub start: u64,
    pub end: u64,
    /// Page-table pages freed by the unmap (their walk-cache entries must go: no IH).
    pub freed_tables: u32,
}

impl IotlbGather {
    pub fn new() -> Self {
        IotlbGather {
            start: u64::MAX,
            end: 0,
            freed_tables: 0,
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
}

/// What one device-side translation did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Translation {
    pub iotlb_hit: bool,
    /// Page-walk memory reads needed (0 on an IOTLB hit).
    pub walk_reads: u32,
    /// The physical pfn the DMA reaches (None: it faults).
    pub phys: Option<u64>,
    /// The translation came from a cached entry the page table no longer holds (unmapped or remapped
    /// but not yet invalidated): the device reached a page it should not.
    pub stale: bool,
}

impl Translation {
    pub fn fault(&self) -> bool {
        self.phys.is_none()
    }
}

/// Invalidation requests by type, named as the specifications and the kernel name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvKind {
    /// VT-d page-selective-within-domain IOTLB invalidation.
    Psi,
    /// VT-d domain-selective IOTLB invalidation.
    Dsi,
    /// VT-d global IOTLB invalidation.
    Global,
    /// VT-d device-TLB (ATS) invalidation.
    DevTlb,
    /// SMMUv3 CMD_TLBI_NH_VA (stage 1, by VA and ASID).
    TlbiNhVa,
    /// SMMUv3 CMD_TLBI_S2_IPA (stage 2, by IPA and VMID).
    TlbiS2Ipa,
    /// SMMUv3 CMD_TLBI_NH_ASID (stage 1, a whole ASID).
    TlbiNhAsid,
    /// SMMUv3 CMD_TLBI_S12_VMALL (a whole VMID).
    TlbiS12Vmall,
    /// SMMUv3 CMD_ATC_INV (ATS translation cache in the device).
    AtcInv,
}

pub const INV_KINDS: usize = 9;

impl InvKind {
    pub const ALL: [InvKind; INV_KINDS] = [
        InvKind::Psi,
        InvKind::Dsi,
        InvKind::Global,
        InvKind::DevTlb,
        InvKind::TlbiNhVa,
        InvKind::TlbiS2Ipa,
        InvKind::TlbiNhAsid,
        InvKind::TlbiS12Vmall,
        InvKind::AtcInv,
    ];
    pub fn name(self) -> &'static str {
        match self {
            InvKind::Psi => "psi",
            InvKind::Dsi => "dsi",
            InvKind::Global => "global",
            InvKind::DevTlb => "devtlb",
            InvKind::TlbiNhVa => "tlbi_nh_va",
            InvKind::TlbiS2Ipa => "tlbi_s2_ipa",
            InvKind::TlbiNhAsid => "tlbi_nh_asid",
            InvKind::TlbiS12Vmall => "tlbi_s12_vmall",
            InvKind::AtcInv => "atc_inv",
        }
    }
    /// IOMMU TLB invalidations (counted in `invalidations.total`); device-side ATC/device-TLB ones are not.
    pub fn is_iotlb(self) -> bool {
        !matches!(self, InvKind::DevTlb | InvKind::AtcInv)
    }
}

/// Invalidations by type, synchronisations, and the cache counters behind translations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IommuCounters {
    /// Invalidation descriptors/commands, indexed by `InvKind as usize`.
    pub inv: [u64; INV_KINDS],
    /// Synchronisations waited for: VT-d wait descriptors, SMMUv3 CMD_SYNCs.
    pub syncs: u64,
    /// Submissions to the hardware queue (qi_submit_sync calls, command-list issues).
    pub submissions: u64,
    /// Time CPUs spent waiting for invalidation completion.
    pub inv_wait_ns: u64,
    pub translations: u64,
    pub iotlb_misses: u64,
    /// Paging-structure-cache misses per non-leaf level, top level first (F&S PTcache-L1, L2, L3).
    pub pwc_misses: [u64; 4],
    pub walk_reads: u64,
    pub faults: u64,
    /// Translations served from an entry the page table no longer holds.
    pub stale_hits: u64,
    /// Page-table pages allocated and freed by map/unmap.
    pub table_pages_allocated: u64,
    pub table_pages_freed: u64,
}

impl IommuCounters {
    pub fn count(&mut self, k: InvKind, n: u64) {
        self.inv[k as usize] += n;
    }
    pub fn get(&self, k: InvKind) -> u64 {
        self.inv[k as usize]
    }
    /// IOMMU TLB invalidations of every type.
    pub fn invalidations(&self) -> u64 {
        InvKind::ALL
            .iter()
            .filter(|k| k.is_iotlb())
            .map(|&k| self.get(k))
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
    /// Whole-domain invalidation and wait (the flush queue's flush_iotlb_all).
    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time;
    /// Device side: translate one 4 KiB page of IOVA.
    fn translate(&mut self, dom: DomainId, iova_pfn: u64) -> Translation {
        self.translator_mut().translate(dom, iova_pfn)
    }
    /// Physical pfn mapped at `iova_pfn`, if any (iova_to_phys).
    fn iova_to_phys(&self, dom: DomainId, iova_pfn: u64) -> Option<u64> {
        self.translator().lookup(dom, iova_pfn)
    }
    fn counters(&self) -> &IommuCounters {
        &self.translator().c
    }
}

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
            (0u64..64, 1u64..4).prop_map(|(p, n)| Op::Unmap(p, n)),
            Just(Op::Sync),
            Just(Op::FlushAll),
            (0u64..67).prop_map(Op::Translate),
        ]
    }

    proptest! {
        /// Once an invalidation covering an IOVA has completed, no translation of it hits a stale entry;
        /// a stale hit happens only for an IOVA unmapped (or remapped) since its last covering invalidation.
        #[test]
        fn no_stale_hit_after_covering_invalidation(smmu in any::<bool>(), ops in proptest::collection::vec(op(), 1..300)) {
            let mut v: Box<dyn Iommu> = if smmu { Box::new(smmuv3::Smmuv3::new(&smmuv3::tests::cfg(true, false), 1)) } else { Box::new(vtd::Vtd::new(&vtd::tests::cfg())) };
            let mut phys_next = 1000;
            let mut pending: Option<IotlbGather> = None; // unmapped, not yet synced
            let mut unsynced = std::collections::BTreeSet::new();
            let mut stale_seen = 0;
            for o in ops {
                match o {
                    Op::Map(p, n) => {
                        if (p..p + n).all(|x| v.iova_to_phys(1, x).is_none()) {
                            v.map_pages(1, p, phys_next, n);
                            phys_next += n;
                        }
                    }
                    Op::Unmap(p, n) => {
                        let g = pending.get_or_insert_with(IotlbGather::new);
                        v.unmap_pages(0, 0, 1, p, n, g);
                        unsynced.extend(p..p + n);
                    }
                    Op::Sync => {
                        if let Some(g) = pending.take() {
                            v.iotlb_sync(0, 0, 1, &g);
                        }
                        unsynced.clear();
                    }
                    Op::FlushAll => {
                        v.flush_iotlb_all(0, 0, 1);
                        pending = None;
                        unsynced.clear();
                    }
                    Op::Translate(p) => {
                        let t = v.translate(1, p);
                        if t.stale {
                            stale_seen += 1;
                            prop_assert!(unsynced.contains(&p), "stale hit on {} after its invalidation", p);
                        } else if let Some(ph) = t.phys {
                            prop_assert_eq!(Some(ph), v.iova_to_phys(1, p));
                        }
                    }
                }
            }
            prop_assert_eq!(v.counters().stale_hits, stale_seen);
        }
    }
}
