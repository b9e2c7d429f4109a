//! Multi-queue NIC receive of bulk TCP (iperf3-like) into page_pool-backed RX rings.
//!
//! The wire offers packets at line rate; each goes to one flow, each flow to one queue (aRFS: the flow's
//! reader runs on the queue's CPU). The device needs posted descriptors, translates each buffer page through
//! the IOMMU and DMAs it; NAPI on the queue's CPU processes completions up to its budget, hands packets to the
//! flow's socket and refills the ring from the page_pool (alloc cache, then ptr_ring, then new pages that must
//! be DMA-mapped). Senders respect each flow's receive window (rcvbuf), so overload idles the wire instead
//! of dropping at the socket. The reader copies data out and returns pages to the pool's ptr_ring; when the ring is full
//! the page leaves the pool: DMA-unmapped and freed (page_pool_return_page).

use super::{Workload, WorkloadStats};
use crate::host::{Event, Host};
use crate::scenario::NicRx;
use crate::sim::{DmaEngine, Time};
use std::collections::VecDeque;

/// include/uapi/linux/if_ether.h ETH_HLEN: the Ethernet header the NIC writes before the IP packet.
const ETH_HLEN: u64 = 14;
/// IEEE 802.3 per-frame wire overhead: preamble 7 + SFD 1 + header 14 + FCS 4 + inter-frame gap 12 bytes.
const ETH_WIRE_OVERHEAD: u64 = 38;
/// IPv4 (20) + TCP (20) + TCP timestamp option (12) header bytes per packet.
const TCPIP_HLEN: u64 = 52;
/// include/net/page_pool/types.h PP_ALLOC_CACHE_SIZE and PP_ALLOC_CACHE_REFILL.
const PP_ALLOC_CACHE_SIZE: usize = 128;
const PP_ALLOC_CACHE_REFILL: usize = 64;
/// Wire arrivals are generated in batches covering at most this much simulated time (a modelling batch).
const WIRE_CHUNK_NS: u64 = 1000;
const PAGE: u64 = 4096;

const EV_WIRE: u16 = 0;
const EV_NAPI: u16 = 1;
const EV_READ: u16 = 2;

/// One 4 KiB buffer page: its physical pfn and the DMA address (pfn) the device uses.
#[derive(Debug, Clone, Copy)]
struct Buf {
    phys: u64,
    dma: u64,
}

struct Completion {
    ready: Time,
    flow: u32,
}

struct RxQueue {
    cpu: usize,
    /// Posted descriptors, each visible to the device from its time.
    ring: VecDeque<(Time, Buf)>,
    /// Written packets awaiting NAPI, and their pages (pages_per_packet each, in order).
    cq: VecDeque<Completion>,
    cq_pages: VecDeque<Buf>,
    napi_scheduled: bool,
    /// page_pool alloc cache (NAPI-local) and ptr_ring.
    cache: Vec<Buf>,
    ptr_ring: VecDeque<Buf>,
}

struct Flow {
    queue: usize,
    sock_pages: VecDeque<Buf>,
    sock_packets: u64,
    /// Bytes sent and not yet read: in the NIC, awaiting NAPI, or in the socket (bounded by the window).
    window_used: u64,
    reader_scheduled: bool,
}

pub struct NicRxWorkload {
    cfg: NicRx,
    queues: Vec<RxQueue>,
    flows: Vec<Flow>,
    engine: DmaEngine,
    /// Picoseconds per packet on the wire, and the next arrival (ps).
    slot_ps: u64,
    next_arrival_ps: u64,
    pages_per_packet: usize,
    frame_bytes: u64,
    payload: u64,
    buffer_ns: u64,
    stats: WorkloadStats,
}

impl NicRxWorkload {
    pub fn new(
        cfg: &NicRx,
        link_gbps: f64,
        translation_slots: u32,
        device_buffer_bytes: u64,
    ) -> Self {
        let frame_bytes = cfg.mtu as u64 + ETH_HLEN;
        let wire_bits = (cfg.mtu as u64 + ETH_WIRE_OVERHEAD) * 8;
        NicRxWorkload {
            cfg: cfg.clone(),
            queues: (0..cfg.queues as usize)
                .map(|q| RxQueue {
                    cpu: q,
                    ring: VecDeque::with_capacity(cfg.ring_size as usize),
                    cq: VecDeque::new(),
                    cq_pages: VecDeque::new(),
                    napi_scheduled: false,
                    cache: Vec::with_capacity(PP_ALLOC_CACHE_SIZE),
                    ptr_ring: VecDeque::with_capacity(cfg.pool_size as usize),
                })
                .collect(),
            flows: (0..cfg.flows as usize)
                .map(|f| Flow {
                    queue: f % cfg.queues as usize,
                    sock_pages: VecDeque::new(),
                    sock_packets: 0,
                    window_used: 0,
                    reader_scheduled: false,
                })
                .collect(),
            engine: DmaEngine::new(translation_slots, link_gbps),
            slot_ps: ((wire_bits as f64 * 1000.0) / cfg.line_rate_gbps)
                .round()
                .max(1.0) as u64,
            next_arrival_ps: 0,
            pages_per_packet: frame_bytes.div_ceil(PAGE) as usize,
            frame_bytes,
            payload: cfg.mtu as u64 - TCPIP_HLEN.min(cfg.mtu as u64 - 1),
            buffer_ns: ((device_buffer_bytes * 8) as f64 / cfg.line_rate_gbps) as u64,
            stats: WorkloadStats::default(),
        }
    }

    /// page_pool_alloc_pages(): alloc cache, refill it from the ptr_ring, else a new page DMA-mapped now.
    fn pp_alloc(&mut self, host: &mut Host, q: usize, t: Time) -> Option<(Buf, Time)> {
        let rq = &mut self.queues[q];
        if self.cfg.page_pool {
            if let Some(b) = rq.cache.pop() {
                return Some((b, t));
            }
            for _ in 0..PP_ALLOC_CACHE_REFILL {
                match rq.ptr_ring.pop_front() {
                    Some(b) => rq.cache.push(b),
                    None => break,
                }
            }
            if let Some(b) = rq.cache.pop() {
                return Some((b, t + host.platform.cpu.lock_ns));
            }
        }
        let cpu = rq.cpu;
        let phys = host.pages.alloc()?;
        let t = t + host.platform.cpu.page_alloc_ns;
        match host.dma_map(t, cpu, phys, 1) {
            Some((dma, t)) => {
                self.stats.pool_pages_mapped += 1;
                Some((Buf { phys, dma }, t))
            }
            None => {
                host.pages.free(phys);
                None
            }
        }
    }

    /// page_pool_put_page(): NAPI context may use the alloc cache; then the ptr_ring; else the page leaves
    /// the pool (page_pool_return_page: DMA unmap, put_page).
    fn pp_put(&mut self, host: &mut Host, q: usize, b: Buf, napi: bool, t: Time) -> Time {
        let rq = &mut self.queues[q];
        if self.cfg.page_pool {
            if napi && rq.cache.len() < PP_ALLOC_CACHE_SIZE {
                rq.cache.push(b);
                return t;
            }
            if rq.ptr_ring.len() < self.cfg.pool_size as usize {
                rq.ptr_ring.push_back(b);
                return t + host.platform.cpu.lock_ns;
            }
        }
        let cpu = rq.cpu;
        let t = host.dma_unmap(t, cpu, b.dma, 1);
        host.pages.free(b.phys);
        self.stats.pool_pages_unmapped += 1;
        t + host.platform.cpu.page_alloc_ns
    }

    /// Post descriptors until the ring is full (mlx5e_post_rx_wqes). Returns the time.
    fn refill(&mut self, host: &mut Host, q: usize, mut t: Time) -> Time {
        while self.queues[q].ring.len() < self.cfg.ring_size as usize {
            let Some((b, t2)) = self.pp_alloc(host, q, t) else {
                break;
            };
            t = t2;
            self.queues[q].ring.push_back((t, b));
        }
        t
    }

    /// The packets of the next WIRE_CHUNK_NS of wire time, each at its own arrival time.
    fn wire(&mut self, host: &mut Host) {
        let chunk_end_ps = self.next_arrival_ps + WIRE_CHUNK_NS * 1000;
        while self.next_arrival_ps < chunk_end_ps {
            let t = self.next_arrival_ps / 1000;
            self.next_arrival_ps += self.slot_ps;
            // Each slot goes to a random flow; TCP senders only send inside the receive window, so a flow whose
            // socket buffer (with what is already on its way) is full passes the slot on, and the slot idles
            // when every window is closed.
            let n = self.flows.len();
            let pick = host.rng.below(n as u64) as usize;
            let open = (0..n)
                .map(|i| (pick + i) % n)
                .find(|&f| self.flows[f].window_used + self.payload <= self.cfg.rcvbuf_bytes);
            let Some(f) = open else {
                self.stats.window_closed += 1;
                continue;
            };
            self.stats.packets_offered += 1;
            let q = self.flows[f].queue;
            let k = self.pages_per_packet;
            let rq = &mut self.queues[q];
            if rq.ring.len() < k || rq.ring[k - 1].0 > t {
                self.stats.drops_ring += 1;
                continue;
            }
            if self.engine.next_start(t) > t + self.buffer_ns {
                self.stats.drops_device += 1;
                continue;
            }
            self.flows[f].window_used += self.payload;
            self.stats.bytes_received += self.payload;
            let mut done = t;
            for j in 0..k {
                let (_, b) = rq.ring.pop_front().expect("checked above");
                let bytes = (self.frame_bytes - j as u64 * PAGE).min(PAGE);
                let (lat, fault) = host.dma_page(b.dma);
                self.stats.dma_faults += fault as u64;
                done = self.engine.issue(t, lat, bytes);
                self.stats.dma_pages += 1;
                rq.cq_pages.push_back(b);
            }
            rq.cq.push_back(Completion {
                ready: done,
                flow: f as u32,
            });
            if !rq.napi_scheduled {
                rq.napi_scheduled = true;
                host.schedule(
                    done,
                    Event::Workload {
                        kind: EV_NAPI,
                        id: q as u32,
                    },
                );
            }
        }
        host.schedule(
            self.next_arrival_ps / 1000,
            Event::Workload {
                kind: EV_WIRE,
                id: 0,
            },
        );
    }

    fn napi_poll(&mut self, host: &mut Host, now: Time, q: usize) {
        let cpu = self.queues[q].cpu;
        if !host.cpu_acquire(
            cpu,
            now,
            Event::Workload {
                kind: EV_NAPI,
                id: q as u32,
            },
        ) {
            return;
        }
        let stack_ns = host.platform.cpu.stack_ns_per_packet;
        let wakeup = host.platform.cpu.wakeup_ns;
        let k = self.pages_per_packet;
        let mut t = now;
        let mut done = 0;
        while done < self.cfg.napi_budget {
            match self.queues[q].cq.front() {
                Some(c) if c.ready <= t => {}
                _ => break,
            }
            let c = self.queues[q].cq.pop_front().expect("front checked");
            t += stack_ns;
            done += 1;
            let f = c.flow as usize;
            let flow = &mut self.flows[f];
            for _ in 0..k {
                flow.sock_pages.push_back(
                    self.queues[q]
                        .cq_pages
                        .pop_front()
                        .expect("pages of completion"),
                );
            }
            flow.sock_packets += 1;
            if !flow.reader_scheduled {
                flow.reader_scheduled = true;
                host.schedule(
                    t + wakeup,
                    Event::Workload {
                        kind: EV_READ,
                        id: f as u32,
                    },
                );
            }
        }
        t = self.refill(host, q, t);
        host.cpus[cpu].account(now, t);
        let rq = &mut self.queues[q];
        match rq.cq.front() {
            Some(c) if done == self.cfg.napi_budget || c.ready <= t => {
                host.schedule(
                    t,
                    Event::Workload {
                        kind: EV_NAPI,
                        id: q as u32,
                    },
                );
            }
            Some(c) => host.schedule(
                c.ready,
                Event::Workload {
                    kind: EV_NAPI,
                    id: q as u32,
                },
            ),
            None => rq.napi_scheduled = false,
        }
    }

    fn read(&mut self, host: &mut Host, now: Time, f: usize) {
        let q = self.flows[f].queue;
        let cpu = self.queues[q].cpu;
        if !host.cpu_acquire(
            cpu,
            now,
            Event::Workload {
                kind: EV_READ,
                id: f as u32,
            },
        ) {
            return;
        }
        let copy_ns = (self.payload as f64 * host.platform.cpu.copy_ns_per_byte).round() as u64;
        let k = self.pages_per_packet;
        let mut t = now;
        let mut read = 0u64;
        while read < self.cfg.read_bytes as u64 && self.flows[f].sock_packets > 0 {
            t += copy_ns;
            for _ in 0..k {
                let b = self.flows[f]
                    .sock_pages
                    .pop_front()
                    .expect("pages of packet");
                t = self.pp_put(host, q, b, false, t);
            }
            let flow = &mut self.flows[f];
            flow.sock_packets -= 1;
            flow.window_used -= self.payload;
            read += self.payload;
            self.stats.bytes_delivered += self.payload;
            self.stats.packets_delivered += 1;
        }
        host.cpus[cpu].account(now, t);
        if self.flows[f].sock_packets > 0 {
            host.schedule(
                t,
                Event::Workload {
                    kind: EV_READ,
                    id: f as u32,
                },
            );
        } else {
            self.flows[f].reader_scheduled = false;
        }
    }
}

impl Workload for NicRxWorkload {
    fn start(&mut self, host: &mut Host, now: Time) {
        for q in 0..self.queues.len() {
            let t = self.refill(host, q, now);
            let cpu = self.queues[q].cpu;
            host.cpus[cpu].account(now, t);
        }
        self.next_arrival_ps = now * 1000;
        host.schedule(
            now,
            Event::Workload {
                kind: EV_WIRE,
                id: 0,
            },
        );
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
        self.stats.clone()
    }

    fn cpus(&self) -> Vec<usize> {
        self.queues.iter().map(|q| q.cpu).collect()
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.line_rate_gbps
    }
}
