//! The IOVA allocator as drivers/iommu/iova.c builds it: a top-down, naturally aligned range allocator over
//! an ordered tree of allocated ranges with cached starting nodes, fronted by per-CPU range caches (rcache:
//! `loaded` and `prev` magazines of 127 pfns per size class 1..32 pages) and a shared depot of full magazines.

use crate::sim::{Coherence, SpinLock, Time};
use std::collections::BTreeMap;

/// iova.c IOVA_MAG_SIZE.
pub const IOVA_MAG_SIZE: usize = 127;
/// iova.h IOVA_RANGE_CACHE_MAX_SIZE: size classes 2^0..2^5 pages are cached.
pub const IOVA_RANGE_CACHE_MAX_SIZE: u32 = 6;
/// iova.c IOVA_DEPOT_DELAY: the depot is trimmed one magazine per 100 ms.
pub const IOVA_DEPOT_DELAY_NS: u64 = 100_000_000;
/// iova.c MAX_GLOBAL_MAGS (before 6.7): the depot array's magazines per size class.
pub const MAX_GLOBAL_MAGS: usize = 32;
/// iova.c IOVA_ANCHOR: the rbtree's sentinel node at the top of the space.
const IOVA_ANCHOR: u64 = u64::MAX;

/// CPU costs of the allocator's paths.
#[derive(Debug, Clone, Copy)]
pub struct IovaCosts {
    pub rcache_ns: u64,
    pub rbtree_ns: u64,
    pub lock_ns: u64,
    /// The shared locks' line moves between CPUs at these costs.
    pub coh: Coherence,
    /// Each size class's `struct iova_rcache` keeps `cpu_rcaches`, which every rcache get and insert reads, in
    /// the line of its depot `lock` (6.7 and later: KernelVersion::iova_depot_shares_line), so a depot push
    /// or pop on one CPU costs every other CPU a line fetch at its next get or insert.
    pub depot_line_shared: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct IovaStats {
    pub rcache_hits: u64,
    pub rbtree_allocs: u64,
    pub rbtree_frees: u64,
    pub depot_pushes: u64,
    pub depot_pops: u64,
    /// Before 6.7: full magazines freed back to the tree because the depot array was full.
    pub magazines_freed: u64,
    pub alloc_failures: u64,
    /// Tree nodes passed by the top-down search (its cost grows with them).
    pub nodes_walked: u64,
}

impl IovaStats {
    /// Add another domain's counts.
    pub fn add(&mut self, o: &IovaStats) {
        self.rcache_hits += o.rcache_hits;
        self.rbtree_allocs += o.rbtree_allocs;
        self.rbtree_frees += o.rbtree_frees;
        self.depot_pushes += o.depot_pushes;
        self.depot_pops += o.depot_pops;
        self.magazines_freed += o.magazines_freed;
        self.alloc_failures += o.alloc_failures;
        self.nodes_walked += o.nodes_walked;
    }
}

#[derive(Default, Clone)]
struct CpuRcache {
    loaded: Vec<u64>,
    prev: Vec<u64>,
}

struct Rcache {
    cpu: Vec<CpuRcache>,
    depot: Vec<Vec<u64>>,
    /// `struct iova_rcache`'s `lock`, the depot's, and the line it sits in.
    lock: SpinLock,
}

pub struct IovaDomain {
    /// pfn_lo → pfn_hi of every allocated range, plus the anchor.
    tree: BTreeMap<u64, u64>,
    cached_node: u64,
    cached32_node: u64,
    start_pfn: u64,
    dma_32bit_pfn: u64,
    max32_alloc_size: u64,
    rcaches: Vec<Rcache>,
    costs: IovaCosts,
    /// Before 6.7: the depot's capacity (MAX_GLOBAL_MAGS); from 6.7 a list, unbounded (KernelVersion::
    /// iova_depot_list).
    depot_max: Option<usize>,
    pub rbtree_lock: SpinLock,
    pub stats: IovaStats,
}

/// order_base_2(): ceil(log2(n)).
fn order_base_2(n: u64) -> u32 {
    if n <= 1 {
        0
    } else {
        64 - (n - 1).leading_zeros()
    }
}

impl IovaDomain {
    /// init_iova_domain(granule 4K, start_pfn) with `cpus` per-CPU caches; dma_32bit_pfn is 4 GiB.
    pub fn new(start_pfn: u64, cpus: usize, costs: IovaCosts) -> Self {
        let mut tree = BTreeMap::new();
        tree.insert(IOVA_ANCHOR, IOVA_ANCHOR);
        let dma_32bit_pfn = 1u64 << (32 - 12);
        IovaDomain {
            tree,
            cached_node: IOVA_ANCHOR,
            cached32_node: IOVA_ANCHOR,
            start_pfn: start_pfn.max(1),
            dma_32bit_pfn,
            max32_alloc_size: dma_32bit_pfn,
            rcaches: (0..IOVA_RANGE_CACHE_MAX_SIZE)
                .map(|_| Rcache {
                    cpu: vec![CpuRcache::default(); cpus.max(1)],
                    depot: Vec::new(),
                    lock: SpinLock::new(costs.coh),
                })
                .collect(),
            costs,
            depot_max: None,
            rbtree_lock: SpinLock::new(costs.coh),
            stats: IovaStats::default(),
        }
    }

    /// The struct layouts of `kernel` (which lines the fast path shares with the depot's lock).
    pub fn follow_layout_of(&mut self, kernel: crate::kernel::KernelVersion) {
        self.costs.depot_line_shared = kernel.iova_depot_shares_line();
        self.depot_max = (!kernel.iova_depot_list()).then_some(MAX_GLOBAL_MAGS);
    }

    /// The allocator's shared locks.
    pub fn lock_stats(&self) -> Vec<(&'static str, crate::sim::LockStats)> {
        vec![
            ("iova_rbtree_lock", self.rbtree_lock.stats.clone()),
            (
                "iova depot lock",
                self.rcaches.iter().map(|rc| &rc.lock.stats).sum(),
            ),
        ]
    }

    /// Allocated ranges (excluding the anchor), for checks.
    pub fn allocated(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tree
            .iter()
            .filter(|(&lo, _)| lo != IOVA_ANCHOR)
            .map(|(&lo, &hi)| (lo, hi))
    }

    fn rb_prev(&self, lo: u64) -> Option<(u64, u64)> {
        self.tree.range(..lo).next_back().map(|(&a, &b)| (a, b))
    }
    fn rb_next(&self, lo: u64) -> u64 {
        self.tree
            .range(lo + 1..)
            .next()
            .map(|(&a, _)| a)
            .unwrap_or(IOVA_ANCHOR)
    }

    /// __alloc_and_insert_iova_range(): walk down from the cached node for the highest aligned fit.
    fn alloc_range(&mut self, size: u64, limit_pfn: u64) -> Option<u64> {
        let align_mask = !((1u64 << order_base_2(size)) - 1);
        // The kernel passes an exclusive limit (alloc_iova() calls with limit_pfn + 1).
        let lim = limit_pfn + 1;
        let mut low_pfn = self.start_pfn;
        let mut high_pfn = lim;
        if lim <= self.dma_32bit_pfn && size >= self.max32_alloc_size {
            return None;
        }
        let mut curr = if lim <= self.dma_32bit_pfn {
            self.cached32_node
        } else {
            self.cached_node
        };
        let retry_pfn = self.tree[&curr];
        loop {
            let mut new_pfn;
            let mut curr_range = Some((curr, self.tree[&curr]));
            loop {
                let (clo, _) = curr_range.expect("loop guard");
                high_pfn = high_pfn.min(clo);
                new_pfn = high_pfn.wrapping_sub(size) & align_mask;
                self.stats.nodes_walked += 1;
                curr_range = self.rb_prev(clo);
                match curr_range {
                    Some((_, phi)) if high_pfn >= size && new_pfn <= phi && new_pfn >= low_pfn => {
                        continue
                    }
                    _ => break,
                }
            }
            if high_pfn < size || new_pfn < low_pfn {
                if low_pfn == self.start_pfn && retry_pfn < lim {
                    // Retry the space above the cached node, from iova_find_limit().
                    high_pfn = lim;
                    low_pfn = retry_pfn + 1;
                    curr = if lim > self.dma_32bit_pfn {
                        IOVA_ANCHOR
                    } else {
                        self.tree
                            .range(lim..)
                            .next()
                            .map(|(&a, _)| a)
                            .unwrap_or(IOVA_ANCHOR)
                    };
                    continue;
                }
                self.max32_alloc_size = self.max32_alloc_size.min(size);
                return None;
            }
            self.tree.insert(new_pfn, new_pfn + size - 1);
            // __cached_rbnode_insert_update()
            if new_pfn + size - 1 < self.dma_32bit_pfn {
                self.cached32_node = new_pfn;
            } else {
                self.cached_node = new_pfn;
            }
            return Some(new_pfn);
        }
    }

    /// remove_iova() + __cached_rbnode_delete_update().
    fn free_range(&mut self, pfn: u64) -> bool {
        let Some(&hi) = self.tree.get(&pfn) else {
            return false;
        };
        if pfn == IOVA_ANCHOR {
            return false;
        }
        let c32 = self.cached32_node;
        if pfn == c32 || (hi < self.dma_32bit_pfn && pfn >= c32) {
            self.cached32_node = self.rb_next(pfn);
        }
        if pfn < self.dma_32bit_pfn {
            self.max32_alloc_size = self.dma_32bit_pfn;
        }
        if pfn >= self.cached_node {
            self.cached_node = self.rb_next(pfn);
        }
        self.tree.remove(&pfn);
        true
    }

    /// alloc_iova_fast(): rcache first, then the rbtree; on failure optionally flush all caches and retry.
    /// Returns the pfn (None when the space is exhausted) and the time the CPU is released.
    pub fn alloc_fast(
        &mut self,
        now: Time,
        cpu: usize,
        pages: u64,
        limit_pfn: u64,
        flush_rcache: bool,
    ) -> (Option<u64>, Time) {
        let size = if pages < (1 << (IOVA_RANGE_CACHE_MAX_SIZE - 1)) {
            pages.next_power_of_two()
        } else {
            pages
        };
        let (pfn, mut t) = self.rcache_get(now, cpu, size, limit_pfn + 1);
        if let Some(p) = pfn {
            self.stats.rcache_hits += 1;
            return (Some(p), t);
        }
        let mut flush = flush_rcache;
        loop {
            let (_, rel) = self
                .rbtree_lock
                .lock_on(t, cpu as u32, self.costs.rbtree_ns);
            t = rel;
            if let Some(p) = self.alloc_range(size, limit_pfn) {
                self.stats.rbtree_allocs += 1;
                return (Some(p), t);
            }
            if !flush {
                self.stats.alloc_failures += 1;
                return (None, t);
            }
            flush = false;
            t = self.flush_rcaches(t, cpu);
        }
    }

    /// free_iova_fast(): into this CPU's rcache, else back to the rbtree.
    pub fn free_fast(&mut self, now: Time, cpu: usize, pfn: u64, pages: u64) -> Time {
        let (ok, t) = self.rcache_insert(now, cpu, pfn, pages);
        if ok {
            return t;
        }
        let (_, rel) = self
            .rbtree_lock
            .lock_on(t, cpu as u32, self.costs.rbtree_ns);
        self.stats.rbtree_frees += 1;
        self.free_range(pfn);
        rel
    }

    fn rcache_get(
        &mut self,
        now: Time,
        cpu: usize,
        size: u64,
        limit_pfn: u64,
    ) -> (Option<u64>, Time) {
        let log = order_base_2(size);
        if log >= IOVA_RANGE_CACHE_MAX_SIZE {
            return (None, now);
        }
        let limit = limit_pfn.saturating_sub(size);
        let rc = &mut self.rcaches[log as usize];
        let mut t = Self::cpu_rcaches(rc, &self.costs, now, cpu) + self.costs.rcache_ns;
        let c = &mut rc.cpu[cpu];
        let has = if !c.loaded.is_empty() {
            true
        } else if !c.prev.is_empty() {
            std::mem::swap(&mut c.loaded, &mut c.prev);
            true
        } else {
            let (_, rel) = rc.lock.lock_on(t, cpu as u32, self.costs.lock_ns);
            t = rel;
            if let Some(m) = rc.depot.pop() {
                self.stats.depot_pops += 1;
                c.loaded = m;
                true
            } else {
                false
            }
        };
        if !has {
            return (None, t);
        }
        // iova_magazine_pop(): the last pfn at or below the limit, swapped out.
        let m = &mut c.loaded;
        let Some(i) = (0..m.len()).rev().find(|&i| m[i] <= limit) else {
            return (None, t);
        };
        let pfn = m.swap_remove(i);
        (Some(pfn), t)
    }

    /// raw_cpu_ptr(rcache->cpu_rcaches): the pointer's read, a line fetch where it shares the depot lock's
    /// line and a depot push or pop on another CPU wrote that line since this CPU last read it.
    fn cpu_rcaches(rc: &mut Rcache, costs: &IovaCosts, now: Time, cpu: usize) -> Time {
        if costs.depot_line_shared {
            rc.lock.read_on(now, cpu as u32)
        } else {
            now
        }
    }

    fn rcache_insert(&mut self, now: Time, cpu: usize, pfn: u64, pages: u64) -> (bool, Time) {
        let log = order_base_2(pages);
        if log >= IOVA_RANGE_CACHE_MAX_SIZE {
            return (false, now);
        }
        let rc = &mut self.rcaches[log as usize];
        let mut t = Self::cpu_rcaches(rc, &self.costs, now, cpu) + self.costs.rcache_ns;
        let c = &mut rc.cpu[cpu];
        if c.loaded.len() >= IOVA_MAG_SIZE {
            if c.prev.len() < IOVA_MAG_SIZE {
                std::mem::swap(&mut c.loaded, &mut c.prev);
            } else {
                let (_, rel) = rc.lock.lock_on(t, cpu as u32, self.costs.lock_ns);
                t = rel;
                let full = std::mem::replace(&mut c.loaded, Vec::with_capacity(IOVA_MAG_SIZE));
                c.loaded.push(pfn);
                if self.depot_max.is_some_and(|max| rc.depot.len() >= max) {
                    // Before 6.7: the depot array is full; the magazine's IOVAs go back to the tree, on this
                    // CPU, after the rcache lock is dropped (iova_magazine_free_pfns).
                    self.stats.magazines_freed += 1;
                    return (true, self.free_pfns(t, cpu, full));
                }
                rc.depot.push(full);
                self.stats.depot_pushes += 1;
                return (true, t);
            }
        }
        c.loaded.push(pfn);
        (true, t)
    }

    /// iova_magazine_free_pfns(): every IOVA of `pfns` (a magazine, or all a flush gathered) back to the tree
    /// under iova_rbtree_lock.
    fn free_pfns(&mut self, now: Time, cpu: usize, pfns: Vec<u64>) -> Time {
        let mut t = now;
        for p in pfns {
            let (_, rel) = self
                .rbtree_lock
                .lock_on(t, cpu as u32, self.costs.rbtree_ns);
            t = rel;
            self.free_range(p);
        }
        t
    }

    /// free_cpu_cached_iovas() for every CPU and free_global_cached_iovas().
    fn flush_rcaches(&mut self, now: Time, cpu: usize) -> Time {
        let mut pfns = Vec::new();
        for rc in &mut self.rcaches {
            for c in &mut rc.cpu {
                pfns.append(&mut c.loaded);
                pfns.append(&mut c.prev);
            }
            for m in rc.depot.drain(..) {
                pfns.extend(m);
            }
        }
        self.free_pfns(now, cpu, pfns)
    }

    /// iova_depot_work_func(): while the depot holds more magazines than CPUs, free one back to the tree.
    /// Returns the CPU time it took and whether more work remains.
    /// It runs on `cpu` (a kworker).
    pub fn depot_work(&mut self, now: Time, cpu: usize) -> (Time, bool) {
        let ncpu = self.rcaches[0].cpu.len();
        let mut t = now;
        let mut more = false;
        if self.depot_max.is_some() {
            return (t, false); // before 6.7 there is no depot worker
        }
        for i in 0..self.rcaches.len() {
            if self.rcaches[i].depot.len() > ncpu {
                // Under the size class's rcache->lock (iova_depot_pop).
                let (_, rel) = self.rcaches[i]
                    .lock
                    .lock_on(t, cpu as u32, self.costs.lock_ns);
                t = rel;
                let m = self.rcaches[i].depot.remove(0);
                t = self.free_pfns(t, cpu, m);
                more |= self.rcaches[i].depot.len() > ncpu;
            }
        }
        (t, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dom() -> IovaDomain {
        IovaDomain::new(
            1,
            2,
            IovaCosts {
                coh: Coherence::default(),
                rcache_ns: 10,
                rbtree_ns: 100,
                lock_ns: 5,
                depot_line_shared: false,
            },
        )
    }
    const LIMIT32: u64 = (1 << 20) - 1;

    #[test]
    fn top_down_below_4g_and_naturally_aligned() {
        let mut d = dom();
        let (a, _) = d.alloc_fast(0, 0, 1, LIMIT32, false);
        assert_eq!(
            a,
            Some(0xfffff),
            "first page at the top of the 32-bit space (0xfffff000)"
        );
        let (b, _) = d.alloc_fast(0, 0, 1, LIMIT32, false);
        assert_eq!(b, Some(0xffffe));
        let (c, _) = d.alloc_fast(0, 0, 3, LIMIT32, false); // rounded to 4, aligned to 4
        assert_eq!(c, Some(0xffff8));
        let (e, _) = d.alloc_fast(0, 0, 64, LIMIT32, false); // 64 pages, aligned to 64
        assert_eq!(e.unwrap() % 64, 0);
    }

    #[test]
    fn freed_iova_comes_back_from_the_cpu_cache() {
        let mut d = dom();
        let (a, _) = d.alloc_fast(0, 0, 1, LIMIT32, false);
        d.free_fast(0, 0, a.unwrap(), 1);
        let (b, t) = d.alloc_fast(0, 0, 1, LIMIT32, false);
        assert_eq!(a, b);
        assert_eq!(d.stats.rcache_hits, 1);
        assert_eq!(t, 10, "rcache path takes only the per-CPU cost");
    }

    #[test]
    fn full_magazines_go_to_the_depot_and_are_trimmed() {
        let mut d = dom();
        let pfns: Vec<u64> = (0..2 * IOVA_MAG_SIZE as u64 + 1)
            .map(|_| d.alloc_fast(0, 0, 1, LIMIT32, false).0.unwrap())
            .collect();
        for &p in &pfns {
            d.free_fast(0, 0, p, 1);
        }
        assert_eq!(d.stats.depot_pushes, 1);
        // Another CPU takes the depot magazine.
        let (x, _) = d.alloc_fast(0, 1, 1, LIMIT32, false);
        assert!(x.is_some());
        assert_eq!(d.stats.depot_pops, 1);
    }

    #[test]
    fn before_6_7_a_full_depot_sends_magazines_back_to_the_tree_and_no_worker_trims_it() {
        let fill = |kernel: crate::kernel::KernelVersion| {
            let mut d = dom();
            d.follow_layout_of(kernel);
            // One CPU frees 40 magazines' worth: two stay per CPU, the rest go to the depot.
            let n = (MAX_GLOBAL_MAGS + 8) * IOVA_MAG_SIZE;
            let pfns: Vec<u64> = (0..n)
                .map(|_| d.alloc_fast(0, 0, 1, LIMIT32, false).0.unwrap())
                .collect();
            for &p in &pfns {
                d.free_fast(0, 0, p, 1);
            }
            let (_, more) = d.depot_work(0, 1);
            (
                d.stats.depot_pushes,
                d.stats.magazines_freed,
                d.rcaches[0].depot.len(),
                more,
            )
        };
        let (pushes, freed, depot, more) = fill(crate::kernel::KernelVersion(6, 1));
        assert_eq!((pushes, depot), (MAX_GLOBAL_MAGS as u64, MAX_GLOBAL_MAGS));
        assert_eq!(
            freed, 6,
            "the magazines beyond the array go back to the tree"
        );
        assert!(!more, "no depot worker before 6.7");
        let (pushes, freed, depot, more) = fill(crate::kernel::KernelVersion(6, 12));
        assert_eq!((pushes, freed), (MAX_GLOBAL_MAGS as u64 + 6, 0));
        assert_eq!(
            depot,
            MAX_GLOBAL_MAGS + 5,
            "the worker trimmed one magazine"
        );
        assert!(more);
    }

    #[test]
    fn from_6_7_a_depot_push_costs_the_other_cpus_a_fetch_of_its_line() {
        // struct iova_rcache keeps cpu_rcaches in the depot lock's line from 6.7 (BTF of 6.1 and 6.12 builds):
        // CPU 1's next get after CPU 0 pushed a magazine to the depot fetches the line; before 6.7 it does not.
        let coh = Coherence {
            cluster_cores: 4,
            socket_cores: 4,
            cluster_ns: 40,
            socket_ns: 40,
            remote_ns: 140,
        };
        let get_after_push = |kernel: crate::kernel::KernelVersion| {
            let costs = IovaCosts {
                coh,
                rcache_ns: 10,
                rbtree_ns: 100,
                lock_ns: 5,
                depot_line_shared: false,
            };
            let mut d = IovaDomain::new(1, 2, costs);
            d.follow_layout_of(kernel);
            let pfns: Vec<u64> = (0..2 * IOVA_MAG_SIZE as u64 + 2)
                .map(|_| d.alloc_fast(0, 0, 1, LIMIT32, false).0.unwrap())
                .collect();
            // CPU 1 holds one IOVA in its own cache, read through the line before the push.
            d.free_fast(0, 1, pfns[0], 1);
            for &p in &pfns[1..] {
                d.free_fast(10_000, 0, p, 1);
            }
            assert_eq!(d.stats.depot_pushes, 1);
            let (got, t) = d.alloc_fast(1_000_000, 1, 1, LIMIT32, false);
            assert_eq!(
                got,
                Some(pfns[0]),
                "from CPU 1's own magazine, not the depot"
            );
            t - 1_000_000
        };
        assert_eq!(get_after_push((6, 1).into()), 10);
        assert_eq!(get_after_push((6, 12).into()), 40 + 10);
    }

    #[test]
    fn exhaustion_flushes_caches_then_fails() {
        let mut d = IovaDomain::new(
            1,
            1,
            IovaCosts {
                coh: Coherence::default(),
                rcache_ns: 1,
                rbtree_ns: 1,
                lock_ns: 1,
                depot_line_shared: false,
            },
        );
        let limit = 16; // pfns 1..=16
        let mut got = vec![];
        while let (Some(p), _) = d.alloc_fast(0, 0, 1, limit, true) {
            got.push(p);
        }
        assert_eq!(got.len(), 16);
        d.free_fast(0, 0, got[3], 2); // size class 2 cache: not usable for 1-page allocations
        let (p, _) = d.alloc_fast(0, 0, 1, limit, true);
        assert_eq!(p, Some(got[3]), "flush_rcache returned it to the tree");
    }

    proptest! {
        /// An IOVA range is never handed out twice while allocated, whatever the mix of sizes and CPUs.
        #[test]
        fn never_overlaps(ops in proptest::collection::vec((0u8..3, 1u64..40, 0usize..2), 1..400)) {
            let mut d = dom();
            let mut live: Vec<(u64, u64)> = vec![];
            for (op, size, cpu) in ops {
                if op < 2 || live.is_empty() {
                    let (p, _) = d.alloc_fast(0, cpu, size, LIMIT32, true);
                    let p = p.unwrap();
                    let rounded = if size < 32 { size.next_power_of_two() } else { size };
                    prop_assert_eq!(p % rounded.next_power_of_two(), 0, "natural alignment");
                    for &(q, s) in &live {
                        prop_assert!(p + size <= q || q + s <= p, "overlap {:#x}+{} with {:#x}+{}", p, size, q, s);
                    }
                    live.push((p, size));
                } else {
                    let (p, s) = live.swap_remove(size as usize % live.len());
                    d.free_fast(0, cpu, p, s);
                }
            }
        }
    }
}
