//! Safety accounting: for every unmapped IOVA range, when its pages went back to their owner (the DMA API
//! returned, or a policy that holds pages let them go) and when an IOTLB invalidation covering it completed.
//! A page released before that completion could still be reached by the device through a cached
//! translation after the kernel was free to hand it to someone else: its exposure window is the gap.
//!
//! An invalidation covers a range if the simulation handled it after the range's PTEs were cleared: from
//! then on the IOMMU's caches hold nothing of the range, whatever the two CPUs' clocks said. CPUs run
//! ahead on their own clocks, so an invalidation handled later may carry an earlier time; the range counts
//! as covered at the later of the invalidation's completion and its own clear.

use crate::sim::hist::Histogram;
use crate::sim::Time;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy)]
struct Entry {
    pages: u64,
    unmapped_at: Time,
    released_at: Option<Time>,
    flushed_at: Option<Time>,
}

impl Entry {
    /// Released at or before `now` and not yet covered by an invalidation completed by then.
    fn exposed_at(&self, now: Time) -> bool {
        self.released_at.is_some_and(|r| r <= now) && self.flushed_at.is_none_or(|f| f > now)
    }
}

/// Cumulative counts (diffed between snapshots like every other counter).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SafetyStats {
    /// Unmapped pages both released and covered by a completed invalidation.
    pub pages_settled: u64,
    /// Of those, pages released before the invalidation completed.
    pub pages_exposed: u64,
    /// Per exposed page: ns from its release to the invalidation's completion.
    pub window: Histogram,
    /// Buffers whose mapping reaches bytes that are not theirs (the rest of the granules they share), and
    /// per buffer how many such bytes.
    pub subpage_buffers: u64,
    pub subpage_bytes: Histogram,
    /// Sum over unmapped such buffers of those bytes times the time they were mapped (byte·ns).
    pub subpage_byte_ns: u128,
}

impl SafetyStats {
    /// Add another domain's counts.
    pub fn add(&mut self, o: &SafetyStats) {
        self.pages_settled += o.pages_settled;
        self.pages_exposed += o.pages_exposed;
        self.subpage_buffers += o.subpage_buffers;
        self.subpage_byte_ns += o.subpage_byte_ns;
        self.window.add(&o.window);
        self.subpage_bytes.add(&o.subpage_bytes);
    }
}

/// One logged unmap: (IOVA pfn, sequence). An IOVA freed before its invalidation (xSMMU) can be mapped and
/// unmapped again meanwhile, so a policy that releases later names the unmap by its ticket.
pub type Ticket = (u64, u64);

/// Unmapped ranges not yet both released and invalidated, keyed by ticket.
#[derive(Debug, Default)]
pub struct SafetyLog {
    /// Logs nothing (a trace replay, which reports what reached the IOMMU and no windows): tickets only.
    off: bool,
    open: BTreeMap<Ticket, Entry>,
    seq: u64,
    /// The largest range logged, so a range invalidation finds ranges starting before it.
    max_pages: u64,
    /// Mapped buffers that share their granules with other data: IOVA pfn → (bytes not theirs, mapped at).
    shared: HashMap<u64, (u64, Time)>,
    pub stats: SafetyStats,
}

impl SafetyLog {
    /// A log that keeps nothing: every call is a no-op but `unmapped`'s ticket.
    pub fn off() -> Self {
        SafetyLog {
            off: true,
            ..Default::default()
        }
    }

    /// A buffer mapped at IOVA pfn `pfn` (its first granule) at `t` lets the device reach `others` bytes
    /// that are not the buffer's (sub-page exposure: a 66-byte ACK head exposes the rest of its slab page).
    pub fn shared_buffer(&mut self, pfn: u64, others: u64, t: Time) {
        if self.off {
            return;
        }
        self.stats.subpage_buffers += 1;
        self.stats.subpage_bytes.record(others);
        self.shared.insert(pfn, (others, t));
    }

    /// The PTEs of [pfn, pfn + pages) were cleared at `t`.
    pub fn unmapped(&mut self, pfn: u64, pages: u64, t: Time) -> Ticket {
        if self.off {
            self.seq += 1;
            return (pfn, self.seq);
        }
        if let Some((others, at)) = self.shared.remove(&pfn) {
            self.stats.subpage_byte_ns += others as u128 * t.saturating_sub(at) as u128;
        }
        self.seq += 1;
        self.max_pages = self.max_pages.max(pages);
        self.open.insert(
            (pfn, self.seq),
            Entry {
                pages,
                unmapped_at: t,
                released_at: None,
                flushed_at: None,
            },
        );
        (pfn, self.seq)
    }

    /// The pages of the latest unmap at `pfn` went back to their owner at `t` (right after the unmap).
    pub fn released(&mut self, pfn: u64, t: Time) {
        if self.off {
            return;
        }
        let key = self
            .open
            .range((pfn, 0)..=(pfn, u64::MAX))
            .rev()
            .find(|(_, e)| e.released_at.is_none())
            .map(|(&k, _)| k);
        if let Some(k) = key {
            self.released_ticket(k, t);
        }
    }

    /// The pages of unmap `k` went back to their owner at `t`.
    pub fn released_ticket(&mut self, k: Ticket, t: Time) {
        if let Some(e) = self.open.get_mut(&k) {
            e.released_at = Some(t);
            if e.flushed_at.is_some() {
                self.settle(k);
            }
        }
    }

    /// An invalidation of [start, end] (None: the whole domain) completed at `done`.
    pub fn invalidated(&mut self, range: Option<(u64, u64)>, done: Time) {
        if self.off {
            return;
        }
        let (lo, hi) = match range {
            Some((s, e)) => (s.saturating_sub(self.max_pages.saturating_sub(1)), e),
            None => (0, u64::MAX),
        };
        let mut settled = Vec::new();
        for (&k, e) in self.open.range_mut((lo, 0)..=(hi, u64::MAX)) {
            let overlaps = range.is_none_or(|(s, _)| k.0 + e.pages > s);
            // An invalidation handled later may have completed earlier: the earliest completion counts.
            let done = done.max(e.unmapped_at);
            if overlaps && e.flushed_at.is_none_or(|f| done < f) {
                e.flushed_at = Some(done);
                if e.released_at.is_some() {
                    settled.push(k);
                }
            }
        }
        for k in settled {
            self.settle(k);
        }
    }

    fn settle(&mut self, k: Ticket) {
        let e = self.open.remove(&k).expect("open entry");
        let (rel, fl) = (
            e.released_at.expect("released"),
            e.flushed_at.expect("flushed"),
        );
        self.stats.pages_settled += e.pages;
        if fl > rel {
            self.stats.pages_exposed += e.pages;
            self.stats.window.record_n(fl - rel, e.pages);
        }
    }

    /// Pages released at or before `now` and still not covered by a completed invalidation.
    pub fn exposed_open(&self, now: Time) -> u64 {
        self.open
            .values()
            .filter(|e| e.exposed_at(now))
            .map(|e| e.pages)
            .sum()
    }

    /// Per page released at or before `now` and not yet covered: how long it has been exposed so far (a
    /// lower bound of its window).
    pub fn open_windows(&self, now: Time) -> Histogram {
        let mut h = Histogram::default();
        for e in self.open.values().filter(|e| e.exposed_at(now)) {
            h.record_n(now - e.released_at.expect("exposed: released"), e.pages);
        }
        h
    }

    /// Whether the page at `pfn` belongs to a range released at or before `now` and not yet covered by a
    /// completed invalidation (reaching it reaches memory its owner may have given to someone else).
    pub fn released_unflushed(&self, pfn: u64, now: Time) -> bool {
        let lo = pfn.saturating_sub(self.max_pages.saturating_sub(1));
        self.open
            .range((lo, 0)..=(pfn, u64::MAX))
            .any(|(&(start, _), e)| start + e.pages > pfn && e.exposed_at(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_order_is_never_exposed() {
        let mut s = SafetyLog::default();
        s.unmapped(10, 2, 100);
        s.invalidated(Some((10, 11)), 900);
        s.released(10, 900);
        assert_eq!((s.stats.pages_settled, s.stats.pages_exposed), (2, 0));
        assert!(s.open.is_empty());
    }

    #[test]
    fn release_before_the_flush_is_a_window() {
        let mut s = SafetyLog::default();
        // A flush handled before the unmap does not cover it.
        s.invalidated(None, 5_000);
        s.unmapped(10, 1, 100);
        s.released(10, 150);
        assert_eq!(s.exposed_open(200), 1);
        assert!(s.released_unflushed(10, 200) && !s.released_unflushed(11, 200));
        assert_eq!(s.stats.pages_settled, 0);
        s.invalidated(None, 10_150);
        assert_eq!((s.stats.pages_settled, s.stats.pages_exposed), (1, 1));
        assert_eq!(s.stats.window.count(), 1);
        assert!((s.stats.window.max() as i64 - 10_000).abs() < 400);
    }

    #[test]
    fn tickets_keep_two_unmaps_of_one_iova_apart() {
        let mut s = SafetyLog::default();
        let a = s.unmapped(7, 1, 10);
        s.invalidated(None, 30);
        s.unmapped(7, 1, 20);
        // The first unmap: covered by the flush at 30 and released at 40, safe; the second stays open.
        s.released_ticket(a, 40);
        assert_eq!((s.stats.pages_settled, s.stats.pages_exposed), (1, 0));
        s.released(7, 50);
        assert_eq!(s.exposed_open(60), 1);
    }

    #[test]
    fn the_earliest_completion_counts_whatever_the_order_it_is_seen_in() {
        let mut s = SafetyLog::default();
        s.unmapped(3, 1, 100);
        s.invalidated(None, 600);
        s.invalidated(None, 300);
        s.released(3, 300);
        assert_eq!((s.stats.pages_settled, s.stats.pages_exposed), (1, 0));
    }

    #[test]
    fn an_invalidation_timed_before_the_clear_covers_it_from_the_clear() {
        // A CPU running ahead cleared the PTEs at 500; a lagging CPU's flush, handled after, completed at 300.
        let mut s = SafetyLog::default();
        s.unmapped(3, 1, 500);
        s.invalidated(None, 300);
        s.released(3, 520);
        assert_eq!((s.stats.pages_settled, s.stats.pages_exposed), (1, 0));
    }

    #[test]
    fn a_range_invalidation_finds_ranges_that_start_below_it() {
        let mut s = SafetyLog::default();
        s.unmapped(0, 64, 0);
        s.unmapped(100, 1, 0);
        s.released(0, 1);
        s.released(100, 1);
        s.invalidated(Some((63, 63)), 10);
        assert_eq!(s.stats.pages_exposed, 64);
        assert_eq!(s.exposed_open(20), 1);
    }
}
