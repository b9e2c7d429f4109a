//! RX buffer pages and where they come from and go back to.
//!
//! A page is held by the driver while it sits in a posted descriptor (WQE) and by the stack once for every
//! packet (skb fragment) written into it; it returns when both let go. Three page sources:
//! - `Unpooled`: every refill allocates and DMA-maps a page, every return unmaps and frees it.
//! - `PagePool`: page_pool keeps pages DMA-mapped (PP_FLAG_DMA_MAP): returns go to the NAPI-local alloc
//!   cache or the ptr_ring, and only a page that finds the ring full leaves the pool (page_pool_return_page:
//!   unmap, put_page).
//! - `DriverCache`: mlx5's own RX page cache in front of a page_pool that does no DMA mapping, as in Linux
//!   6.0 (en_rx.c mlx5e_rx_cache_put/get, en.h MLX5E_CACHE_SIZE; removed later by "net/mlx5e: RX, Remove
//!   internal page_cache"). The driver puts a page into the cache when it releases its WQE, still mapped and
//!   possibly still referenced by sockets; a refill takes the cache's head only if nobody else holds it
//!   (page_ref_count == 1), else it allocates from page_pool and maps. A put that finds the cache full unmaps
//!   the page and recycles it to page_pool (mlx5e_page_release_dynamic), which keeps it only if the stack
//!   no longer holds it.

use crate::host::Host;
use crate::sim::hist::Histogram;
use crate::sim::Time;
use crate::workload::RxPageCache;
use std::collections::VecDeque;

/// include/net/page_pool/types.h PP_ALLOC_CACHE_SIZE and PP_ALLOC_CACHE_REFILL.
pub const PP_ALLOC_CACHE_SIZE: usize = 128;
const PP_ALLOC_CACHE_REFILL: usize = 64;

pub type PageId = u32;
/// One RX descriptor's pages: one for a cyclic RQ's WQE (inline, no allocation per descriptor), 64 for a
/// striding one.
pub type WqePages = smallvec::SmallVec<[PageId; 2]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    /// In a posted or in-use descriptor: the driver holds it.
    Driver,
    /// Released by the driver; returns when the stack lets go.
    Stack,
    /// In the mlx5 RX page cache (mapped).
    DriverCache,
    /// Left its pool while the stack still held it: freed when the stack lets go.
    Orphan,
    /// In a page_pool cache or ring, or freed.
    Pool,
}

#[derive(Debug, Clone, Copy)]
struct Page {
    phys: u64,
    dma: Option<u64>,
    stack_refs: u32,
    home: Home,
    /// When the stack last let go of it (its last fragment consumed).
    stack_done: Time,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Unpooled,
    PagePool { ring: usize },
    DriverCache { size: usize, ring: usize },
}

/// One RX queue's pool: page_pool's alloc cache and ptr_ring, and the driver's page cache.
#[derive(Default)]
struct Pool {
    cache: Vec<PageId>,
    ptr_ring: VecDeque<PageId>,
    driver_cache: VecDeque<PageId>,
}

/// Counters of page traffic between the driver, the stack and the pools.
#[derive(Debug, Default, Clone, Copy)]
pub struct PageCounters {
    pub mapped: u64,
    pub unmapped: u64,
    /// mlx5 rx_cache_reuse / rx_cache_busy / rx_cache_empty / rx_cache_full.
    pub cache: RxPageCache,
}

pub struct Pages {
    source: Source,
    pages: Vec<Page>,
    free_ids: Vec<PageId>,
    pools: Vec<Pool>,
    pub counters: PageCounters,
    /// For every reuse from the driver cache: how long before it the stack had let go of the head page,
    /// i.e. by how much a later release would still have missed a busy head (mlx5e_rx_cache_get).
    pub reuse_slack: Histogram,
}

impl Pages {
    pub fn new(source: Source, queues: usize) -> Self {
        Pages {
            source,
            pages: Vec::new(),
            free_ids: Vec::new(),
            pools: (0..queues).map(|_| Pool::default()).collect(),
            counters: PageCounters::default(),
            reuse_slack: Histogram::default(),
        }
    }

    pub fn dma(&self, id: PageId) -> Option<u64> {
        self.pages[id as usize].dma
    }

    fn new_id(&mut self, phys: u64) -> PageId {
        let p = Page {
            phys,
            dma: None,
            stack_refs: 0,
            home: Home::Driver,
            stack_done: 0,
        };
        match self.free_ids.pop() {
            Some(id) => {
                self.pages[id as usize] = p;
                id
            }
            None => {
                self.pages.push(p);
                (self.pages.len() - 1) as PageId
            }
        }
    }

    fn map(&mut self, host: &mut Host, cpu: usize, id: PageId, t: Time) -> Option<Time> {
        let phys = self.pages[id as usize].phys;
        // page_pool_dma_map / mlx5e_page_alloc: DMA_FROM_DEVICE, DMA_ATTR_SKIP_CPU_SYNC.
        let (dma, t) = host.dma_map_rx_page(t, cpu, phys)?;
        self.pages[id as usize].dma = Some(dma);
        self.counters.mapped += 1;
        Some(t)
    }

    fn unmap(&mut self, host: &mut Host, cpu: usize, id: PageId, t: Time) -> Time {
        match self.pages[id as usize].dma.take() {
            Some(dma) => {
                self.counters.unmapped += 1;
                host.dma_unmap(t, cpu, dma, 1)
            }
            None => t,
        }
    }

    fn free(&mut self, host: &mut Host, id: PageId, t: Time) -> Time {
        host.pages.free(self.pages[id as usize].phys);
        self.pages[id as usize].home = Home::Pool;
        self.free_ids.push(id);
        t + host.platform.cpu.page_alloc_ns
    }

    /// A mapped page for a descriptor of queue `q` (on `cpu`): page_pool_alloc_pages() or
    /// mlx5e_page_alloc_pool(). None when memory or IOVA space ran out.
    pub fn alloc(
        &mut self,
        host: &mut Host,
        q: usize,
        cpu: usize,
        t: Time,
    ) -> Option<(PageId, Time)> {
        if let Source::DriverCache { .. } = self.source {
            // mlx5e_rx_cache_get(): only the head, only if no socket still holds it.
            match self.pools[q].driver_cache.front() {
                Some(&id) if self.pages[id as usize].stack_refs == 0 => {
                    self.pools[q].driver_cache.pop_front();
                    let done = self.pages[id as usize].stack_done;
                    self.reuse_slack.record(t.saturating_sub(done));
                    self.pages[id as usize].home = Home::Driver;
                    self.counters.cache.reuse += 1;
                    return Some((id, t));
                }
                Some(_) => self.counters.cache.busy += 1,
                None => self.counters.cache.empty += 1,
            }
        }
        let (id, t) = match self.pool_get(host, q, t) {
            Some(got) => got,
            None => {
                let phys = host.pages.alloc()?;
                (self.new_id(phys), t + host.platform.cpu.page_alloc_ns)
            }
        };
        self.pages[id as usize].home = Home::Driver;
        if self.pages[id as usize].dma.is_some() {
            return Some((id, t));
        }
        match self.map(host, cpu, id, t) {
            Some(t) => Some((id, t)),
            None => {
                self.free(host, id, t);
                None
            }
        }
    }

    /// FANDS: `n` fresh pages for one multi-packet WQE, mapped into one IOVA block (no recycling, so no
    /// pool to draw from). None when memory or IOVA space ran out.
    pub fn alloc_block(
        &mut self,
        host: &mut Host,
        cpu: usize,
        n: usize,
        mut t: Time,
    ) -> Option<(WqePages, Time)> {
        let mut phys = Vec::with_capacity(n);
        for _ in 0..n {
            match host.pages.alloc() {
                Some(p) => phys.push(p),
                None => break,
            }
            t += host.platform.cpu.page_alloc_ns;
        }
        let mapped = if phys.len() == n {
            host.dma_map_block(t, cpu, &phys)
        } else {
            None
        };
        let Some((iova, t)) = mapped else {
            for p in phys {
                host.pages.free(p);
            }
            return None;
        };
        let ids = phys
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let id = self.new_id(p);
                self.pages[id as usize].dma = Some(iova + i as u64);
                id
            })
            .collect();
        self.counters.mapped += n as u64;
        Some((ids, t))
    }

    /// FANDS' mlx5e_free_rx_mpwqe(): the last page unmaps the WQE's whole IOVA block (one sync) and every
    /// page goes to the page allocator, at once or when the stack lets go of it (recycle = false).
    pub fn release_block(&mut self, host: &mut Host, cpu: usize, ids: &[PageId], t: Time) -> Time {
        let base = self.pages[ids[0] as usize]
            .dma
            .expect("block pages are mapped");
        let mut t = host.dma_unmap(t, cpu, base, ids.len() as u64);
        self.counters.unmapped += ids.len() as u64;
        for &id in ids {
            self.pages[id as usize].dma = None;
            if self.pages[id as usize].stack_refs > 0 {
                self.pages[id as usize].home = Home::Orphan;
            } else {
                t = self.free(host, id, t);
            }
        }
        t
    }

    /// page_pool's alloc cache, refilled from its ptr_ring.
    fn pool_get(&mut self, host: &Host, q: usize, t: Time) -> Option<(PageId, Time)> {
        if self.source == Source::Unpooled {
            return None;
        }
        let pool = &mut self.pools[q];
        if let Some(id) = pool.cache.pop() {
            return Some((id, t));
        }
        for _ in 0..PP_ALLOC_CACHE_REFILL {
            match pool.ptr_ring.pop_front() {
                Some(id) => pool.cache.push(id),
                None => break,
            }
        }
        pool.cache
            .pop()
            .map(|id| (id, t + host.platform.cpu.lock_ns))
    }

    /// page_pool_put_page() of a page nobody holds: the alloc cache (NAPI context), the ptr_ring, else the
    /// page leaves the pool (unmapped if mapped, freed).
    fn pool_put(
        &mut self,
        host: &mut Host,
        q: usize,
        cpu: usize,
        id: PageId,
        napi: bool,
        t: Time,
    ) -> Time {
        let ring = match self.source {
            Source::Unpooled => 0,
            Source::PagePool { ring } | Source::DriverCache { ring, .. } => ring,
        };
        let pool = &mut self.pools[q];
        self.pages[id as usize].home = Home::Pool;
        if self.source != Source::Unpooled {
            if napi && pool.cache.len() < PP_ALLOC_CACHE_SIZE {
                pool.cache.push(id);
                return t;
            }
            if pool.ptr_ring.len() < ring {
                pool.ptr_ring.push_back(id);
                return t + host.platform.cpu.lock_ns;
            }
        }
        let t = self.unmap(host, cpu, id, t);
        self.free(host, id, t)
    }

    /// The stack takes one reference (a packet's fragment in this page).
    pub fn stack_get(&mut self, id: PageId) {
        self.pages[id as usize].stack_refs += 1;
    }

    /// The driver releases a page of a finished descriptor (mlx5e_free_rx_mpwqe / page release), in NAPI.
    pub fn driver_release(
        &mut self,
        host: &mut Host,
        q: usize,
        cpu: usize,
        id: PageId,
        t: Time,
    ) -> Time {
        if let Source::DriverCache { size, .. } = self.source {
            // mlx5e_rx_cache_put(): a ring of `size` slots, one kept empty.
            if self.pools[q].driver_cache.len() + 1 < size {
                self.pools[q].driver_cache.push_back(id);
                self.pages[id as usize].home = Home::DriverCache;
                return t;
            }
            self.counters.cache.full += 1;
            // mlx5e_page_dma_unmap + page_pool_recycle_direct: the pool keeps it only if nobody holds it.
            let t = self.unmap(host, cpu, id, t);
            if self.pages[id as usize].stack_refs > 0 {
                self.pages[id as usize].home = Home::Orphan;
                return t;
            }
            return self.pool_put(host, q, cpu, id, true, t);
        }
        if self.pages[id as usize].stack_refs > 0 {
            self.pages[id as usize].home = Home::Stack;
            return t;
        }
        self.pool_put(host, q, cpu, id, true, t)
    }

    /// The stack drops one reference (the reader consumed a packet), on `cpu` outside NAPI.
    pub fn stack_put(
        &mut self,
        host: &mut Host,
        q: usize,
        cpu: usize,
        id: PageId,
        t: Time,
    ) -> Time {
        let p = &mut self.pages[id as usize];
        p.stack_refs -= 1;
        if p.stack_refs > 0 {
            return t;
        }
        p.stack_done = t;
        match p.home {
            Home::Stack => self.pool_put(host, q, cpu, id, false, t),
            Home::Orphan => self.free(host, id, t),
            // Still in a descriptor, or in the driver cache (now reusable).
            _ => t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::test_host as host;

    #[test]
    fn page_pool_keeps_pages_mapped() {
        let mut h = host("strict");
        let mut p = Pages::new(Source::PagePool { ring: 16 }, 1);
        let (a, t) = p.alloc(&mut h, 0, 0, 0).unwrap();
        p.stack_get(a);
        let t = p.driver_release(&mut h, 0, 0, a, t);
        let t = p.stack_put(&mut h, 0, 0, a, t);
        let (b, _) = p.alloc(&mut h, 0, 0, t).unwrap();
        assert_eq!(a, b);
        assert_eq!((p.counters.mapped, p.counters.unmapped), (1, 0));
    }

    #[test]
    fn unpooled_maps_every_use() {
        let mut h = host("strict");
        let mut p = Pages::new(Source::Unpooled, 1);
        let (a, t) = p.alloc(&mut h, 0, 0, 0).unwrap();
        let t = p.driver_release(&mut h, 0, 0, a, t);
        p.alloc(&mut h, 0, 0, t).unwrap();
        assert_eq!((p.counters.mapped, p.counters.unmapped), (2, 1));
    }

    #[test]
    fn a_reuse_records_how_long_before_it_the_stack_let_go() {
        let mut h = host("strict");
        let mut p = Pages::new(Source::DriverCache { size: 4, ring: 16 }, 1);
        let (a, _) = p.alloc(&mut h, 0, 0, 0).unwrap();
        p.stack_get(a);
        p.driver_release(&mut h, 0, 0, a, 1_000);
        p.stack_put(&mut h, 0, 0, a, 5_000);
        assert_eq!(p.reuse_slack.count(), 0);
        let (again, _) = p.alloc(&mut h, 0, 0, 25_000).unwrap();
        assert_eq!(again, a);
        assert_eq!(p.reuse_slack.count(), 1);
        let slack = p.reuse_slack.quantile(0.5);
        assert!(slack.abs_diff(20_000) <= 20_000 / 32, "{slack}");
    }

    #[test]
    fn driver_cache_reuses_only_a_head_nobody_holds() {
        let mut h = host("strict");
        let mut p = Pages::new(Source::DriverCache { size: 4, ring: 16 }, 1);
        let mut ids = vec![];
        let mut t = 0;
        for _ in 0..4 {
            let (id, t2) = p.alloc(&mut h, 0, 0, t).unwrap();
            p.stack_get(id);
            ids.push(id);
            t = t2;
        }
        // Three fit (one slot stays empty); the fourth finds the cache full: unmapped, left to the stack.
        for &id in &ids {
            t = p.driver_release(&mut h, 0, 0, id, t);
        }
        assert_eq!(p.counters.cache.full, 1);
        assert_eq!(p.counters.unmapped, 1);
        // The head is still held by a socket: busy, a fresh page is mapped.
        let (fresh, t2) = p.alloc(&mut h, 0, 0, t).unwrap();
        assert!(!ids.contains(&fresh));
        assert_eq!((p.counters.cache.busy, p.counters.mapped), (1, 5));
        t = p.stack_put(&mut h, 0, 0, ids[0], t2);
        let (again, _) = p.alloc(&mut h, 0, 0, t).unwrap();
        assert_eq!(again, ids[0]);
        assert_eq!(p.counters.cache.reuse, 1);
        // The orphan is freed when the stack lets go; nothing is unmapped twice.
        p.stack_put(&mut h, 0, 0, ids[3], t);
        assert_eq!(p.counters.unmapped, 1);
    }
}
