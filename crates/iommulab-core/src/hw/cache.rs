//! Set-associative translation caches with LRU replacement: the IOTLB and the paging-structure caches; and
//! an emulated IOMMU's IOTLB, QEMU's hash.
//! Each entry holds a tag and the value it caches (a physical pfn, a table pointer), so a cached entry that
//! outlived its mapping returns the old value, as hardware would.

/// A set-associative cache of 64-bit tags with a value each (a fully associative cache is one set; a cache
/// of 0 entries holds nothing, as an emulated IOMMU's absent walk caches).
#[derive(Debug, Clone)]
pub struct TagCache<V = u64> {
    sets: usize,
    /// sets - 1 when sets is a power of two (a mask instead of a division on every lookup).
    set_mask: Option<u64>,
    ways: usize,
    tags: Vec<u64>,
    vals: Vec<V>,
    stamp: Vec<u64>,
    clock: u64,
    /// Ways holding an entry: when every way does, an insert goes straight to the LRU search.
    filled: usize,
}

const EMPTY: u64 = u64::MAX;

impl<V: Copy + Default> TagCache<V> {
    pub fn new(entries: usize, ways: usize) -> Self {
        let ways = if entries == 0 {
            0
        } else {
            ways.max(1).min(entries)
        };
        let sets = (entries / ways.max(1)).max(1);
        TagCache {
            sets,
            set_mask: sets.is_power_of_two().then_some(sets as u64 - 1),
            ways,
            tags: vec![EMPTY; sets * ways],
            vals: vec![V::default(); sets * ways],
            stamp: vec![0; sets * ways],
            clock: 0,
            filled: 0,
        }
    }

    pub fn entries(&self) -> usize {
        self.sets * self.ways
    }

    #[inline]
    fn set_of(&self, tag: u64, index: u64) -> usize {
        let _ = tag;
        let set = match self.set_mask {
            Some(m) => index & m,
            None => index % self.sets as u64,
        };
        set as usize * self.ways
    }

    /// Look up `tag` in the set chosen by `index`; on a miss insert it with `val` (evicting the LRU way).
    /// Returns whether it hit.
    #[inline]
    pub fn access(&mut self, tag: u64, index: u64, val: V) -> bool {
        if self.lookup(tag, index).is_some() {
            return true;
        }
        self.insert(tag, index, val);
        false
    }

    /// Look up `tag`, refreshing its LRU position on a hit; returns the cached value.
    #[inline]
    pub fn lookup(&mut self, tag: u64, index: u64) -> Option<V> {
        self.clock += 1;
        let base = self.set_of(tag, index);
        let w = self.tags[base..base + self.ways]
            .iter()
            .position(|&t| t == tag)?;
        self.stamp[base + w] = self.clock;
        Some(self.vals[base + w])
    }

    /// Insert `tag` → `val` (not present), evicting the least recently used way of its set.
    #[inline]
    pub fn insert(&mut self, tag: u64, index: u64, val: V) {
        if self.ways == 0 {
            return;
        }
        self.clock += 1;
        let base = self.set_of(tag, index);
        let set = &mut self.tags[base..base + self.ways];
        let stamps = &self.stamp[base..base + self.ways];
        // An empty way if there is one (none when every way is filled), else the least recently used.
        let empty = if self.filled < set.len() * self.sets {
            set.iter().position(|&t| t == EMPTY)
        } else {
            None
        };
        self.filled += empty.is_some() as usize;
        let victim = empty.unwrap_or_else(|| {
            (0..stamps.len())
                .min_by_key(|&w| stamps[w])
                .expect("ways > 0")
        });
        set[victim] = tag;
        self.vals[base + victim] = val;
        self.stamp[base + victim] = self.clock;
    }

    /// Whether `tag` is present (no LRU update).
    pub fn contains(&self, tag: u64, index: u64) -> bool {
        let base = self.set_of(tag, index);
        self.tags[base..base + self.ways].contains(&tag)
    }

    /// Drop `tag` if present (its set is chosen by `index`).
    pub fn invalidate(&mut self, tag: u64, index: u64) {
        if self.filled == 0 {
            return;
        }
        let base = self.set_of(tag, index);
        for t in &mut self.tags[base..base + self.ways] {
            if *t == tag {
                *t = EMPTY;
                self.filled -= 1;
            }
        }
    }

    /// Drop every entry for which `pred(tag)` holds.
    pub fn invalidate_where(&mut self, mut pred: impl FnMut(u64) -> bool) {
        if self.filled == 0 {
            return;
        }
        for t in &mut self.tags {
            if *t != EMPTY && pred(*t) {
                *t = EMPTY;
                self.filled -= 1;
            }
        }
    }

    pub fn valid(&self) -> usize {
        self.tags.iter().filter(|&&t| t != EMPTY).count()
    }

    /// Entries held (as `valid`, without the scan).
    pub fn len(&self) -> usize {
        self.filled
    }

    pub fn is_empty(&self) -> bool {
        self.filled == 0
    }
}

/// Which cached entries QEMU's page-selective invalidation drops (vtd_hash_remove_by_page,
/// smmu_hash_remove_by_asid_iova).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsiMatch {
    /// The entries overlapping the range.
    Range,
    /// QEMU's VT-d before 9.1: VTDIOTLBPageInvInfo.mask is a uint8_t, so an entry also goes whenever the low
    /// 8 bits of its page number, under the mask, equal the address's (fixed by "intel_iommu: fix type of
    /// the mask field in VTDIOTLBPageInvInfo", QEMU 9.1): one PSI in 256 pages of IOVA space drops a ring.
    LowByte,
    /// Every entry of the domain, whatever the range (QEMU's amdvi_inval_pages).
    Domain,
}

/// QEMU's software IOTLB of an emulated IOMMU: a glib hash keyed by the entry's tag, no sets and no LRU.
/// A full hash is emptied whole before the next insert (vtd_update_iotlb at VTD_IOTLB_MAX_SIZE,
/// smmu_iotlb_insert at SMMU_IOTLB_MAX_SIZE); every invalidation scans all of it
/// (g_hash_table_foreach_remove).
#[derive(Debug, Clone)]
pub struct QemuIotlb<V> {
    map: std::collections::HashMap<u64, (u64, V)>,
    cap: usize,
    pub psi: PsiMatch,
    /// Times the hash was emptied because it was full.
    pub resets: u64,
}

impl<V: Copy> QemuIotlb<V> {
    pub fn new(cap: usize, psi: PsiMatch) -> Self {
        QemuIotlb {
            map: Default::default(),
            cap,
            psi,
            resets: 0,
        }
    }

    pub fn entries(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn lookup(&self, tag: u64) -> Option<V> {
        self.map.get(&tag).map(|&(_, v)| v)
    }

    /// Insert (or replace) `tag` → `val`; `index` is what the tag caches (kept for invalidation by
    /// address).
    pub fn insert(&mut self, tag: u64, index: u64, val: V) {
        if self.cap == 0 {
            return;
        }
        if self.map.len() >= self.cap && !self.map.contains_key(&tag) {
            self.map.clear();
            self.resets += 1;
        }
        self.map.insert(tag, (index, val));
    }

    /// Drop every entry for which `pred(tag, index)` holds: one scan of the hash.
    pub fn invalidate_where(&mut self, mut pred: impl FnMut(u64, u64) -> bool) {
        self.map.retain(|&t, &mut (i, _)| !pred(t, i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_way_emptied_by_an_invalidation_is_filled_before_any_eviction() {
        let mut c = TagCache::new(4, 4);
        for t in 1..=4 {
            c.insert(t, 0, t * 10);
        }
        c.invalidate(3, 0);
        c.insert(5, 0, 50); // into 3's way: 1, the least recently used, stays
        assert!(c.contains(1, 0) && c.contains(5, 0) && !c.contains(3, 0));
        c.insert(6, 0, 60); // full again: the LRU (1) goes
        assert!(!c.contains(1, 0) && c.contains(6, 0));
        c.invalidate_where(|t| t % 2 == 0);
        assert_eq!(c.valid(), 1);
        c.insert(7, 0, 70);
        c.insert(8, 0, 80);
        assert!(c.contains(5, 0) && c.contains(7, 0) && c.contains(8, 0));
    }

    #[test]
    fn lru_evicts_least_recent() {
        let mut c = TagCache::new(2, 2);
        assert!(!c.access(1, 0, 100));
        assert!(!c.access(2, 0, 200));
        assert!(c.access(1, 0, 0));
        assert_eq!(
            c.lookup(1, 0),
            Some(100),
            "keeps the value it was filled with"
        );
        assert!(!c.access(3, 0, 300)); // evicts 2
        assert!(c.contains(1, 0) && c.contains(3, 0) && !c.contains(2, 0));
    }
    #[test]
    fn sets_are_independent_and_invalidation_works() {
        let mut c = TagCache::new(4, 2);
        c.access(10, 0, 0);
        c.access(11, 1, 0);
        c.access(12, 0, 0);
        c.access(13, 0, 0); // set 0 full: evicts 10
        assert!(c.contains(11, 1));
        assert!(!c.contains(10, 0));
        c.invalidate(11, 1);
        assert!(!c.contains(11, 1));
        c.invalidate_where(|t| t >= 12);
        assert_eq!(c.valid(), 0);
    }
}
