//! IOMMU hardware: page tables, IOTLB and paging-structure caches, and the invalidation interface.
//!
//! The [`Iommu`] trait mirrors the kernel's `struct iommu_domain_ops` (map_pages, unmap_pages with an iotlb
//! gather, iotlb_sync_map, iotlb_sync, flush_iotlb_all) plus the hardware side the device sees (translate).
//! A vendor is one file implementing it.

pub mod cache;
pub mod pgtable;
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

/// Invalidation descriptors by type, and the cache counters behind translations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IommuCounters {
    /// Page-selective IOTLB invalidations (VT-d PSI).
    pub psi: u64,
    /// Domain-selective IOTLB invalidations (VT-d DSI).
    pub dsi: u64,
    /// Global IOTLB invalidations.
    pub global: u64,
    /// Wait descriptors (one per synchronous submission).
    pub wait: u64,
    /// qi_submit_sync() calls.
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
    pub fn invalidations(&self) -> u64 {
        self.psi + self.dsi + self.global
    }
}

/// An IOMMU as the DMA layer and the device see it. Times: the caller passes `now` and gets back the time it
/// is released (it spins on completion in between).
pub trait Iommu: Send + Sync {
    fn name(&self) -> &'static str;
    /// Install `n` 4 KiB leaf PTEs. Returns the number of PTEs written.
    fn map_pages(&mut self, dom: DomainId, iova_pfn: u64, phys_pfn: u64, n: u64) -> u64;
    /// Clear `n` leaf PTEs, freeing emptied table pages, and record the range in `gather`. Returns pages unmapped.
    fn unmap_pages(
        &mut self,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> u64;
    /// After a map: needed only where hardware may cache non-present entries (caching mode) or has RWBF.
    fn iotlb_sync_map(&mut self, now: Time, dom: DomainId, iova_pfn: u64, n: u64) -> Time;
    /// After an unmap (strict): invalidate the gathered range and wait for completion.
    fn iotlb_sync(&mut self, now: Time, dom: DomainId, gather: &IotlbGather) -> Time;
    /// Whole-domain invalidation and wait (the flush queue's flush_iotlb_all).
    fn flush_iotlb_all(&mut self, now: Time, dom: DomainId) -> Time;
    /// Device side: translate one 4 KiB page of IOVA.
    fn translate(&mut self, dom: DomainId, iova_pfn: u64) -> Translation;
    /// Physical pfn mapped at `iova_pfn`, if any (iova_to_phys).
    fn iova_to_phys(&self, dom: DomainId, iova_pfn: u64) -> Option<u64>;
    fn counters(&self) -> &IommuCounters;
}
