use super::Time;
use std::collections::BTreeMap;

/// How far behind the latest request an earlier-timed request may still arrive. A CPU's work runs ahead of the
/// event being processed by at most one work item (a NAPI poll, a read); booked intervals older than this are
/// forgotten. A modelling bound, not a kernel constant.
pub const LOOKBEHIND_NS: Time = 2_000_000;

/// A resource used by one holder at a time (a spinlock, a hardware queue), booked as a calendar of busy
/// intervals. CPUs run their work ahead of the event clock, so requests do not arrive in time order: a request
/// at time t takes the first free gap at or after t that is long enough, as it would have in real time.
/// Holders are served in time order, as a ticket/queued spinlock serves them in arrival order.
#[derive(Debug, Clone, Default)]
pub struct SpinLock {
    busy: BTreeMap<Time, Time>,
    latest: Time,
    pub acquisitions: u64,
    pub contended: u64,
    pub wait_ns: u64,
}

impl SpinLock {
    /// Acquire at `at`, hold for `hold` ns. Returns (acquired_at, released_at).
    pub fn acquire(&mut self, at: Time, hold: u64) -> (Time, Time) {
        self.acquisitions += 1;
        self.latest = self.latest.max(at);
        let floor = self.latest.saturating_sub(LOOKBEHIND_NS);
        while let Some((&s, &e)) = self.busy.first_key_value() {
            if e > floor {
                break;
            }
            let _ = s;
            self.busy.pop_first();
        }
        // Fast path: at or after everything booked (requests mostly come in time order).
        match self.busy.last_key_value().map(|(&s, &e)| (s, e)) {
            None => {
                if hold > 0 {
                    self.busy.insert(at, at + hold);
                }
                return (at, at + hold);
            }
            Some((ls, le)) if at >= le => {
                if hold > 0 {
                    if at == le {
                        *self.busy.get_mut(&ls).expect("last exists") = at + hold;
                    } else {
                        self.busy.insert(at, at + hold);
                    }
                }
                return (at, at + hold);
            }
            _ => {}
        }
        // First gap at or after `at` of length `hold`.
        let mut start = at;
        if let Some((_, &e)) = self.busy.range(..=at).next_back() {
            start = start.max(e);
        }
        for (&s, &e) in self.busy.range(at + 1..) {
            if s >= start + hold.max(1) {
                break;
            }
            start = start.max(e);
        }
        if start > at {
            self.contended += 1;
            self.wait_ns += start - at;
        }
        if hold > 0 {
            self.book(start, start + hold);
        }
        (start, start + hold)
    }

    /// Keep the resource busy over [s, e) as well (a holder that learns its release time only after
    /// acquiring, e.g. a lock held across a wait), merging with every booking it touches or overlaps.
    pub fn extend(&mut self, mut s: Time, mut e: Time) {
        if e <= s {
            return;
        }
        let overlapping: Vec<(Time, Time)> = self
            .busy
            .range(..=e)
            .rev()
            .take_while(|&(_, &be)| be >= s)
            .map(|(&bs, &be)| (bs, be))
            .collect();
        for (bs, be) in overlapping {
            self.busy.remove(&bs);
            s = s.min(bs);
            e = e.max(be);
        }
        self.busy.insert(s, e);
        self.latest = self.latest.max(s);
    }

    /// Insert [s, e), merging with neighbours that touch it.
    fn book(&mut self, mut s: Time, mut e: Time) {
        if let Some((&ps, &pe)) = self.busy.range(..=s).next_back() {
            if pe == s {
                s = ps;
                self.busy.remove(&ps);
            }
        }
        if let Some(&ne) = self.busy.get(&e) {
            self.busy.remove(&e);
            e = ne;
        }
        self.busy.insert(s, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn second_acquirer_waits_for_first() {
        let mut l = SpinLock::default();
        assert_eq!(l.acquire(100, 50), (100, 150));
        assert_eq!(l.acquire(120, 10), (150, 160));
        assert_eq!(l.contended, 1);
        assert_eq!(l.wait_ns, 30);
        assert_eq!(l.acquire(500, 10), (500, 510));
    }
    #[test]
    fn earlier_request_fits_in_a_gap_before_a_later_booking() {
        let mut l = SpinLock::default();
        assert_eq!(l.acquire(1000, 100), (1000, 1100));
        // A CPU whose clock is behind asks at 200: the lock was free then.
        assert_eq!(l.acquire(200, 100), (200, 300));
        // Asking at 950 for 100 ns overlaps [1000,1100): it goes after.
        assert_eq!(l.acquire(950, 100), (1100, 1200));
        assert_eq!(l.contended, 1);
    }
    #[test]
    fn extend_merges_overlapping_bookings() {
        let mut l = SpinLock::default();
        l.acquire(100, 50);
        l.acquire(300, 50);
        l.extend(140, 320);
        assert_eq!(l.busy.len(), 1);
        assert_eq!(l.acquire(0, 10), (0, 10));
        assert_eq!(l.acquire(200, 10), (350, 360));
    }
    #[test]
    fn adjacent_bookings_merge() {
        let mut l = SpinLock::default();
        for _ in 0..1000 {
            l.acquire(0, 10);
        }
        assert_eq!(l.busy.len(), 1);
        assert_eq!(l.busy.last_key_value(), Some((&0, &10_000)));
    }
}
