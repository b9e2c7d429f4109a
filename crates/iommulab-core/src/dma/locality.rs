//! IOVA locality as F&S (SOSP'24 §2.2, Figures 2e and 3e) measure it: for each IOVA handed to a buffer, or
//! each page the device accesses, how many distinct last-level walk-cache entries (PT-L3 pages in F&S's
//! naming: 2 MiB of IOVA with 4 KiB pages) were used since its own entry last was. That is the entry's LRU
//! stack distance in the sequence: at or above the walk cache's size, the device's walk likely misses.

use crate::sim::hist::Histogram;

/// What a `ReuseDistance` has counted. Cumulative: a window is the difference of two (`since`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReuseCounts {
    /// Distances of events on an entry used before.
    pub hist: Histogram,
    /// Events on an entry never used before.
    pub first_use: u64,
}

impl ReuseCounts {
    /// What was counted after `earlier`.
    pub fn since(&self, earlier: &ReuseCounts) -> ReuseCounts {
        ReuseCounts {
            hist: self.hist.since(&earlier.hist),
            first_use: self.first_use - earlier.first_use,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ReuseDistance {
    /// log2 of the 4 KiB pages one entry spans (PtFormat::walk_entry_shift).
    entry_shift: u32,
    /// Entries used, least recently first.
    lru: Vec<u64>,
    pub counts: ReuseCounts,
    /// The page of the last access (`accessed`).
    last_access: Option<u64>,
}

impl ReuseDistance {
    /// Entries of 2^`entry_shift` 4 KiB pages.
    pub fn new(entry_shift: u32) -> Self {
        ReuseDistance {
            entry_shift,
            lru: Vec::new(),
            counts: ReuseCounts::default(),
            last_access: None,
        }
    }

    /// An IOVA at 4 KiB pfn `iova_pfn` was handed to a buffer.
    pub fn allocated(&mut self, iova_pfn: u64) {
        self.record(iova_pfn >> self.entry_shift);
    }

    /// The device accessed the page at 4 KiB pfn `iova_pfn`; an access to the page accessed last is the
    /// same visit (a packet that continues a page another began) and is not counted again.
    pub fn accessed(&mut self, iova_pfn: u64) {
        if self.last_access.replace(iova_pfn) != Some(iova_pfn) {
            self.record(iova_pfn >> self.entry_shift);
        }
    }

    /// An IOVA was allocated from (or an access touched) walk-cache entry `entry`.
    fn record(&mut self, entry: u64) {
        match self.lru.iter().rposition(|&e| e == entry) {
            Some(i) => {
                self.counts.hist.record((self.lru.len() - 1 - i) as u64);
                self.lru.remove(i);
            }
            None => self.counts.first_use += 1,
        }
        self.lru.push(entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against the definition: the distinct entries allocated from strictly between an entry's last
        /// use and this one.
        #[test]
        fn distances_match_the_definition(seq in proptest::collection::vec(0u64..12, 1..200)) {
            let mut r = ReuseDistance::new(0);
            let mut want = Histogram::default();
            let mut first = 0;
            for (i, &e) in seq.iter().enumerate() {
                r.record(e);
                match seq[..i].iter().rposition(|&x| x == e) {
                    Some(j) => {
                        let mut between: Vec<u64> = seq[j + 1..i].to_vec();
                        between.sort_unstable();
                        between.dedup();
                        want.record(between.len() as u64);
                    }
                    None => first += 1,
                }
            }
            prop_assert_eq!(r.counts.first_use, first);
            prop_assert_eq!(&r.counts.hist, &want);
        }
    }

    #[test]
    fn distance_counts_distinct_entries_in_between() {
        let mut r = ReuseDistance::new(0);
        for e in [1, 1, 2, 3, 2, 2, 1] {
            r.record(e);
        }
        // 1 (first), 1 → 0, 2 (first), 3 (first), 2 → 1 (3 in between), 2 → 0, 1 → 2 (3 and 2).
        assert_eq!(r.counts.first_use, 3);
        assert_eq!(r.counts.hist.count(), 4);
        assert_eq!(
            (
                r.counts.hist.quantile(0.25),
                r.counts.hist.quantile(0.75),
                r.counts.hist.max()
            ),
            (0, 1, 2)
        );
    }

    #[test]
    fn repeated_accesses_to_one_page_are_one_visit() {
        // Entries of 2 pages: pages 0 and 1 share entry 0, page 2 is entry 1.
        let mut r = ReuseDistance::new(1);
        for pfn in [0, 0, 0, 1, 1, 2, 0, 0] {
            r.accessed(pfn);
        }
        // Visits 0, 1, 2, 0: entry 0 (first), 0 → 0, 1 (first), 0 → 1.
        assert_eq!(
            (
                r.counts.first_use,
                r.counts.hist.count(),
                r.counts.hist.max()
            ),
            (2, 2, 1)
        );
    }

    #[test]
    fn a_cycle_over_more_entries_than_a_cache_holds_has_that_distance() {
        let mut r = ReuseDistance::new(0);
        for _ in 0..3 {
            for e in 0..20 {
                r.record(e);
            }
        }
        assert_eq!(r.counts.first_use, 20);
        assert_eq!((r.counts.hist.quantile(0.0), r.counts.hist.max()), (19, 19));
        assert_eq!(
            (
                r.counts.hist.count_at_least(16),
                r.counts.hist.count_at_least(20)
            ),
            (40, 0)
        );
    }
}
