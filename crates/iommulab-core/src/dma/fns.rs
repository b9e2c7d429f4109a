//! F&S (SOSP'24 "Fast & Safe IO Memory Protection", §3): strict safety, each IOTLB miss made cheap.
//! - Contiguous IOVA: an RX multi-packet WQE gets one 64-page block, as FANDS (the same fands.patch RX
//!   path, no recycling); every other mapping (TX frags and heads, ACKs, single-page RX descriptors) takes
//!   the next slots of its CPU's 256 KB chunk, "mapped contiguously to pages across descriptors, in the
//!   same order that they will be accessed by the NIC" ([`super::chunks`]).
//! - Page-walk caches survive: qi_flush_iotlb() takes IH from the address (the patch's dmar.c change), so
//!   a PSI whose unmap freed no table keeps the PTcache entries.
//! - One invalidation per descriptor: a completed descriptor's segments, adjacent in their chunk, are
//!   unmapped into one gather and invalidated by one PSI before dma_unmap returns.

use super::chunks::IovaChunks;
use super::{DmaCore, DmaPolicy};
use crate::hw::IotlbGather;
use crate::scenario::PolicyName;
use crate::sim::Time;

pub struct Fns {
    chunks: IovaChunks,
}

impl Fns {
    pub fn new(cpus: usize) -> Self {
        Fns {
            chunks: IovaChunks::new(cpus, false),
        }
    }
}

impl DmaPolicy for Fns {
    fn name(&self) -> PolicyName {
        PolicyName::Fns
    }
    fn rx_wqe_iova_blocks(&self) -> bool {
        true
    }
    fn psi_ih(&self) -> bool {
        true
    }
    fn map(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        self.chunks.map(core, now, cpu, phys_pfn, pages)
    }
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        self.unmap_desc(core, now, cpu, &[(iova_pfn, pages)])
    }
    fn unmap_desc(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        segs: &[(u64, u64)],
    ) -> Time {
        let mut g = IotlbGather::new();
        let mut t = now;
        for &(iova, pages) in segs {
            let (one, t2, _) = core.unmap_ptes(t, cpu, iova, pages);
            t = t2;
            // iommu_iotlb_gather_add_page(): a range disjoint from the gathered one is synced first.
            if g.is_disjoint(&one) {
                t = core.iotlb_sync(t, cpu, &g);
                g = IotlbGather::new();
            }
            g.merge(&one);
        }
        t = core.iotlb_sync(t, cpu, &g);
        for &(iova, pages) in segs {
            t = self.chunks.put(core, t, cpu, iova, pages);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::flush_queue::tests::core;
    use crate::hw::InvClass;

    #[test]
    fn a_descriptor_of_adjacent_slots_costs_one_psi() {
        let mut c = core(1);
        let mut f = Fns::new(1);
        let mut t = 0;
        let mut segs = vec![];
        for (p, n) in [(100, 1), (300, 2), (900, 1)] {
            let (iova, t2) = f.map(&mut c, t, 0, p, n).unwrap();
            segs.push((iova, n));
            t = t2;
        }
        let t = f.unmap_desc(&mut c, t, 0, &segs);
        assert_eq!(c.iommu.counters().class(InvClass::Range), 1);
        assert_eq!(c.stats.iova_pages_unmapped, 4);
        // A lone single-page descriptor: its own PSI.
        let (iova, t) = f.map(&mut c, t, 0, 77, 1).unwrap();
        f.unmap(&mut c, t, 0, iova, 1);
        assert_eq!(c.iommu.counters().class(InvClass::Range), 2);
        assert_eq!(c.safety.exposed_open(t + 1_000_000), 0);
    }
}
