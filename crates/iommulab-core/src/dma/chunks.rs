//! IOVA chunks (F&S, SOSP'24 §3, "contiguous IOVA allocations"): each CPU hands out the slots of one
//! descriptor-sized IOVA chunk in order, mapping each buffer's pages to the next slots, so buffers the
//! device reads one after another share IOVA locality (one PT-L4 page, one PTcache-L3 entry per chunk)
//! instead of scattering over the rcache's magazines. A chunk counts the granules mapped into it that are
//! not yet unmapped, and goes back to the allocator once it is full and that count reaches zero: no IOVA
//! of a chunk is handed out twice while a translation of it may still be cached, so the caller must only
//! `put` a range after the invalidation covering it completed.

use super::DmaCore;
use crate::sim::PerCpu;
use crate::sim::Time;
use std::collections::BTreeMap;

/// Granules per chunk: F&S's descriptor-sized chunk, 256 KB for the 64 pages of an mlx5 RX multi-packet
/// WQE (F&S §3; en.h MLX5_MPWRQ_PAGES_PER_WQE).
pub const CHUNK_GRANULES: u64 = 64;

#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// Granules in the chunk (CHUNK_GRANULES, or a larger buffer's own size).
    size: u64,
    /// Granules handed out so far (the next slot).
    used: u64,
    /// Granules mapped and not yet put back.
    live: u64,
    /// Still a CPU's current chunk (more slots may be handed out).
    open: bool,
}

/// One CPU's chunk state.
#[derive(Default)]
struct CpuChunk {
    /// The base granule of the chunk it hands slots out of.
    current: Option<u64>,
    /// Slots of its current chunk put back after their invalidation, handed out again newest first
    /// (`reuse` only): (first granule, granules).
    free: Vec<(u64, u64)>,
}

pub struct IovaChunks {
    cpus: PerCpu<CpuChunk>,
    reuse: bool,
    /// Chunks by base granule.
    chunks: BTreeMap<u64, Chunk>,
    /// Chunks allocated and freed (for tests and reports).
    pub allocated: u64,
    pub freed: u64,
}

impl IovaChunks {
    /// `reuse`: slots of the current chunk that were put back are handed out again (newest first, as the
    /// rcache's magazines would), so a hot buffer keeps its IOVA while the chunk lasts; else a chunk's
    /// slots are used once. Slots of a closed chunk are not reused: it goes back whole.
    pub fn new(cpus: usize, reuse: bool) -> Self {
        IovaChunks {
            cpus: PerCpu::new(cpus),
            reuse,
            chunks: BTreeMap::new(),
            allocated: 0,
            freed: 0,
        }
    }

    /// dma_map_page() into the next slots of `cpu`'s chunk: returns (iova pfn of `phys_pfn`, release
    /// time), or None when IOVA space ran out. A buffer larger than a chunk gets a chunk of its own size.
    pub fn map(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        core.map_with(now, cpu, phys_pfn, pages, |core, t, cpu, n| {
            self.slots(core, t, cpu, n)
        })
    }

    /// `n` consecutive granules: from the current chunk if they fit, else from a new one (None: no IOVA).
    fn slots(&mut self, core: &mut DmaCore, now: Time, cpu: usize, n: u64) -> (Option<u64>, Time) {
        let me = self.cpus.get_mut(cpu);
        if let Some(base) = me.current {
            let c = self.chunks.get_mut(&base).expect("current chunk is listed");
            if let Some(i) = me.free.iter().rposition(|&(_, k)| k == n) {
                c.live += n;
                return (Some(me.free.remove(i).0), now);
            }
            if c.size - c.used >= n {
                let slot = base + c.used;
                c.used += n;
                c.live += n;
                return (Some(slot), now);
            }
        }
        let size = n.max(CHUNK_GRANULES);
        let (base, mut t) = core.alloc_iova(now, cpu, size);
        let Some(base) = base else {
            return (None, t);
        };
        self.allocated += 1;
        let own = n > CHUNK_GRANULES;
        self.chunks.insert(
            base,
            Chunk {
                size,
                used: n,
                live: n,
                open: !own,
            },
        );
        if !own {
            // The old chunk is closed: it goes back once its last buffer does.
            let me = self.cpus.get_mut(cpu);
            if let Some(old) = me.current.replace(base) {
                me.free.clear();
                let c = self.chunks.get_mut(&old).expect("current chunk is listed");
                c.open = false;
                t = self.free_if_done(core, t, cpu, old);
            }
        }
        (Some(base), t)
    }

    /// The base granule of the chunk holding IOVA pfn `iova_pfn`, if a chunk holds it.
    pub fn chunk_of(&self, core: &DmaCore, iova_pfn: u64) -> Option<u64> {
        let g = iova_pfn / core.granule;
        self.chunks
            .range(..=g)
            .next_back()
            .filter(|(&base, c)| g < base + c.size)
            .map(|(&base, _)| base)
    }

    /// The range at `iova_pfn` was unmapped and its invalidation completed: its slots are done. A range
    /// no chunk holds (a FANDS WQE block) is freed as dma-iommu would. Returns the release time.
    pub fn put(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        let Some(base) = self.chunk_of(core, iova_pfn) else {
            return core.free_iova(now, cpu, iova_pfn, pages);
        };
        let (first, _, n) = core.granules(iova_pfn, pages);
        let c = self.chunks.get_mut(&base).expect("found above");
        c.live = c.live.checked_sub(n).expect("a chunk's slots are put once");
        if self.reuse && c.open {
            // Back to the free slots of the CPU whose current chunk this is.
            if let Some(owner) = self.cpus.iter_mut().find(|c| c.current == Some(base)) {
                owner.free.push((first / core.granule, n));
            }
        }
        self.free_if_done(core, now, cpu, base)
    }

    fn free_if_done(&mut self, core: &mut DmaCore, now: Time, cpu: usize, base: u64) -> Time {
        let c = self.chunks[&base];
        if c.open || c.live > 0 {
            return now;
        }
        self.chunks.remove(&base);
        self.freed += 1;
        core.iovad.free_fast(now, cpu, base, c.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::flush_queue::tests::core;

    #[test]
    fn buffers_take_consecutive_slots_and_a_chunk_returns_when_full_and_empty() {
        let mut c = core(1);
        let mut ch = IovaChunks::new(1, false);
        let mut t = 0;
        let mut iovas = vec![];
        for p in 0..CHUNK_GRANULES + 1 {
            let (iova, t2) = ch.map(&mut c, t, 0, 5000 + 7 * p, 1).unwrap();
            iovas.push(iova);
            t = t2;
        }
        for w in iovas[..CHUNK_GRANULES as usize].windows(2) {
            assert_eq!(w[1], w[0] + 1, "slots of one chunk are consecutive");
        }
        assert_eq!(iovas[0] % CHUNK_GRANULES, 0, "the chunk is size-aligned");
        assert_eq!(ch.allocated, 2);
        assert_eq!(c.iommu.iova_to_phys(c.dom, iovas[3]), Some(5021));
        // The first chunk is closed; it goes back with its last buffer.
        for &i in &iovas[..CHUNK_GRANULES as usize - 1] {
            t = ch.put(&mut c, t, 0, i, 1);
        }
        assert_eq!(ch.freed, 0);
        ch.put(&mut c, t, 0, iovas[CHUNK_GRANULES as usize - 1], 1);
        assert_eq!(ch.freed, 1);
        // The open chunk stays even when empty.
        ch.put(&mut c, t, 0, iovas[CHUNK_GRANULES as usize], 1);
        assert_eq!(ch.freed, 1);
    }

    #[test]
    fn with_reuse_a_put_slot_of_the_current_chunk_comes_back_first() {
        let mut c = core(1);
        let mut ch = IovaChunks::new(1, true);
        let (a, t) = ch.map(&mut c, 0, 0, 100, 1).unwrap();
        let (b, t) = ch.map(&mut c, t, 0, 200, 1).unwrap();
        let t = ch.put(&mut c, t, 0, a, 1);
        let (again, t) = ch.map(&mut c, t, 0, 300, 1).unwrap();
        assert_eq!(again, a);
        let (next, _) = ch.map(&mut c, t, 0, 400, 1).unwrap();
        assert_eq!(next, b + 1, "no free slot: the next unused one");
        assert_eq!(ch.allocated, 1);
    }

    #[test]
    fn a_buffer_larger_than_a_chunk_gets_its_own_and_leaves_the_current_one() {
        let mut c = core(1);
        let mut ch = IovaChunks::new(1, false);
        let (a, t) = ch.map(&mut c, 0, 0, 100, 1).unwrap();
        let (big, t) = ch.map(&mut c, t, 0, 1000, CHUNK_GRANULES + 3).unwrap();
        let (b, t) = ch.map(&mut c, t, 0, 200, 2).unwrap();
        assert_eq!(b, a + 1);
        assert_ne!(ch.chunk_of(&c, big), ch.chunk_of(&c, a));
        ch.put(&mut c, t, 0, big, CHUNK_GRANULES + 3);
        assert_eq!(ch.freed, 1, "its own chunk is closed from the start");
    }
}
