//! Multi-queue NIC transmit of bulk TCP (iperf3 client).
//!
//! Each flow's sender runs on its queue's CPU (XPS) and builds one TSO skb at a time: tcp_sendmsg() copies
//! the data into the socket's page-frag chunks, tcp_write_xmit() cuts an skb of the TSO size goal, and
//! mlx5e_xmit() inlines the headers into the WQE and maps each page frag (skb_frag_dma_map), so every skb
//! costs one mapping per frag (`sq`). The device fetches the WQE, reads the data through the IOMMU,
//! serialises the segments onto the wire and writes a completion; NAPI reaps completions and unmaps the
//! frags, and the freed skbs return the socket's TCP Small Queues budget (tcp_wfree → tcp_tsq_handler),
//! which is what paces a sender the NIC cannot keep up with. The peer's ACKs arrive one round trip after
//! the data left the wire and are written into RX pages page_pool keeps mapped; NAPI handles them.
//!
//! Simplifications: the peer and the network never limit the senders (no congestion window, no loss);
//! ACKs free no DMA state (the clone the NIC read was freed at completion), so they cost CPU and device
//! accesses only; a flow's chunks are reused in turn, enough of them that data in flight is never
//! overwritten.

use super::napi::{Moderation, Napi, RX_CQ, TX_CQ};
use super::net::{self, Port, ACK_FRAME, ETH_HLEN, TCPIP_HLEN};
use super::rxq::KeptRxRing;
use super::sq::{wqebbs, FragStream, Seg, SendQueue, MAP_RETRY_NS, TX_CQ_POLL_BUDGET};
use super::{event, Device, Workload, WorkloadStats};
use crate::host::Host;
use crate::scenario::NicTx;
use crate::sim::{Ctx, Time};

/// include/net/tcp.h MAX_TCP_HEADER (128 + MAX_HEADER, cache-aligned; 320 on x86-64 distribution
/// configs): tcp_xmit_size_goal() keeps an skb below GSO_MAX_SIZE - 1 - MAX_TCP_HEADER.
const MAX_TCP_HEADER: u64 = 320;

const EV_SEND: u16 = 0;
const EV_NAPI: u16 = 1;
const EV_ACK: u16 = 2;

struct Flow {
    queue: usize,
    /// Bytes in skbs handed to the device and not yet completed (sk_wmem_alloc as TSQ sees it).
    in_flight: u64,
    /// TSQ_THROTTLED: waiting for completions to free budget.
    throttled: bool,
    /// A send event is pending.
    scheduled: bool,
    /// The socket's page-frag chunks (allocated at start).
    frags: Option<FragStream>,
    /// Bytes sent since the peer's last ACK.
    unacked: u64,
}

struct TxQueue {
    cpu: usize,
    sq: Option<SendQueue>,
    rx: Option<KeptRxRing<()>>,
    napi: Napi,
}

pub struct NicTxWorkload {
    cfg: NicTx,
    queues: Vec<TxQueue>,
    flows: Vec<Flow>,
    dev: Device,
    /// Payload per skb (the TSO size goal) and segments per skb.
    skb_bytes: u64,
    segs_per_skb: u64,
    chunk_bytes: u64,
    port: Port,
    segs: Vec<Seg>,
    reaped: Vec<u32>,
    stats: WorkloadStats,
}

impl NicTxWorkload {
    pub fn new(cfg: &NicTx, link_gbps: f64, translation_slots: u32) -> Self {
        let mss = net::mss(cfg.mtu);
        // tcp_xmit_size_goal(): whole segments below the GSO limit.
        let goal = (cfg.tso_max_bytes as u64).saturating_sub(1 + MAX_TCP_HEADER);
        let segs_per_skb = (goal / mss).max(1);
        let skb_bytes = segs_per_skb * mss;
        let chunk_bytes = cfg.frag_kb as u64 * 1024;
        NicTxWorkload {
            cfg: cfg.clone(),
            queues: (0..cfg.queues as usize)
                .map(|q| TxQueue {
                    cpu: q,
                    sq: None,
                    rx: None,
                    napi: Napi::new(Moderation::cqe(cfg.irq_usecs, cfg.irq_frames)),
                })
                .collect(),
            flows: (0..cfg.flows as usize)
                .map(|f| Flow {
                    queue: f % cfg.queues as usize,
                    in_flight: 0,
                    throttled: false,
                    scheduled: false,
                    frags: None,
                    unacked: 0,
                })
                .collect(),
            dev: Device::new(translation_slots, link_gbps),
            skb_bytes,
            segs_per_skb,
            chunk_bytes,
            port: Port::new(cfg.line_rate_gbps),
            segs: Vec::new(),
            reaped: Vec::new(),
            stats: WorkloadStats::default(),
        }
    }

    fn schedule_send(&mut self, host: &mut Host, f: usize, at: Time) {
        if !self.flows[f].scheduled {
            self.flows[f].scheduled = true;
            host.schedule(at, event(EV_SEND, f));
        }
    }

    /// A completion entry of queue `q`'s `cq` becomes visible at `at`.
    fn completion_event(&mut self, host: &mut Host, q: usize, at: Time, cq: usize) {
        if let Some(fire) = self.queues[q].napi.completion(cq, at) {
            host.schedule(fire, event(EV_NAPI, q));
        }
    }

    /// Map the next skb's data: one segment per page-frag piece. False if IOVA space ran out.
    fn map_skb(&mut self, host: &mut Host, f: usize, cpu: usize, t: Time) -> (bool, Time) {
        self.segs.clear();
        let frags = self.flows[f]
            .frags
            .as_mut()
            .expect("frags allocated at start");
        frags.map(host, cpu, t, self.skb_bytes, &mut self.segs)
    }

    /// The sender of flow `f`: one skb per event while TSQ allows (tcp_sendmsg, tcp_write_xmit,
    /// dev_queue_xmit, mlx5e_xmit).
    fn send(&mut self, host: &mut Host, now: Time, f: usize) {
        if self.flows[f].in_flight >= self.cfg.tsq_bytes {
            // tcp_small_queue_check(): wait for TX completions.
            self.flows[f].scheduled = false;
            self.flows[f].throttled = true;
            return;
        }
        let q = self.flows[f].queue;
        let cpu = self.queues[q].cpu;
        if !host.cpu_acquire(cpu, now, event(EV_SEND, f), Ctx::Task) {
            return;
        }
        self.flows[f].scheduled = false;
        let cpu_cfg = &host.platform.cpu;
        let copy_ns = (self.skb_bytes as f64 * cpu_cfg.copy_ns_per_byte).round() as u64;
        let t = now + copy_ns + cpu_cfg.tx_packet_ns;
        let (ok, t) = self.map_skb(host, f, cpu, t);
        if !ok {
            self.stats.drops_map += 1;
            host.cpus[cpu].account(now, t);
            self.flows[f].scheduled = true;
            host.schedule(t + MAP_RETRY_NS, event(EV_SEND, f));
            return;
        }
        let segs = std::mem::take(&mut self.segs);
        let mut sq = self.queues[q]
            .sq
            .take()
            .expect("send queue set up at start");
        let wqebbs = wqebbs(ETH_HLEN + TCPIP_HLEN, segs.len());
        let read = sq.fetch_and_read(&mut self.dev, host, t, wqebbs, &segs);
        let wire_end = self.port.send(t, self.skb_bytes, self.segs_per_skb, read);
        let done = sq.complete(&mut self.dev, host, wire_end, &segs, f as u32);
        self.queues[q].sq = Some(sq);
        self.stats.dma_pages += segs.iter().map(|s| s.pages).sum::<u64>();
        self.segs = segs;
        self.stats.packets_offered += self.segs_per_skb;
        self.stats.bytes_received += self.skb_bytes;
        self.completion_event(host, q, done, TX_CQ);
        let flow = &mut self.flows[f];
        flow.in_flight += self.skb_bytes;
        flow.unacked += self.skb_bytes;
        let rtt = (self.cfg.rtt_us * 1000.0).round() as u64;
        while flow.unacked >= self.cfg.peer_ack_bytes {
            flow.unacked -= self.cfg.peer_ack_bytes;
            host.schedule(wire_end + rtt, event(EV_ACK, q));
        }
        host.cpus[cpu].account(now, t);
        self.schedule_send(host, f, t);
    }

    /// A peer ACK reaches queue `q`: the device fetches the next RX descriptor, writes the frame into its
    /// page and a completion entry.
    fn ack_arrives(&mut self, host: &mut Host, now: Time, q: usize) {
        let Some(rx) = self.queues[q].rx.as_mut() else {
            return;
        };
        let done = rx.receive(&mut self.dev, host, now, ACK_FRAME, ());
        self.completion_event(host, q, done, RX_CQ);
    }

    /// mlx5e_napi_poll(): reap TX completions (unmapping the frags, returning TSQ budget), then the ACKs.
    fn napi_poll(&mut self, host: &mut Host, now: Time, q: usize) {
        let cpu = self.queues[q].cpu;
        if !self.queues[q].napi.enter(host, cpu, now, event(EV_NAPI, q)) {
            return; // superseded, or waiting for the CPU
        }
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.clear();
        let mut t = match self.queues[q].sq.as_mut() {
            Some(sq) => sq.reap(host, cpu, now, now, |f| reaped.push(f)),
            None => now,
        };
        for &f in &reaped {
            let f = f as usize;
            self.stats.bytes_delivered += self.skb_bytes;
            self.stats.packets_delivered += self.segs_per_skb;
            self.stats.tx_packets += self.segs_per_skb;
            let flow = &mut self.flows[f];
            flow.in_flight -= self.skb_bytes;
            // tcp_wfree(): a throttled socket's tcp_tsq_handler() runs from this CPU's tasklet.
            if flow.throttled && flow.in_flight < self.cfg.tsq_bytes {
                flow.throttled = false;
                self.schedule_send(host, f, t);
            }
        }
        let tx_busy = reaped.len() == TX_CQ_POLL_BUDGET;
        self.reaped = reaped;
        let stack_ns = host.platform.cpu.rx_lone_packet_ns();
        let mut acks = 0;
        if let Some(rx) = self.queues[q].rx.as_mut() {
            while acks < self.cfg.napi_budget {
                let Some((_, synced)) = rx.pop_ready(host, t) else {
                    break;
                };
                t = synced + stack_ns; // tcp_v4_rcv → tcp_ack
                acks += 1;
            }
        }
        host.cpus[cpu].account(now, t);
        let queue = &mut self.queues[q];
        let rx = queue.rx.iter().flat_map(|rx| rx.pending_times());
        let tx = queue.sq.iter().flat_map(|sq| sq.pending_times());
        let busy = tx_busy || acks == self.cfg.napi_budget;
        if let Some(at) = queue.napi.finish(t, busy, rx, tx) {
            host.schedule(at, event(EV_NAPI, q));
        }
    }

    /// Queue `q` at probe: its send queue, the ACK RX ring (pages allocated and mapped by page_pool), and
    /// the page-frag chunks of its flows.
    fn setup(&mut self, host: &mut Host, q: usize, mut t: Time) -> Time {
        let cpu = self.queues[q].cpu;
        if let Some((sq, t2)) = SendQueue::alloc(host, cpu, t) {
            self.queues[q].sq = Some(sq);
            t = t2;
        }
        if let Some((rx, t2)) = KeptRxRing::alloc(host, cpu, self.cfg.rx_ring_size as u64, t) {
            self.queues[q].rx = Some(rx);
            t = t2;
        }
        // Enough chunks for the TSQ budget, one skb over it, and the chunk being filled.
        let chunks = (self.cfg.tsq_bytes + 2 * self.skb_bytes).div_ceil(self.chunk_bytes) + 1;
        for f in (q..self.flows.len()).step_by(self.queues.len()) {
            // Memory that runs out here stops the set-up; the run reports it (host.pages.exhausted).
            let Some(frags) = FragStream::alloc(host, self.chunk_bytes, chunks) else {
                return t;
            };
            self.flows[f].frags = Some(frags);
        }
        t
    }
}

impl Workload for NicTxWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        for q in 0..self.queues.len() {
            let t = self.setup(host, q, now);
            let cpu = self.queues[q].cpu;
            host.cpus[cpu].account(now, t);
        }
        for f in 0..self.flows.len() {
            self.schedule_send(host, f, now);
        }
        now
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            EV_SEND => self.send(host, now, id as usize),
            EV_NAPI => self.napi_poll(host, now, id as usize),
            EV_ACK => self.ack_arrives(host, now, id as usize),
            _ => unreachable!("nic_tx event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        WorkloadStats {
            dma_faults: self.dev.faults,
            device: self.dev.busy(),
            wire_ns: self.port.busy_ns,
            ..self.stats.clone()
        }
    }

    fn cpus(&self) -> Vec<usize> {
        self.queues.iter().map(|q| q.cpu).collect()
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.line_rate_gbps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::PAGE_SIZE as PAGE;

    fn cfg() -> NicTx {
        let sc = "[run]\nduration_ms = 1\n[platform]\nprofile = \"vtd-server\"\n[os]\npolicy = \"strict\"\n\
                  [workload.nic_tx]\nline_rate_gbps = 100\nqueues = 2\nflows = 2\nmtu = 1500\n";
        let v = crate::scenario::load(
            crate::scenario::Source::Text {
                name: "t.toml",
                text: sc,
            },
            &[],
        )
        .unwrap();
        v[0].scenario.workload.nic_tx.clone().unwrap()
    }

    #[test]
    fn the_tso_size_goal_is_whole_segments_below_gso_max_size() {
        let w = NicTxWorkload::new(&cfg(), 128.0, 1);
        // (65536 - 1 - 320) / 1448 = 45 segments.
        assert_eq!(
            (net::mss(1500), w.segs_per_skb, w.skb_bytes),
            (1448, 45, 65160)
        );
        // ctrl + eth + 4 inline (64 header bytes) + 3 frags = 9 segments: 3 building blocks.
        assert_eq!(wqebbs(66, 3), 3);
        assert_eq!(wqebbs(66, 2), 2);
    }

    #[test]
    fn an_skb_maps_one_segment_per_frag_piece_and_never_crosses_a_chunk() {
        let mut host = crate::run::test_host("strict");
        let mut w = NicTxWorkload::new(&cfg(), 128.0, 1);
        w.setup(&mut host, 0, 0);
        let mut total = 0;
        for _ in 0..20 {
            let (ok, _) = w.map_skb(&mut host, 0, 0, 0);
            assert!(ok);
            let bytes: u64 = w.segs.iter().map(|s| s.bytes).sum();
            assert_eq!(bytes, w.skb_bytes);
            assert!((2..=4).contains(&w.segs.len()), "{:?}", w.segs);
            for s in &w.segs {
                assert!(s.offset + s.bytes <= s.pages * PAGE);
                assert!(s.bytes <= w.chunk_bytes);
            }
            total += bytes;
        }
        let frags = w.flows[0].frags.as_ref().unwrap();
        assert_eq!(frags.position(), total % frags.len_bytes());
    }

    fn run_tx(policy: &str, extra: &[(&str, &str)]) -> crate::metrics::RunResult {
        let mut ov = vec![
            ("os.policy", policy),
            ("run.duration_ms", "4"),
            ("run.warmup_ms", "2"),
        ];
        ov.extend_from_slice(extra);
        crate::run::run_variant(&crate::run::builtin_with("tx", &ov)[0])
    }

    #[test]
    fn strict_invalidates_once_per_frag_and_never_serves_a_stale_translation() {
        let r = run_tx("strict", &[]);
        assert!(r.throughput_gbps > 10.0, "{r:?}");
        assert_eq!(r.dma_faults, 0);
        assert_eq!(r.stale_translations, 0);
        // One PSI per unmapped frag, each frag spanning 8 or 9 pages of a 32 KiB chunk (a 64 KiB skb has
        // 2 to 4 frags): fewer invalidations than pages, more than one per 16 pages.
        assert!(
            r.inv_per_page > 1.0 / 16.0 && r.inv_per_page < 0.5,
            "{}",
            r.inv_per_page
        );
        assert!(r.iova_pages_unmapped > 0);
    }

    #[test]
    fn the_policies_order_as_their_costs_and_passthrough_reaches_the_line_rate() {
        let pt = run_tx("passthrough", &[]);
        let lazy = run_tx("lazy", &[]);
        let strict = run_tx("strict", &[]);
        // 1448 of every 1538 bytes on the wire are payload.
        assert!(
            pt.throughput_gbps > 0.97 * 100.0 * 1448.0 / 1538.0,
            "{}",
            pt.throughput_gbps
        );
        assert!(strict.throughput_gbps < lazy.throughput_gbps);
        // Both at the line rate: a 4 ms window's edges move either by a frame or two.
        assert!(
            lazy.throughput_gbps <= pt.throughput_gbps * 1.005,
            "{} {}",
            lazy.throughput_gbps,
            pt.throughput_gbps
        );
        assert!(strict.cpu_inv_wait_share > lazy.cpu_inv_wait_share);
    }

    #[test]
    fn tcp_small_queues_pace_a_sender_the_nic_cannot_keep_up_with() {
        // A 10 Gbps port under 4 flows: TSQ holds each socket to about its budget in flight, so the link,
        // not the CPUs, is the limit, and the senders mostly wait.
        let r = run_tx("passthrough", &[("workload.nic_tx.line_rate_gbps", "10")]);
        assert!(
            r.throughput_gbps > 9.0 && r.throughput_gbps < 10.0,
            "{}",
            r.throughput_gbps
        );
        assert!(r.cpu_busy < 0.2, "{}", r.cpu_busy);
    }
}
