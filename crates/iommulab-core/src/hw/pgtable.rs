//! A radix I/O page table with 512 eight-byte entries per 4 KiB table page (VT-d second level, ARM LPAE 4K
//! granule). 4 KiB leaves only in this model; map allocates table pages, unmap frees a table page only when
//! the unmapped range covers its whole span, as intel/iommu.c dma_pte_clear_level() and io-pgtable-arm do.

const ENTRIES: usize = 512;
const BITS: u32 = 9;

struct Table {
    e: Box<[u64; ENTRIES]>,
    live: u32,
}

/// Entries store `value + 1` (0 = not present): a child table index for non-leaf levels, a phys pfn for leaves.
pub struct RadixPgtable {
    levels: u32,
    tables: Vec<Table>,
    free_slots: Vec<u32>,
    root: u32,
    pub tables_allocated: u64,
    pub tables_freed: u64,
}

impl RadixPgtable {
    pub fn new(levels: u32) -> Self {
        let mut pt = RadixPgtable {
            levels,
            tables: Vec::new(),
            free_slots: Vec::new(),
            root: 0,
            tables_allocated: 0,
            tables_freed: 0,
        };
        pt.root = pt.alloc_table();
        pt
    }

    pub fn levels(&self) -> u32 {
        self.levels
    }

    /// Pages covered by one entry at `level` (level 1 = leaf PTEs).
    #[inline]
    pub fn entry_span(level: u32) -> u64 {
        1u64 << (BITS * (level - 1))
    }

    #[inline]
    fn index(pfn: u64, level: u32) -> usize {
        ((pfn >> (BITS * (level - 1))) & (ENTRIES as u64 - 1)) as usize
    }

    fn alloc_table(&mut self) -> u32 {
        self.tables_allocated += 1;
        if let Some(i) = self.free_slots.pop() {
            return i;
        }
        self.tables.push(Table {
            e: Box::new([0; ENTRIES]),
            live: 0,
        });
        (self.tables.len() - 1) as u32
    }

    fn free_table(&mut self, i: u32) {
        debug_assert_eq!(self.tables[i as usize].live, 0);
        self.tables_freed += 1;
        self.free_slots.push(i);
    }

    /// Map `n` pages; returns the number of leaf PTEs written (already-present leaves are overwritten).
    pub fn map(&mut self, iova_pfn: u64, phys_pfn: u64, n: u64) -> u64 {
        for k in 0..n {
            let pfn = iova_pfn + k;
            let mut t = self.root;
            for level in (2..=self.levels).rev() {
                let idx = Self::index(pfn, level);
                let e = self.tables[t as usize].e[idx];
                t = if e == 0 {
                    let child = self.alloc_table();
                    let tab = &mut self.tables[t as usize];
                    tab.e[idx] = child as u64 + 1;
                    tab.live += 1;
                    child
                } else {
                    (e - 1) as u32
                };
            }
            let tab = &mut self.tables[t as usize];
            let idx = Self::index(pfn, 1);
            if tab.e[idx] == 0 {
                tab.live += 1;
            }
            tab.e[idx] = phys_pfn + k + 1;
        }
        n
    }

    /// Unmap [iova_pfn, iova_pfn + n). Returns (pages that were mapped, table pages freed).
    pub fn unmap(&mut self, iova_pfn: u64, n: u64) -> (u64, u32) {
        let mut freed = 0;
        let unmapped = self.clear_level(
            self.root,
            self.levels,
            0,
            iova_pfn,
            iova_pfn + n,
            &mut freed,
        );
        (unmapped, freed)
    }

    fn clear_level(
        &mut self,
        t: u32,
        level: u32,
        base: u64,
        lo: u64,
        hi: u64,
        freed: &mut u32,
    ) -> u64 {
        let span = Self::entry_span(level);
        let first = ((lo - base) / span) as usize;
        let last = ((hi - 1 - base) / span) as usize;
        let mut unmapped = 0;
        for idx in first..=last.min(ENTRIES - 1) {
            let e = self.tables[t as usize].e[idx];
            if e == 0 {
                continue;
            }
            let ebase = base + idx as u64 * span;
            if level == 1 {
                let tab = &mut self.tables[t as usize];
                tab.e[idx] = 0;
                tab.live -= 1;
                unmapped += 1;
                continue;
            }
            let child = (e - 1) as u32;
            unmapped += self.clear_level(
                child,
                level - 1,
                ebase,
                lo.max(ebase),
                hi.min(ebase + span),
                freed,
            );
            if lo <= ebase && ebase + span <= hi && self.tables[child as usize].live == 0 {
                let tab = &mut self.tables[t as usize];
                tab.e[idx] = 0;
                tab.live -= 1;
                self.free_table(child);
                *freed += 1;
            }
        }
        unmapped
    }

    /// The physical pfn mapped at `iova_pfn`, and the deepest level whose entry was present.
    pub fn lookup(&self, iova_pfn: u64) -> Option<u64> {
        let mut t = self.root;
        for level in (1..=self.levels).rev() {
            let e = self.tables[t as usize].e[Self::index(iova_pfn, level)];
            if e == 0 {
                return None;
            }
            if level == 1 {
                return Some(e - 1);
            }
            t = (e - 1) as u32;
        }
        None
    }

    /// Highest IOVA pfn this table can address.
    pub fn max_pfn(&self) -> u64 {
        (1u64 << (BITS * self.levels)) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_lookup_unmap_roundtrip() {
        let mut pt = RadixPgtable::new(4);
        assert_eq!(pt.tables_allocated, 1);
        pt.map(0x12345, 0x777, 3);
        assert_eq!(pt.lookup(0x12346), Some(0x778));
        assert_eq!(pt.tables_allocated, 4, "root + 3 levels below");
        let (un, freed) = pt.unmap(0x12345, 3);
        assert_eq!(
            (un, freed),
            (3, 0),
            "a 3-page unmap never covers a whole table"
        );
        assert_eq!(pt.lookup(0x12345), None);
    }

    #[test]
    fn unmap_covering_a_whole_table_frees_it() {
        let mut pt = RadixPgtable::new(4);
        pt.map(512, 9000, 512); // exactly one leaf table
        let (un, freed) = pt.unmap(512, 512);
        assert_eq!(un, 512);
        assert_eq!(freed, 1);
        // Mapping again re-allocates the leaf table.
        pt.map(512, 1, 1);
        assert_eq!(pt.tables_allocated, 5);
    }

    #[test]
    fn unmap_of_unmapped_range_is_zero() {
        let mut pt = RadixPgtable::new(4);
        assert_eq!(pt.unmap(100, 10), (0, 0));
    }
}
