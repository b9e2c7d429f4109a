//! A hardware queue served in the order requests reach it (an invalidation queue, an SMMU command queue):
//! each request waits for the ones that reached it earlier, then takes its work.
//!
//! CPUs run their work ahead of the event clock (a NAPI poll's unmaps, each waiting for its sync, are
//! computed in one go), so a request can arrive after later-timed requests have been served. A calendar
//! that only fills gaps would make it wait behind the whole run-ahead chain (a 200 µs poll of back-to-back
//! syncs leaves no gap long enough), which no FIFO does. Here it is served after its predecessor in request
//! time, and the work it adds is charged to whatever comes after the latest request: the requests it
//! overtook keep the times already handed out (they cannot be recomputed), and the server's total work is
//! conserved.

use super::lock::{LockStats, LOOKBEHIND_NS};
use super::split_deque::partition_from_back;
use super::Time;
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy)]
struct Req {
    at: Time,
    end: Time,
}

#[derive(Debug, Clone, Default)]
pub struct FifoServer {
    /// Recent requests in request-time order.
    reqs: VecDeque<Req>,
    /// When the server is done with everything handed to it (out-of-order work included).
    horizon: Time,
    latest: Time,
    pub stats: LockStats,
}

impl FifoServer {
    /// When a request reaching the server at `at` would start (what `serve` returns as its start, whatever
    /// its work): after its predecessor in request time.
    pub fn start_for(&self, at: Time) -> Time {
        self.slot(at).1
    }

    /// Where a request at `at` goes among the recent ones, and when it starts: behind everything when it is
    /// the latest, else after its predecessor in request time.
    fn slot(&self, at: Time) -> (usize, Time) {
        let (a, b) = self.reqs.as_slices();
        let i = partition_from_back(&[a, b], |r| r.at <= at);
        let start = if i == self.reqs.len() {
            at.max(self.horizon)
        } else {
            at.max(if i > 0 { self.reqs[i - 1].end } else { 0 })
        };
        (i, start)
    }

    /// A request at `at` needing `work` ns of the server. Returns (start, end).
    pub fn serve(&mut self, at: Time, work: u64) -> (Time, Time) {
        self.latest = self.latest.max(at);
        let floor = self.latest.saturating_sub(LOOKBEHIND_NS);
        while self
            .reqs
            .front()
            .is_some_and(|r| r.end <= floor && r.at <= floor)
        {
            self.reqs.pop_front();
        }
        let (i, start) = self.slot(at);
        let end = start + work;
        if i == self.reqs.len() {
            self.horizon = end;
            self.reqs.push_back(Req { at, end });
        } else {
            // Overtaken by later-timed requests already served: after its own predecessor.
            self.reqs.insert(i, Req { at, end });
            self.horizon = self.horizon.max(start) + work;
        }
        // The hardware spins no CPU: the wait is the requester's, charged by its caller.
        self.stats.record(super::NO_CPU, start - at, 0);
        self.stats.busy(work);
        self.stats.queue = true;
        (start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_requests_queue_behind_each_other() {
        let mut q = FifoServer::default();
        assert_eq!(q.serve(0, 100), (0, 100));
        assert_eq!(q.serve(50, 100), (100, 200));
        assert_eq!(q.serve(500, 10), (500, 510));
        assert_eq!(q.stats.contended, 1);
    }

    #[test]
    fn a_late_arrival_is_served_after_its_predecessor_not_after_a_run_ahead_chain() {
        let mut q = FifoServer::default();
        // One CPU ran ahead: back-to-back syncs from 0 to 10 µs, 200 ns apart.
        let mut t = 0;
        for _ in 0..10 {
            let (_, e) = q.serve(t, 800);
            t = e + 200;
        }
        // Another CPU's request at 1.5 µs: in a FIFO it follows the one in service (ends 1.8 µs).
        assert_eq!(q.start_for(1_500), 1_800);
        assert_eq!(q.serve(1_500, 800), (1_800, 2_600));
        // Its work is charged to what comes after the horizon.
        assert_eq!(q.serve(t, 800).0, t + 800 - 200);
    }
}
