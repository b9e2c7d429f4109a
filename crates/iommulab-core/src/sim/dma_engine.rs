use super::Time;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A device's DMA engine: transactions issue in order, at most `slots` may await translation at once, and
/// translated data then crosses the link one transaction after another at the link bandwidth.
/// Translation-limited bandwidth therefore follows Little's law: slots × bytes / translation latency.
#[derive(Debug, Clone)]
pub struct DmaEngine {
    slots: usize,
    in_flight: BinaryHeap<Reverse<Time>>,
    link_free_at: Time,
    ps_per_byte: u64,
    pub transactions: u64,
    pub bytes: u64,
    /// Time transactions waited for a free translation slot.
    pub slot_wait_ns: u64,
}

impl DmaEngine {
    pub fn new(slots: u32, link_gbps: f64) -> Self {
        DmaEngine {
            slots: slots.max(1) as usize,
            in_flight: BinaryHeap::new(),
            link_free_at: 0,
            // bits/ns = Gbps; ps per byte = 8000 / Gbps
            ps_per_byte: (8000.0 / link_gbps).round().max(1.0) as u64,
            transactions: 0,
            bytes: 0,
            slot_wait_ns: 0,
        }
    }

    /// When a transaction arriving at `at` would start translation (without issuing it).
    pub fn next_start(&self, at: Time) -> Time {
        if self.in_flight.len() < self.slots {
            at
        } else {
            at.max(self.in_flight.peek().map(|r| r.0).unwrap_or(0))
        }
    }

    /// Issue one transaction of `bytes` whose translation takes `translate_ns`. Returns its completion time.
    pub fn issue(&mut self, at: Time, translate_ns: u64, bytes: u64) -> Time {
        let mut start = at;
        if self.in_flight.len() >= self.slots {
            let Reverse(free) = self.in_flight.pop().expect("slots > 0");
            start = start.max(free);
        }
        self.slot_wait_ns += start - at;
        let translated = start + translate_ns;
        self.in_flight.push(Reverse(translated));
        let xfer = (bytes * self.ps_per_byte).div_ceil(1000);
        let done = translated.max(self.link_free_at) + xfer;
        self.link_free_at = done;
        self.transactions += 1;
        self.bytes += bytes;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn one_slot_serialises_translations() {
        let mut e = DmaEngine::new(1, 8000.0); // 1 ps/byte: transfer ~free
        let d1 = e.issue(0, 100, 1000);
        let d2 = e.issue(0, 100, 1000);
        assert_eq!(d1, 101);
        assert_eq!(d2, 201);
        assert_eq!(e.slot_wait_ns, 100);
    }
    #[test]
    fn little_law_bandwidth() {
        // 4 slots, 400 ns translation, 4096 B: ~4*4096/400 B/ns = 327 Gbps > 128 Gbps link → link bound.
        let mut e = DmaEngine::new(4, 128.0);
        let mut done = 0;
        for _ in 0..1000 {
            done = e.issue(0, 400, 4096);
        }
        let gbps = 1000.0 * 4096.0 * 8.0 / done as f64;
        assert!((gbps - 128.0).abs() < 2.0, "{gbps}");
        // 1 slot: 4096 B per 400 ns = 81.9 Gbps.
        let mut e = DmaEngine::new(1, 128.0);
        for _ in 0..1000 {
            done = e.issue(0, 400, 4096);
        }
        let gbps = 1000.0 * 4096.0 * 8.0 / done as f64;
        assert!((gbps - 81.9).abs() < 1.0, "{gbps}");
    }
}
