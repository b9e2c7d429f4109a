//! xSMMU (seed 002 §3.2, Linux 6.0.3 + xSMMU): dma_unmap_page_attrs_no_sync() clears the PTEs and frees the
//! IOVA with no IOTLB invalidation; the driver holds each page on its queue's pending list, and at the end
//! of the NAPI poll (mlx5e_process_rx_release_batch) or of a TX completion batch, or when the list reaches
//! `iommu_napi_poll_threshold`, dma_sync_device_iotlb() issues one domain-wide invalidation and only then
//! lets the pages go. Page recycling (mlx5 cache, page_pool) is unchanged.
//!
//! intel_sync_domain_iotlb() asks for the DSI with IH = 1, but the hint is defined for page-selective
//! requests only (VT-d IVA_REG.IH: "on a page-selective invalidation request, hardware may preserve the
//! cached non-leaf entries"), so the DSI drops the domain's paging-structure caches like any DSI. On
//! SMMUv3 the same call is a TLBI by ASID.

use super::safety::Ticket;
use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::PerCpu;
use crate::sim::Time;

/// iommu_napi_poll_threshold: pending pages per queue that force a sync before the poll ends (the xSMMU
/// tree's mlx5e pending_release array of 1024).
pub const XSMMU_PENDING_THRESHOLD: usize = 1024;

pub struct Xsmmu {
    /// Per CPU (one queue per CPU): the unmaps whose pages wait for the next sync.
    pending: PerCpu<Vec<Ticket>>,
}

impl Xsmmu {
    pub fn new(cpus: usize) -> Self {
        Xsmmu {
            pending: PerCpu::new(cpus),
        }
    }

    /// dma_sync_device_iotlb(): one domain-wide invalidation, then the held pages go back.
    fn sync(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        let t = core.flush_iotlb_all(now, cpu);
        for k in self.pending.get_mut(cpu).drain(..) {
            core.safety.released_ticket(k, t);
        }
        t
    }
}

impl DmaPolicy for Xsmmu {
    fn name(&self) -> PolicyName {
        PolicyName::Xsmmu
    }
    fn holds_pages(&self) -> bool {
        true
    }
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        let mut t = now;
        if self.pending.get_mut(cpu).len() >= XSMMU_PENDING_THRESHOLD {
            t = self.sync(core, t, cpu);
        }
        // __iommu_dma_unmap_no_sync(): clear the PTEs, free the IOVA, no iommu_iotlb_sync().
        let (_g, t, ticket) = core.unmap_ptes(t, cpu, iova_pfn, pages);
        let t = core.free_iova(t, cpu, iova_pfn, pages);
        self.pending.get_mut(cpu).push(ticket);
        t
    }
    fn batch_end(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        match self.pending.get(cpu) {
            Some(p) if !p.is_empty() => self.sync(core, now, cpu),
            _ => now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::flush_queue::tests::core;
    use crate::hw::InvClass;
    use crate::hw::LATER;

    #[test]
    fn one_dsi_per_batch_and_pages_held_until_it() {
        let mut c = core(2);
        let mut x = Xsmmu::new(2);
        let mut t = 0;
        let mut iovas = vec![];
        for p in 0..10 {
            let (iova, t2) = c.iommu_map(t, 0, 1000 + p, 1).unwrap();
            iovas.push(iova);
            t = t2;
        }
        for &i in &iovas {
            t = x.unmap(&mut c, t, 0, i, 1);
        }
        assert_eq!(c.iommu.counters().invalidations(), 0);
        // Nothing released yet: nothing exposed, nothing settled.
        assert_eq!(c.safety.exposed_open(t), 0);
        assert_eq!(x.batch_end(&mut c, t, 1), t, "CPU 1 holds nothing");
        let t = x.batch_end(&mut c, t, 0);
        assert_eq!(c.iommu.counters().class(InvClass::Domain), 1);
        assert_eq!(
            (c.safety.stats.pages_settled, c.safety.stats.pages_exposed),
            (10, 0)
        );
        assert_eq!(x.batch_end(&mut c, t, 0), t, "an empty list syncs nothing");
    }

    #[test]
    fn an_iova_freed_before_its_dsi_is_reused_and_the_device_reaches_the_held_page() {
        // The published design frees each IOVA at unmap (__iommu_dma_unmap_no_sync), ahead of the DSI. A
        // refill in the same poll takes it back from the rcache (LIFO), and the device, whose IOTLB still
        // holds the old entry, writes into the held page instead of the new one.
        let mut c = core(1);
        let mut x = Xsmmu::new(1);
        let dom = c.dom;
        let (iova, t) = c.iommu_map(0, 0, 1000, 1).unwrap();
        assert_eq!(c.iommu.translate(LATER, dom, iova).phys, Some(1000));
        let t = x.unmap(&mut c, t, 0, iova, 1);
        let (again, t) = c.iommu_map(t, 0, 2000, 1).unwrap();
        assert_eq!(again, iova, "the rcache hands the freed IOVA straight back");
        let tr = c.iommu.translate(LATER, dom, again);
        assert!(tr.stale);
        assert_eq!(
            tr.phys,
            Some(1000),
            "the write lands in the page still on the pending list"
        );
        // Page 1000 is still held, so nothing reaches a page the kernel got back.
        assert_eq!(c.safety.stats.pages_exposed, 0);
        // The poll's DSI ends it.
        x.batch_end(&mut c, t, 0);
        let tr = c.iommu.translate(LATER, dom, again);
        assert_eq!((tr.stale, tr.phys), (false, Some(2000)));
    }

    #[test]
    fn a_full_pending_list_syncs_before_the_poll_ends() {
        let mut c = core(1);
        let mut x = Xsmmu::new(1);
        let mut t = 0;
        for p in 0..=XSMMU_PENDING_THRESHOLD as u64 {
            let (iova, t2) = c.iommu_map(t, 0, 1000 + p, 1).unwrap();
            t = x.unmap(&mut c, t2, 0, iova, 1);
        }
        assert_eq!(c.iommu.counters().class(InvClass::Domain), 1);
        assert_eq!(x.pending.get(0).map(Vec::len), Some(1));
    }
}
