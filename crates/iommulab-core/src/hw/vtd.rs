//! Intel VT-d: second-level page table, IOTLB and paging-structure caches (shared [`Translator`]), and queued
//! invalidation (PSI with address mask, DSI, global, wait descriptor) through one hardware queue that all CPUs
//! submit to under the queue lock.

use super::translator::Translator;
use super::{DomainId, InvKind, Iommu, IotlbGather};
use crate::scenario::{IommuProfile, VtdProfile};
use crate::sim::{SpinLock, Time};

/// One invalidation descriptor (VT-d spec, "IOTLB Invalidate Descriptor": granularity G, DID, ADDR, AM, IH).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvDesc {
    /// Page-selective-within-domain: 2^am pages at `addr_pfn` (aligned); `ih` keeps paging-structure caches.
    Psi {
        dom: DomainId,
        addr_pfn: u64,
        am: u32,
        ih: bool,
    },
    /// Domain-selective.
    Dsi {
        dom: DomainId,
    },
    Global,
}

/// drivers/iommu/intel/cache.c calculate_psi_aligned_address(): the smallest naturally aligned power-of-two
/// block holding [start, start + pages). Returns (aligned base pfn, address mask AM).
pub fn psi_aligned(start_pfn: u64, pages: u64) -> (u64, u32) {
    let aligned = pages.max(1).next_power_of_two();
    let bitmask = aligned - 1;
    let mut mask = aligned.trailing_zeros();
    if bitmask & start_pfn != 0 {
        let end_pfn = start_pfn + pages - 1;
        let shared = !(start_pfn ^ end_pfn) & !bitmask;
        mask = if shared != 0 {
            shared.trailing_zeros()
        } else {
            64
        };
    }
    let base = if mask >= 64 {
        0
    } else {
        start_pfn & !((1u64 << mask) - 1)
    };
    (base, mask)
}

pub struct Vtd {
    cfg: VtdProfile,
    tr: Translator,
    q_lock: SpinLock,
    /// The invalidation hardware as a server: busy while it processes descriptors.
    hw: SpinLock,
}

impl Vtd {
    pub fn new(p: &IommuProfile) -> Self {
        Vtd {
            cfg: p
                .vtd
                .clone()
                .expect("validated: vendor vtd has [iommu.vtd]"),
            tr: Translator::new(p),
            q_lock: SpinLock::default(),
            hw: SpinLock::default(),
        }
    }

    /// Apply a descriptor's effect on the translation caches.
    fn apply(&mut self, d: InvDesc) {
        match d {
            InvDesc::Psi {
                dom,
                addr_pfn,
                am,
                ih,
            } => {
                self.tr.c.count(InvKind::Psi, 1);
                self.tr
                    .invalidate_range(dom, addr_pfn, 1u64 << am.min(63), ih);
            }
            InvDesc::Dsi { dom } => {
                self.tr.c.count(InvKind::Dsi, 1);
                self.tr.invalidate_domain(dom);
            }
            InvDesc::Global => {
                self.tr.c.count(InvKind::Global, 1);
                self.tr.invalidate_all();
            }
        }
    }

    /// dmar.c qi_submit_sync(): write the descriptors and a wait descriptor under q_lock, ring the tail, then
    /// spin (lock dropped) until the hardware has processed the wait descriptor. Returns the release time.
    pub fn qi_submit_sync(&mut self, now: Time, descs: &[InvDesc]) -> Time {
        let n = descs.len() as u64 + 1;
        let (_, written) = self.q_lock.acquire(now, n * self.cfg.submit_desc_ns);
        // The hardware drains the queue in order, one descriptor after another.
        let (_, done) = self.hw.acquire(
            written,
            descs.len() as u64 * self.cfg.inv_desc_ns + self.cfg.inv_wait_ns,
        );
        for &d in descs {
            self.apply(d);
        }
        self.tr.c.syncs += 1;
        self.tr.c.submissions += 1;
        self.tr.c.inv_wait_ns += done - now;
        done
    }

    /// cache.c cache_tag_flush_range(): PSI for the aligned block, or DSI when the mask exceeds MAMV.
    fn flush_range(
        &mut self,
        now: Time,
        dom: DomainId,
        start_pfn: u64,
        pages: u64,
        ih: bool,
    ) -> Time {
        let (base, am) = psi_aligned(start_pfn, pages);
        let d = if am > self.cfg.mamv {
            InvDesc::Dsi { dom }
        } else {
            InvDesc::Psi {
                dom,
                addr_pfn: base,
                am,
                ih,
            }
        };
        self.qi_submit_sync(now, &[d])
    }
}

impl Iommu for Vtd {
    fn name(&self) -> &'static str {
        "vtd"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        &[InvKind::Psi, InvKind::Dsi, InvKind::Global, InvKind::DevTlb]
    }

    fn translator(&self) -> &Translator {
        &self.tr
    }

    fn translator_mut(&mut self) -> &mut Translator {
        &mut self.tr
    }

    fn unmap_pages(
        &mut self,
        now: Time,
        _cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> (u64, Time) {
        // Freed table pages wait for the sync (IH=0 then), unlike io-pgtable-arm's immediate flush_walk.
        (self.tr.unmap(dom, iova_pfn, n, gather), now)
    }

    fn iotlb_sync_map(
        &mut self,
        now: Time,
        _cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
    ) -> Time {
        // intel_iommu_iotlb_sync_map → cache_tag_flush_range_np(): a PSI only in caching mode.
        if self.cfg.caching_mode {
            self.flush_range(now, dom, iova_pfn, n, false)
        } else {
            now
        }
    }

    fn iotlb_sync(&mut self, now: Time, _cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        // intel_iommu_tlb_sync(): IH only when no page-table pages were freed.
        self.flush_range(now, dom, g.start, g.pages(), g.freed_tables == 0)
    }

    fn flush_iotlb_all(&mut self, now: Time, _cpu: usize, dom: DomainId) -> Time {
        // cache_tag_flush_all(): DSI.
        self.qi_submit_sync(now, &[InvDesc::Dsi { dom }])
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small VT-d configuration for unit tests across the crate.
    pub(crate) fn cfg() -> IommuProfile {
        IommuProfile {
            iotlb_entries: 64,
            iotlb_ways: 4,
            pwc_entries: vec![16, 16, 16],
            pt_levels: 4,
            vtd: Some(VtdProfile {
                inv_desc_ns: 400,
                inv_wait_ns: 200,
                submit_desc_ns: 40,
                mamv: 9,
                caching_mode: false,
            }),
            smmuv3: None,
        }
    }

    #[test]
    fn psi_mask_for_unaligned_three_pages() {
        // pfn 0x1005..0x1007: 3 pages → 4 aligned would be 0x1004..0x1007, which holds it: AM 2.
        assert_eq!(psi_aligned(0x1005, 3), (0x1004, 2));
        // pfn 0x1007..0x1009 crosses an 8-page boundary: AM grows to 4 (0x1000..0x100f).
        assert_eq!(psi_aligned(0x1007, 3), (0x1000, 4));
        assert_eq!(psi_aligned(0x2000, 1), (0x2000, 0));
    }

    #[test]
    fn mask_above_mamv_falls_back_to_dsi() {
        let mut v = Vtd::new(&cfg());
        let mut g = IotlbGather::new();
        v.map_pages(1, 0, 100, 1024);
        v.unmap_pages(0, 0, 1, 0, 1024, &mut g); // 1024 pages: AM 10 > MAMV 9
        v.iotlb_sync(0, 0, 1, &g);
        assert_eq!(
            (
                v.tr.c.get(InvKind::Psi),
                v.tr.c.get(InvKind::Dsi),
                v.tr.c.syncs
            ),
            (0, 1, 1)
        );
    }

    #[test]
    fn walk_caches_cut_reads_and_psi_without_ih_drops_them() {
        let mut v = Vtd::new(&cfg());
        v.map_pages(1, 0x40000, 7, 4);
        let t = v.translate(1, 0x40000);
        assert_eq!((t.iotlb_hit, t.walk_reads), (false, 4));
        assert!(v.translate(1, 0x40000).iotlb_hit);
        let t = v.translate(1, 0x40001); // same leaf table: PDE cached
        assert_eq!(t.walk_reads, 1);
        // IH=1 keeps the walk caches, IH=0 drops them.
        v.qi_submit_sync(
            0,
            &[InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x40002,
                am: 0,
                ih: true,
            }],
        );
        assert_eq!(v.translate(1, 0x40002).walk_reads, 1);
        v.qi_submit_sync(
            0,
            &[InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x40003,
                am: 0,
                ih: false,
            }],
        );
        assert_eq!(v.translate(1, 0x40003).walk_reads, 4);
    }

    #[test]
    fn stale_iotlb_entry_hits_until_invalidated() {
        let mut v = Vtd::new(&cfg());
        v.map_pages(1, 10, 99, 1);
        v.translate(1, 10);
        let mut g = IotlbGather::new();
        v.unmap_pages(0, 0, 1, 10, 1, &mut g);
        let t = v.translate(1, 10);
        assert!(
            t.iotlb_hit && t.stale && t.phys == Some(99),
            "unmapped, not invalidated: stale hit"
        );
        assert_eq!(v.tr.c.stale_hits, 1);
        v.iotlb_sync(0, 0, 1, &g);
        let t = v.translate(1, 10);
        assert!(!t.iotlb_hit && t.fault());
    }

    #[test]
    fn shared_queue_serialises_cpus() {
        let mut v = Vtd::new(&cfg());
        let a = v.flush_iotlb_all(0, 0, 1);
        let b = v.flush_iotlb_all(0, 0, 1);
        assert_eq!(a, 80 + 400 + 200);
        assert!(b >= a + 600, "second submitter waits behind the first: {b}");
    }

    #[test]
    fn caching_mode_invalidates_on_map() {
        let mut c = cfg();
        c.vtd.as_mut().unwrap().caching_mode = true;
        let mut v = Vtd::new(&c);
        v.map_pages(1, 5, 5, 1);
        v.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(v.tr.c.get(InvKind::Psi), 1);
        let mut v = Vtd::new(&cfg());
        v.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(v.tr.c.get(InvKind::Psi), 0);
    }
}
