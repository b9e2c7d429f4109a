//! I/O page tables in the vendors' radix formats: VT-d second level (4 KiB pages, 2 MiB/1 GiB superpages,
//! 4 or 5 levels) and Arm LPAE stage 1 / stage 2 (4K, 16K or 64K granule, blocks, stage-2 concatenated
//! start level). Addresses here are in granule pfns; levels count up from the leaf (level 1 holds pages).
//!
//! Map chooses page sizes as iommu.c iommu_pgsize() does; unmap frees a table page only when the range
//! covers its whole span, as intel/iommu.c dma_pte_clear_level() and io-pgtable-arm __arm_lpae_unmap() do.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Bytes per page-table entry (both formats use 64-bit descriptors).
const PTE_SHIFT: u32 = 3;
/// io-pgtable-arm.c ARM_LPAE_S2_MAX_CONCAT_PAGES: stage-2 start tables concatenated up to 16 pages.
const S2_MAX_CONCAT_PAGES: u32 = 16;
/// Entry marks (0 = not present): a leaf (page or block) carries its physical granule pfn + 1 with this
/// bit; a table pointer carries the child's slot + 1.
const LEAF: u64 = 1 << 63;

/// A page-table format: what a walk reads and which levels may hold leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtFormat {
    /// log2 of the translation granule in bytes (12, 14, 16).
    pub granule_shift: u32,
    /// Index bits per table below the top (granule_shift - 3).
    pub bits: u32,
    /// Levels a full walk reads.
    pub levels: u32,
    /// Index bits of the top table (pgd_bits; wider than `bits` for a concatenated stage-2 start level).
    pub top_bits: u32,
    /// Bit L set: level L may hold a leaf (bit 1 always; higher bits are superpages / blocks).
    pub leaf_levels: u32,
}

impl PtFormat {
    /// VT-d second-level table for an address width of `aw_bits` (SAGAW: 48 → 4 levels, 57 → 5);
    /// `superpages` = CAP.SLLPS 2 MiB and 1 GiB.
    pub fn vtd(aw_bits: u32, superpages: bool) -> Result<Self, String> {
        let levels = match aw_bits {
            39 => 3,
            48 => 4,
            57 => 5,
            _ => return Err("expected a VT-d address width of 39, 48 or 57 bits".into()),
        };
        Ok(PtFormat {
            granule_shift: 12,
            bits: 9,
            levels,
            top_bits: 9,
            leaf_levels: if superpages { 0b1110 } else { 0b10 },
        })
    }

    /// Arm LPAE table (io-pgtable-arm arm_lpae_alloc_pgtable): granule 4/16/64 KiB, input size `ias_bits`,
    /// stage 1 or 2, block mappings as arm_lpae_restrict_pgsizes() allows them (4K: 2M, 1G; 16K: 32M;
    /// 64K: 512M).
    pub fn lpae(granule_kb: u32, ias_bits: u32, stage: u32, blocks: bool) -> Result<Self, String> {
        let granule_shift = match granule_kb {
            4 => 12,
            16 => 14,
            64 => 16,
            _ => return Err("expected a granule of 4, 16 or 64 KiB".into()),
        };
        if !(32..=48).contains(&ias_bits) {
            return Err("expected an input address size of 32..=48 bits".into());
        }
        let bits = granule_shift - PTE_SHIFT;
        let va_bits = ias_bits - granule_shift;
        let mut levels = va_bits.div_ceil(bits);
        let mut top_bits = va_bits - bits * (levels - 1);
        // arm_64_lpae_alloc_pgtable_s2(): concatenate a small level-0 table into the level-1 tables.
        if stage == 2 && levels == 4 && (1u32 << top_bits) <= S2_MAX_CONCAT_PAGES {
            top_bits += bits;
            levels -= 1;
        }
        let block_levels = match granule_kb {
            4 => 0b1100,
            _ => 0b100,
        };
        let leaf_levels = 0b10
            | if blocks {
                block_levels & ((1 << levels) - 1)
            } else {
                0
            };
        Ok(PtFormat {
            granule_shift,
            bits,
            levels,
            top_bits,
            leaf_levels,
        })
    }

    /// 4 KiB pages per granule.
    pub fn granule_pages(&self) -> u64 {
        1 << (self.granule_shift - 12)
    }

    /// log2 of the granule pfns one entry at `level` spans.
    #[inline]
    pub fn span_shift(&self, level: u32) -> u32 {
        self.bits * (level - 1)
    }

    /// log2 of the 4 KiB pages one entry of the last walk cache spans: a level-2 entry, which points at a
    /// leaf table (F&S's PT-L3 page; 2 MiB with 4 KiB pages).
    pub fn walk_entry_shift(&self) -> u32 {
        self.granule_shift - 12 + self.span_shift(2)
    }

    /// Granule pfns the table can address.
    pub fn max_gpfn(&self) -> u64 {
        (1u64 << (self.bits * (self.levels - 1) + self.top_bits)) - 1
    }

    fn entries(&self, level: u32) -> usize {
        1 << if level == self.levels {
            self.top_bits
        } else {
            self.bits
        }
    }

    #[inline]
    fn index(&self, gpfn: u64, level: u32) -> usize {
        let mask = self.entries(level) as u64 - 1;
        ((gpfn >> self.span_shift(level)) & mask) as usize
    }

    /// iommu.c iommu_pgsize() over the format's page sizes: the leaf level to map [iova, iova + size) of
    /// granule pfns with, and how many pages of it before a larger page size could take over.
    pub fn pgsize(&self, iova: u64, phys: u64, size: u64) -> (u32, u64) {
        let bitmap = (1..=self.levels)
            .filter(|&l| self.leaf_levels & (1 << l) != 0)
            .fold(0u64, |m, l| m | 1 << self.span_shift(l));
        let (shift, count) = super::iommu_pgsize(bitmap, iova, phys, size);
        (shift / self.bits + 1, count)
    }
}

/// What an unmap cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unmapped {
    pub granules: u64,
    /// Leaf entries cleared (a block counts once).
    pub leaves: u64,
    pub tables_freed: u32,
    /// First and last granule pfn cleared (first > last when nothing was mapped).
    pub first: u64,
    pub last: u64,
    /// Level of the largest leaf cleared (0 when nothing was mapped): the gather's page size.
    pub leaf_level: u32,
}

/// Present entries a table holds in place before it gets an array of all its entries: the upper levels of
/// a domain, and every table of a sparse address space, hold a few (a host-side layout: what a walk reads
/// is the same).
const SMALL_TABLE_ENTRIES: usize = 4;

struct Table {
    /// Every entry, once the table has held more than [`SMALL_TABLE_ENTRIES`] present ones.
    full: Option<Box<[u64]>>,
    /// Until then its present entries: the first `live` indices, ascending, and their entries.
    idx: [u32; SMALL_TABLE_ENTRIES],
    ent: [u64; SMALL_TABLE_ENTRIES],
    /// Present entries (kept by [`Table::set`]).
    live: u32,
    /// Unique per allocation (0 once freed), so a walk-cache entry pointing at a freed (or reused) table page
    /// is detected.
    id: u64,
}

impl Table {
    fn new(id: u64) -> Self {
        Table {
            full: None,
            idx: [0; SMALL_TABLE_ENTRIES],
            ent: [0; SMALL_TABLE_ENTRIES],
            live: 0,
            id,
        }
    }

    /// Entry `i` (0: not present).
    #[inline]
    fn get(&self, i: usize) -> u64 {
        match &self.full {
            Some(e) => e[i],
            None => {
                let n = self.live as usize;
                self.idx[..n]
                    .iter()
                    .position(|&x| x == i as u32)
                    .map_or(0, |k| self.ent[k])
            }
        }
    }

    /// Write entry `i` of a table of `entries` entries (0: clear it), counting present entries.
    fn set(&mut self, i: usize, v: u64, entries: usize) {
        if let Some(e) = self.full.as_mut() {
            let old = std::mem::replace(&mut e[i], v);
            self.live = self.live + (v != 0) as u32 - (old != 0) as u32;
            return;
        }
        let n = self.live as usize;
        let k = self.idx[..n].partition_point(|&x| x < i as u32);
        if k < n && self.idx[k] == i as u32 {
            if v != 0 {
                self.ent[k] = v;
            } else {
                self.idx.copy_within(k + 1..n, k);
                self.ent.copy_within(k + 1..n, k);
                self.live -= 1;
            }
            return;
        }
        if v == 0 {
            return;
        }
        if n < SMALL_TABLE_ENTRIES {
            self.idx.copy_within(k..n, k + 1);
            self.ent.copy_within(k..n, k + 1);
            self.idx[k] = i as u32;
            self.ent[k] = v;
            self.live += 1;
            return;
        }
        let mut e = vec![0; entries].into_boxed_slice();
        for k in 0..n {
            e[self.idx[k] as usize] = self.ent[k];
        }
        e[i] = v;
        self.full = Some(e);
        self.live += 1;
    }

    /// A small table's first index in [from, last] that holds an entry.
    #[inline]
    fn next_small(&self, from: usize, last: usize) -> Option<usize> {
        let n = self.live as usize;
        let k = self.idx[..n].partition_point(|&x| (x as usize) < from);
        (k < n && self.idx[k] as usize <= last).then(|| self.idx[k] as usize)
    }
}

/// A table's handle, as walk caches hold it: its allocation id above its slot, so a walk can resume at the
/// table a walk-cache entry names and find out whether that table is still the one it cached.
const SLOT_BITS: u32 = 24;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;

/// The end of a walk: the leaf found (its physical granule pfn, with the offset inside a block added), the
/// level the walk stopped at (the leaf's, or the non-present entry's), and the table ids the entries above
/// it pointed to (`ptr[L]` = table the level-L entry points at).
#[derive(Debug, Clone, Copy)]
pub struct Walk {
    pub phys: Option<u64>,
    pub level: u32,
    pub ptr: [u64; 8],
}

/// Leaf tables remembered by the span they cover, so maps, unmaps and lookups near recent ones go straight
/// to their leaf table (direct-mapped by span; a host-side shortcut: what a walk reads and what a map or
/// unmap changes are the same).
const LEAF_HINTS: usize = 64;

pub struct RadixPgtable {
    fmt: PtFormat,
    /// Per hint: the span (granule pfn >> bits, plus one; 0: none) and the handle of its leaf table. Atomics
    /// only because lookups take `&self`; one thread uses a table at a time.
    hints: Box<[(AtomicU64, AtomicU64)]>,
    tables: Vec<Table>,
    free_slots: Vec<u32>,
    root: u32,
    next_id: u64,
    pub tables_allocated: u64,
    pub tables_freed: u64,
    /// Present leaves a map overwrote (callers map only unmapped ranges, so normally 0).
    pub leaves_replaced: u64,
}

impl RadixPgtable {
    pub fn new(fmt: PtFormat) -> Self {
        let mut pt = RadixPgtable {
            fmt,
            hints: (0..LEAF_HINTS)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            tables: Vec::new(),
            free_slots: Vec::new(),
            root: 0,
            next_id: 1,
            tables_allocated: 0,
            tables_freed: 0,
            leaves_replaced: 0,
        };
        pt.root = pt.alloc_table(fmt.levels);
        pt
    }

    pub fn format(&self) -> &PtFormat {
        &self.fmt
    }

    fn alloc_table(&mut self, level: u32) -> u32 {
        self.tables_allocated += 1;
        let id = self.next_id;
        self.next_id += 1;
        let n = self.fmt.entries(level);
        if let Some(i) = self.free_slots.pop() {
            // A freed table holds no present entry; a full one keeps its array for a table of its size.
            let t = &mut self.tables[i as usize];
            if t.full.as_ref().is_some_and(|e| e.len() != n) {
                t.full = None;
            }
            t.id = id;
            return i;
        }
        self.tables.push(Table::new(id));
        (self.tables.len() - 1) as u32
    }

    fn free_table(&mut self, i: u32) {
        debug_assert_eq!(self.tables[i as usize].live, 0);
        self.tables_freed += 1;
        self.tables[i as usize].id = 0;
        self.free_slots.push(i);
    }

    /// The handle of the table in slot `t` (see [`SLOT_BITS`]).
    #[inline]
    fn handle(&self, t: u32) -> u64 {
        self.tables[t as usize].id << SLOT_BITS | t as u64
    }

    /// The leaf table (level 1) covering `gpfn`, if a hint remembers it and it is still in the tree.
    #[inline]
    fn hinted(&self, gpfn: u64) -> Option<u32> {
        let span = gpfn >> self.fmt.bits;
        let (k, h) = &self.hints[span as usize % LEAF_HINTS];
        if k.load(Relaxed) != span + 1 {
            return None;
        }
        let h = h.load(Relaxed);
        let t = (h & SLOT_MASK) as u32;
        // Freed (id 0) or its slot reused (another id): stale.
        (self.tables[t as usize].id == h >> SLOT_BITS).then_some(t)
    }

    /// Remember that leaf table `t` covers `gpfn`.
    #[inline]
    fn hint(&self, gpfn: u64, t: u32) {
        let span = gpfn >> self.fmt.bits;
        let (k, h) = &self.hints[span as usize % LEAF_HINTS];
        k.store(span + 1, Relaxed);
        h.store(self.handle(t), Relaxed);
    }

    /// Forget every hint (a table left the tree without being freed).
    fn forget_hints(&self) {
        for (k, _) in self.hints.iter() {
            k.store(0, Relaxed);
        }
    }

    /// Map `count` pages of the size of `level` at granule pfns `iova`/`phys` (both aligned to it).
    /// Returns leaf entries written; a present entry in the way is replaced (its table, if any, leaks as
    /// the kernel would refuse it: callers map only unmapped ranges).
    pub fn map_level(&mut self, iova: u64, phys: u64, count: u64, level: u32) -> u64 {
        let step = 1u64 << self.fmt.span_shift(level);
        for k in 0..count {
            let va = iova + k * step;
            let hinted = if level == 1 { self.hinted(va) } else { None };
            let mut t = hinted.unwrap_or(self.root);
            let upper = if hinted.is_some() { 1 } else { self.fmt.levels };
            for l in (level + 1..=upper).rev() {
                let idx = self.fmt.index(va, l);
                let e = self.tables[t as usize].get(idx);
                t = if e == 0 || e & LEAF != 0 {
                    self.leaves_replaced += (e != 0) as u64;
                    let child = self.alloc_table(l - 1);
                    let n = self.fmt.entries(l);
                    self.tables[t as usize].set(idx, child as u64 + 1, n);
                    child
                } else {
                    (e - 1) as u32
                };
            }
            if level == 1 && hinted.is_none() && self.fmt.levels > 1 {
                self.hint(va, t);
            }
            let idx = self.fmt.index(va, level);
            let old = self.tables[t as usize].get(idx);
            self.leaves_replaced += (old != 0) as u64;
            if level > 1 && old != 0 && old & LEAF == 0 {
                // A block over a table: the table (and those below it) leaves the tree unfreed.
                self.forget_hints();
            }
            let n = self.fmt.entries(level);
            self.tables[t as usize].set(idx, LEAF | (phys + k * step + 1), n);
        }
        count
    }

    /// __iommu_map(): map `n` granules, splitting into page sizes with [`PtFormat::pgsize`]. Returns leaf
    /// entries written.
    pub fn map(&mut self, iova: u64, phys: u64, n: u64) -> u64 {
        let (mut va, mut pa, mut left, mut written) = (iova, phys, n, 0);
        while left > 0 {
            let (level, count) = self.fmt.pgsize(va, pa, left);
            written += self.map_level(va, pa, count, level);
            let pages = count << self.fmt.span_shift(level);
            va += pages;
            pa += pages;
            left -= pages;
        }
        written
    }

    /// Unmap [gpfn, gpfn + n). A leaf (block) only partly inside is removed whole, as intel_iommu_unmap()
    /// widens the range to the large page (io-pgtable-arm would split the block instead; the DMA layer
    /// always unmaps what it mapped, so the two agree on its calls).
    pub fn unmap(&mut self, gpfn: u64, n: u64) -> Unmapped {
        let mut u = Unmapped {
            granules: 0,
            leaves: 0,
            tables_freed: 0,
            first: u64::MAX,
            last: 0,
            leaf_level: 0,
        };
        // Inside one leaf table's span without covering it: only that table changes (no table is freed).
        let span = 1u64 << self.fmt.bits;
        let base = gpfn & !(span - 1);
        let inside = self.fmt.levels > 1 && n > 0 && gpfn + n <= base + span && n < span;
        u.granules = match self.hinted(gpfn).filter(|_| inside) {
            Some(t) => self.clear_level(t, 1, base, gpfn, gpfn + n, &mut u),
            None => self.clear_level(self.root, self.fmt.levels, 0, gpfn, gpfn + n, &mut u),
        };
        u
    }

    fn clear_level(
        &mut self,
        t: u32,
        level: u32,
        base: u64,
        lo: u64,
        hi: u64,
        u: &mut Unmapped,
    ) -> u64 {
        let shift = self.fmt.span_shift(level);
        let first = ((lo - base) >> shift) as usize;
        let last = (((hi - 1 - base) >> shift) as usize).min(self.fmt.entries(level) - 1);
        let mut unmapped = 0;
        if first == last || self.tables[t as usize].full.is_some() {
            for idx in first..=last {
                unmapped += self.clear_entry(t, level, base, idx, lo, hi, u);
            }
        } else {
            let mut from = first;
            while let Some(idx) = self.tables[t as usize].next_small(from, last) {
                unmapped += self.clear_entry(t, level, base, idx, lo, hi, u);
                from = idx + 1;
            }
        }
        unmapped
    }

    /// Clear entry `idx` of table `t` (of `level`, spanning from `base`) as far as [lo, hi) covers it: a leaf
    /// whole, a table's entries below, and the table itself once the range covers its span and it is empty.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn clear_entry(
        &mut self,
        t: u32,
        level: u32,
        base: u64,
        idx: usize,
        lo: u64,
        hi: u64,
        u: &mut Unmapped,
    ) -> u64 {
        let e = self.tables[t as usize].get(idx);
        if e == 0 {
            return 0;
        }
        let shift = self.fmt.span_shift(level);
        let span = 1u64 << shift;
        let entries = self.fmt.entries(level);
        let ebase = base + ((idx as u64) << shift);
        if e & LEAF != 0 {
            self.tables[t as usize].set(idx, 0, entries);
            u.first = u.first.min(ebase);
            u.last = u.last.max(ebase + span - 1);
            u.leaf_level = u.leaf_level.max(level);
            u.leaves += 1;
            return span;
        }
        let child = (e - 1) as u32;
        let unmapped = self.clear_level(
            child,
            level - 1,
            ebase,
            lo.max(ebase),
            hi.min(ebase + span),
            u,
        );
        if lo <= ebase && ebase + span <= hi && self.tables[child as usize].live == 0 {
            self.tables[t as usize].set(idx, 0, entries);
            self.free_table(child);
            u.tables_freed += 1;
        }
        unmapped
    }

    /// Walk to `gpfn`: the leaf, the level the walk stopped at, and the tables the entries above pointed to.
    pub fn walk(&self, gpfn: u64) -> Walk {
        self.walk_at(self.root, self.fmt.levels, gpfn)
    }

    /// Walk to `gpfn` from the table a walk-cache entry of `level` points at (`handle`, from a walk's `ptr`):
    /// the walk of the levels below it, or None when that table is no longer in the tree (freed, or its slot
    /// reused), i.e. the entry is stale.
    #[inline]
    pub fn walk_from(&self, handle: u64, level: u32, gpfn: u64) -> Option<Walk> {
        let t = (handle & SLOT_MASK) as u32;
        let live = self.tables.get(t as usize)?.id;
        (live != 0 && live == handle >> SLOT_BITS).then(|| self.walk_at(t, level - 1, gpfn))
    }

    /// Walk from table `t` of level `top` down.
    #[inline]
    fn walk_at(&self, mut t: u32, top: u32, gpfn: u64) -> Walk {
        let mut w = Walk {
            phys: None,
            level: top,
            ptr: [0; 8],
        };
        for level in (1..=top).rev() {
            w.level = level;
            let e = self.tables[t as usize].get(self.fmt.index(gpfn, level));
            if e == 0 {
                return w;
            }
            if e & LEAF != 0 {
                let mask = (1u64 << self.fmt.span_shift(level)) - 1;
                w.phys = Some(((e & !LEAF) - 1) + (gpfn & mask));
                return w;
            }
            t = (e - 1) as u32;
            w.ptr[level as usize] = self.handle(t);
        }
        w
    }

    /// The physical granule pfn mapped at `gpfn` and the level of its leaf (the walk without its record;
    /// it runs on every cache hit to detect stale entries).
    #[inline]
    pub fn lookup(&self, gpfn: u64) -> Option<(u64, u32)> {
        if let Some(t) = self.hinted(gpfn) {
            let e = self.tables[t as usize].get(self.fmt.index(gpfn, 1));
            return (e != 0).then(|| ((e & !LEAF) - 1, 1));
        }
        let mut t = self.root;
        for level in (1..=self.fmt.levels).rev() {
            let e = self.tables[t as usize].get(self.fmt.index(gpfn, level));
            if e == 0 {
                return None;
            }
            if e & LEAF != 0 {
                let mask = (1u64 << self.fmt.span_shift(level)) - 1;
                return Some((((e & !LEAF) - 1) + (gpfn & mask), level));
            }
            t = (e - 1) as u32;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A table read, written and searched in place until it holds more than a few entries, then as
        /// an array, answers as a plain array of its entries would.
        #[test]
        fn a_small_table_reads_as_its_array(ops in proptest::collection::vec((0usize..24, 0u64..3), 1..200)) {
            let mut t = Table::new(1);
            let mut model = [0u64; 24];
            for (i, v) in ops {
                t.set(i, v, 24);
                model[i] = v;
                for (j, &m) in model.iter().enumerate() {
                    prop_assert_eq!(t.get(j), m);
                }
                let (a, b) = (i / 2, (i + 7).min(23));
                let present: Vec<usize> = if t.full.is_some() {
                    (a..=b).filter(|&j| t.get(j) != 0).collect()
                } else {
                    std::iter::successors(t.next_small(a, b), |&j| t.next_small(j + 1, b)).collect()
                };
                let expected: Vec<usize> = (a..=b).filter(|&j| model[j] != 0).collect();
                prop_assert_eq!(present, expected);
            }
        }

        /// Leaf-table hints change nothing: a table that forgets them before every call maps, unmaps, looks
        /// up and walks alike, over spans whose hints collide, superpages laid over tables and tables
        /// freed and reused.
        #[test]
        fn hints_change_nothing(ops in proptest::collection::vec(
            (0u8..4, 0u64..200, 0u64..512, 1u64..700, any::<bool>()), 1..80,
        )) {
            let fmt = PtFormat::vtd(48, true).unwrap();
            let (mut hinted, mut plain) = (RadixPgtable::new(fmt), RadixPgtable::new(fmt));
            let mut next_phys = 1u64 << 30;
            for (kind, span, off, n, block) in ops {
                // Spans k and k + 64 share a hint.
                let at = span << 9 | off;
                plain.forget_hints();
                // A whole leaf table's span (a 2 MiB block to map) when asked for, else any range.
                let (at, n) = if block { (at & !511, 512) } else { (at, n) };
                match kind {
                    0 | 1 => {
                        prop_assert_eq!(hinted.map(at, next_phys, n), plain.map(at, next_phys, n));
                        next_phys += 1 << 20;
                    }
                    2 => prop_assert_eq!(hinted.unmap(at, n), plain.unmap(at, n)),
                    _ => {
                        for p in (at..at + n).step_by(37) {
                            prop_assert_eq!(hinted.lookup(p), plain.lookup(p));
                            let (a, b) = (hinted.walk(p), plain.walk(p));
                            prop_assert_eq!((a.phys, a.level, a.ptr), (b.phys, b.level, b.ptr));
                        }
                    }
                }
                prop_assert_eq!(
                    (hinted.tables_allocated, hinted.tables_freed, hinted.leaves_replaced),
                    (plain.tables_allocated, plain.tables_freed, plain.leaves_replaced)
                );
            }
        }

        /// Maps and unmaps of any ranges leave the table translating exactly what a page-by-page model says.
        #[test]
        fn maps_and_unmaps_translate_as_a_page_map(ops in proptest::collection::vec((any::<bool>(), 0u64..4096, 1u64..600), 1..60)) {
            // 4 KiB pages only: an unmap clears a block whole, which a page model does not follow.
            let mut pt = RadixPgtable::new(PtFormat::vtd(48, false).unwrap());
            let mut model = std::collections::BTreeMap::new();
            let mut next_phys = 1u64 << 20;
            for (map, at, n) in ops {
                let at = at << 9; // spread over several tables at each level
                if map {
                    if (at..at + n).all(|p| !model.contains_key(&p)) {
                        pt.map(at, next_phys, n);
                        model.extend((0..n).map(|k| (at + k, next_phys + k)));
                        next_phys += 1 << 20;
                    }
                } else {
                    pt.unmap(at, n);
                    let gone: Vec<u64> = model.range(at..at + n).map(|(&p, _)| p).collect();
                    for p in gone {
                        model.remove(&p);
                    }
                }
                for (&p, &phys) in model.iter().step_by(7) {
                    prop_assert_eq!(pt.lookup(p).map(|x| x.0), Some(phys));
                    prop_assert_eq!(pt.walk(p).phys, Some(phys));
                }
            }
            for p in (0..4096u64 << 9).step_by(4093) {
                prop_assert_eq!(pt.lookup(p).map(|x| x.0), model.get(&p).copied());
            }
        }
    }

    fn vtd4() -> PtFormat {
        PtFormat::vtd(48, true).unwrap()
    }

    #[test]
    fn formats_follow_the_specs() {
        let f = vtd4();
        assert_eq!((f.levels, f.bits, f.top_bits), (4, 9, 9));
        assert_eq!(PtFormat::vtd(57, true).unwrap().levels, 5);
        // LPAE stage 1, 48-bit: 4K → 4 levels; 16K → 4 levels with a 2-entry level 0; 64K → 3 levels.
        let l4 = PtFormat::lpae(4, 48, 1, true).unwrap();
        assert_eq!((l4.levels, l4.top_bits, l4.leaf_levels), (4, 9, 0b1110));
        let l16 = PtFormat::lpae(16, 48, 1, true).unwrap();
        assert_eq!((l16.levels, l16.bits, l16.top_bits), (4, 11, 1));
        assert_eq!(l16.leaf_levels, 0b110, "16K: 32M blocks at level 2");
        let l64 = PtFormat::lpae(64, 48, 1, true).unwrap();
        assert_eq!((l64.levels, l64.bits, l64.top_bits), (3, 13, 6));
        // Stage 2: a 40-bit IPA with 4K granule would start at level 0 with 2 entries: concatenated into
        // a 1024-entry level-1 table, 3 levels. 48-bit keeps 4 levels (512 > 16 pages).
        let s2 = PtFormat::lpae(4, 40, 2, true).unwrap();
        assert_eq!((s2.levels, s2.top_bits), (3, 10));
        assert_eq!(PtFormat::lpae(4, 48, 2, true).unwrap().levels, 4);
        assert_eq!(PtFormat::lpae(4, 40, 1, true).unwrap().levels, 4);
        assert!(PtFormat::lpae(8, 48, 1, true).is_err());
        assert!(PtFormat::vtd(50, true).is_err());
    }

    #[test]
    fn pgsize_picks_superpages_like_iommu_pgsize() {
        let f = vtd4();
        assert_eq!(f.pgsize(0, 0, 1), (1, 1));
        // 2 MiB aligned on both sides and at least 512 pages: one 2M page.
        assert_eq!(f.pgsize(512, 1024, 512), (2, 1));
        // Unaligned start: 4K pages up to the 2M boundary, then the rest in bigger pages.
        assert_eq!(f.pgsize(500, 1012, 1100), (1, 12));
        // IOVA and phys differently offset inside 2M: 4K pages throughout.
        assert_eq!(f.pgsize(500, 1013, 1100), (1, 1100));
        // Without superpages: always 4K.
        assert_eq!(
            PtFormat::vtd(48, false).unwrap().pgsize(512, 1024, 512),
            (1, 512)
        );
    }

    #[test]
    fn map_lookup_unmap_roundtrip() {
        let mut pt = RadixPgtable::new(vtd4());
        assert_eq!(pt.tables_allocated, 1);
        pt.map(0x12345, 0x777, 3);
        assert_eq!(pt.lookup(0x12346), Some((0x778, 1)));
        assert_eq!(pt.tables_allocated, 4, "root + 3 levels below");
        let u = pt.unmap(0x12345, 3);
        assert_eq!(
            (u.granules, u.tables_freed),
            (3, 0),
            "a 3-page unmap never covers a whole table"
        );
        assert_eq!((u.first, u.last, u.leaf_level), (0x12345, 0x12347, 1));
        assert_eq!(pt.lookup(0x12345), None);
    }

    #[test]
    fn superpage_map_is_one_entry_and_walks_stop_early() {
        let mut pt = RadixPgtable::new(vtd4());
        assert_eq!(pt.map(512, 2048, 512), 1, "one 2M leaf");
        assert_eq!(pt.tables_allocated, 3, "no leaf table");
        let w = pt.walk(512 + 7);
        assert_eq!((w.phys, w.level), (Some(2048 + 7), 2));
        // Unmapping one 4K page of it removes the whole 2M page (intel_iommu_unmap widens the range).
        let u = pt.unmap(600, 1);
        assert_eq!(
            (u.granules, u.first, u.last, u.leaf_level),
            (512, 512, 1023, 2)
        );
        assert_eq!(pt.lookup(512), None);
    }

    #[test]
    fn unmap_covering_a_whole_table_frees_it() {
        let mut pt = RadixPgtable::new(PtFormat::vtd(48, false).unwrap());
        pt.map(512, 9000, 512); // exactly one leaf table
        let u = pt.unmap(512, 512);
        assert_eq!((u.granules, u.tables_freed), (512, 1));
        // Mapping again re-allocates the leaf table, with a new id.
        let before = pt.walk(512).ptr[2];
        pt.map(512, 1, 1);
        assert_eq!(pt.tables_allocated, 5);
        assert_ne!(pt.walk(512).ptr[2], before);
    }

    #[test]
    fn a_walk_resumes_at_a_cached_table_while_it_is_in_the_tree() {
        let mut pt = RadixPgtable::new(PtFormat::vtd(48, false).unwrap());
        pt.map(512, 9000, 512);
        let full = pt.walk(512 + 7);
        // The level-2 entry points at the leaf table: resuming there gives the same leaf and stop level.
        let w = pt
            .walk_from(full.ptr[2], 2, 512 + 7)
            .expect("still in the tree");
        assert_eq!((w.phys, w.level), (full.phys, full.level));
        // The level-3 entry points at the level-2 table: the walk from there records the leaf table too.
        let w = pt
            .walk_from(full.ptr[3], 3, 512 + 7)
            .expect("still in the tree");
        assert_eq!(
            (w.phys, w.level, w.ptr[2]),
            (full.phys, full.level, full.ptr[2])
        );
        // Freed, and freed then reused for a new table in the same slot: stale either way.
        pt.unmap(512, 512);
        assert!(pt.walk_from(full.ptr[2], 2, 512 + 7).is_none());
        pt.map(512, 1, 1);
        assert_eq!(
            pt.walk(512).ptr[2] & SLOT_MASK,
            full.ptr[2] & SLOT_MASK,
            "the slot is reused"
        );
        assert!(pt.walk_from(full.ptr[2], 2, 512 + 7).is_none());
    }

    #[test]
    fn sixty_four_k_granule_tables() {
        let f = PtFormat::lpae(64, 48, 1, true).unwrap();
        let mut pt = RadixPgtable::new(f);
        pt.map(3, 40, 1);
        assert_eq!(pt.lookup(3), Some((40, 1)));
        assert_eq!(pt.tables_allocated, 3, "3 levels");
        // 8192 granules of 64K = one 512M block.
        assert_eq!(pt.map(8192, 8192, 8192), 1);
        assert_eq!(pt.lookup(8192 + 5), Some((8192 + 5, 2)));
    }

    #[test]
    fn unmap_of_unmapped_range_is_zero() {
        let mut pt = RadixPgtable::new(vtd4());
        let u = pt.unmap(100, 10);
        assert_eq!((u.granules, u.tables_freed, u.leaf_level), (0, 0, 0));
    }
}
