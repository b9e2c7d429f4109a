use super::Time;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Where a transaction waits before translation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Written from the device's receive buffer, which fills from the wire and drains in order: the data and
    /// completion entries of received frames, and the descriptor fetches they start.
    Receive,
    /// A read the host's doorbell asked for (a send WQE, the data it points at): it does not queue behind the
    /// receive buffer, and its data comes down the link's other direction.
    SendRead,
    /// A send completion entry: written up the link beside the receive buffer's writes.
    SendWrite,
}

/// A device's DMA engine: transactions issue in order, at most `slots` may await translation at once, and
/// translated data then crosses the link one transaction after another at the link bandwidth.
/// Translation-limited bandwidth therefore follows Little's law: slots × bytes / translation latency.
///
/// Received frames wait in the device's buffer (`Path::Receive`, issued at arrival), so under a translation
/// backlog their slots are taken well into the future. Send-side transactions (`SendRead`, `SendWrite`)
/// queue only among themselves: the device fetches a doorbell's WQE beside its receive buffer, and PCIe
/// orders a read behind the posted writes already at the root port, not behind frames still in the device
/// (PCIe Base Spec §2.4.1, Transaction Ordering Rules). Their translation time is charged to the receive
/// path's next slot, so the IOMMU serves the same total work.
#[derive(Debug, Clone)]
pub struct DmaEngine {
    slots: usize,
    in_flight: BinaryHeap<Reverse<Time>>,
    /// Send-side transactions awaiting translation (their own FIFO over the same slots).
    send_in_flight: BinaryHeap<Reverse<Time>>,
    /// When the link's upstream (device to host) and downstream directions are next free.
    link_free_at: Time,
    down_free_at: Time,
    ps_per_byte: u64,
    pub transactions: u64,
    pub bytes: u64,
    /// Time transactions waited for a free translation slot.
    pub slot_wait_ns: u64,
    /// Slot-time spent translating (summed over slots), and time the link's upstream and downstream
    /// directions carried data: the engine's utilisation over a window.
    pub busy: EngineBusy,
}

/// A DMA engine's (or several engines') work in ns: translation slot-time over `slots`, and link time per
/// direction. Cumulative; a window is the difference of two (`since`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineBusy {
    pub slots: u64,
    pub translate_ns: u64,
    pub link_up_ns: u64,
    pub link_down_ns: u64,
    /// Engines summed (each brings its own link).
    pub engines: u64,
}

impl EngineBusy {
    pub fn since(&self, e: &EngineBusy) -> EngineBusy {
        EngineBusy {
            slots: self.slots,
            translate_ns: self.translate_ns - e.translate_ns,
            link_up_ns: self.link_up_ns - e.link_up_ns,
            link_down_ns: self.link_down_ns - e.link_down_ns,
            engines: self.engines,
        }
    }
    pub fn add(&mut self, o: &EngineBusy) {
        self.slots += o.slots;
        self.translate_ns += o.translate_ns;
        self.link_up_ns += o.link_up_ns;
        self.link_down_ns += o.link_down_ns;
        self.engines += o.engines;
    }
    /// Over a window of `dt` ns: the translation slots' busy share, and the busier link direction's.
    pub fn shares(&self, dt: u64) -> (f64, f64) {
        let per = |ns: u64, n: u64| ns as f64 / (n.max(1) * dt.max(1)) as f64;
        (
            per(self.translate_ns, self.slots),
            per(self.link_up_ns.max(self.link_down_ns), self.engines),
        )
    }
}

impl DmaEngine {
    pub fn new(slots: u32, link_gbps: f64) -> Self {
        DmaEngine {
            slots: slots.max(1) as usize,
            in_flight: BinaryHeap::new(),
            send_in_flight: BinaryHeap::new(),
            link_free_at: 0,
            down_free_at: 0,
            // bits/ns = Gbps; ps per byte = 8000 / Gbps
            ps_per_byte: (8000.0 / link_gbps).round().max(1.0) as u64,
            transactions: 0,
            bytes: 0,
            slot_wait_ns: 0,
            busy: EngineBusy {
                slots: slots.max(1) as u64,
                engines: 1,
                ..Default::default()
            },
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

    /// Issue one transaction of `bytes` on `path` whose translation takes `translate_ns`. Returns its
    /// completion time.
    pub fn issue_on(&mut self, path: Path, at: Time, translate_ns: u64, bytes: u64) -> Time {
        let xfer = (bytes * self.ps_per_byte).div_ceil(1000);
        self.transactions += 1;
        self.bytes += bytes;
        self.busy.translate_ns += translate_ns;
        if path == Path::Receive {
            self.busy.link_up_ns += xfer;
            let translated = self.translate(false, at, translate_ns);
            self.link_free_at = translated.max(self.link_free_at) + xfer;
            return self.link_free_at;
        }
        let translated = self.translate(true, at, translate_ns);
        // The slot it used is one the receive path does not get: its next free slot moves on by as much.
        let start = translated - translate_ns;
        if self.in_flight.len() >= self.slots {
            let Reverse(free) = self.in_flight.pop().expect("slots > 0");
            self.in_flight.push(Reverse(free.max(start) + translate_ns));
        } else {
            self.in_flight.push(Reverse(translated));
        }
        if path == Path::SendRead {
            self.busy.link_down_ns += xfer;
            self.down_free_at = translated.max(self.down_free_at) + xfer;
            self.down_free_at
        } else {
            // Upstream beside the receive buffer's writes: its transfer time is theirs to wait.
            self.busy.link_up_ns += xfer;
            self.link_free_at = translated.max(self.link_free_at) + xfer;
            translated + xfer
        }
    }

    /// Wait for one of the slots the receive (or send) side queues for, hold it while translating: when the
    /// translation is done.
    fn translate(&mut self, send: bool, at: Time, translate_ns: u64) -> Time {
        let queue = if send {
            &mut self.send_in_flight
        } else {
            &mut self.in_flight
        };
        let mut start = at;
        if queue.len() >= self.slots {
            let Reverse(free) = queue.pop().expect("slots > 0");
            start = start.max(free);
        }
        queue.push(Reverse(start + translate_ns));
        self.slot_wait_ns += start - at;
        start + translate_ns
    }

    /// Issue one received frame's transaction (`Path::Receive`) of `bytes` whose translation takes
    /// `translate_ns`. Returns its completion time.
    pub fn issue(&mut self, at: Time, translate_ns: u64, bytes: u64) -> Time {
        self.issue_on(Path::Receive, at, translate_ns, bytes)
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

    #[test]
    fn a_send_read_does_not_wait_behind_the_receive_buffer_but_delays_it() {
        // One slot, 100 ns translations: ten received frames at t=0 hold the slot until 1000 ns.
        let mut e = DmaEngine::new(1, 8000.0);
        let mut fifo = DmaEngine::new(1, 8000.0);
        for _ in 0..10 {
            e.issue(0, 100, 1000);
            fifo.issue(0, 100, 1000);
        }
        // A WQE fetch at 50 ns is translated at once; through the receive FIFO it would wait to 1000 ns.
        assert_eq!(e.issue_on(Path::SendRead, 50, 100, 64), 150 + 1);
        assert_eq!(fifo.issue(50, 100, 64), 1100 + 1);
        // The next received frame pays for that slot: the same as if the fetch had queued.
        assert_eq!(e.issue(60, 100, 1000), fifo.issue(60, 100, 1000));
        // Send reads queue among themselves.
        let second = e.issue_on(Path::SendRead, 50, 100, 64);
        assert_eq!(second, 250 + 1);
    }

    #[test]
    fn send_reads_use_the_downstream_direction() {
        // Link-bound receive writes (1 ps/byte at 8000 Gbps is 1 ns/KB; here 8 Gbps, 1 ns/byte) do not hold
        // up a read's data, which crosses the other direction.
        let mut e = DmaEngine::new(4, 8.0);
        let mut last = 0;
        for _ in 0..4 {
            last = e.issue(0, 10, 1000);
        }
        assert_eq!(last, 4010);
        assert_eq!(e.issue_on(Path::SendRead, 0, 10, 1000), 10 + 1000);
        // A send completion written upstream goes beside them, and they wait its transfer.
        assert_eq!(e.issue_on(Path::SendWrite, 0, 10, 64), 10 + 64);
        assert_eq!(e.issue(0, 10, 1000), 4010 + 64 + 1000);
    }
}
