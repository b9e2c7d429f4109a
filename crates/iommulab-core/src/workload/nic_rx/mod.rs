//! Multi-queue NIC receive of bulk TCP (iperf3-like).
//!
//! The wire offers packets at line rate; each goes to one flow, each flow to one queue; the flow's reader
//! runs on the queue's CPU (aRFS) or on a CPU of its own (`readers`). The device writes each frame into
//! posted RX buffers (`rq`: one page per descriptor, or mlx5's multi-packet WQEs), translating every page
//! it touches through the IOMMU, fetches each descriptor it starts and writes a completion entry per frame
//! (`desc_ring`). NAPI on the queue's CPU reaps TX completions, then processes RX completions up to its
//! budget: frames go through GRO to the flow's socket, TCP sends ACKs (`tcp`), finished descriptors go back
//! to the driver, and the ring is refilled (`pages`). Senders send only inside the window each flow's
//! receiver advertised (`tcp`), so overload idles the wire instead of dropping at the socket. The reader
//! copies data out, dropping the stack's page references.

mod pages;
mod rq;
mod sender;
mod tcp;

use super::desc_ring::DescRing;
use super::napi::{Moderation, Napi, RX_CQ, TX_CQ};
use super::net::{self, ACK_FRAME, ETH_HLEN};
use super::sq::{HeadSlab, SendQueue, CQE_BYTES, DS_BYTES};
use super::{event, Device, Workload, WorkloadStats};
use crate::host::Host;
use crate::kernel::KernelVersion;
use crate::scenario::{NicRx, Readers, RingFill, RqKind, SenderModel};
use crate::sim::{Ctx, Path, Time};
use pages::{PageId, Pages, Source, WqePages};
use rq::{Layout, Rq};
use sender::Senders;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use tcp::{RxTcp, WinFromSpace};

/// Wire arrivals are generated in batches covering at most this much simulated time (a modelling batch).
const WIRE_CHUNK_NS: u64 = 1000;
/// RX descriptor bytes of a striding RQ's WQE (next segment + data segment, 64-byte stride); a cyclic RQ's
/// is one data segment per page (`sq::DS_BYTES`).
const RX_DESC_BYTES_STRIDING: u64 = 64;

const EV_WIRE: u16 = 0;
const EV_NAPI: u16 = 1;
const EV_READ: u16 = 2;

/// A frame written: when its completion entry is visible, its flow, how many pages it touched and how many
/// descriptors the device finished up to it.
struct Completion {
    ready: Time,
    flow: u32,
    pages: u8,
    finished: u8,
    /// Beyond a gap left by a lost segment (goes to the out-of-order queue).
    ooo: bool,
}

/// One queue's TX side as ACKs use it: the send queue and the slab pages ACK heads come from.
struct Tx {
    sq: SendQueue,
    heads: HeadSlab,
}

struct RxQueue {
    cpu: usize,
    rq: Rq,
    desc: Option<DescRing>,
    rx_cq: Option<DescRing>,
    tx: Option<Tx>,
    /// Written frames awaiting NAPI, and their pages in order.
    cq: VecDeque<Completion>,
    cq_pages: VecDeque<PageId>,
    napi: Napi,
}

struct Flow {
    queue: usize,
    /// Packets in the socket (pages each), and their pages in order; the last `ooo` of them are beyond a
    /// gap and cannot be read yet.
    sock: VecDeque<u8>,
    sock_pages: VecDeque<PageId>,
    ooo: usize,
    /// A segment was lost: from this time on the flow's next segment to arrive is its retransmission.
    gap: Option<Time>,
    /// Bytes sent since the stream began.
    sent: u64,
    reader_scheduled: bool,
    /// The CPU the reader runs on.
    reader_cpu: usize,
}

pub struct NicRxWorkload {
    cfg: NicRx,
    /// The channels: the first `cfg.queues` carry the flows, the rest only hold filled rings.
    queues: Vec<RxQueue>,
    flows: Vec<Flow>,
    pages: Pages,
    tcp: RxTcp,
    /// The peers' DCTCP senders (`sender = "dctcp"`); None: senders held by the receive window alone.
    senders: Option<Senders>,
    dev: Device,
    /// Picoseconds per packet on the wire, and the next arrival (ps).
    slot_ps: u64,
    next_arrival_ps: u64,
    frame_bytes: u64,
    payload: u64,
    buffer_ns: u64,
    pieces: Vec<(PageId, u64)>,
    skbs: Vec<(u32, u64, bool)>,
    stats: WorkloadStats,
    /// The DMA policy gives each multi-packet WQE one IOVA block and forbids recycling (FANDS).
    wqe_blocks: bool,
}

impl NicRxWorkload {
    pub fn new(
        cfg: &NicRx,
        link_gbps: f64,
        translation_slots: u32,
        device_buffer_bytes: u64,
        cores: usize,
        kernel: KernelVersion,
    ) -> Self {
        let queues = cfg.queues as usize;
        let channels = cfg.channels.unwrap_or(cfg.queues) as usize;
        // Flow f is steered to queue f % queues, which runs on the CPU of its number. Its reader runs there,
        // or on the next of the CPUs past the queues' (the scheduler wakes a reader on an idle CPU,
        // select_idle_sibling()).
        let reader_cpu = |q: usize, f: usize| match cfg.readers {
            Readers::Queue => q,
            Readers::Own => queues + f % (cores - queues),
        };
        let frame_bytes = cfg.mtu as u64 + ETH_HLEN;
        let payload = net::mss(cfg.mtu);
        let (layout, descs) = match cfg.rq {
            RqKind::Cyclic => (Layout::Cyclic, cfg.ring_size),
            RqKind::Mlx5Striding => rq::mlx5_striding(cfg.ring_size, cfg.mtu),
        };
        let source = match (cfg.page_pool, cfg.driver_page_cache) {
            (false, _) => Source::Unpooled,
            (true, 0) => Source::PagePool {
                ring: cfg.pool_size as usize,
            },
            (true, size) => Source::DriverCache {
                size: size as usize,
                ring: cfg.pool_size as usize,
            },
        };
        let tcp = RxTcp::new(
            cfg.flows as usize,
            payload,
            cfg.gro_max_bytes as u64,
            cfg.rcvbuf_bytes,
            rq::frame_truesize(layout, cfg.mtu, frame_bytes),
            if kernel.tcp_scaling_ratio() {
                WinFromSpace::ScalingRatio
            } else {
                WinFromSpace::AdvWinScale
            },
        );
        let senders = match cfg.sender {
            SenderModel::Window => None,
            SenderModel::Dctcp => {
                let rtt = (cfg.rtt_us * 1000.0).round() as Time;
                let edge = tcp.right_edge(0);
                Some(Senders::new(cfg.flows as usize, payload, rtt, edge))
            }
        };
        NicRxWorkload {
            cfg: cfg.clone(),
            // Channel c's NAPI runs on CPU c; those past the queues only fill their rings, on CPUs the
            // model wraps onto its own.
            queues: (0..channels)
                .map(|c| RxQueue {
                    cpu: c % cores,
                    rq: Rq::new(layout, descs),
                    desc: None,
                    rx_cq: None,
                    tx: None,
                    cq: VecDeque::new(),
                    cq_pages: VecDeque::new(),
                    napi: {
                        let napi = Napi::new(Moderation::cqe(cfg.irq_usecs, cfg.irq_frames));
                        if cfg.dim {
                            napi.with_dim()
                        } else {
                            napi
                        }
                    },
                })
                .collect(),
            flows: (0..cfg.flows as usize)
                .map(|f| (f % queues, f))
                .map(|(q, f)| Flow {
                    queue: q,
                    sock: VecDeque::new(),
                    sock_pages: VecDeque::new(),
                    ooo: 0,
                    gap: None,
                    sent: 0,
                    reader_scheduled: false,
                    reader_cpu: reader_cpu(q, f),
                })
                .collect(),
            pages: Pages::new(source, channels),
            tcp,
            senders,
            dev: Device::new(translation_slots, link_gbps),
            slot_ps: net::frame_wire_ps(cfg.mtu, cfg.line_rate_gbps),
            next_arrival_ps: 0,
            frame_bytes,
            payload,
            buffer_ns: ((device_buffer_bytes * 8) as f64 / cfg.line_rate_gbps) as u64,
            pieces: Vec::new(),
            skbs: Vec::new(),
            stats: WorkloadStats::default(),
            wqe_blocks: false,
        }
    }

    /// Give a finished descriptor's pages back (mlx5e_free_rx_mpwqe / mlx5e_dealloc_rx_wqe).
    fn release_wqe(&mut self, host: &mut Host, q: usize, wqe: WqePages, mut t: Time) -> Time {
        let cpu = self.queues[q].cpu;
        if self.wqe_blocks {
            return self.pages.release_block(host, cpu, &wqe, t);
        }
        for id in wqe {
            t = self.pages.driver_release(host, q, cpu, id, t);
        }
        t
    }

    /// A completion entry becomes visible at `at`: arm the interrupt if NAPI is idle, and move an armed one.
    /// A completion entry of queue `q`'s `cq` becomes visible at `at`.
    fn completion_event(&mut self, host: &mut Host, q: usize, at: Time, cq: usize) {
        if let Some(fire) = self.queues[q].napi.completion(cq, at) {
            host.schedule(fire, event(EV_NAPI, q));
        }
    }

    /// Post descriptors until the ring is full (mlx5e_post_rx_wqes / mlx5e_post_rx_mpwqes).
    fn refill(&mut self, host: &mut Host, q: usize, mut t: Time) -> Time {
        let mut got = WqePages::new();
        while self.refill_step(host, q, &mut got, &mut t) {}
        t
    }

    /// One step of queue `q`'s refill: one page allocated and mapped into the WQE being built in `got`
    /// (FANDS: one WQE's pages in one IOVA block), posting the WQE once it is complete. False when the
    /// ring is full, or memory or IOVA space ran out (the pages of an unfinished WQE go back).
    fn refill_step(&mut self, host: &mut Host, q: usize, got: &mut WqePages, t: &mut Time) -> bool {
        if !self.queues[q].rq.wants_refill() {
            return false;
        }
        let cpu = self.queues[q].cpu;
        let n = self.queues[q].rq.pages_per_wqe();
        if self.wqe_blocks {
            let Some((ids, t2)) = self.pages.alloc_block(host, cpu, n, *t) else {
                return false;
            };
            *t = t2;
            self.queues[q].rq.post(*t, ids);
            return true;
        }
        let Some((id, t2)) = self.pages.alloc(host, q, cpu, *t) else {
            *t = self.release_wqe(host, q, std::mem::take(got), *t);
            return false;
        };
        *t = t2;
        got.push(id);
        if got.len() == n {
            self.queues[q].rq.post(*t, std::mem::take(got));
        }
        true
    }

    /// tcp_send_ack() of flow `f` on `cpu` through queue `q`'s send queue (a reader's CPU without a queue of
    /// its own picks one by the flow's hash): map the ACK's skb head, post a send WQE; the device fetches
    /// it, reads the frame and writes a TX completion, after which NAPI unmaps the head. The ACK leaves
    /// for the sender when the device has read it (at once when ACKs are not modelled as sent).
    fn send_ack(&mut self, host: &mut Host, f: usize, cpu: usize, t: Time) -> Time {
        let q = self.flows[f].queue;
        let Some(mut tx) = self.queues[q].tx.take() else {
            self.heard(f, t);
            return t;
        };
        let t = t + host.platform.cpu.tx_packet_ns;
        let Some((seg, t)) = tx.heads.map(host, cpu, t, ACK_FRAME) else {
            self.queues[q].tx = Some(tx);
            self.heard(f, t);
            return t;
        };
        self.stats.tx_packets += 1;
        self.queues[q].napi.count(TX_CQ, 1, ACK_FRAME);
        let seg = [seg];
        let read = tx.sq.fetch_and_read(&mut self.dev, host, t, 1, &seg);
        self.heard(f, read);
        let done = tx.sq.complete(&mut self.dev, host, read, &seg, 0);
        self.queues[q].tx = Some(tx);
        self.completion_event(host, q, done, TX_CQ);
        t
    }

    /// Flow `f`'s ACK left the host at `at`: its sender hears it a round trip later.
    fn heard(&mut self, f: usize, at: Time) {
        if let Some(s) = self.senders.as_mut() {
            s.ack(f, at, self.tcp.acked(f), self.tcp.right_edge(f));
        }
    }

    /// mlx5e_poll_tx_cq(): unmap the ACKs the device completed by `now`.
    fn reap_tx(&mut self, host: &mut Host, q: usize, now: Time, t: Time) -> Time {
        let cpu = self.queues[q].cpu;
        match self.queues[q].tx.as_mut() {
            Some(tx) => tx.sq.reap(host, cpu, now, t, |_| {}),
            None => t,
        }
    }

    /// The packets of the next WIRE_CHUNK_NS of wire time, each at its own arrival time.
    fn wire(&mut self, host: &mut Host) {
        let chunk_end_ps = self.next_arrival_ps + WIRE_CHUNK_NS * 1000;
        while self.next_arrival_ps < chunk_end_ps {
            let t = self.next_arrival_ps / 1000;
            self.next_arrival_ps += self.slot_ps;
            // Each slot goes to a random flow; a flow whose sender has used up its receive or congestion
            // window passes the slot on, and the slot idles when every flow's is used up.
            let n = self.flows.len();
            let pick = host.rng.below(n as u64) as usize;
            let open = (0..n).map(|i| (pick + i) % n).find(|&f| {
                let sent = self.flows[f].sent;
                match self.senders.as_mut() {
                    None => sent + self.payload <= self.tcp.right_edge(f),
                    Some(s) => s.may_send(f, t, sent).is_ok(),
                }
            });
            let Some(f) = open else {
                self.stats.window_closed += 1;
                continue;
            };
            self.stats.packets_offered += 1;
            let q = self.flows[f].queue;
            if self.dev.engine.next_start(t) > t + self.buffer_ns {
                self.stats.drops_device += 1;
                self.lose(f, t);
                continue;
            }
            let mut pieces = std::mem::take(&mut self.pieces);
            pieces.clear();
            let Some(placed) = self.queues[q].rq.place(t, self.frame_bytes, &mut pieces) else {
                self.pieces = pieces;
                self.stats.drops_ring += 1;
                self.lose(f, t);
                continue;
            };
            let flow = &mut self.flows[f];
            flow.sent += self.payload;
            // Until the retransmission arrives, a round trip after the loss, segments land beyond the gap.
            let ooo = flow.gap.is_some_and(|at| t < at);
            if !ooo {
                flow.gap = None;
            }
            self.stats.bytes_received += self.payload;
            // The device fetches each descriptor it starts (translated like any access; NICs prefetch
            // descriptors ahead of need, so the fetch does not hold up the data).
            let mut desc = self.queues[q].desc.take();
            for _ in 0..placed.started {
                if let Some(ring) = desc.as_mut() {
                    self.dev.ring_access(host, Path::Receive, t, ring);
                }
            }
            self.queues[q].desc = desc;
            let mut done = t;
            for &(id, bytes) in &pieces {
                self.pages.stack_get(id);
                let dma = self.pages.dma(id).expect("posted pages are mapped");
                done = self.dev.access(host, Path::Receive, t, dma, bytes);
                self.stats.dma_pages += 1;
                self.queues[q].cq_pages.push_back(id);
            }
            // The completion entry is written after the data (PCIe keeps posted writes in order); its
            // translation overlaps the data's transfer.
            if let Some(mut cq) = self.queues[q].rx_cq.take() {
                done = done.max(self.dev.ring_access(host, Path::Receive, t, &mut cq));
                self.queues[q].rx_cq = Some(cq);
            }
            let rq = &mut self.queues[q];
            rq.cq.push_back(Completion {
                ready: done,
                flow: f as u32,
                pages: pieces.len() as u8,
                finished: placed.finished as u8,
                ooo,
            });
            self.pieces = pieces;
            self.completion_event(host, q, done, RX_CQ);
        }
        host.schedule(self.next_arrival_ps / 1000, event(EV_WIRE, 0));
    }

    /// Flow `f`'s segment arriving at `t` was dropped: a DCTCP sender learns of it a round trip later and
    /// retransmits it as the flow's next segment then; what arrives before is out of order. (A window-only
    /// sender resends it at once: no gap.)
    fn lose(&mut self, f: usize, t: Time) {
        if let Some(s) = self.senders.as_mut() {
            s.loss(f, t, self.flows[f].sent);
            self.flows[f].gap.get_or_insert(t + s.rtt());
        }
    }

    fn napi_poll(&mut self, host: &mut Host, now: Time, q: usize) {
        let cpu = self.queues[q].cpu;
        if !self.queues[q].napi.enter(host, cpu, now, event(EV_NAPI, q)) {
            return; // superseded, or waiting for the CPU
        }
        let stack_ns = host.platform.cpu.stack_ns_per_packet;
        let wakeup = host.platform.cpu.wakeup_ns;
        let mut t = self.reap_tx(host, q, now, now);
        let mut done = 0;
        let mut skbs = std::mem::take(&mut self.skbs);
        while done < self.cfg.napi_budget {
            match self.queues[q].cq.front() {
                Some(c) if c.ready <= t => {}
                _ => break,
            }
            let c = self.queues[q].cq.pop_front().expect("front checked");
            // mlx5e_skb_from_cqe_mpwrq_linear: dma_sync_single_range_for_cpu of the frame.
            t = host.dma_sync_for_cpu(t, self.frame_bytes) + stack_ns;
            done += 1;
            let f = c.flow as usize;
            let flow = &mut self.flows[f];
            for _ in 0..c.pages {
                let id = self.queues[q]
                    .cq_pages
                    .pop_front()
                    .expect("pages of completion");
                flow.sock_pages.push_back(id);
            }
            flow.sock.push_back(c.pages);
            // tcp_ofo_queue(): the gap filled, what lay beyond it becomes readable.
            flow.ooo = if c.ooo { flow.ooo + 1 } else { 0 };
            if !flow.reader_scheduled && flow.sock.len() > flow.ooo {
                flow.reader_scheduled = true;
                host.schedule(t + wakeup, event(EV_READ, f));
            }
            for _ in 0..c.finished {
                let wqe = self.queues[q]
                    .rq
                    .pop_finished()
                    .expect("finished descriptor");
                t = self.release_wqe(host, q, wqe, t);
            }
            if let Some((bytes, ooo)) = self.tcp.segment(f, c.ooo) {
                skbs.push((f as u32, bytes, ooo));
            }
        }
        self.tcp.flush(&mut skbs);
        self.queues[q]
            .napi
            .count(RX_CQ, done as u64, done as u64 * self.frame_bytes);
        let skb_ns = host.platform.cpu.stack_ns_per_skb;
        for &(f, bytes, ooo) in &skbs {
            t += skb_ns; // netif_receive_skb_list → tcp_v4_rcv → tcp_data_queue
            let held = self.flows[f as usize].sock.len() as u64 * self.payload;
            if self.tcp.deliver(f as usize, bytes, held, ooo) {
                t = self.send_ack(host, f as usize, cpu, t);
            }
        }
        skbs.clear();
        self.skbs = skbs;
        t = self.refill(host, q, t);
        // xSMMU's mlx5e_process_rx_release_batch(): one sync for the poll's unmaps.
        t = host.dma_batch_end(t, cpu);
        host.cpus[cpu].account(now, t);
        // Poll again if the budget was used up (net_rx_action), else napi_complete_done() and re-arm:
        // completions already on their way raise the next interrupt.
        let queue = &mut self.queues[q];
        let rx = queue.cq.iter().map(|c| c.ready);
        let tx = queue.tx.iter().flat_map(|tx| tx.sq.pending_times());
        if let Some(at) = queue.napi.finish(t, done == self.cfg.napi_budget, rx, tx) {
            host.schedule(at, event(EV_NAPI, q));
        }
    }

    fn read(&mut self, host: &mut Host, now: Time, f: usize) {
        let q = self.flows[f].queue;
        let cpu = self.flows[f].reader_cpu;
        let ev = event(EV_READ, f);
        if !host.cpu_acquire(cpu, now, ev, Ctx::Task) {
            return;
        }
        let copy_ns = (self.payload as f64 * host.platform.cpu.copy_ns_per_byte).round() as u64;
        let mut t = now;
        let mut read = 0u64;
        while read < self.cfg.read_bytes as u64 && self.flows[f].sock.len() > self.flows[f].ooo {
            let k = self.flows[f].sock.pop_front().expect("length checked");
            t += copy_ns;
            for _ in 0..k {
                let id = self.flows[f]
                    .sock_pages
                    .pop_front()
                    .expect("pages of packet");
                t = self.pages.stack_put(host, q, cpu, id, t);
            }
            read += self.payload;
            self.stats.bytes_delivered += self.payload;
            self.stats.packets_delivered += 1;
        }
        let queued = self.flows[f].sock.len() as u64 * self.payload;
        if read > 0 && self.tcp.read(f, queued) {
            t = self.send_ack(host, f, cpu, t);
        }
        host.cpus[cpu].account(now, t);
        if self.flows[f].sock.len() == self.flows[f].ooo {
            self.flows[f].reader_scheduled = false;
        } else {
            host.schedule(t, ev);
        }
    }

    /// Coherent rings of queue `q` (descriptors, RX completions, TX send and completion rings), mapped
    /// at probe.
    fn setup_rings(&mut self, host: &mut Host, q: usize, mut t: Time) -> Time {
        let cpu = self.queues[q].cpu;
        let desc_bytes = match self.cfg.rq {
            RqKind::Cyclic => DS_BYTES,
            RqKind::Mlx5Striding => RX_DESC_BYTES_STRIDING,
        };
        let descs = self.queues[q].rq.descriptors();
        let mut ring = |entries, bytes, t: &mut Time| {
            DescRing::alloc(host, cpu, entries, bytes, *t).map(|(r, t2)| {
                *t = t2;
                r
            })
        };
        let desc = ring(descs, desc_bytes, &mut t);
        let rx_cq = ring(self.queues[q].rq.cqes(), CQE_BYTES, &mut t);
        let tx = if self.cfg.acks {
            let sq = SendQueue::alloc(host, cpu, t).map(|(sq, t2)| {
                t = t2;
                sq
            });
            match (sq, HeadSlab::alloc(host)) {
                (Some(sq), Some(heads)) => Some(Tx { sq, heads }),
                _ => None,
            }
        } else {
            None
        };
        let rq = &mut self.queues[q];
        rq.desc = desc;
        rq.rx_cq = rx_cq;
        rq.tx = tx;
        t
    }
}

impl Workload for NicRxWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        // FANDS applies to multi-packet WQEs only.
        if host.dma.policy.rx_wqe_iova_blocks() && self.cfg.rq == RqKind::Mlx5Striding {
            self.wqe_blocks = true;
            self.pages = Pages::new(Source::Unpooled, self.queues.len());
        }
        // Every channel's coherent rings first, then the RX buffers: mlx5e_open_channels() sets up each
        // channel's rings in turn and mlx5e_activate_channels() then triggers every channel's NAPI, whose
        // first poll posts its RQ, all at once on the channels' CPUs: their dma_map calls take IOVAs from
        // the one allocator in the order they come (the channel furthest behind in time maps its next page
        // first). ena_up() creates all IO queues before ena_up_complete() refills them one after another.
        let channels = self.queues.len();
        let mut ts: Vec<Time> = (0..channels)
            .map(|c| self.setup_rings(host, c, now))
            .collect();
        match self.cfg.ring_fill() {
            RingFill::InTurn => {
                for (c, t) in ts.iter_mut().enumerate() {
                    *t = self.refill(host, c, *t);
                }
            }
            RingFill::Napi => {
                let mut got: Vec<WqePages> = vec![WqePages::new(); channels];
                let mut due: BinaryHeap<Reverse<(Time, usize)>> = ts
                    .iter()
                    .enumerate()
                    .map(|(c, &t)| Reverse((t, c)))
                    .collect();
                while let Some(Reverse((_, c))) = due.pop() {
                    if self.refill_step(host, c, &mut got[c], &mut ts[c]) {
                        due.push(Reverse((ts[c], c)));
                    }
                }
            }
        }
        // Channels past the queues run on CPUs the model leaves out: only the queues' time is accounted.
        for (q, &t) in ts.iter().enumerate().take(self.cfg.queues as usize) {
            let cpu = self.queues[q].cpu;
            host.cpus[cpu].account(now, t);
        }
        // The peers send once the interface is up: every channel's ring posted.
        let up = ts.iter().copied().max().unwrap_or(now);
        self.next_arrival_ps = up * 1000;
        host.schedule(up, event(EV_WIRE, 0));
        up
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            EV_WIRE => self.wire(host),
            EV_NAPI => self.napi_poll(host, now, id as usize),
            EV_READ => self.read(host, now, id as usize),
            _ => unreachable!("nic_rx event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        let c = self.pages.counters;
        WorkloadStats {
            pool_pages_mapped: c.mapped,
            pool_pages_unmapped: c.unmapped,
            rx_cache: c.cache,
            rx_cache_slack: self.pages.reuse_slack.clone(),
            loss_recoveries: self.senders.as_ref().map_or(0, |s| s.recoveries),
            dma_faults: self.dev.faults,
            device: self.dev.busy(),
            // The wire time of the frames the device accepted (those dropped were offered beyond what the
            // host took, so they do not make the wire the limit).
            wire_ns: self.stats.bytes_received / self.payload.max(1) * self.slot_ps / 1000,
            ..self.stats.clone()
        }
    }

    fn cpus(&self) -> Vec<usize> {
        let active = &self.queues[..self.cfg.queues as usize];
        let mut cpus: Vec<usize> = active.iter().map(|q| q.cpu).collect();
        cpus.extend(self.flows.iter().map(|f| f.reader_cpu));
        cpus.sort_unstable();
        cpus.dedup();
        cpus
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.line_rate_gbps
    }
}
