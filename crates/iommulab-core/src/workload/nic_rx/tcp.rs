//! Receive-side TCP as far as it decides ACKs.
//!
//! GRO merges a flow's segments of one NAPI poll into skbs of at most `gro_max` bytes (net/core/gro.c
//! dev_gro_receive; all flushed when the poll ends, napi_complete_done). For each skb TCP acknowledges at
//! once when more than one full-sized segment is unacknowledged and the window it would advertise has not
//! shrunk since the last ACK, or when the skb grew the window (quick-ACK) (net/ipv4/tcp_input.c
//! __tcp_ack_snd_check). The reader's recvmsg then acknowledges when more than one segment is
//! unacknowledged or the window grew to at least twice what the sender has left (net/ipv4/tcp.c
//! tcp_cleanup_rbuf). The delayed-ACK timer is not modelled: in bulk receive a read always comes first.
//!
//! Segments that arrive while a lost one's retransmission is awaited go to the out-of-order queue
//! (tcp_data_queue_ofo): GRO keeps them apart from in-order ones, and each such skb is acknowledged at once
//! (a duplicate ACK with SACK) up to TCP_FASTRETRANS_THRESH of them, then through the compressed-SACK timer
//! (__tcp_ack_snd_check, tcp_sack_compress): 5 % of the RTT, a microsecond or two, so taken as one ACK per
//! NAPI poll. The retransmission fills the gap and is acknowledged at once (tcp_data_queue: ICSK_ACK_NOW).
//! Out-of-order data is counted as acknowledged: SACK tells the sender it arrived.
//!
//! The window offered is Linux's (net/ipv4/tcp_output.c __tcp_select_window): the free receive space,
//! capped by `rcv_ssthresh`, which grows only as data arrives into free space beyond it
//! (tcp_input.c tcp_grow_window) and never beyond `window_clamp`, the full space less one segment
//! (tcp_init_buffer_space); a window once offered is never shrunk (tcp_select_window). The cap is what
//! lets an skb that lands in an emptied socket be acknowledged at once.
//! Windows are in payload bytes. `rcvbuf` is the window the whole receive buffer allows,
//! tcp_win_from_space(sk_rcvbuf). The free space is tcp_space(): tcp_win_from_space(sk_rcvbuf -
//! sk_rmem_alloc), where sk_rmem_alloc counts the held skbs' truesize, the RX buffer each segment took
//! (`rq::frame_truesize`), not their payload. How space becomes window changed in Linux 6.6 (`WinFromSpace`):
//! before, half of it (tcp_adv_win_scale = 1), so a socket holds up to twice `rcvbuf` in truesize, nearly
//! twice `rcvbuf` of payload where segments fill their buffers (mlx5's striding RQ); from 6.6, the space
//! scaled by the flow's measured payload/truesize, so it holds about `rcvbuf` of payload whatever the
//! layout. tcp_grow_window() checks the same ratio before it opens rcv_ssthresh (check #2,
//! __tcp_grow_window).
//!
//! The sender sends only inside the window the last ACK it has heard offered: up to its right edge,
//! rcv_wup + rcv_wnd (tcp_output.c tcp_snd_wnd_test on the sender; `sender`).

/// Initial rcv_ssthresh: the SYN's window, at most 64 KiB (tcp_select_initial_window, 5.4 to 6.0:
/// `min(space, U16_MAX)`), which tcp_grow_window then opens.
const INITIAL_WINDOW: u64 = 65535;
/// TCP_FASTRETRANS_THRESH (include/net/tcp.h): duplicate ACKs sent at once before SACK compression.
const FASTRETRANS_THRESH: u32 = 3;

/// tcp_win_from_space(): how buffer space becomes window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WinFromSpace {
    /// Before Linux 6.6: space - (space >> tcp_adv_win_scale), at the sysctl's default of 1
    /// (Documentation/networking/ip-sysctl.rst): half of it.
    AdvWinScale,
    /// From 6.6 (`KernelVersion::tcp_scaling_ratio`): space * tp->scaling_ratio, the payload/truesize of the
    /// flow's skbs (tcp_measure_rcv_mss()); the model's segments all have the same ratio.
    ScalingRatio,
}

/// net.ipv4.tcp_adv_win_scale's default (`WinFromSpace::AdvWinScale`).
const TCP_ADV_WIN_SCALE: u32 = 1;

pub struct RxTcp {
    gro_max: u64,
    mss: u64,
    rcvbuf: u64,
    /// sk_rcvbuf: the buffer whose tcp_win_from_space() is `rcvbuf`.
    sk_rcvbuf: u64,
    /// The truesize of one MSS-sized segment in the socket.
    truesize: u64,
    rule: WinFromSpace,
    /// window_clamp: tcp_init_buffer_space() reserves one segment of the full space.
    clamp: u64,
    /// Bytes of each flow's open GRO skb and whether it holds out-of-order segments, and the flows with
    /// one open, in order.
    gro: Vec<u64>,
    gro_ooo: Vec<bool>,
    open: Vec<u32>,
    /// Per flow: bytes of segments through GRO (already in the socket) that TCP has not queued yet.
    later: Vec<u64>,
    /// Per flow: bytes acknowledged (rcv_wup), received since the last ACK (rcv_nxt - rcv_wup), the window
    /// that ACK advertised (rcv_wnd), rcv_ssthresh, and quick-ACK mode (icsk_ack.quick).
    acked: Vec<u64>,
    unacked: Vec<u64>,
    advertised: Vec<u64>,
    ssthresh: Vec<u64>,
    quick: Vec<bool>,
    /// Per flow: duplicate ACKs sent for the out-of-order queue (dup_ack_counter; non-zero exactly while
    /// the queue holds data, as the first out-of-order skb always sends one); the poll its last compressed
    /// SACK went out in. `poll` counts NAPI polls.
    dupacks: Vec<u32>,
    sack_poll: Vec<u64>,
    poll: u64,
}

impl RxTcp {
    /// `truesize`: what one MSS-sized segment adds to sk_rmem_alloc; `rule`: the kernel's tcp_win_from_space().
    pub fn new(
        flows: usize,
        mss: u64,
        gro_max: u64,
        rcvbuf: u64,
        truesize: u64,
        rule: WinFromSpace,
    ) -> Self {
        let clamp = rcvbuf.saturating_sub(mss).max(mss.min(rcvbuf));
        let initial = INITIAL_WINDOW.min(clamp);
        RxTcp {
            gro_max: gro_max.max(mss),
            mss,
            rcvbuf,
            sk_rcvbuf: match rule {
                WinFromSpace::AdvWinScale => rcvbuf << TCP_ADV_WIN_SCALE,
                WinFromSpace::ScalingRatio => (rcvbuf * truesize).div_ceil(mss),
            },
            truesize,
            rule,
            clamp,
            gro: vec![0; flows],
            gro_ooo: vec![false; flows],
            open: Vec::new(),
            later: vec![0; flows],
            acked: vec![0; flows],
            unacked: vec![0; flows],
            advertised: vec![initial; flows],
            ssthresh: vec![initial; flows],
            quick: vec![false; flows],
            dupacks: vec![0; flows],
            sack_poll: vec![u64::MAX; flows],
            poll: 0,
        }
    }

    /// tcp_win_from_space().
    fn win_from_space(&self, space: u64) -> u64 {
        match self.rule {
            WinFromSpace::AdvWinScale => space - (space >> TCP_ADV_WIN_SCALE),
            WinFromSpace::ScalingRatio => space * self.mss / self.truesize,
        }
    }

    /// The truesize of `bytes` of full-sized segments.
    fn truesize_of(&self, bytes: u64) -> u64 {
        bytes * self.truesize / self.mss
    }

    /// tcp_space() with `queued` payload bytes held: the window the buffer's free part allows.
    fn space(&self, queued: u64) -> u64 {
        self.win_from_space(self.sk_rcvbuf.saturating_sub(self.truesize_of(queued)))
    }

    /// __tcp_select_window(): the free space, capped by rcv_ssthresh; below half the full space quick-ACK
    /// mode ends, and below a sixteenth of it (or one segment) the window closes.
    fn select(&mut self, f: usize, queued: u64) -> u64 {
        let free = self.space(queued);
        if free < self.clamp / 2 {
            self.quick[f] = false;
            if free < self.rcvbuf / 16 || free < self.mss {
                return 0;
            }
        }
        free.min(self.ssthresh[f])
    }

    /// tcp_grow_window(): an skb of `len` bytes arrived with `queued` bytes now held; rcv_ssthresh grows
    /// toward the free space by at least two segments or twice the skb, and the ACK goes out at once. An
    /// skb whose truesize would not fit its payload in the window (check #2) grows it only while
    /// rcv_ssthresh is small against the buffer (__tcp_grow_window).
    fn grow(&mut self, f: usize, len: u64, queued: u64) {
        let room = self
            .clamp
            .min(self.space(queued))
            .saturating_sub(self.ssthresh[f]);
        if room > 0 && self.grows(f, len) {
            self.ssthresh[f] += room.min((2 * self.mss).max(2 * len));
            self.quick[f] = true;
        }
    }

    /// tcp_grow_window() check #2 and __tcp_grow_window(): whether an skb of `len` bytes opens rcv_ssthresh.
    fn grows(&self, f: usize, len: u64) -> bool {
        let win = self.win_from_space(self.truesize_of(len));
        if win <= len {
            return true;
        }
        let mut truesize = win >> 1;
        // The kernel halves from tcp_rmem[2], which the modelled buffer is (no autotuning).
        let mut window = self.win_from_space(self.sk_rcvbuf) >> 1;
        while self.ssthresh[f] <= window {
            if truesize <= len {
                return true;
            }
            truesize >>= 1;
            window >>= 1;
        }
        false
    }

    /// tcp_send_ack() through tcp_select_window(): never offer less than what is left of the last window.
    fn ack(&mut self, f: usize, queued: u64) -> bool {
        let left = self.advertised[f].saturating_sub(self.unacked[f]);
        self.advertised[f] = self.select(f, queued).max(left);
        self.acked[f] += std::mem::take(&mut self.unacked[f]);
        self.quick[f] = false; // tcp_dec_quickack_mode()
        true
    }

    /// Bytes of flow `f` acknowledged (rcv_wup).
    pub fn acked(&self, f: usize) -> u64 {
        self.acked[f]
    }

    /// The last byte flow `f`'s sender may send, plus one: the right edge of the window last advertised
    /// (rcv_wup + rcv_wnd), in bytes from the start of the stream.
    pub fn right_edge(&self, f: usize) -> u64 {
        self.acked[f] + self.advertised[f]
    }

    /// One segment of flow `f` reaches GRO, out of order (beyond a gap) or not. Some((bytes, ooo)) when it
    /// first closes the flow's open skb, which must then be delivered (`deliver`): at GRO's size limit, or
    /// where the segments stop being contiguous.
    pub fn segment(&mut self, f: usize, ooo: bool) -> Option<(u64, bool)> {
        let mut closed = None;
        if self.gro[f] > 0 && (self.gro[f] + self.mss > self.gro_max || self.gro_ooo[f] != ooo) {
            closed = Some((std::mem::take(&mut self.gro[f]), self.gro_ooo[f]));
            self.open.retain(|&o| o as usize != f);
        }
        if self.gro[f] == 0 {
            self.open.push(f as u32);
            self.gro_ooo[f] = ooo;
        }
        self.gro[f] += self.mss;
        self.later[f] += self.mss;
        closed
    }

    /// The poll ends: every open skb goes up the stack, (flow, bytes, ooo) in order.
    pub fn flush(&mut self, out: &mut Vec<(u32, u64, bool)>) {
        for f in self.open.drain(..) {
            let f = f as usize;
            out.push((f as u32, std::mem::take(&mut self.gro[f]), self.gro_ooo[f]));
        }
        self.poll += 1;
    }

    /// TCP queues an skb of `bytes` for flow `f`, in order or out of order (tcp_data_queue,
    /// tcp_event_data_recv): true when __tcp_ack_snd_check() sends an ACK now. `held` is what the flow's
    /// socket holds counting the poll's segments GRO has not handed up yet; the stack takes a poll's skbs
    /// one by one (netif_receive_skb_list), so the skb is checked against the socket up to itself only.
    pub fn deliver(&mut self, f: usize, bytes: u64, held: u64, ooo: bool) -> bool {
        self.later[f] = self.later[f].saturating_sub(bytes);
        let queued = held.saturating_sub(self.later[f]);
        self.unacked[f] += bytes;
        self.grow(f, bytes, queued);
        if ooo {
            if self.dupacks[f] < FASTRETRANS_THRESH {
                self.dupacks[f] += 1;
                return self.ack(f, queued);
            }
            if self.sack_poll[f] != self.poll {
                self.sack_poll[f] = self.poll; // the compressed-SACK timer, once per poll
                return self.ack(f, queued);
            }
            return false;
        }
        if std::mem::take(&mut self.dupacks[f]) > 0 {
            // The gap filled (ICSK_ACK_NOW); rcv_nxt moved, so a new dup_ack_counter.
            return self.ack(f, queued);
        }
        let more_than_one = self.unacked[f] > self.mss;
        if (more_than_one && self.select(f, queued) >= self.advertised[f]) || self.quick[f] {
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
        if 2 * left <= self.clamp {
            let window = self.select(f, queued);
            if window > 0 && window >= 2 * left {
                return self.ack(f, queued);
            }
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
        let mut t = RxTcp::new(1, 4000, 65536, 1 << 20, 8000, WinFromSpace::AdvWinScale);
        let closed: Vec<u64> = (0..40)
            .filter_map(|_| t.segment(0, false))
            .map(|c| c.0)
            .collect();
        assert_eq!(closed, vec![64000, 64000]);
        let mut rest = vec![];
        t.flush(&mut rest);
        assert_eq!(rest, vec![(0, 32000, false)]);
    }

    /// Open flow 0's window: skbs of `skb` bytes into an empty socket, each read at once, until
    /// rcv_ssthresh stops growing.
    fn opened(t: &mut RxTcp, skb: u64) {
        loop {
            let before = t.ssthresh[0];
            t.deliver(0, skb, skb, false);
            t.read(0, 0);
            if t.ssthresh[0] == before {
                return;
            }
        }
    }

    #[test]
    fn the_window_opens_with_quick_acks_up_to_the_clamp() {
        let mut t = RxTcp::new(1, 1000, 65536, 100_000, 2000, WinFromSpace::AdvWinScale);
        assert_eq!(t.ssthresh[0], INITIAL_WINDOW);
        // An skb that finds free space beyond rcv_ssthresh is acknowledged at once, even a lone segment.
        assert!(t.deliver(0, 1000, 1000, false));
        t.read(0, 0);
        opened(&mut t, 1000);
        // rcv_ssthresh reached the free space after one segment; window_clamp is one segment short of full.
        assert_eq!(t.ssthresh[0], 99_000);
        assert_eq!(t.clamp, 99_000);
        // Once it is open, a lone segment waits (the last one `opened` delivered), and a second goes.
        assert_eq!(t.unacked[0], 1000);
        assert!(t.deliver(0, 1000, 1000, false));
    }

    #[test]
    fn acks_wait_while_the_socket_fills_and_the_read_sends_them() {
        let mut t = RxTcp::new(1, 1000, 65536, 100_000, 2000, WinFromSpace::AdvWinScale);
        opened(&mut t, 1000);
        // The socket fills (nothing read): the window shrinks, no immediate ACK.
        assert!(!t.deliver(0, 5000, 5000, false));
        assert!(!t.deliver(0, 5000, 10_000, false));
        // The reader drains it: recvmsg acknowledges, once.
        assert!(t.read(0, 0));
        assert!(!t.read(0, 0));
    }

    #[test]
    fn rcv_ssthresh_lets_an_skb_into_an_emptied_socket_be_acked_at_once() {
        // 10000-byte skbs, each into an empty socket: rcv_ssthresh stops at the free space with one queued.
        let mut t = RxTcp::new(1, 1000, 65536, 100_000, 2000, WinFromSpace::AdvWinScale);
        opened(&mut t, 10_000);
        assert_eq!(t.ssthresh[0], 90_000);
        // Two skbs before the reader runs: the second shrinks the window and waits; the read acknowledges.
        assert!(t.deliver(0, 10_000, 10_000, false));
        assert!(!t.deliver(0, 10_000, 20_000, false));
        assert!(t.read(0, 0));
        // That ACK offered rcv_ssthresh, not the whole free space, so the next skb into the emptied
        // socket does not shrink the window and is acknowledged at once.
        assert_eq!(t.advertised[0], 90_000);
        assert!(t.deliver(0, 10_000, 10_000, false));
        // A larger one would shrink it: it waits for the read.
        t.read(0, 0);
        assert!(!t.deliver(0, 20_000, 20_000, false));
        assert!(t.read(0, 0));
    }

    #[test]
    fn each_skb_of_a_poll_is_checked_against_the_socket_up_to_itself() {
        // 10000-byte skbs, each into an emptied socket, open the window (as above).
        let mut t = RxTcp::new(1, 1000, 10_000, 100_000, 2000, WinFromSpace::AdvWinScale);
        opened(&mut t, 10_000);
        t.read(0, 0);
        // One poll brings 20 segments: two skbs, all in the socket before TCP takes the first.
        let mut skbs = vec![];
        for _ in 0..20 {
            if let Some((bytes, ooo)) = t.segment(0, false) {
                skbs.push((0, bytes, ooo));
            }
        }
        t.flush(&mut skbs);
        assert_eq!(skbs, vec![(0, 10_000, false); 2]);
        // The first meets the emptied socket and is acknowledged at once; the second shrinks the window.
        assert!(t.deliver(0, 10_000, 20_000, false));
        assert!(!t.deliver(0, 10_000, 20_000, false));
        assert_eq!(t.later[0], 0);
    }

    /// What the receiver holds once a sender held to the right edge has sent all it may, in skbs of `skb`
    /// bytes, to a socket already holding `queued`; and the ACKs that sent.
    fn fill(t: &mut RxTcp, skb: u64, mut queued: u64) -> (u64, u32) {
        let mut acks = 0;
        while t.acked[0] + t.unacked[0] + skb <= t.right_edge(0) {
            queued += skb;
            acks += t.deliver(0, skb, queued, false) as u32;
        }
        (queued, acks)
    }

    #[test]
    fn a_sender_held_to_the_right_edge_stops_at_a_closed_window_until_the_reader_opens_it() {
        let mut t = RxTcp::new(1, 1000, 65536, 100_000, 2000, WinFromSpace::AdvWinScale);
        opened(&mut t, 1000);
        // The window the last ACK offered fills without an ACK: each skb shrinks it.
        let (queued, acks) = fill(&mut t, 2000, 1000);
        assert_eq!((queued, acks), (99_000, 0));
        // A small read acknowledges but can offer no window (below a sixteenth of the space): the edge
        // stays where it was and nothing more arrives, so nothing more is acknowledged.
        assert!(t.read(0, 98_000));
        let edge = t.right_edge(0);
        assert_eq!(edge, t.acked[0]);
        assert_eq!(fill(&mut t, 2000, 98_000), (98_000, 0));
        // A read that frees half the space sends the window update, and the sender goes on.
        assert!(t.read(0, 48_000));
        assert_eq!(t.right_edge(0), edge + 52_000);
        assert_eq!(fill(&mut t, 2000, 48_000), (100_000, 0));
    }

    #[test]
    fn the_buffer_counts_truesize_and_the_kernel_decides_what_that_leaves_of_the_window() {
        // The sender held to the right edge fills the socket until the window closes; each ACK offers what
        // tcp_space() then allows, and the sender goes on until an ACK lets no further segment in.
        let held = |truesize, rule| {
            let mut t = RxTcp::new(1, 1000, 65536, 100_000, truesize, rule);
            opened(&mut t, 1000);
            let (mut queued, _) = fill(&mut t, 1000, 0);
            loop {
                t.ack(0, queued);
                let more = fill(&mut t, 1000, queued).0;
                if more == queued {
                    return queued;
                }
                queued = more;
            }
        };
        // Before 6.6 the window is half the free buffer: segments whose truesize is their payload (mlx5's
        // striding RQ at a 4000-byte MTU, about) fill nearly the whole 200000-byte sk_rcvbuf, twice what a
        // truesize of twice the payload allows.
        let full = held(1000, WinFromSpace::AdvWinScale);
        assert!(full > 180_000 && full <= 200_000, "{full}");
        assert!(held(2000, WinFromSpace::AdvWinScale) <= 100_000);
        // From 6.6 the window scales by the measured payload/truesize: about `rcvbuf` of payload either way.
        for truesize in [1000, 2000, 4096] {
            let h = held(truesize, WinFromSpace::ScalingRatio);
            assert!(h > 90_000 && h <= 100_000, "{truesize}: {h}");
        }
    }

    #[test]
    fn skbs_whose_truesize_outgrows_the_window_stop_opening_it_early() {
        // Page-per-frame rings (truesize 4096 for 1448 bytes) before 6.6: check #2 fails, and
        // __tcp_grow_window lets rcv_ssthresh grow only up to a quarter of sk_rcvbuf; a good ratio opens it
        // to the clamp, as the measured ratio always does from 6.6.
        let opened_to = |truesize, rule| {
            let mut t = RxTcp::new(1, 1448, 65536, 1_000_000, truesize, rule);
            opened(&mut t, 1448);
            t.ssthresh[0]
        };
        assert_eq!(opened_to(2048, WinFromSpace::AdvWinScale), 1_000_000 - 1448);
        let capped = opened_to(4096, WinFromSpace::AdvWinScale);
        assert!(capped > 500_000 && capped <= 500_000 + 2 * 1448, "{capped}");
        assert_eq!(
            opened_to(4096, WinFromSpace::ScalingRatio),
            1_000_000 - 1448
        );
    }

    #[test]
    fn a_read_that_doubles_a_nearly_used_window_acks() {
        // 6000-byte segments in a 20000-byte space (window_clamp 14000).
        let mut t = RxTcp::new(1, 6000, 65536, 20_000, 12000, WinFromSpace::AdvWinScale);
        assert!(!t.deliver(0, 5000, 5000, false));
        assert!(!t.deliver(0, 5000, 10_000, false));
        // A read of 1000 bytes acknowledges the 10000 and offers the 11000 then free.
        assert!(t.read(0, 9000));
        assert_eq!(t.advertised[0], 11_000);
        // One segment's worth arrives: not more than an MSS, no ACK; the sender has 6000 left.
        assert!(!t.deliver(0, 5000, 14_000, false));
        // A read that frees only up to 10000 does not double it; one that frees all does.
        assert!(!t.read(0, 10_000));
        assert!(t.read(0, 0));
    }

    #[test]
    fn a_gap_gets_three_duplicate_acks_then_one_per_poll_and_its_filling_one_more() {
        let mut t = RxTcp::new(1, 1000, 65536, 1 << 20, 2000, WinFromSpace::AdvWinScale);
        opened(&mut t, 1000);
        t.read(0, 0);
        // GRO keeps out-of-order segments apart from in-order ones.
        assert_eq!(t.segment(0, false), None);
        assert_eq!(t.segment(0, true), Some((1000, false)));
        let mut acks = vec![];
        for _poll in 0..3 {
            // Three out-of-order skbs per poll: three duplicate ACKs at once, then one per poll.
            acks.push(
                (0..3)
                    .map(|_| t.deliver(0, 1000, 1000, true))
                    .collect::<Vec<_>>(),
            );
            t.flush(&mut vec![]);
        }
        assert_eq!(
            acks,
            vec![
                vec![true; 3],
                vec![true, false, false],
                vec![true, false, false]
            ]
        );
        // The retransmission fills the gap: acknowledged at once, and the next gap gets three again.
        assert!(t.deliver(0, 1000, 1000, false));
        assert!(!t.deliver(0, 1000, 2000, false));
        t.read(0, 0);
        assert!((0..3).all(|_| t.deliver(0, 1000, 1000, true)));
    }
}
