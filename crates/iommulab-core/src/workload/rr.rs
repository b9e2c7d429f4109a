//! Request/response over TCP (memcached- or HTTP-like, driven as wrk2 or a closed loop).
//!
//! Clients on the far side of the wire send small requests; each lands in a kept-mapped RX page of its
//! connection's queue (`rxq`), NAPI hands it to the socket and wakes the server thread on the queue's CPU,
//! which serves requests in arrival order: its own work (`service_ns`), tcp_sendmsg() copying the response
//! into the socket's page frags, and mlx5e_xmit() mapping what the NIC reads: a response of one segment
//! maps its skb head (headers; nothing is inlined) and its frags, a larger one is a TSO skb whose headers
//! are inlined, so only its frags are mapped. The mappings are undone when NAPI reaps the TX completion.
//! Small packets make the per-packet DMA-API work, not the bytes, the cost.
//!
//! Closed loop (`rate_rps = 0`): each connection sends its next request as soon as the previous response
//! arrives. Fixed rate (wrk2 -R): requests are due at a constant rate, round robin over the connections,
//! and latency counts from when each was due, so queueing behind a slow server is not hidden
//! (coordinated omission). Latency is the client's: from sending the request to receiving the whole
//! response, the round trip outside the host included.
//!
//! Simplifications: requests fit one segment; the client's ACKs ride on its next request (none arrive on
//! their own); the server never runs out of send window.

use super::napi::{Moderation, Napi, RX_CQ, TX_CQ};
use super::net::{self, Port, ETH_HLEN, TCPIP_HLEN};
use super::rxq::KeptRxRing;
use super::sq::{
    wqebbs, FragStream, HeadSlab, Seg, SendQueue, MAP_RETRY_NS, SKB_FRAG_PAGE_BYTES,
    TX_CQ_POLL_BUDGET, TX_RING_ENTRIES,
};
use super::{event, Device, Workload, WorkloadStats};
use crate::host::Host;
use crate::scenario::Rr;
use crate::sim::{Ctx, Time};
use std::collections::VecDeque;

const EV_REQUEST: u16 = 0;
const EV_NAPI: u16 = 1;
const EV_SERVE: u16 = 2;
const EV_GENERATE: u16 = 3;

/// A request as the server sees it: its connection and when the client sent it (or, at a fixed rate,
/// when it was due).
#[derive(Debug, Clone, Copy)]
struct Request {
    conn: u32,
    sent: Time,
}

struct Queue {
    cpu: usize,
    sq: Option<SendQueue>,
    rx: Option<KeptRxRing<Request>>,
    heads: Option<HeadSlab>,
    frags: Option<FragStream>,
    napi: Napi,
    /// Requests in the socket, waiting for the server thread.
    backlog: VecDeque<Request>,
    /// The server thread is running or has been woken.
    serving: bool,
}

pub struct RrWorkload {
    cfg: Rr,
    queues: Vec<Queue>,
    /// Requests each connection has on the wire, by when the client sent them.
    in_flight: Vec<VecDeque<Time>>,
    dev: Device,
    port: Port,
    mss: u64,
    request_frame: u64,
    /// One-way time outside the host (half the round trip), ns.
    one_way_ns: u64,
    /// Fixed rate: the next request's due time (ps, for an exact rate) and number.
    next_due_ps: u64,
    generated: u64,
    segs: Vec<Seg>,
    stats: WorkloadStats,
}

impl RrWorkload {
    pub fn new(cfg: &Rr, link_gbps: f64, translation_slots: u32) -> Self {
        RrWorkload {
            cfg: cfg.clone(),
            queues: (0..cfg.queues as usize)
                .map(|q| Queue {
                    cpu: q,
                    sq: None,
                    rx: None,
                    heads: None,
                    frags: None,
                    napi: Napi::new(Moderation::cqe(cfg.irq_usecs, cfg.irq_frames)),
                    backlog: VecDeque::new(),
                    serving: false,
                })
                .collect(),
            in_flight: vec![VecDeque::new(); cfg.connections as usize],
            dev: Device::new(translation_slots, link_gbps),
            port: Port::new(cfg.line_rate_gbps),
            mss: net::mss(cfg.mtu),
            request_frame: ETH_HLEN + TCPIP_HLEN + cfg.request_bytes as u64,
            one_way_ns: (cfg.rtt_us * 500.0).round() as u64,
            next_due_ps: 0,
            generated: 0,
            segs: Vec::new(),
            stats: WorkloadStats::default(),
        }
    }

    fn queue_of(&self, conn: usize) -> usize {
        conn % self.queues.len()
    }

    /// The client of `conn` sends a request at `sent`; it reaches the NIC one way later.
    fn client_send(&mut self, host: &mut Host, conn: usize, sent: Time) {
        self.in_flight[conn].push_back(sent);
        host.schedule(sent + self.one_way_ns, event(EV_REQUEST, conn));
    }

    /// A completion entry of queue `q`'s `cq` becomes visible at `at`.
    fn completion_event(&mut self, host: &mut Host, q: usize, at: Time, cq: usize) {
        if let Some(fire) = self.queues[q].napi.completion(cq, at) {
            host.schedule(fire, event(EV_NAPI, q));
        }
    }

    /// A request of `conn` reaches the NIC: written into the next RX page of its queue.
    fn request_arrives(&mut self, host: &mut Host, now: Time, conn: usize) {
        let q = self.queue_of(conn);
        let sent = self.in_flight[conn]
            .pop_front()
            .expect("a request on the wire");
        let Some(rx) = self.queues[q].rx.as_mut() else {
            return;
        };
        let req = Request {
            conn: conn as u32,
            sent,
        };
        let done = rx.receive(&mut self.dev, host, now, self.request_frame, req);
        self.stats.packets_offered += 1;
        self.stats.bytes_received += self.cfg.request_bytes as u64;
        self.stats.dma_pages += 1;
        self.completion_event(host, q, done, RX_CQ);
    }

    /// mlx5e_napi_poll(): unmap completed responses, then hand requests to the socket and wake the server.
    fn napi_poll(&mut self, host: &mut Host, now: Time, q: usize) {
        let cpu = self.queues[q].cpu;
        if !self.queues[q].napi.enter(host, cpu, now, event(EV_NAPI, q)) {
            return; // superseded, or waiting for the CPU
        }
        let mut reaped = 0;
        let mut t = match self.queues[q].sq.as_mut() {
            Some(sq) => sq.reap(host, cpu, now, now, |_| reaped += 1),
            None => now,
        };
        let stack_ns = host.platform.cpu.rx_lone_packet_ns();
        let mut got = 0;
        let queue = &mut self.queues[q];
        if let Some(rx) = queue.rx.as_mut() {
            while got < self.cfg.napi_budget {
                let Some((req, synced)) = rx.pop_ready(host, t) else {
                    break;
                };
                t = synced + stack_ns; // tcp_v4_rcv → the socket's receive queue
                got += 1;
                queue.backlog.push_back(req);
            }
        }
        if got > 0 && !queue.serving {
            // sk_data_ready(): the server thread is woken.
            queue.serving = true;
            host.schedule(t + host.platform.cpu.wakeup_ns, event(EV_SERVE, q));
        }
        host.cpus[cpu].account(now, t);
        // Poll again if a budget was used up, else napi_complete_done() and re-arm.
        let queue = &mut self.queues[q];
        let rx = queue.rx.iter().flat_map(|rx| rx.pending_times());
        let tx = queue.sq.iter().flat_map(|sq| sq.pending_times());
        let busy = reaped == TX_CQ_POLL_BUDGET || got == self.cfg.napi_budget;
        if let Some(at) = queue.napi.finish(t, busy, rx, tx) {
            host.schedule(at, event(EV_NAPI, q));
        }
    }

    /// Map a response of `bytes`: its head when it goes out as one segment, then its frags.
    fn map_response(&mut self, host: &mut Host, q: usize, bytes: u64, t: Time) -> (bool, Time) {
        let cpu = self.queues[q].cpu;
        self.segs.clear();
        let mut t = t;
        if bytes <= self.mss {
            let heads = self.queues[q].heads.as_mut().expect("slab at start");
            let Some((seg, t2)) = heads.map(host, cpu, t, ETH_HLEN + TCPIP_HLEN) else {
                return (false, t);
            };
            t = t2;
            self.segs.push(seg);
        }
        let frags = self.queues[q].frags.as_mut().expect("frags at start");
        let (ok, t) = frags.map(host, cpu, t, bytes, &mut self.segs);
        if !ok {
            let mut t = t;
            for s in self.segs.drain(..) {
                t = host.dma_unmap(t, cpu, s.dma, s.pages);
            }
            return (false, t);
        }
        (true, t)
    }

    /// The server thread of queue `q` answers its oldest request.
    fn serve(&mut self, host: &mut Host, now: Time, q: usize) {
        let cpu = self.queues[q].cpu;
        if !host.cpu_acquire(cpu, now, event(EV_SERVE, q), Ctx::Task) {
            return;
        }
        let Some(req) = self.queues[q].backlog.front().copied() else {
            self.queues[q].serving = false;
            return;
        };
        let bytes = self.cfg.response_bytes as u64;
        let c = &host.platform.cpu;
        let copy_ns = (bytes as f64 * c.copy_ns_per_byte).round() as u64;
        let t = now + self.cfg.service_ns + copy_ns + c.tx_packet_ns;
        let (ok, t) = self.map_response(host, q, bytes, t);
        host.cpus[cpu].account(now, t);
        if !ok {
            self.stats.drops_map += 1;
            host.schedule(t + MAP_RETRY_NS, event(EV_SERVE, q));
            return;
        }
        self.queues[q].backlog.pop_front();
        let segs = std::mem::take(&mut self.segs);
        let gso = bytes > self.mss;
        let inline = if gso { ETH_HLEN + TCPIP_HLEN } else { 0 };
        let frames = bytes.div_ceil(self.mss).max(1);
        let mut sq = self.queues[q].sq.take().expect("send queue at start");
        let read = sq.fetch_and_read(&mut self.dev, host, t, wqebbs(inline, segs.len()), &segs);
        let wire_end = self.port.send(t, bytes, frames, read);
        let done = sq.complete(&mut self.dev, host, wire_end, &segs, req.conn);
        self.queues[q].sq = Some(sq);
        self.stats.dma_pages += segs.iter().map(|s| s.pages).sum::<u64>();
        self.segs = segs;
        self.completion_event(host, q, done, TX_CQ);
        // The client has the whole response one way after its last frame left.
        let received = wire_end + self.one_way_ns;
        self.stats.latency.record(received - req.sent);
        self.stats.packets_delivered += 1;
        self.stats.bytes_delivered += bytes;
        self.stats.tx_packets += frames;
        if self.cfg.rate_rps == 0.0 {
            self.client_send(host, req.conn as usize, received);
        }
        if self.queues[q].backlog.is_empty() {
            self.queues[q].serving = false;
        } else {
            host.schedule(t, event(EV_SERVE, q));
        }
    }

    /// Fixed rate: the next request falls due.
    fn generate(&mut self, host: &mut Host, now: Time) {
        let conn = (self.generated % self.cfg.connections as u64) as usize;
        self.generated += 1;
        self.client_send(host, conn, now);
        self.next_due_ps += (1e12 / self.cfg.rate_rps).round().max(1.0) as u64;
        host.schedule(self.next_due_ps / 1000, event(EV_GENERATE, 0));
    }

    /// Queue `q` at probe: send queue, RX ring, head slab and the server socket's page frags (enough for
    /// every response the send ring can hold).
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
        // Memory that runs out here stops the set-up; the run reports it (host.pages.exhausted).
        self.queues[q].heads = HeadSlab::alloc(host);
        let bytes = TX_RING_ENTRIES * self.cfg.response_bytes as u64;
        let chunks = bytes.div_ceil(SKB_FRAG_PAGE_BYTES) + 1;
        self.queues[q].frags = FragStream::alloc(host, SKB_FRAG_PAGE_BYTES, chunks);
        t
    }
}

impl Workload for RrWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        for q in 0..self.queues.len() {
            let t = self.setup(host, q, now);
            host.cpus[self.queues[q].cpu].account(now, t);
        }
        if self.cfg.rate_rps > 0.0 {
            self.next_due_ps = now * 1000;
            host.schedule(now, event(EV_GENERATE, 0));
        } else {
            for c in 0..self.in_flight.len() {
                self.client_send(host, c, now);
            }
        }
        now
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            EV_REQUEST => self.request_arrives(host, now, id as usize),
            EV_NAPI => self.napi_poll(host, now, id as usize),
            EV_SERVE => self.serve(host, now, id as usize),
            EV_GENERATE => self.generate(host, now),
            _ => unreachable!("rr event kind {kind}"),
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

    fn open_limit(&self) -> super::OpenLimit {
        super::OpenLimit::OfferedLoad
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::RunResult;

    fn run_rr(policy: &str, extra: &[(&str, &str)]) -> RunResult {
        let mut ov = vec![
            ("os.policy", policy),
            ("run.duration_ms", "4"),
            ("run.warmup_ms", "1"),
        ];
        ov.extend_from_slice(extra);
        crate::run::run_variant(&crate::run::builtin_with("rr", &ov)[0])
    }

    const ONE: [(&str, &str); 3] = [
        ("workload.rr.rate_rps", "0"),
        ("workload.rr.connections", "1"),
        ("workload.rr.queues", "1"),
    ];

    #[test]
    fn one_closed_loop_connection_waits_out_every_stage_of_its_path() {
        let r = run_rr("passthrough", &ONE);
        let lat = r.latency.clone().expect("latency recorded");
        // vtd-server and the scenario: round trip 10, interrupt moderation 3, NAPI 1.7 (one packet, one
        // skb), wakeup 3, service 2, copy 0.1 and send 0.6 µs, plus DMA and the wire (well under a µs).
        let stages = 10.0 + 3.0 + 1.7 + 3.0 + 2.0 + 0.1 + 0.6;
        assert!(lat.p50_us > stages && lat.p50_us < stages + 1.5, "{lat:?}");
        // A closed loop of one: one request per latency.
        let rps = r.packets_per_sec;
        assert!((rps * lat.p50_us / 1e6 - 1.0).abs() < 0.05, "{rps} {lat:?}");
    }

    #[test]
    fn strict_maps_head_and_frag_of_a_small_response_and_only_frags_of_a_tso_one() {
        let small = run_rr("strict", &ONE);
        let per =
            |r: &RunResult| r.iova_pages_unmapped as f64 / (r.packets_per_sec * r.sim_seconds);
        // 1 KiB responses: head + one frag, a frag sometimes straddling a page: 2 to 3 pages each.
        assert!((2.0..2.5).contains(&per(&small)), "{}", per(&small));
        // One PSI per mapping: two per response, give or take the one response in flight at each end of
        // the measured window.
        let responses = small.packets_per_sec * small.sim_seconds;
        let psi = small.invalidations.total as f64;
        assert!((psi - 2.0 * responses).abs() <= 4.0, "{psi} {responses}");
        assert_eq!(small.stale_translations, 0);
        let mut big = ONE.to_vec();
        big.push(("workload.rr.response_bytes", "16384"));
        let tso = run_rr("strict", &big);
        // 16 KiB in one or two frags of a 32 KiB chunk, no head: 4 or 5 pages, 1 or 2 PSIs, give or take
        // the response in flight at each end of the window.
        let responses = tso.packets_per_sec * tso.sim_seconds;
        let pages = tso.iova_pages_unmapped as f64;
        assert!(
            pages >= 4.0 * (responses - 2.0) && pages < 5.0 * (responses + 2.0),
            "{pages} {responses}"
        );
        let lat = |r: &RunResult| r.latency.clone().unwrap().p50_us;
        let pt = run_rr("passthrough", &ONE);
        assert!(
            lat(&small) > lat(&pt),
            "strict's unmaps and waits lengthen the path"
        );
    }

    #[test]
    fn a_fixed_rate_is_served_until_the_server_saturates_then_latency_grows() {
        let ok = run_rr("passthrough", &[("workload.rr.rate_rps", "400000")]);
        assert!(
            (ok.packets_per_sec / 400000.0 - 1.0).abs() < 0.02,
            "{}",
            ok.packets_per_sec
        );
        // 8 server threads of 10 µs a request serve at most 800k/s: at 1M/s the backlog grows and, counted
        // from when each request was due, so does latency.
        let over = run_rr(
            "passthrough",
            &[
                ("workload.rr.rate_rps", "1000000"),
                ("workload.rr.service_ns", "10000"),
            ],
        );
        assert!(over.packets_per_sec < 850000.0, "{}", over.packets_per_sec);
        assert!(over.cpu_busy > 0.95);
        let (a, b) = (ok.latency.unwrap(), over.latency.unwrap());
        assert!(b.p99_us > 10.0 * a.p99_us, "{a:?} {b:?}");
    }
}
