//! Receive-side TCP as far as it decides ACKs.
//!
//! GRO merges a flow's segments of one NAPI poll into skbs of at most `gro_max` bytes (net/core/gro.c
//! dev_gro_receive; all flushed when the poll ends, napi_complete_done). For each skb TCP acknowledges at
//! once only when more than one full-sized segment is unacknowledged and the window it would advertise has
//! not shrunk since the last ACK (net/ipv4/tcp_input.c __tcp_ack_snd_check, __tcp_select_window): while the
//! socket fills, ACKs wait. The reader's recvmsg then acknowledges when more than one segment is
//! unacknowledged or the window grew to at least twice what the sender has left (net/ipv4/tcp.c
//! tcp_cleanup_rbuf). The delayed-ACK timer is not modelled: in bulk receive a read always comes first.
//! Windows are in payload bytes of a `rcvbuf`-byte receive space.

pub struct RxTcp {
    gro_max: u64,
    mss: u64,
    rcvbuf: u64,
    /// Bytes of each flow's open GRO skb, and the flows with one open, in order.
    gro: Vec<u64>,
    open: Vec<u32>,
    /// Received since the last ACK (rcv_nxt - rcv_wup), and the window that ACK advertised (rcv_wnd).
    unacked: Vec<u64>,
    advertised: Vec<u64>,
}

impl RxTcp {
    pub fn new(flows: usize, mss: u64, gro_max: u64, rcvbuf: u64) -> Self {
        RxTcp {
            gro_max: gro_max.max(mss),
            mss,
            rcvbuf,
            gro: vec![0; flows],
            open: Vec::new(),
            unacked: vec![0; flows],
            advertised: vec![rcvbuf; flows],
        }
    }

    /// __tcp_select_window(): the free receive space.
    fn window(&self, queued: u64) -> u64 {
        self.rcvbuf.saturating_sub(queued)
    }

    fn ack(&mut self, f: usize, queued: u64) -> bool {
        self.unacked[f] = 0;
        self.advertised[f] = self.window(queued);
        true
    }

    /// One segment of flow `f` reaches GRO. Some(bytes) when it first closes the flow's open skb, which
    /// must then be delivered (`deliver`).
    pub fn segment(&mut self, f: usize) -> Option<u64> {
        let mut closed = None;
        if self.gro[f] > 0 && self.gro[f] + self.mss > self.gro_max {
            closed = Some(std::mem::take(&mut self.gro[f]));
            self.open.retain(|&o| o as usize != f);
        }
        if self.gro[f] == 0 {
            self.open.push(f as u32);
        }
        self.gro[f] += self.mss;
        closed
    }

    /// The poll ends: every open skb goes up the stack, (flow, bytes) in order.
    pub fn flush(&mut self, out: &mut Vec<(u32, u64)>) {
        for f in self.open.drain(..) {
            out.push((f, std::mem::take(&mut self.gro[f as usize])));
        }
    }

    /// TCP queues an skb of `bytes` for flow `f`, whose socket now holds `queued` bytes: true when it
    /// sends an ACK now.
    pub fn deliver(&mut self, f: usize, bytes: u64, queued: u64) -> bool {
        self.unacked[f] += bytes;
        if self.unacked[f] > self.mss && self.window(queued) >= self.advertised[f] {
            return self.ack(f, queued);
        }
        false
    }

    /// recvmsg copied data out of flow `f`'s socket, which now holds `queued` bytes: true when
    /// tcp_cleanup_rbuf() sends an ACK.
    pub fn read(&mut self, f: usize, queued: u64) -> bool {
        if self.unacked[f] > self.mss {
            return self.ack(f, queued);
        }
        let left = self.advertised[f].saturating_sub(self.unacked[f]);
        if 2 * left <= self.rcvbuf && self.window(queued) >= 2 * left && self.window(queued) > 0 {
            return self.ack(f, queued);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gro_closes_skbs_at_its_limit_and_at_poll_end() {
        // 4000-byte segments, 64 KiB GRO: 16 per skb; 40 in a poll = 16 + 16 + 8.
        let mut t = RxTcp::new(1, 4000, 65536, 1 << 20);
        let closed: Vec<u64> = (0..40).filter_map(|_| t.segment(0)).collect();
        assert_eq!(closed, vec![64000, 64000]);
        let mut rest = vec![];
        t.flush(&mut rest);
        assert_eq!(rest, vec![(0, 32000)]);
    }

    #[test]
    fn acks_at_once_only_while_the_window_does_not_shrink() {
        let mut t = RxTcp::new(1, 1000, 65536, 100_000);
        // A lone segment waits; the second makes more than one MSS unacknowledged.
        assert!(!t.deliver(0, 1000, 0));
        assert!(t.deliver(0, 1000, 0));
        // The socket fills (nothing read): the window shrinks, no immediate ACK.
        assert!(!t.deliver(0, 5000, 5000));
        assert!(!t.deliver(0, 5000, 10_000));
        // The reader drains it: recvmsg acknowledges.
        assert!(t.read(0, 0));
        assert!(!t.read(0, 0));
    }

    #[test]
    fn a_read_that_doubles_a_nearly_used_window_acks() {
        // 6000-byte segments in a 10000-byte space: one segment (not more than an MSS) is unacknowledged.
        let mut t = RxTcp::new(1, 6000, 65536, 10_000);
        assert!(!t.deliver(0, 5000, 5000));
        // The sender has 5000 left; a read that frees only 7000 does not double it, one that frees all does.
        assert!(!t.read(0, 3000));
        assert!(t.read(0, 0));
    }
}
