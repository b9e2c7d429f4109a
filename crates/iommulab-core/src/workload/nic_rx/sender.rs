//! The peers' TCP senders as the receiver sees them: each flow's sender keeps to the receive window and to
//! a congestion window, and learns of ACKs and losses one round trip late.
//!
//! The congestion window follows DCTCP without ECN marks (the bottleneck is the receiving host, not a
//! switch queue), i.e. Reno: slow start from TCP_INIT_CWND, then one segment per window of segments
//! acknowledged (net/ipv4/tcp_cong.c tcp_reno_cong_avoid, tcp_slow_start, tcp_cong_avoid_ai), growing only
//! while the window is what holds the sender back (tcp_is_cwnd_limited). A loss the sender learns of puts
//! it in recovery: ssthresh becomes half the window (tcp_dctcp.c dctcp_react_to_loss, via dctcp_state on
//! entering TCP_CA_Recovery) and the window drops to it (PRR's end point, tcp_end_cwnd_reduction); further
//! losses of the same window are ignored until everything sent before recovery began is acknowledged
//! (tcp_input.c tcp_try_to_open / high_seq).
//!
//! Feedback is stamped when the receiver's device sends the ACK (or drops the segment) and acts on the
//! sender `rtt` later: an ACK travels back and what the sender then sends travels forward, so a segment
//! arriving at the receiver at `t` was sent on what the receiver had said by `t - rtt`. A lost segment is
//! retransmitted as the flow's next one (the stream's byte count does not advance); the sender learns of the
//! loss a round trip after it, as duplicate ACKs would tell it.

use crate::sim::Time;
use std::collections::VecDeque;

/// TCP_INIT_CWND (include/net/tcp.h): 10 segments.
const INIT_CWND: u64 = 10;
/// The least ssthresh a loss leaves (dctcp_react_to_loss: `max(cwnd >> 1, 2)`).
const MIN_SSTHRESH: u64 = 2;

/// Why a flow may not send its next segment now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// The receive window the sender last heard of is used up (tcp_snd_wnd_test).
    Rwnd,
    /// The congestion window is full (tcp_cwnd_test).
    Cwnd,
}

#[derive(Clone)]
struct Sender {
    /// snd_una and the receive window's right edge as last heard, bytes.
    una: u64,
    edge: u64,
    /// snd_cwnd and snd_ssthresh in segments, and snd_cwnd_cnt.
    cwnd: u64,
    ssthresh: u64,
    cnt: u64,
    /// In recovery (TCP_CA_Recovery) until snd_una reaches high_seq, snd_nxt when it began; a loss
    /// before high_seq belongs to a window already reacted to.
    in_recovery: bool,
    high_seq: u64,
    /// The window was found full with this much sent; it counts as cwnd-limited until acknowledged
    /// (tcp_cwnd_validate's cwnd_usage_seq).
    limited_to: u64,
    /// ACKs (stamp, bytes acknowledged, right edge) and losses (stamp, stream offset) not yet heard.
    acks: VecDeque<(Time, u64, u64)>,
    losses: VecDeque<(Time, u64)>,
}

pub struct Senders {
    mss: u64,
    rtt: Time,
    flows: Vec<Sender>,
    /// Recovery episodes entered.
    pub recoveries: u64,
}

impl Senders {
    /// `flows` senders of `mss`-byte segments, each first allowed `edge` bytes by the receiver.
    pub fn new(flows: usize, mss: u64, rtt: Time, edge: u64) -> Self {
        let sender = Sender {
            una: 0,
            edge,
            cwnd: INIT_CWND,
            ssthresh: u64::MAX, // TCP_INFINITE_SSTHRESH
            cnt: 0,
            in_recovery: false,
            high_seq: 0,
            limited_to: 0,
            acks: VecDeque::new(),
            losses: VecDeque::new(),
        };
        Senders {
            mss,
            rtt,
            flows: vec![sender; flows],
            recoveries: 0,
        }
    }

    /// The round trip feedback takes to act.
    pub fn rtt(&self) -> Time {
        self.rtt
    }

    /// The receiver's device sent an ACK of flow `f` at `at`: `acked` bytes in all, window to `edge`.
    pub fn ack(&mut self, f: usize, at: Time, acked: u64, edge: u64) {
        self.flows[f].acks.push_back((at, acked, edge));
    }

    /// The segment at stream offset `seq` of flow `f` was lost at the receiver at `at`.
    pub fn loss(&mut self, f: usize, at: Time, seq: u64) {
        self.flows[f].losses.push_back((at, seq));
    }

    /// May flow `f`, which has sent `sent` bytes, send its next segment at the receiver's time `now`?
    /// Takes in first whatever feedback has reached the sender by then.
    pub fn may_send(&mut self, f: usize, now: Time, sent: u64) -> Result<(), Blocked> {
        let heard = now.saturating_sub(self.rtt);
        let mss = self.mss;
        let s = &mut self.flows[f];
        // Feedback in the order the receiver sent it.
        loop {
            let ack = s.acks.front().map(|a| a.0).filter(|&at| at <= heard);
            let loss = s.losses.front().map(|l| l.0).filter(|&at| at <= heard);
            match (ack, loss) {
                (Some(a), l) if l.is_none_or(|l| a <= l) => {
                    let (_, acked, edge) = s.acks.pop_front().expect("front checked");
                    s.on_ack(acked, edge, mss);
                }
                (_, Some(_)) => {
                    let (_, seq) = s.losses.pop_front().expect("front checked");
                    self.recoveries += s.on_loss(seq, sent) as u64;
                }
                _ => break,
            }
        }
        if sent + mss > s.edge {
            return Err(Blocked::Rwnd);
        }
        if sent + mss > s.una + s.cwnd * mss {
            s.limited_to = sent;
            return Err(Blocked::Cwnd);
        }
        Ok(())
    }

    #[cfg(test)]
    fn cwnd(&self, f: usize) -> u64 {
        self.flows[f].cwnd
    }
}

impl Sender {
    /// tcp_ack(): the window update, snd_una, the end of recovery and the congestion window's growth,
    /// which counts only while the window was full for data this ACK covers (tcp_is_cwnd_limited).
    fn on_ack(&mut self, acked: u64, edge: u64, mss: u64) {
        self.edge = self.edge.max(edge);
        if acked <= self.una {
            return;
        }
        let limited = self.una < self.limited_to;
        let segs = (acked - self.una).div_ceil(mss);
        self.una = acked;
        if self.in_recovery {
            self.in_recovery = self.una < self.high_seq; // tcp_try_to_open
        } else if limited {
            self.cong_avoid(segs);
        }
    }

    /// A loss of the segment at `seq` heard with `sent` bytes sent: true when it starts a recovery, which
    /// halves the window (tcp_enter_recovery → dctcp_react_to_loss; high_seq = snd_nxt). A loss of a window
    /// already reacted to does not.
    fn on_loss(&mut self, seq: u64, sent: u64) -> bool {
        if self.in_recovery || seq < self.high_seq {
            return false;
        }
        self.ssthresh = (self.cwnd / 2).max(MIN_SSTHRESH);
        self.cwnd = self.ssthresh;
        self.cnt = 0;
        self.in_recovery = true;
        self.high_seq = sent;
        true
    }

    /// tcp_reno_cong_avoid(): slow start below ssthresh, then additive increase.
    fn cong_avoid(&mut self, mut acked: u64) {
        if self.cwnd < self.ssthresh {
            // tcp_slow_start()
            let cwnd = (self.cwnd + acked).min(self.ssthresh);
            acked -= cwnd - self.cwnd;
            self.cwnd = cwnd;
            if acked == 0 {
                return;
            }
        }
        // tcp_cong_avoid_ai(tp, cwnd, acked)
        let w = self.cwnd;
        if self.cnt >= w {
            self.cnt = 0;
            self.cwnd += 1;
        }
        self.cnt += acked;
        if self.cnt >= w {
            let delta = self.cnt / w;
            self.cnt -= delta * w;
            self.cwnd += delta;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MSS: u64 = 1000;

    /// Send from flow 0 at `now` until blocked; returns what was sent and why it stopped.
    fn send_all(s: &mut Senders, now: Time, sent: &mut u64) -> Blocked {
        loop {
            match s.may_send(0, now, *sent) {
                Ok(()) => *sent += MSS,
                Err(b) => return b,
            }
        }
    }

    #[test]
    fn a_sender_starts_with_ten_segments_and_hears_acks_a_round_trip_late() {
        let mut s = Senders::new(1, MSS, 100, 1 << 30);
        let mut sent = 0;
        assert_eq!(send_all(&mut s, 0, &mut sent), Blocked::Cwnd);
        assert_eq!(sent, 10 * MSS);
        // The receiver acknowledges all ten at 50; the sender hears it at 150, not before.
        s.ack(0, 50, 10 * MSS, 1 << 30);
        assert_eq!(send_all(&mut s, 149, &mut sent), Blocked::Cwnd);
        assert_eq!(sent, 10 * MSS);
        // Slow start: ten acknowledged segments open the window to twenty.
        assert_eq!(send_all(&mut s, 150, &mut sent), Blocked::Cwnd);
        assert_eq!(s.cwnd(0), 20);
        assert_eq!(sent, 30 * MSS);
    }

    #[test]
    fn the_receive_window_holds_the_sender_and_the_congestion_window_then_stays() {
        let mut s = Senders::new(1, MSS, 0, 5 * MSS);
        let mut sent = 0;
        assert_eq!(send_all(&mut s, 0, &mut sent), Blocked::Rwnd);
        assert_eq!(sent, 5 * MSS);
        // Acknowledged while the receive window, not cwnd, held the sender back: tcp_is_cwnd_limited()
        // is false and cwnd does not grow.
        s.ack(0, 0, 5 * MSS, 10 * MSS);
        assert_eq!(send_all(&mut s, 0, &mut sent), Blocked::Rwnd);
        assert_eq!(s.cwnd(0), INIT_CWND);
    }

    #[test]
    fn a_loss_halves_the_window_once_per_window() {
        let mut s = Senders::new(1, MSS, 10, 1 << 30);
        let mut sent = 0;
        // Grow to 40 segments in flight.
        for round in 0..2u64 {
            send_all(&mut s, round * 10, &mut sent);
            s.ack(0, round * 10, sent, 1 << 30);
        }
        send_all(&mut s, 20, &mut sent);
        assert_eq!(s.cwnd(0), 40);
        // Two segments of that window are lost; the sender hears at 35 and halves once.
        s.loss(0, 25, sent - 20 * MSS);
        s.loss(0, 25, sent - 10 * MSS);
        assert_eq!(send_all(&mut s, 35, &mut sent), Blocked::Cwnd);
        assert_eq!((s.cwnd(0), s.recoveries), (20, 1));
        let in_recovery = sent;
        // No growth in recovery; once everything sent before it is acknowledged, a new loss halves again.
        s.ack(0, 40, in_recovery - MSS, 1 << 30);
        s.loss(0, 40, in_recovery - MSS);
        send_all(&mut s, 50, &mut sent);
        assert_eq!((s.cwnd(0), s.recoveries), (20, 1));
        s.ack(0, 60, in_recovery, 1 << 30);
        s.loss(0, 60, in_recovery);
        send_all(&mut s, 70, &mut sent);
        assert_eq!((s.cwnd(0), s.recoveries), (10, 2));
    }

    #[test]
    fn congestion_avoidance_adds_one_segment_per_window_acknowledged() {
        let mut s = Senders::new(1, MSS, 0, 1 << 30);
        let mut sent = 0;
        send_all(&mut s, 0, &mut sent);
        // The first segment is lost: cwnd 10 → 5; the window's ACK ends recovery without growth.
        s.loss(0, 0, 0);
        s.ack(0, 1, sent, 1 << 30);
        send_all(&mut s, 1, &mut sent);
        assert_eq!((s.cwnd(0), s.recoveries), (5, 1));
        // Then each full window acknowledged adds one segment.
        for round in 0..5 {
            s.ack(0, 2 + round, sent, 1 << 30);
            send_all(&mut s, 2 + round, &mut sent);
        }
        assert_eq!(s.cwnd(0), 10);
    }
}
