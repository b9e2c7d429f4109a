//! A device's descriptor or completion ring in coherent DMA memory (dma_alloc_coherent: physically
//! contiguous here, one IOVA range mapped at setup and kept). The device reads or writes its entries in
//! order, so each access translates the page holding the next entry.

use crate::host::Host;
use crate::hw::PAGE_SIZE as PAGE;
use crate::sim::Time;

pub struct DescRing {
    dma: u64,
    entries: u64,
    entry_bytes: u64,
    next: u64,
}

impl DescRing {
    /// Allocate and map a ring of `entries` × `entry_bytes` on `cpu` at `t`. None when memory or IOVA
    /// space ran out.
    pub fn alloc(
        host: &mut Host,
        cpu: usize,
        entries: u64,
        entry_bytes: u64,
        t: Time,
    ) -> Option<(Self, Time)> {
        let pages = (entries * entry_bytes).div_ceil(PAGE).max(1);
        let phys = host.pages.alloc_contiguous(pages)?;
        // A ring the device and driver share: dma_alloc_coherent, never bounced.
        let (dma, t) = host.dma_alloc_coherent(t, cpu, phys, pages)?;
        Some((
            DescRing {
                dma,
                entries: entries.max(1),
                entry_bytes,
                next: 0,
            },
            t,
        ))
    }

    pub fn entry_bytes(&self) -> u64 {
        self.entry_bytes
    }

    /// The DMA page of the next entry; the ring advances.
    pub fn next_page(&mut self) -> u64 {
        let page = self.next * self.entry_bytes / PAGE;
        self.next = (self.next + 1) % self.entries;
        self.dma + page
    }
}
