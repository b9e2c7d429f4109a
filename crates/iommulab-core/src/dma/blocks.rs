//! Block batching with recycling (iommulab's own scheme; seed 002 §5.1: "keep recycled pages mapped within
//! the same contiguous IOVA regions, and maintain per-region reference counting so a region is only
//! unmapped/freed when no page in that region is in use").
//! - Every mapping takes the next slots of its CPU's 64-granule IOVA chunk ([`super::chunks`]), so the
//!   pages page_pool maps on refill sit side by side, and page_pool keeps recycling them, mapped, exactly
//!   as under strict: nothing changes for a page that stays in the pool.
//! - dma_unmap clears the PTEs without an invalidation and holds the page (it does not go back to its
//!   owner) on its CPU's list, grouped by chunk.
//! - At the end of each NAPI poll or TX completion batch, or when the CPU holds BLOCKS_PENDING_THRESHOLD
//!   pages, each chunk with held pages gets one page-selective invalidation over the span of its unmapped
//!   slots, with IH (no table was freed, so the walk caches stay); the held pages then go back.
//! - A chunk's IOVA is freed only when it is full and every slot has been unmapped and invalidated (its
//!   reference count), so the IOVA of a cached translation is never handed out again, unlike xSMMU.
//!
//! Against xSMMU: a PSI per chunk instead of a DSI per batch keeps other chunks' IOTLB entries and every
//! walk-cache entry. Against F&S: recycling kept, and one invalidation per chunk per batch instead of per
//! descriptor.

use super::chunks::IovaChunks;
use super::safety::Ticket;
use super::xsmmu::XSMMU_PENDING_THRESHOLD;
use super::{DmaCore, DmaPolicy};
use crate::hw::IotlbGather;
use crate::scenario::PolicyName;
use crate::sim::PerCpu;
use crate::sim::Time;

/// Held pages per CPU that force the invalidations before the batch ends: the same bound as xSMMU's
/// pending list, so the two hold comparable memory.
pub const BLOCKS_PENDING_THRESHOLD: u64 = XSMMU_PENDING_THRESHOLD as u64;

/// The unmaps of one chunk waiting for its invalidation.
struct Held {
    /// The chunk's base granule (None: a range no chunk holds, as a replayed trace's).
    chunk: Option<u64>,
    gather: IotlbGather,
    tickets: Vec<Ticket>,
    segs: Vec<(u64, u64)>,
}

/// One CPU's held unmaps, by chunk in the order the chunks were first touched, and their pages.
#[derive(Default)]
struct CpuHeld {
    list: Vec<Held>,
    pages: u64,
}

pub struct Blocks {
    chunks: IovaChunks,
    held: PerCpu<CpuHeld>,
}

impl Blocks {
    pub fn new(cpus: usize) -> Self {
        Blocks {
            chunks: IovaChunks::new(cpus, true),
            held: PerCpu::new(cpus),
        }
    }

    /// One invalidation per chunk with held pages, then the pages go back and the slots are done.
    fn sync(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        let mut t = now;
        let held = std::mem::take(self.held.get_mut(cpu));
        for h in held.list {
            t = core.iotlb_sync(t, cpu, &h.gather);
            for k in h.tickets {
                core.safety.released_ticket(k, t);
            }
            for (iova, pages) in h.segs {
                t = self.chunks.put(core, t, cpu, iova, pages);
            }
        }
        t
    }
}

impl DmaPolicy for Blocks {
    fn name(&self) -> PolicyName {
        PolicyName::Blocks
    }
    fn holds_pages(&self) -> bool {
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
        let mut t = now;
        if self.held.get_mut(cpu).pages >= BLOCKS_PENDING_THRESHOLD {
            t = self.sync(core, t, cpu);
        }
        let (g, t, ticket) = core.unmap_ptes(t, cpu, iova_pfn, pages);
        let chunk = self.chunks.chunk_of(core, iova_pfn);
        let held = self.held.get_mut(cpu);
        let list = &mut held.list;
        // The chunk unmapped last is the likeliest: look from the end (each chunk has one entry).
        let i = match list
            .iter()
            .rposition(|h| chunk.is_some() && h.chunk == chunk)
        {
            Some(i) => i,
            None => {
                list.push(Held {
                    chunk,
                    gather: IotlbGather::new(),
                    tickets: Vec::new(),
                    segs: Vec::new(),
                });
                list.len() - 1
            }
        };
        let h = &mut list[i];
        h.gather.merge(&g);
        h.tickets.push(ticket);
        h.segs.push((iova_pfn, pages));
        held.pages += pages;
        t
    }
    fn batch_end(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        match self.held.get(cpu) {
            Some(h) if !h.list.is_empty() => self.sync(core, now, cpu),
            _ => now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::flush_queue::tests::core;
    use crate::hw::InvClass;

    #[test]
    fn one_psi_per_chunk_per_batch_and_pages_held_until_it() {
        let mut c = core(1);
        let mut b = Blocks::new(1);
        let mut t = 0;
        let mut iovas = vec![];
        // 70 pages: one full chunk and six slots of a second.
        for p in 0..70 {
            let (iova, t2) = b.map(&mut c, t, 0, 1000 + 3 * p, 1).unwrap();
            iovas.push(iova);
            t = t2;
        }
        // Unmap every other page: both chunks get held pages.
        for &i in iovas.iter().step_by(2) {
            t = b.unmap(&mut c, t, 0, i, 1);
        }
        assert_eq!(c.iommu.counters().invalidations(), 0);
        assert_eq!(c.safety.exposed_open(t), 0);
        assert_eq!(c.iommu.iova_to_phys(c.dom, iovas[0]), None, "PTE cleared");
        let t = b.batch_end(&mut c, t, 0);
        assert_eq!(
            c.iommu.counters().class(InvClass::Range),
            2,
            "one PSI per chunk"
        );
        assert_eq!(c.iommu.counters().class(InvClass::Domain), 0);
        assert_eq!(
            (c.safety.stats.pages_settled, c.safety.stats.pages_exposed),
            (35, 0)
        );
        // Recycled (still mapped) pages keep their translations and their slots.
        assert_eq!(c.iommu.iova_to_phys(c.dom, iovas[1]), Some(1003));
        assert_eq!(b.chunks.freed, 0, "no chunk is empty yet");
        let mut t = t;
        for &i in iovas[..64].iter().skip(1).step_by(2) {
            t = b.unmap(&mut c, t, 0, i, 1);
        }
        b.batch_end(&mut c, t, 0);
        assert_eq!(
            b.chunks.freed, 1,
            "the full chunk goes back once all its slots are invalidated"
        );
    }

    #[test]
    fn a_full_held_list_syncs_before_the_batch_ends() {
        let mut c = core(1);
        let mut b = Blocks::new(1);
        let mut t = 0;
        for p in 0..=BLOCKS_PENDING_THRESHOLD {
            let (iova, t2) = b.map(&mut c, t, 0, 1000 + p, 1).unwrap();
            t = b.unmap(&mut c, t2, 0, iova, 1);
        }
        assert_eq!(
            c.iommu.counters().class(InvClass::Range),
            BLOCKS_PENDING_THRESHOLD / 64
        );
        assert_eq!(b.held.get(0).map(|h| h.pages), Some(1));
    }
}
