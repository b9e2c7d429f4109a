//! A guest's virtio-net device carrying one bulk TCP stream (netperf TCP_STREAM / TCP_MAERTS) through the
//! guest's vIOMMU. With VIRTIO_F_ACCESS_PLATFORM the guest driver maps every buffer through the DMA API
//! (drivers/virtio/virtio_ring.c vring_map_one_sg, one mapping per scatterlist entry; detach_buf unmaps
//! it), so each RX buffer and each TX skb's head and frags is mapped when added to a virtqueue and
//! unmapped when the device has used it.
//!
//! The device is software on the host: QEMU's virtio-net (`vhost = false`) or vhost-net (`vhost =
//! true`), one thread serving both virtqueues. It translates every guest page it touches: QEMU through
//! the vIOMMU's emulation (its IOTLB, a software walk of the guest's page table on a miss), the rings'
//! pages on every access to them (`vring`: each step of QEMU 7.2's split-ring code, as counted), each
//! buffer page once; vhost through its device IOTLB, whose misses are messages to QEMU (VHOST_IOTLB_MISS,
//! QEMU's translation, VHOST_IOTLB_UPDATE) — the platform's ATC stands for it (`Host` builds it from
//! `[hypervisor]`), and the guest's invalidations reach it through QEMU's IOMMU notifiers; vhost keeps
//! its rings' translations (vhost_vq_meta_prefetch). Then it copies the data. Where the IOMMU translates
//! MSI writes (SMMUv3), each interrupt the device raises is one more translation.
//!
//! Guest side (vCPU 0: the interrupt and NAPI; vCPU 1, when there is one: the application): RX NAPI
//! unmaps the used buffers (receive_mergeable), hands each GSO skb to the stack, sends an ACK per
//! `ack_bytes` (mapped, through the TX virtqueue) and refills the ring with fresh mergeable buffers
//! (add_recvbuf_mergeable: get_mergeable_buf_len's length carved from 32 KiB page_frag chunks, each mapped
//! on its own, one page or two where it straddles a boundary; without `mergeable`, add_recvbuf_big's 18
//! pages in 19 mappings and an indirect table), the reader woken as the first skb is queued; TX: the
//! application writes `send_bytes`
//! at a time, tcp_sendmsg copies them into the socket's 32 KiB page_frag chunks and hands down each skb
//! that reaches the size goal, and the rest unless it autocorks (tcp_should_autocork: the socket has data
//! below TCP; the TSQ handler pushes it when a completion frees an skb); without TSO each MSS segment is
//! an skb of its own (software GSO). start_xmit maps the head and each frag (virtqueue_add_outbuf; more
//! than one entry goes into an indirect descriptor table, mapped too: one ring slot per skb) and kicks the
//! device when it waits for work; TX completions (free_old_xmit_skbs) unmap and return the TCP Small
//! Queues budget. Kicks are ioeventfd exits; a kick to an idle device thread wakes it (`cpu.wakeup_ns`).
//!
//! That is TX NAPI's transmit (`napi_tx`, the default from 5.3: `KernelVersion::virtio_net_napi_tx`).
//! Without it (4.19's default) start_xmit orphans each skb (skb_orphan), so the socket's memory is back
//! before the write returns: nothing is below TCP for TSQ or autocorking to wait on, and each write leaves
//! as skbs of its own; the device interrupts only for its first used skb and when start_xmit found the
//! ring nearly full (virtqueue_enable_cb_delayed), and used skbs are reaped by the next start_xmit.
//! Mapping counts per version, from drivers/net/virtio_net.c 4.19 to 6.12: xmit_skb() pushes the vnet
//! header into the linear part (`can_push`: VIRTIO_F_VERSION_1 gives any_header_sg, TCP's skbs have
//! headroom and an unshared header), so an skb is one mapping for its headers and one per frag
//! (skb_to_sgvec, one entry per frag), plus the indirect table; the same in every version. 6.6 to 6.10
//! premap the mergeable RX buffers' page_frag chunks (`KernelVersion::virtio_net_rx_premapped`): one
//! mapping per 32 KiB chunk, not per buffer.
//!
//! Simplifications: the host's own NIC and stack are not modelled (the tap side runs at the line rate);
//! either sender keeps at most the receiver's window (3 MiB) unacknowledged and never backs off; one RX
//! and one TX virtqueue; the mergeable buffers' length is the EWMA's steady value for the stream's packets; the
//! device thread's translation and copy do not overlap; a send() costs its copy only (no system call);
//! TSO skbs are not deferred to grow (tcp_tso_should_defer) and the congestion window never binds; with TX
//! NAPI, RX NAPI does not reap TX completions (virtnet_poll_cleantx), the TX interrupt does; virtio-net's
//! BQL (6.10+) is not modelled.

use super::net::{mss, ACK_FRAME};
use super::vring::{Vring, DESC_BYTES};
use super::{event, Workload, WorkloadStats};
use crate::host::Host;
use crate::hw::emul::ExitCause;
use crate::hw::{pages_spanned, PAGE_SIZE as PAGE};
use crate::kernel::KernelVersion;
use crate::scenario::{Direction, KvmProfile, MapDir, VirtioNet};
use crate::sim::{Ctx, Time};
use std::collections::VecDeque;

/// struct virtio_net_hdr_mrg_rxbuf at the head of each mergeable RX buffer.
const VNET_HDR_BYTES: u64 = 12;
/// The TCP receive window a socket offers with Linux's default tcp_rmem[2] (6 MB) at tcp_adv_win_scale
/// = 1: half of it (tcp_win_from_space).
const RX_WINDOW_BYTES: u64 = 3 << 20;
/// page_frag chunks (SKB_FRAG_PAGE_ORDER 3: 32 KiB): a sending socket's (sk_page_frag) and the RX queue's
/// the mergeable buffers are carved from (skb_page_frag_refill).
const FRAG_BYTES: u64 = super::sq::SKB_FRAG_PAGE_BYTES;
/// NAPI's weight (NAPI_POLL_WEIGHT): skbs per poll.
const NAPI_BUDGET: usize = 64;
/// GOOD_PACKET_LEN (ETH_HLEN + VLAN_HLEN + ETH_DATA_LEN): the smallest mergeable buffer's payload
/// (drivers/net/virtio_net.c mergeable_min_buf_len).
const GOOD_PACKET_LEN: u64 = 1518;
/// L1_CACHE_BYTES: mergeable buffer lengths are rounded up to it (get_mergeable_buf_len).
const L1_CACHE_BYTES: u64 = 64;
/// Pages of a big-packets RX buffer (add_recvbuf_big with guest GSO: big_packets_num_skbfrags =
/// MAX_SKB_FRAGS 17, plus the first page holding the header).
const BIG_PAGES: usize = 18;
/// sizeof(struct padded_vnet_hdr) (virtio_net_hdr_v1_hash and its padding): where the data starts in a
/// big buffer's first page.
const PADDED_VNET_HDR_BYTES: u64 = 32;
/// MAX_SKB_FRAGS: start_xmit() stops the queue with fewer than 2 + MAX_SKB_FRAGS descriptors free (room for
/// the largest skb).
const MAX_SKB_FRAGS: u64 = 17;
/// sizeof(struct virtnet_rq_dma) (dma_addr_t, two u32 and a u16, padded to 8): the head of a premapped
/// page_frag chunk (6.6 to 6.10), before its first buffer.
const RQ_DMA_BYTES: u64 = 24;
/// vhost/net.c VHOST_NET_WEIGHT and VHOST_NET_PKT_WEIGHT: bytes and packets handle_tx moves before it
/// requeues itself so that one virtqueue does not starve the others.
const VHOST_NET_WEIGHT: u64 = 0x80000;
const VHOST_NET_PKT_WEIGHT: u64 = 256;

const EV_PEER: u16 = 0;
const EV_DEV: u16 = 1;
const EV_NAPI: u16 = 2;
const EV_SEND: u16 = 3;
const EV_TX_DONE: u16 = 4;
const EV_READ: u16 = 5;
const EV_PEER_ACK: u16 = 6;
const EV_TSQ: u16 = 7;
const EV_RETX: u16 = 8;

/// A mapped guest buffer: (DMA pfn, pages).
type Map = (u64, u64);

/// A piece of an skb's data in one page_frag chunk: the chunk's first page, the offset and the length.
#[derive(Clone, Copy)]
struct Frag {
    chunk: u64,
    off: u64,
    len: u64,
}

impl Frag {
    /// The frag's pages: (first physical page, pages spanned).
    fn pages(&self) -> (u64, u64) {
        (
            self.chunk + self.off / PAGE,
            pages_spanned(self.off, self.len),
        )
    }
}

/// A page_frag (struct page_frag): chunks of FRAG_BYTES taken in turn, the current one and the offset
/// into it.
#[derive(Default)]
struct PageFrag {
    chunks: Vec<u64>,
    at: usize,
    off: u64,
}

impl PageFrag {
    /// `n` chunks (None when the simulated memory runs out).
    fn alloc(host: &mut Host, n: usize) -> Option<Self> {
        let chunks = (0..n)
            .map(|_| host.pages.alloc_contiguous(FRAG_BYTES / PAGE))
            .collect::<Option<Vec<u64>>>()?;
        Some(PageFrag {
            chunks,
            at: 0,
            off: 0,
        })
    }

    /// skb_page_frag_refill(): the next chunk unless `need` bytes fit in the current one. True when it
    /// took one (a page allocation).
    fn refill(&mut self, need: u64) -> bool {
        if self.off + need <= FRAG_BYTES {
            return false;
        }
        self.at = (self.at + 1) % self.chunks.len();
        self.off = 0;
        true
    }

    /// Bytes left in the current chunk.
    fn room(&self) -> u64 {
        FRAG_BYTES - self.off
    }

    /// The current chunk's next `len` bytes (they fit).
    fn take(&mut self, len: u64) -> Frag {
        let f = Frag {
            chunk: self.chunks[self.at],
            off: self.off,
            len,
        };
        self.off += len;
        f
    }
}

/// The part of `frags` (an skb's data in order) from byte `from`, `len` bytes long: a GSO segment's frags
/// (skb_segment keeps the pages and takes the range).
fn frag_range(frags: &[Frag], from: u64, len: u64) -> Vec<Frag> {
    let mut out = Vec::new();
    let mut at = 0;
    for f in frags {
        let (lo, hi) = (from.max(at), (from + len).min(at + f.len));
        if lo < hi {
            out.push(Frag {
                chunk: f.chunk,
                off: f.off + (lo - at),
                len: hi - lo,
            });
        }
        at += f.len;
    }
    out
}

/// A descriptor chain the driver added (virtqueue_add_split): each scatterlist entry's mapping, and the
/// indirect descriptor table holding them (mapped on its own) when there is more than one.
struct Chain {
    maps: Vec<Map>,
    indirect: Option<Map>,
}

impl Chain {
    fn pages(&self) -> u64 {
        self.maps.iter().map(|m| m.1).sum()
    }
}

/// An RX buffer posted to the device: its chain and how many bytes it holds; a premapped buffer (6.6 to
/// 6.10) is carved from a chunk's mapping (its index in the RX page_frag) and unmaps nothing itself.
struct RxBuf {
    chain: Chain,
    len: u64,
    chunk: Option<usize>,
}

/// A premapped page_frag chunk (struct virtnet_rq_dma): its mapping (DMA pfn, pages) and `ref`, one per
/// buffer carved from it not yet used, and one while it is the chunk buffers are carved from.
struct ChunkDma {
    map: Map,
    refs: u32,
}

/// What the device took from the TX virtqueue: the skb's chain and its bytes on the wire.
struct TxSkb {
    chain: Chain,
    bytes: u64,
    /// An ACK the guest sent (RX direction), not stream data.
    ack: bool,
}

/// A packet the host's tap hands the device for the guest: bytes, and whether it is the peer's ACK.
#[derive(Clone, Copy)]
struct RxPkt {
    bytes: u64,
    ack: bool,
}

pub struct VirtioNetWorkload {
    cfg: VirtioNet,
    /// The host's costs (its exits, QEMU's and vhost's work).
    h: KvmProfile,
    /// vCPUs: the interrupt and NAPI's, and the application's (the same on a one-vCPU guest).
    irq_cpu: usize,
    app_cpu: usize,
    mss: u64,
    /// The page_frag RX buffers are carved from (enough for the ring twice).
    rx_frag: PageFrag,
    /// The mergeable buffers' length (get_mergeable_buf_len at the stream's packet size), or a big
    /// buffer's (receive_big's max_len).
    rx_buf_len: u64,
    /// The guest kernel premaps the mergeable buffers' chunks (`KernelVersion::virtio_net_rx_premapped`);
    /// each chunk's mapping while it has one.
    rx_premapped: bool,
    rx_chunk_dma: Vec<Option<ChunkDma>>,
    /// Without mergeable buffers: the pages big buffers take in turn, and the next.
    rx_big_pages: Vec<u64>,
    rx_big_next: usize,
    /// Buffers posted in the RX virtqueue.
    rx_avail: VecDeque<RxBuf>,
    /// Filled by the device, waiting for NAPI: per packet its buffers and bytes.
    rx_used: VecDeque<(Vec<RxBuf>, RxPkt)>,
    /// The two virtqueues as the device reads them, and where their rings are mapped (DMA pfn).
    rxq: Vring,
    txq: Vring,
    rx_ring: u64,
    tx_ring: u64,
    /// The device is flushing TX with the queue's notifications off (virtio_net_tx_bh's burst).
    tx_burst: bool,
    /// The emulated IOMMU keeps an IOTLB (its hits and misses are counted).
    emul_iotlb: bool,
    /// The MSI doorbell's DMA pfn when the IOMMU translates MSI writes.
    msi: Option<u64>,
    /// Packets at the tap waiting for RX buffers.
    tap: VecDeque<RxPkt>,
    /// Added to the TX virtqueue, not yet taken by the device; taken and used, not yet reaped.
    tx_avail: VecDeque<TxSkb>,
    tx_used: VecDeque<TxSkb>,
    /// The device thread: busy until; an EV_DEV pending; waiting for RX buffers (notifications on).
    dev_free: Time,
    dev_scheduled: bool,
    dev_wants_rx: bool,
    /// TX skbs and bytes the device has moved since it last served the tap or found TX empty.
    tx_run: (u64, u64),
    /// vhost's RX work has its turn ahead of waiting TX skbs (their weight was spent).
    rx_turn: bool,
    napi_scheduled: bool,
    tx_irq_scheduled: bool,
    /// TX NAPI (`workload.virtio_net.napi_tx`, by default the kernel's); skbs the device has used in all;
    /// without TX NAPI, the used count at which the device next interrupts (used_event), if armed.
    napi_tx: bool,
    tx_completed: u64,
    tx_irq_at: Option<u64>,
    /// Interrupts that kicked the running interrupt vCPU out (no posted interrupts), not yet paid for.
    irq_exits: u64,
    /// RX: the peer's bytes in flight (sent, not yet read by the application) and its next send time.
    peer_in_flight: u64,
    peer_blocked: bool,
    wire_free: Time,
    /// Received skbs not yet read (when queued to the socket, bytes); bytes since the last ACK (either
    /// side's).
    unread: VecDeque<(Time, u64)>,
    read_scheduled: bool,
    unacked: u64,
    /// TX: the guest socket's bytes below TCP (TSQ) and whether the sender waits for completions.
    tsq_in_flight: u64,
    /// Bytes of skbs the driver dropped (their mapping failed), sent again one RTT later.
    retx: u64,
    /// TX: bytes sent and not yet acknowledged by the peer (at most the peer's receive window).
    tx_unacked: u64,
    sender_throttled: bool,
    /// TX: bytes written and not yet handed down (the socket's tail skb, autocorked), and a TSQ handler
    /// pending to push it.
    corked: u64,
    tsq_scheduled: bool,
    /// The socket's page_frag (sk_page_frag) its data is copied into.
    tx_frag: PageFrag,
    /// Pages the skbs' heads and indirect tables come from (kmalloc'd), used in turn.
    send_pages: Vec<u64>,
    next_send_page: usize,
    stats: WorkloadStats,
}

impl VirtioNetWorkload {
    pub fn new(cfg: &VirtioNet, h: &KvmProfile, vcpus: usize, kernel: KernelVersion) -> Self {
        let napi_tx = cfg.napi_tx.unwrap_or(kernel.virtio_net_napi_tx());
        VirtioNetWorkload {
            cfg: cfg.clone(),
            h: h.clone(),
            irq_cpu: 0,
            app_cpu: if vcpus > 1 { 1 } else { 0 },
            mss: mss(cfg.mtu),
            rx_frag: PageFrag::default(),
            rx_buf_len: if cfg.mergeable {
                Self::mergeable_buf_len(cfg)
            } else {
                BIG_PAGES as u64 * PAGE - PADDED_VNET_HDR_BYTES + VNET_HDR_BYTES
            },
            rx_premapped: cfg.mergeable && kernel.virtio_net_rx_premapped(),
            rx_chunk_dma: Vec::new(),
            rx_big_pages: Vec::new(),
            rx_big_next: 0,
            rx_avail: VecDeque::new(),
            rxq: Vring::new(cfg.queue_size),
            txq: Vring::new(cfg.queue_size),
            rx_ring: 0,
            tx_ring: 0,
            tx_burst: false,
            emul_iotlb: false,
            msi: None,
            rx_used: VecDeque::new(),
            tap: VecDeque::new(),
            tx_avail: VecDeque::new(),
            tx_used: VecDeque::new(),
            dev_free: 0,
            dev_scheduled: false,
            dev_wants_rx: false,
            tx_run: (0, 0),
            rx_turn: false,
            napi_scheduled: false,
            tx_irq_scheduled: false,
            napi_tx,
            tx_completed: 0,
            // The TX virtqueue is created with its callback on and used_event 0: the first used skb
            // interrupts (skb_xmit_done then turns the callback off for good without TX NAPI).
            tx_irq_at: if napi_tx { None } else { Some(1) },
            irq_exits: 0,
            peer_in_flight: 0,
            peer_blocked: false,
            wire_free: 0,
            unread: VecDeque::new(),
            read_scheduled: false,
            unacked: 0,
            tsq_in_flight: 0,
            retx: 0,
            tx_unacked: 0,
            sender_throttled: false,
            corked: 0,
            tsq_scheduled: false,
            tx_frag: PageFrag::default(),
            send_pages: Vec::new(),
            next_send_page: 0,
            stats: WorkloadStats::default(),
        }
    }

    /// get_mergeable_buf_len(): the header and the average packet (clamped to [GOOD_PACKET_LEN, a page
    /// less the header]) rounded up to a cache line. The average is the stream's frames: a host packet
    /// (`gso_max_bytes` of payload) with its headers.
    fn mergeable_buf_len(cfg: &VirtioNet) -> u64 {
        let avg = Self::frame(Self::payload(cfg)).clamp(GOOD_PACKET_LEN, PAGE - VNET_HDR_BYTES);
        (VNET_HDR_BYTES + avg).next_multiple_of(L1_CACHE_BYTES)
    }

    /// TCP payload of one packet the host hands the device: GRO'd segments up to `gso_max_bytes`, at
    /// least one MSS.
    fn payload(cfg: &VirtioNet) -> u64 {
        let m = mss(cfg.mtu);
        (cfg.gso_max_bytes as u64 / m).max(1) * m
    }

    /// The Ethernet frame carrying `payload` bytes of TCP.
    fn frame(payload: u64) -> u64 {
        payload + super::net::TCPIP_HLEN + super::net::ETH_HLEN
    }

    /// Mergeable buffers a packet of `bytes` of payload fills: the header and the frame.
    fn buffers_for(&self, bytes: u64) -> usize {
        (Self::frame(bytes) + VNET_HDR_BYTES)
            .div_ceil(self.rx_buf_len)
            .max(1) as usize
    }

    /// The device's accesses to a virtqueue's ring since the last: each translated.
    fn ring_accesses(&mut self, host: &mut Host, t: Time, tx: bool) -> Time {
        let (pages, base) = if tx {
            (self.txq.take(), self.tx_ring)
        } else {
            (self.rxq.take(), self.rx_ring)
        };
        // vhost translates its rings once and keeps them (vhost_vq_meta_prefetch); without a device IOTLB
        // (no vIOMMU) it reaches them through their user addresses (vhost_get_user), translating nothing.
        if self.cfg.vhost && (self.h.vhost_meta_cache || !host.dma.policy.translated()) {
            return t;
        }
        pages
            .into_iter()
            .fold(t, |t, p| self.translate(host, t, base + p))
    }

    /// The device's translation of each page of a mapped buffer (address_space_map over its length).
    fn translate_map(&mut self, host: &mut Host, t: Time, (dma, pages): Map) -> Time {
        (0..pages).fold(t, |t, p| self.translate(host, t, dma + p))
    }

    /// virtqueue_add_split() of `pieces` (the buffers, in bytes) for `dir`: each mapped
    /// (vring_map_one_sg), and with more than one an indirect table (a kmalloc'd page) mapped too, for the
    /// device to read. None when the IOVA space or the bounce pool is exhausted.
    fn add_chain(
        &mut self,
        host: &mut Host,
        now: Time,
        cpu: usize,
        pieces: &[Frag],
        dir: MapDir,
    ) -> Option<(Chain, Time)> {
        let mut t = now;
        let mut maps = Vec::with_capacity(pieces.len());
        for f in pieces {
            let (phys, off) = (f.chunk + f.off / PAGE, f.off % PAGE);
            let Some((dma, pages, t2)) = host.dma_map_dir(t, cpu, phys, off, f.len, dir) else {
                break;
            };
            t = t2;
            maps.push((dma, pages));
        }
        if maps.is_empty() {
            return None;
        }
        let mut indirect = None;
        if maps.len() > 1 {
            let table = self.send_page();
            let bytes = maps.len() as u64 * DESC_BYTES;
            if let Some((dma, pages, t2)) =
                host.dma_map_dir(t, cpu, table, 0, bytes, MapDir::ToDevice)
            {
                t = t2;
                indirect = Some((dma, pages));
            }
        }
        Some((Chain { maps, indirect }, t))
    }

    /// The device's reads of a chain it popped: an indirect table's entries one by one through its own
    /// mapping, then each buffer's pages (virtqueue_map_desc).
    fn read_chain(&mut self, host: &mut Host, now: Time, chain: &Chain) -> Time {
        let mut t = now;
        if let Some((dma, _)) = chain.indirect {
            for _ in 0..chain.maps.len() {
                t = self.translate(host, t, dma);
            }
        }
        for &m in &chain.maps {
            t = self.translate_map(host, t, m);
        }
        self.stats.dma_pages += chain.pages();
        t
    }

    /// detach_buf_split(): every mapping of a used chain unmapped, the indirect table's last.
    fn unmap_chain(host: &mut Host, now: Time, cpu: usize, chain: &Chain) -> Time {
        chain
            .maps
            .iter()
            .chain(&chain.indirect)
            .fold(now, |t, &(dma, pages)| host.dma_unmap(t, cpu, dma, pages))
    }

    /// The device signals the guest (msix_notify): its MSI write, translated where the IOMMU does so.
    fn interrupt(&mut self, host: &mut Host, t: Time) -> Time {
        match self.msi {
            Some(m) => self.translate(host, t, m),
            None => t,
        }
    }

    /// KVM delivers the device's interrupt (irqfd) to the interrupt vCPU, whose handler `kind` runs when it
    /// arrives. Without posted interrupts a vCPU running guest work is kicked out to take it: an exit
    /// its handler pays for first.
    fn inject(&mut self, host: &mut Host, t: Time, kind: u16) {
        let at = t + self.h.irq_inject_ns;
        if !self.h.posted_interrupts && host.cpus[self.irq_cpu].busy_until > at {
            self.irq_exits += 1;
        }
        host.schedule(at, event(kind, 0));
    }

    /// The interrupt exits taken on the interrupt vCPU since its handler last ran: their vCPU time.
    fn irq_exit_time(&mut self) -> u64 {
        let n = std::mem::take(&mut self.irq_exits);
        let ns = n * self.h.kick_exit_ns;
        self.stats.exits.record(ExitCause::Irq, n, ns);
        ns
    }

    /// ns the wire needs for `payload` bytes in MSS segments at the line rate.
    fn wire_ns(&self, payload: u64) -> u64 {
        let segs = payload.div_ceil(self.mss).max(1);
        let bytes = payload + segs * (super::net::ETH_WIRE_OVERHEAD + super::net::TCPIP_HLEN);
        (bytes as f64 * 8.0 / self.cfg.line_rate_gbps).ceil() as u64
    }

    /// A virtqueue notification from the guest (ioeventfd): the vCPU's exit, and the device thread woken
    /// if it was idle. Returns the vCPU's release time.
    fn kick(&mut self, host: &mut Host, t: Time) -> Time {
        let back = t + self.h.kick_exit_ns;
        self.stats
            .exits
            .record(ExitCause::Kick, 1, self.h.kick_exit_ns);
        // KVM signals the eventfd between the exit and the re-entry; the device thread wakes from there.
        let signalled = back - self.h.kick_exit_ns / 2;
        let wake = host.platform.cpu.wakeup_ns;
        self.wake_device(host, signalled + wake);
        back
    }

    /// Make sure the device thread runs at or after `at`.
    fn wake_device(&mut self, host: &mut Host, at: Time) {
        if !self.dev_scheduled {
            self.dev_scheduled = true;
            host.schedule(at.max(self.dev_free), event(EV_DEV, 0));
        }
    }

    /// The device thread idle and waiting for a kick (its notifications on)?
    fn device_idle(&self, now: Time) -> bool {
        !self.dev_scheduled && self.dev_free <= now
    }

    /// The device's translation of one guest page: the lookup, a vhost IOTLB miss's round trip to QEMU,
    /// the emulator's walk reads.
    fn translate(&mut self, host: &mut Host, t: Time, dma: u64) -> Time {
        let h = &self.h;
        let lookup = if self.cfg.vhost {
            h.vhost_iotlb_lookup_ns
        } else {
            h.qemu_translate_ns
        };
        let Some(tr) = host.sw_translate(t, dma) else {
            return t + lookup;
        };
        if tr.fault() {
            self.stats.dma_faults += 1;
        }
        // QEMU's translation (vtd_iommu_translate, smmuv3_translate, virtio_iommu_translate): every access
        // of QEMU's device; of vhost's, only its IOTLB misses.
        if !self.cfg.vhost || tr.ats_request {
            self.stats
                .exits
                .work
                .translated(self.emul_iotlb, tr.iotlb_hit);
        }
        if !tr.ats_request {
            return t + lookup + host.emulator_walk_ns(&tr);
        }
        let (back, wait) = host.vhost_iotlb_miss(t + lookup, &tr);
        self.stats.exits.bql_wait_ns += wait;
        back
    }

    /// One unit of the device thread's work: the guest's TX skbs first, then packets for the guest.
    fn device(&mut self, host: &mut Host, now: Time) {
        self.dev_scheduled = false;
        if self.dev_free > now {
            self.wake_device(host, self.dev_free);
            return;
        }
        // QEMU's virtio-net runs in its main loop under the BQL, behind any vCPU's trapped IOMMU handler
        // (and they behind it); vhost's worker is a kernel thread of its own.
        let begin = if self.cfg.vhost {
            now
        } else {
            host.bql_free(now).unwrap_or(now)
        };
        self.stats.exits.bql_wait_ns += begin - now;
        let per_pkt = if self.cfg.vhost {
            self.h.vhost_packet_ns
        } else {
            self.h.qemu_packet_ns
        };
        let t = if self.tx_turn() {
            self.rx_turn = false;
            let bytes = self.tx_avail.front().expect("tx_turn").bytes;
            self.tx_run = (self.tx_run.0 + 1, self.tx_run.1 + bytes);
            let t = self.device_tx(host, begin + per_pkt);
            if self.tx_avail.is_empty() {
                self.tx_run = (0, 0);
            }
            t
        } else if let Some(&pkt) = self.tap.front() {
            self.rx_turn = !self.tx_avail.is_empty();
            self.tx_run = (0, 0);
            let need = self.buffers_for(pkt.bytes);
            // virtio_net_has_buffers(): with notifications on again if the ring lacks them, then once
            // more.
            let has = |q: &mut Vring| !q.empty() && q.avail_bufs(need as u64);
            if !has(&mut self.rxq) {
                self.rxq.set_notification(true);
                if !has(&mut self.rxq) {
                    // Out of buffers: the device waits for the guest's refill kick.
                    let t = self.ring_accesses(host, begin, false);
                    self.device_busy(host, now, begin, t);
                    self.dev_wants_rx = true;
                    if !self.tx_avail.is_empty() {
                        self.wake_device(host, self.dev_free);
                    }
                    return;
                }
            }
            self.rxq.set_notification(false);
            self.tap.pop_front();
            self.device_rx(host, begin + per_pkt, pkt, need)
        } else {
            return;
        };
        self.device_busy(host, now, begin, t);
        if !self.tx_avail.is_empty() || !self.tap.is_empty() {
            self.wake_device(host, self.dev_free);
        }
    }

    /// Whether the device thread's next unit is a TX skb: one is waiting, and vhost's handle_tx has not used
    /// up its weight while packets for the guest wait at the tap (vhost_exceeds_weight → vhost_poll_queue
    /// puts TX work behind the RX work the tap queued). QEMU's TX bottom half flushes up to tx_burst (256, a
    /// ring's worth) before the main loop turns to the tap: TX first.
    fn tx_turn(&self) -> bool {
        if self.tx_avail.is_empty() {
            return false;
        }
        let spent = self.tx_run.0 >= VHOST_NET_PKT_WEIGHT || self.tx_run.1 >= VHOST_NET_WEIGHT;
        // handle_rx, once its turn comes, takes what the tap holds (its own weight is far more than ACKs).
        let rx_waits = !self.tap.is_empty() && !self.dev_wants_rx;
        !(self.cfg.vhost && rx_waits && (spent || self.rx_turn))
    }

    /// The device thread, asked to run at `asked`, worked from `begin` to `t` (QEMU's under the BQL).
    fn device_busy(&mut self, host: &mut Host, asked: Time, begin: Time, t: Time) {
        self.stats.exits.device_ns += t - begin;
        if !self.cfg.vhost && host.bql_serve(asked, t - begin).is_some() {
            self.stats.exits.bql_ns += t - begin;
        }
        self.dev_free = t;
    }

    /// virtio_net_flush_tx() for one skb (QEMU's virtio_net_tx_bh turns the queue's notifications off
    /// for the burst and back on when it drains). Returns when the device is done with it.
    fn device_tx(&mut self, host: &mut Host, now: Time) -> Time {
        let copy = host.platform.cpu.copy_ns_per_byte;
        if !self.tx_burst {
            self.tx_burst = true;
            self.txq.set_notification(false);
        }
        let skb = self.tx_avail.pop_front().expect("checked");
        self.txq.pop();
        let mut t = self.ring_accesses(host, now, true);
        t = self.read_chain(host, t, &skb.chain);
        t += (skb.bytes as f64 * copy).round() as u64;
        if !skb.ack {
            // The data leaves through the host's NIC at the line rate; the peer ACKs it a round trip
            // later.
            let ns = self.wire_ns(skb.bytes);
            self.wire_free = self.wire_free.max(t) + ns;
            self.stats.wire_ns += ns;
            self.unacked += skb.bytes;
            while self.unacked >= self.cfg.ack_bytes {
                self.unacked -= self.cfg.ack_bytes;
                let rtt = (self.cfg.rtt_us * 1000.0).round() as u64;
                host.schedule(self.wire_free + rtt, event(EV_PEER_ACK, 0));
            }
        }
        self.tx_used.push_back(skb);
        self.tx_completed += 1;
        // virtqueue_push() and virtio_notify().
        self.txq.fill();
        self.txq.flush();
        self.txq.notify();
        if self.tx_avail.is_empty() {
            // The next pop finds the ring empty; notifications back on, and one more look.
            self.txq.pop();
            self.txq.set_notification(true);
            self.txq.empty();
            self.tx_burst = false;
        }
        t = self.ring_accesses(host, t, true);
        if self.tx_interrupt_due() && !self.tx_irq_scheduled {
            self.tx_irq_scheduled = true;
            t = self.interrupt(host, t);
            self.inject(host, t, EV_TX_DONE);
        }
        t
    }

    /// Whether the skb the device just used interrupts the guest (vring_need_event on used_event). With TX
    /// NAPI the callback is on whenever TX NAPI is not running; without it only once armed, and
    /// skb_xmit_done() turns it off again (virtqueue_disable_cb).
    fn tx_interrupt_due(&mut self) -> bool {
        if self.napi_tx {
            return true;
        }
        match self.tx_irq_at {
            Some(at) if self.tx_completed >= at => {
                self.tx_irq_at = None;
                true
            }
            _ => false,
        }
    }

    /// start_xmit() without TX NAPI: with fewer than 2 + MAX_SKB_FRAGS descriptors free the queue stops and
    /// virtqueue_enable_cb_delayed() asks for an interrupt once three quarters of the skbs outstanding are
    /// used (used_event = last_used_idx + bufs).
    fn arm_tx_interrupt_if_full(&mut self) {
        let pending = (self.tx_avail.len() + self.tx_used.len()) as u64;
        if (self.cfg.queue_size as u64).saturating_sub(pending) < 2 + MAX_SKB_FRAGS {
            self.arm_tx_interrupt();
        }
    }

    /// virtqueue_enable_cb_delayed() without TX NAPI: used_event three quarters of the way through the skbs
    /// outstanding (from the driver's last_used_idx).
    fn arm_tx_interrupt(&mut self) {
        if self.napi_tx || self.tx_irq_at.is_some() {
            return;
        }
        let pending = (self.tx_avail.len() + self.tx_used.len()) as u64;
        let last_used = self.tx_completed - self.tx_used.len() as u64;
        self.tx_irq_at = Some(last_used + pending * 3 / 4 + 1);
    }

    /// virtio_net_receive_rcu() of `pkt` into `need` buffers (the ring has them): pop and fill each,
    /// publish, notify. Returns when the device is done with it.
    fn device_rx(&mut self, host: &mut Host, now: Time, pkt: RxPkt, need: usize) -> Time {
        let copy = host.platform.cpu.copy_ns_per_byte;
        let mut t = now;
        let mut bufs = Vec::with_capacity(need);
        let mut left = Self::frame(pkt.bytes) + VNET_HDR_BYTES;
        for _ in 0..need {
            self.rxq.pop();
            t = self.ring_accesses(host, t, false);
            let b = self.rx_avail.pop_front().expect("counted");
            t = self.read_chain(host, t, &b.chain);
            let n = left.min(b.len);
            left -= n;
            t += (n as f64 * copy).round() as u64;
            bufs.push(b);
        }
        for _ in 0..need {
            self.rxq.fill();
        }
        self.rxq.flush();
        self.rxq.notify();
        t = self.ring_accesses(host, t, false);
        self.stats.bytes_received += pkt.bytes;
        self.rx_used.push_back((bufs, pkt));
        if !self.napi_scheduled {
            self.napi_scheduled = true;
            t = self.interrupt(host, t);
            self.inject(host, t, EV_NAPI);
        }
        t
    }

    /// A packet reaches the tap for the guest.
    fn send_to_tap(&mut self, host: &mut Host, now: Time, pkt: RxPkt) {
        self.tap.push_back(pkt);
        if !self.dev_wants_rx && self.device_idle(now) {
            // The tap's readiness wakes the device thread (vhost's socket poll, QEMU's fd handler).
            let wake = host.platform.cpu.wakeup_ns;
            self.wake_device(host, now + wake);
        }
    }

    /// RX direction: the peer sends GSO-sized bursts at the line rate while its window allows.
    fn peer_send(&mut self, host: &mut Host, now: Time) {
        let g = Self::payload(&self.cfg);
        if self.peer_in_flight + g > RX_WINDOW_BYTES {
            self.peer_blocked = true;
            self.stats.window_closed += 1;
            return;
        }
        let start = now.max(self.wire_free);
        let ns = self.wire_ns(g);
        self.wire_free = start + ns;
        self.stats.wire_ns += ns;
        self.peer_in_flight += g;
        self.stats.packets_offered += g.div_ceil(self.mss);
        let arrive = self.wire_free;
        self.send_to_tap(
            host,
            arrive.max(now),
            RxPkt {
                bytes: g,
                ack: false,
            },
        );
        host.schedule(self.wire_free, event(EV_PEER, 0));
    }

    /// RX NAPI on the interrupt vCPU: unmap the used buffers, the stack, ACKs, the refill.
    fn napi(&mut self, host: &mut Host, now: Time) {
        let cpu = self.irq_cpu;
        if !host.cpu_acquire(cpu, now, event(EV_NAPI, 0), Ctx::Softirq) {
            return;
        }
        let c = host.platform.cpu.clone();
        let mut t = now + self.irq_exit_time();
        let mut consumed = 0;
        for _ in 0..NAPI_BUDGET {
            let Some((bufs, pkt)) = self.rx_used.pop_front() else {
                break;
            };
            for b in &bufs {
                t = self.release_rx(host, t, cpu, b);
            }
            consumed += bufs.len();
            if pkt.ack {
                // The peer's ACK opens the window (tcp_ack); a sender it held back goes on.
                t += c.rx_lone_packet_ns();
                self.tx_unacked -= self.cfg.ack_bytes.min(self.tx_unacked);
                self.resume_sender(host, t);
                continue;
            }
            let segs = pkt.bytes.div_ceil(self.mss);
            t += c.stack_ns_per_skb + segs * c.stack_ns_per_packet;
            // tcp_data_queue → sk_data_ready: the reader wakes as the first skb is queued.
            self.unread.push_back((t, pkt.bytes));
            if !self.read_scheduled {
                self.read_scheduled = true;
                host.schedule(t + c.wakeup_ns, event(EV_READ, 0));
            }
            self.stats.packets_delivered += segs;
            // tcp_rcv_established's ACK: once per ack_bytes received, through the TX virtqueue.
            self.unacked += pkt.bytes;
            while self.unacked >= self.cfg.ack_bytes {
                self.unacked -= self.cfg.ack_bytes;
                t = self.xmit(host, t, cpu, ACK_FRAME, &[], true);
            }
        }
        t = host.dma_batch_end(t, cpu);
        t = self.refill(host, t, cpu, consumed);
        if self.rx_used.is_empty() {
            self.napi_scheduled = false;
        } else {
            host.schedule(t, event(EV_NAPI, 0));
        }
        host.cpus[cpu].account(now, t);
    }

    /// add_recvbuf_mergeable for `n` buffers, and a kick when the device waits for them. Each buffer is
    /// the next `rx_buf_len` bytes of the queue's page_frag chunk (the last one of a chunk takes the hole
    /// left), mapped on its own.
    fn refill(&mut self, host: &mut Host, now: Time, cpu: usize, n: usize) -> Time {
        let mut t = if self.cfg.mergeable {
            self.refill_mergeable(host, now, cpu, n)
        } else {
            self.refill_big(host, now, cpu, n)
        };
        if self.dev_wants_rx && !self.rx_avail.is_empty() {
            self.dev_wants_rx = false;
            t = self.kick(host, t);
        }
        t
    }

    /// add_recvbuf_big() for `n` buffers: BIG_PAGES fresh pages each (get_a_page: the last packet's skb
    /// kept its pages), posted as BIG_PAGES + 1 scatterlist entries, the header and the data sharing
    /// the first page, so two mappings of it, and an indirect table.
    fn refill_big(&mut self, host: &mut Host, now: Time, cpu: usize, n: usize) -> Time {
        let mut t = now;
        for _ in 0..n {
            let first = self.rx_big_next;
            self.rx_big_next = (self.rx_big_next + BIG_PAGES) % self.rx_big_pages.len();
            let pages = &self.rx_big_pages[first..first + BIG_PAGES];
            // The header, then the data from the padded header's end of the first page on.
            let piece = |p: u64, off: u64| Frag {
                chunk: p,
                off,
                len: PAGE - off,
            };
            let pieces: Vec<Frag> = std::iter::once(Frag {
                chunk: pages[0],
                off: 0,
                len: VNET_HDR_BYTES,
            })
            .chain(std::iter::once(piece(pages[0], PADDED_VNET_HDR_BYTES)))
            .chain(pages[1..].iter().map(|&p| piece(p, 0)))
            .collect();
            t += BIG_PAGES as u64 * host.platform.cpu.page_alloc_ns;
            let Some((chain, t2)) = self.add_chain(host, t, cpu, &pieces, MapDir::FromDevice)
            else {
                break;
            };
            t = t2;
            self.rx_avail.push_back(RxBuf {
                chain,
                len: self.rx_buf_len,
                chunk: None,
            });
            self.rxq.posted += 1;
        }
        t
    }

    /// add_recvbuf_mergeable() for `n` buffers (see `refill`).
    fn refill_mergeable(&mut self, host: &mut Host, now: Time, cpu: usize, n: usize) -> Time {
        let mut t = now;
        for _ in 0..n {
            if self.rx_frag.refill(self.rx_buf_len) {
                t += host.platform.cpu.page_alloc_ns;
            }
            if self.rx_premapped && self.rx_frag.off == 0 {
                let Some(t2) = self.premap_chunk(host, t, cpu) else {
                    break;
                };
                t = t2;
            }
            let mut len = self.rx_buf_len;
            if self.rx_frag.room() - len < self.rx_buf_len {
                len = self.rx_frag.room();
            }
            let f = self.rx_frag.take(len);
            let (chain, chunk) = if self.rx_premapped {
                (self.carve(f), Some(self.rx_frag.at))
            } else {
                let Some((chain, t2)) = self.add_chain(host, t, cpu, &[f], MapDir::FromDevice)
                else {
                    break;
                };
                t = t2;
                (chain, None)
            };
            self.rx_avail.push_back(RxBuf { chain, len, chunk });
            self.rxq.posted += 1;
        }
        t
    }

    /// virtnet_rq_alloc() and virtnet_rq_init_one_sg() on a premapped chunk: the buffer's address is the
    /// chunk's plus its offset, nothing mapped; the chunk gains a reference.
    fn carve(&mut self, f: Frag) -> Chain {
        let dma = self.rx_chunk_dma[self.rx_frag.at]
            .as_mut()
            .expect("premap_chunk maps a chunk before its first buffer");
        dma.refs += 1;
        Chain {
            maps: vec![(dma.map.0 + f.off / PAGE, f.pages().1)],
            indirect: None,
        }
    }

    /// virtnet_rq_alloc() on a fresh chunk (6.6 to 6.10): the chunk carved before it loses its own
    /// reference (unmapped if its buffers are all used), and the new one is mapped whole behind its struct
    /// virtnet_rq_dma, with one reference of its own. None when the IOVA space is exhausted.
    fn premap_chunk(&mut self, host: &mut Host, now: Time, cpu: usize) -> Option<Time> {
        let n = self.rx_frag.chunks.len();
        self.rx_chunk_dma.resize_with(n, || None);
        let at = self.rx_frag.at;
        let mut t = self.put_chunk(host, now, cpu, (at + n - 1) % n);
        debug_assert!(
            self.rx_chunk_dma[at].is_none(),
            "a chunk comes round again only after its buffers are used"
        );
        // virtqueue_dma_map_single_attrs(DMA_FROM_DEVICE); unmapped with DMA_ATTR_SKIP_CPU_SYNC, each buffer
        // synced for the CPU instead (virtnet_rq_get_buf).
        let phys = self.rx_frag.chunks[at];
        let (dma, pages, t2) =
            host.dma_map_attrs_in(0, t, cpu, phys, 0, FRAG_BYTES, MapDir::FromDevice, true)?;
        t = t2;
        self.rx_chunk_dma[at] = Some(ChunkDma {
            map: (dma, pages),
            refs: 1,
        });
        self.rx_frag.take(RQ_DMA_BYTES);
        Some(t)
    }

    /// virtnet_rq_unmap(): one reference of chunk `at` dropped; the last unmaps the whole chunk.
    fn put_chunk(&mut self, host: &mut Host, now: Time, cpu: usize, at: usize) -> Time {
        let Some(dma) = self.rx_chunk_dma[at].as_mut() else {
            return now;
        };
        dma.refs -= 1;
        if dma.refs > 0 {
            return now;
        }
        let (pfn, pages) = dma.map;
        self.rx_chunk_dma[at] = None;
        host.dma_unmap(now, cpu, pfn, pages)
    }

    /// A used RX buffer given back (virtnet_rq_get_buf): its own mappings unmapped (detach_buf_split), or a
    /// premapped buffer's reference on its chunk dropped.
    fn release_rx(&mut self, host: &mut Host, now: Time, cpu: usize, b: &RxBuf) -> Time {
        match b.chunk {
            Some(at) => {
                let t = host.dma_sync_for_cpu(now, b.len);
                self.put_chunk(host, t, cpu, at)
            }
            None => Self::unmap_chain(host, now, cpu, &b.chain),
        }
    }

    /// start_xmit of one skb of `bytes` (its data in `frags`) from vCPU `cpu`: free_old_xmit_skbs, map
    /// head and frags, add, and kick the device if it waits. Returns the release time.
    fn xmit(
        &mut self,
        host: &mut Host,
        now: Time,
        cpu: usize,
        bytes: u64,
        frags: &[Frag],
        ack: bool,
    ) -> Time {
        let mut t = now + host.platform.cpu.tx_packet_ns;
        t = self.reap_tx(host, t, cpu);
        // The head (the virtio-net header pushed before the frame's headers, in the linear part, and the
        // payload too where the device has no SG: csum off); then each frag.
        let linear = if self.cfg.csum || ack { 0 } else { bytes };
        let head = Frag {
            chunk: self.send_page(),
            off: 0,
            len: VNET_HDR_BYTES + super::net::ETH_HLEN + super::net::TCPIP_HLEN + linear,
        };
        let pieces: Vec<Frag> = std::iter::once(head).chain(frags.iter().cloned()).collect();
        let Some((chain, t2)) = self.add_chain(host, t, cpu, &pieces, MapDir::ToDevice) else {
            // start_xmit: xmit_skb failed, so tx_dropped and the skb freed (its TSQ budget back). The peer's
            // duplicate ACKs for what follows bring it back by fast retransmit, a round trip later.
            self.stats.drops_map += 1;
            if !ack {
                if self.napi_tx {
                    self.tsq_in_flight -= bytes;
                }
                self.tx_unacked -= bytes.min(self.tx_unacked);
                if self.retx == 0 {
                    let rtt = (self.cfg.rtt_us * 1000.0).round() as u64;
                    host.schedule(t + rtt.max(1), event(EV_RETX, 0));
                }
                self.retx += bytes;
            }
            return t;
        };
        t = t2;
        self.stats.tx_packets += 1;
        self.txq.posted += 1;
        self.tx_avail.push_back(TxSkb { chain, bytes, ack });
        self.arm_tx_interrupt_if_full();
        // virtqueue_kick_prepare(): the device asked to be told (its notifications are on) unless it is
        // in a burst.
        if !self.tx_burst && self.device_idle(t) {
            t = self.kick(host, t);
        } else {
            self.wake_device(host, t);
        }
        t
    }

    /// The next guest page a TX skb's data sits in (the socket's frags, reused in turn).
    fn send_page(&mut self) -> u64 {
        let p = self.send_pages[self.next_send_page % self.send_pages.len()];
        self.next_send_page += 1;
        p
    }

    /// free_old_xmit_skbs: unmap every used TX skb and return its TSQ budget.
    fn reap_tx(&mut self, host: &mut Host, now: Time, cpu: usize) -> Time {
        let mut t = now;
        let mut any = false;
        while let Some(skb) = self.tx_used.pop_front() {
            t = Self::unmap_chain(host, t, cpu, &skb.chain);
            if !skb.ack && self.napi_tx {
                self.tsq_in_flight -= skb.bytes;
            }
            any = true;
        }
        if any {
            t = host.dma_batch_end(t, cpu);
            self.resume_sender(host, t);
            // tcp_wfree() on a TSQ_THROTTLED socket: its tasklet pushes what autocorking held back. An
            // orphaned skb has no destructor left to call it.
            if self.napi_tx && self.corked > 0 && !self.tsq_scheduled {
                self.tsq_scheduled = true;
                host.schedule(t, event(EV_TSQ, cpu));
            }
        }
        t
    }

    /// Whether the sender may hand down another skb: TSQ budget, the peer's window, a ring slot.
    /// Whether the application may write once more: the write (with what is corked) fits the TSQ budget
    /// and the peer's window, and its skbs or segments the ring.
    fn may_send(&self) -> bool {
        let need = self.corked + self.cfg.send_bytes();
        self.tsq_in_flight + need.min(self.cfg.tsq_bytes) <= self.cfg.tsq_bytes
            && self.tx_unacked + need.min(RX_WINDOW_BYTES) <= RX_WINDOW_BYTES
            && self.ring_room()
    }

    /// Whether the next write's skbs or segments (with what is corked) fit the TX ring.
    fn ring_room(&self) -> bool {
        let need = self.corked + self.cfg.send_bytes();
        let per_slot = if self.cfg.tso {
            Self::payload(&self.cfg)
        } else {
            self.mss
        };
        let q = self.cfg.queue_size as u64;
        let slots = need.div_ceil(per_slot).min(q);
        (self.tx_avail.len() + self.tx_used.len()) as u64 + slots <= q
    }

    /// A sender held back by a full ring without TX NAPI: in the kernel its skbs wait in the qdisc behind
    /// the stopped queue, whose start_xmit reaped what was used and armed the interrupt
    /// (virtqueue_enable_cb_delayed) that wakes it. Returns the vCPU's release time.
    fn stop_queue(&mut self, host: &mut Host, now: Time, cpu: usize) -> Time {
        let t = self.reap_tx(host, now, cpu);
        if self.sender_throttled && !self.ring_room() {
            self.arm_tx_interrupt();
        }
        t
    }

    /// Wake a sender that waited for completions or ACKs, once it may send again.
    fn resume_sender(&mut self, host: &mut Host, t: Time) {
        if self.sender_throttled && self.may_send() {
            self.sender_throttled = false;
            host.schedule(t, event(EV_SEND, 0));
        }
    }

    /// TX direction: the application writes `send_bytes` (tcp_sendmsg): copied into the socket's page
    /// frags, each skb handed down as it reaches the size goal, and the tail too unless it autocorks.
    fn send(&mut self, host: &mut Host, now: Time) {
        let cpu = self.app_cpu;
        if !host.cpu_acquire(cpu, now, event(EV_SEND, 0), Ctx::Task) {
            return;
        }
        if !self.may_send() {
            self.sender_throttled = true;
            self.stats.window_closed += 1;
            if !self.napi_tx && !self.ring_room() {
                let t = self.stop_queue(host, now, cpu);
                host.cpus[cpu].account(now, t);
            }
            return;
        }
        let m = self.cfg.send_bytes();
        let mut t = now + (m as f64 * host.platform.cpu.copy_ns_per_byte).round() as u64;
        self.corked += m;
        let goal = Self::payload(&self.cfg);
        while self.corked >= goal {
            t = self.push(host, t, cpu, goal);
        }
        // tcp_push() → tcp_should_autocork(): a short tail waits while the socket has data below TCP
        // (never without TX NAPI: the skbs below were orphaned).
        if self.tsq_in_flight == 0 && self.pushable() > 0 {
            t = self.push(host, t, cpu, self.pushable());
        }
        host.schedule(t, event(EV_SEND, 0));
        host.cpus[cpu].account(now, t);
    }

    /// The TSQ tasklet (tcp_tsq_handler → tcp_write_xmit) on the vCPU that freed the skbs: the autocorked
    /// tail goes down.
    fn tsq_handler(&mut self, host: &mut Host, now: Time, cpu: usize) {
        if !host.cpu_acquire(cpu, now, event(EV_TSQ, cpu), Ctx::Softirq) {
            return;
        }
        self.tsq_scheduled = false;
        let t = match self.pushable() {
            0 => now,
            n => self.push(host, now, cpu, n),
        };
        host.cpus[cpu].account(now, t);
    }

    /// What tcp_write_xmit may send of the corked tail: all of it, or while data is unacknowledged (always,
    /// in a stream) whole MSS segments only: Nagle holds the part below one MSS for the next write
    /// (tcp_nagle_test).
    fn pushable(&self) -> u64 {
        if self.tx_unacked > 0 {
            self.corked / self.mss * self.mss
        } else {
            self.corked
        }
    }

    /// tcp_write_xmit of one skb of `bytes` from the written data: through the stack to the driver, as
    /// one TSO skb or (TSO off) as the MSS segments software GSO cuts it into.
    fn push(&mut self, host: &mut Host, now: Time, cpu: usize, bytes: u64) -> Time {
        self.corked -= bytes;
        // skb_orphan() in start_xmit without TX NAPI: the socket's memory (sk_wmem_alloc) is back before
        // the write returns, so TSQ and autocorking see nothing below TCP.
        if self.napi_tx {
            self.tsq_in_flight += bytes;
        }
        self.tx_unacked += bytes;
        self.stats.packets_offered += bytes.div_ceil(self.mss);
        let mut t = now + host.platform.cpu.stack_ns_per_skb;
        let frags = self.take_frags(host, &mut t, bytes);
        if self.cfg.tso {
            return self.xmit(host, t, cpu, bytes, &frags, false);
        }
        let mut from = 0;
        while from < bytes {
            let n = self.mss.min(bytes - from);
            let seg = if self.cfg.csum {
                frag_range(&frags, from, n)
            } else {
                // No NETIF_F_SG / HW_CSUM: validate_xmit_skb() linearizes the segment (skb_linearize, a
                // copy into one new head) and skb_checksum_help() reads it again, each a pass over the
                // frame at the copy rate; the payload then rides in the head (xmit's linear frame).
                let pass = Self::frame(n) as f64 * host.platform.cpu.copy_ns_per_byte;
                t += (2.0 * pass).round() as u64;
                Vec::new()
            };
            t = self.xmit(host, t, cpu, n, &seg, false);
            from += n;
        }
        t
    }

    /// The next `bytes` of the socket's page_frag chunks (sk_page_frag_refill takes a fresh chunk when the
    /// current one is full).
    fn take_frags(&mut self, host: &Host, t: &mut Time, bytes: u64) -> Vec<Frag> {
        let mut out = Vec::new();
        let mut left = bytes;
        while left > 0 {
            if self.tx_frag.refill(1) {
                *t += host.platform.cpu.page_alloc_ns;
            }
            let n = left.min(self.tx_frag.room());
            out.push(self.tx_frag.take(n));
            left -= n;
        }
        out
    }

    /// The TX interrupt's NAPI (virtnet_poll_tx) on the interrupt vCPU. Without TX NAPI the interrupt's
    /// skb_xmit_done() wakes the stopped queue and the next start_xmit reaps (free_old_xmit_skbs); its reap
    /// stands for that one.
    fn tx_done(&mut self, host: &mut Host, now: Time) {
        let cpu = self.irq_cpu;
        if !host.cpu_acquire(cpu, now, event(EV_TX_DONE, 0), Ctx::Softirq) {
            return;
        }
        self.tx_irq_scheduled = false;
        let t = now + self.irq_exit_time();
        let t = self.reap_tx(host, t, cpu);
        host.cpus[cpu].account(now, t);
    }

    /// The application reads what has been queued by now (RX direction): the copy to user space; the
    /// window reopens. It reads on while NAPI queues more.
    fn read(&mut self, host: &mut Host, now: Time) {
        let cpu = self.app_cpu;
        if !host.cpu_acquire(cpu, now, event(EV_READ, 0), Ctx::Task) {
            return;
        }
        self.read_scheduled = false;
        let mut bytes = 0;
        while let Some(&(_, b)) = self.unread.front().filter(|(at, _)| *at <= now) {
            bytes += b;
            self.unread.pop_front();
        }
        let t = now + (bytes as f64 * host.platform.cpu.copy_ns_per_byte).round() as u64;
        if let Some(&(at, _)) = self.unread.front() {
            self.read_scheduled = true;
            host.schedule(t.max(at), event(EV_READ, 0));
        }
        self.stats.bytes_delivered += bytes;
        self.peer_in_flight -= bytes.min(self.peer_in_flight);
        if self.peer_blocked {
            self.peer_blocked = false;
            host.schedule(now.max(self.wire_free), event(EV_PEER, 0));
        }
        host.cpus[cpu].account(now, t);
    }
}

impl Workload for VirtioNetWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        let q = self.cfg.queue_size as usize;
        // The RX buffers' memory, enough for the ring twice over: page_frag chunks for mergeable ones,
        // single pages for big ones.
        if self.cfg.mergeable {
            let per_chunk = (FRAG_BYTES / self.rx_buf_len).max(1) as usize;
            let Some(frag) = PageFrag::alloc(host, (2 * q).div_ceil(per_chunk) + 1) else {
                return now;
            };
            self.rx_frag = frag;
        } else {
            let Some(pages) = (0..(2 * q + 1) * BIG_PAGES)
                .map(|_| host.pages.alloc())
                .collect::<Option<Vec<u64>>>()
            else {
                return now;
            };
            self.rx_big_pages = pages;
        }
        self.emul_iotlb = host.emulator_iotlb();
        // virtnet_probe → vring_create_virtqueue_split: each ring in coherent memory (dma_alloc_coherent,
        // mapped once), the receive queue's first; and on an IOMMU that translates MSIs, the doorbell.
        let mut t = now;
        for tx in [false, true] {
            let pages = if tx { &self.txq } else { &self.rxq }.pages();
            let Some(phys) = host.pages.alloc_contiguous(pages) else {
                return now;
            };
            let Some((dma, t2)) = host.dma_alloc_coherent(t, self.irq_cpu, phys, pages) else {
                return now;
            };
            t = t2;
            if tx {
                self.tx_ring = dma;
            } else {
                self.rx_ring = dma;
            }
        }
        if host.msi_translated() {
            let Some(phys) = host.pages.alloc() else {
                return now;
            };
            let Some((dma, t2)) = host.dma_map(t, self.irq_cpu, phys, 1) else {
                return now;
            };
            t = t2;
            self.msi = Some(dma);
        }
        // The socket's page frags: enough for the TSQ budget and the peer's window; pages for the skbs'
        // heads and indirect tables, enough for the ring twice over.
        let chunks = (self.cfg.tsq_bytes + RX_WINDOW_BYTES).div_ceil(FRAG_BYTES) as usize + 1;
        let Some(frag) = PageFrag::alloc(host, chunks) else {
            return now;
        };
        self.tx_frag = frag;
        let Some(send) = (0..4 * q)
            .map(|_| host.pages.alloc())
            .collect::<Option<Vec<u64>>>()
        else {
            return now;
        };
        self.send_pages = send;
        // virtnet_open → try_fill_recv: the whole RX ring posted.
        let t = self.refill(host, t, self.irq_cpu, q);
        match self.cfg.direction {
            Direction::Rx => host.schedule(t, event(EV_PEER, 0)),
            Direction::Tx => host.schedule(t, event(EV_SEND, 0)),
        }
        t
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            EV_PEER => self.peer_send(host, now),
            EV_DEV => self.device(host, now),
            EV_NAPI => self.napi(host, now),
            EV_SEND => self.send(host, now),
            EV_TX_DONE => self.tx_done(host, now),
            EV_TSQ => self.tsq_handler(host, now, id as usize),
            EV_RETX => {
                // tcp_retransmit_skb: the dropped bytes queued again for the sender to push.
                self.corked += std::mem::take(&mut self.retx);
                self.resume_sender(host, now);
            }
            EV_READ => self.read(host, now),
            EV_PEER_ACK => {
                // The peer has received ack_bytes more of the stream: goodput counts there.
                self.stats.bytes_delivered += self.cfg.ack_bytes;
                self.stats.packets_delivered += self.cfg.ack_bytes.div_ceil(self.mss);
                self.send_to_tap(
                    host,
                    now,
                    RxPkt {
                        bytes: ACK_FRAME,
                        ack: true,
                    },
                )
            }
            _ => unreachable!("virtio-net event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        self.stats.clone()
    }

    fn cpus(&self) -> Vec<usize> {
        if self.app_cpu == self.irq_cpu {
            vec![self.irq_cpu]
        } else {
            vec![self.irq_cpu, self.app_cpu]
        }
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.line_rate_gbps
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::RunResult;
    use crate::run::{builtin_with, run_variant};

    /// guest-x86's runs of CONFIG (its named setting) with `ov` pinned.
    fn x86(config: &str, ov: &[(&str, &str)]) -> RunResult {
        let v = builtin_with("guest-x86", ov);
        let v = v
            .iter()
            .find(|v| v.label.split(' ').next() == Some(config))
            .expect("config");
        run_variant(v)
    }

    fn exits(r: &RunResult, cause: &str) -> u64 {
        let vm = r.vm_exits.as_ref().expect("a guest reports its exits");
        vm.by_cause
            .iter()
            .find(|c| c.cause == cause)
            .map_or(0, |c| c.count)
    }

    const RX_OFF: &[(&str, &str)] = &[
        ("workload.virtio_net.direction", "rx"),
        ("workload.virtio_net.vhost", "false"),
    ];
    const RX_ON: &[(&str, &str)] = &[
        ("workload.virtio_net.direction", "rx"),
        ("workload.virtio_net.vhost", "true"),
    ];

    #[test]
    fn strict_traps_once_per_invalidation_submission_and_caching_mode_doubles_them() {
        let strict = x86("strict", RX_OFF);
        let cm = x86("strict-cm", RX_OFF);
        // One PSI per unmapped buffer; with caching mode one more per map: two per page.
        assert_eq!(strict.inv_per_page, 1.0);
        assert_eq!(cm.inv_per_page, 2.0);
        // Every qi_submit_sync is one tail write, one exit.
        assert_eq!(exits(&strict, "qi_tail"), strict.invalidations.total);
        assert_eq!(exits(&cm, "qi_tail"), cm.invalidations.total);
        // No vIOMMU: no IOMMU exits (the virtqueue kicks are the only ones left).
        let none = x86("noiommu", RX_OFF);
        assert_eq!(exits(&none, "qi_tail"), 0);
    }

    /// MiB at `gbps` over the run's window.
    fn mib(r: &RunResult, gbps: f64) -> f64 {
        gbps * 1e9 / 8.0 * r.sim_seconds / (1 << 20) as f64
    }

    /// Strict unmaps (one PSI each) per MiB the guest sent.
    fn unmaps_per_mib(r: &RunResult) -> f64 {
        r.invalidations.total as f64 / mib(r, r.throughput_gbps)
    }

    const TX_OFF: &[(&str, &str)] = &[
        ("workload.virtio_net.direction", "tx"),
        ("workload.virtio_net.vhost", "false"),
    ];

    /// TX skbs per MiB sent.
    fn skbs_per_mib(r: &RunResult) -> f64 {
        r.tx_packets as f64 / mib(r, r.throughput_gbps)
    }

    #[test]
    fn small_sends_and_software_segmentation_map_more_per_byte() {
        // netperf's 16 KiB sends go down on their own while nothing of the socket is below TCP, each skb a
        // head and a frag or two; iperf3's 128 KiB sends fill 64 KiB TSO skbs. Where the device keeps up
        // (no vIOMMU) more sends find the queue empty than under strict, where most autocork into
        // bigger skbs: the difference shrinks but stays. (A 5.15 guest: with TX NAPI, so autocorking.)
        let tool = |c: &str, t: &str| {
            let ov = [("workload.virtio_net.tool", t), ("os.kernel", "5.15")];
            x86(c, &[TX_OFF, &ov].concat())
        };
        let (fast_np, fast_ip) = (tool("noiommu", "netperf"), tool("noiommu", "iperf3"));
        assert!(skbs_per_mib(&fast_np) > 1.3 * skbs_per_mib(&fast_ip));
        let (netperf, iperf3) = (tool("strict", "netperf"), tool("strict", "iperf3"));
        assert!(skbs_per_mib(&netperf) < skbs_per_mib(&fast_np));
        assert!(
            unmaps_per_mib(&netperf) > 1.05 * unmaps_per_mib(&iperf3),
            "{} vs {}",
            unmaps_per_mib(&netperf),
            unmaps_per_mib(&iperf3)
        );
        // With TSO off every MSS segment is mapped on its own: a head and its frag per 1448 bytes.
        let no_tso = x86(
            "strict",
            &[
                TX_OFF,
                &[
                    ("workload.virtio_net.tool", "iperf3"),
                    ("workload.virtio_net.tso", "false"),
                ],
            ]
            .concat(),
        );
        let per_mib = unmaps_per_mib(&no_tso);
        let segs = (1 << 20) as f64 / 1448.0;
        assert!(per_mib > 2.0 * segs, "{per_mib} unmaps per MiB");
        assert!(per_mib > 5.0 * unmaps_per_mib(&iperf3));
    }

    #[test]
    fn a_4_19_guest_sends_each_16_kib_write_as_its_own_skb() {
        // Issue 67 item 1. 4.19's virtio-net has no TX NAPI by default (napi_tx on from 5.3): start_xmit
        // orphans each skb, nothing stays below TCP for autocorking or TSQ to wait on, and each of netperf's
        // 16 KiB writes goes down at once: 1 MiB / 16 KiB = 64 skbs per MiB (Nagle holds each write's last
        // 16384 - 11 * 1448 = 456 bytes for the next, so the skbs average the write's size). 5.15 holds the
        // tails back while skbs are below TCP and sends fewer, larger skbs.
        // guest-x86 runs 4.19 (its virtio-iommu config 5.14, the oldest allowed there).
        let at = |kernel: &'static str, napi: Option<&'static str>| {
            let mut ov = TX_OFF.to_vec();
            if kernel != "4.19" {
                ov.push(("os.kernel", kernel));
            }
            if let Some(n) = napi {
                ov.push(("workload.virtio_net.napi_tx", n));
            }
            x86("strict", &ov)
        };
        let old = at("4.19", None);
        let per_mib = skbs_per_mib(&old);
        assert!((60.0..68.0).contains(&per_mib), "{per_mib} skbs per MiB");
        let new = at("5.15", None);
        assert!(skbs_per_mib(&new) < 0.7 * per_mib, "{}", skbs_per_mib(&new));
        // The module parameter decides it, not the version: 4.19 booted with virtio_net.napi_tx=1 coalesces.
        let napi = skbs_per_mib(&at("4.19", Some("true")));
        assert!(napi < 0.7 * per_mib, "{napi}");
        // Each skb is a head and a frag or two mapped, and an indirect table: more unmaps per byte.
        assert!(
            unmaps_per_mib(&old) > 1.3 * unmaps_per_mib(&new),
            "{} vs {}",
            unmaps_per_mib(&old),
            unmaps_per_mib(&new)
        );
    }

    #[test]
    fn vhosts_tx_yields_to_the_peers_acks_after_its_weight() {
        // Issue 67 item 1. Without TSQ a 4.19 guest keeps the peer's whole window (3 MiB) in the TX ring.
        // vhost's handle_tx requeues itself after VHOST_NET_WEIGHT bytes (512 KiB, 32 of netperf's skbs)
        // behind the RX work the tap queued, so the peer's ACKs reach the guest while its ring drains and
        // it sends all through the run. Serving TX first until the ring was empty held the ACKs back until
        // the 3 MiB had gone: at 0.7 Gbps that is most of the run, with one skb sent in it.
        let v = builtin_with(
            "guest-arm",
            &[
                ("workload.virtio_net.direction", "tx"),
                ("workload.virtio_net.vhost", "true"),
            ],
        );
        let v = v
            .iter()
            .find(|v| v.label.split(' ').next() == Some("smmuv3"))
            .expect("config");
        let r = run_variant(v);
        // 64 skbs per MiB where what is sent in the run is what is acknowledged in it; the 3 MiB in flight at
        // either edge of a run that delivers about 4 MiB moves that by a fifth either way.
        let per_mib = skbs_per_mib(&r);
        assert!((45.0..80.0).contains(&per_mib), "{per_mib} skbs per MiB");
    }

    #[test]
    fn a_jumbo_mtu_maps_less_per_byte_where_segments_are_what_is_mapped() {
        // Where every MSS segment is mapped on its own (TSO off when sending; no GRO'd packets, so
        // MTU-sized mergeable buffers, when receiving), 9000-byte frames carry six times a 1500-byte
        // frame's payload. Receiving, a 9000-byte frame fills three page-sized buffers.
        fn at(mtu: &str, dir: &[(&str, &str)], extra: &[(&str, &str)]) -> RunResult {
            let ov = [dir, &[("workload.virtio_net.mtu", mtu)], extra].concat();
            x86("strict", &ov)
        }
        let tx = |mtu| {
            let r = at(mtu, TX_OFF, &[("workload.virtio_net.tso", "false")]);
            unmaps_per_mib(&r)
        };
        let ratio = tx("9000") / tx("1500");
        assert!((0.12..0.3).contains(&ratio), "{ratio}");
        let rx = |mtu: &'static str| {
            let r = at(mtu, RX_OFF, &[("workload.virtio_net.gso_max_bytes", mtu)]);
            r.invalidations.total as f64 / mib(&r, r.received_gbps)
        };
        let ratio = rx("9000") / rx("1500");
        assert!((0.35..0.65).contains(&ratio), "{ratio}");
        // With the host's GRO'd packets and TSO the MTU leaves the mappings per byte nearly as they were.
        let gro = |mtu| {
            let r = at(mtu, RX_OFF, &[]);
            r.invalidations.total as f64 / mib(&r, r.received_gbps)
        };
        let ratio = gro("9000") / gro("1500");
        assert!((0.9..1.1).contains(&ratio), "{ratio}");
    }

    #[test]
    fn big_packets_buffers_map_every_page_of_a_buffer_and_their_table() {
        // Mergeable buffers are page-sized, one mapping each: a 64 KiB packet is 16 buffers, 16 strict
        // unmaps (and one for the ACK the guest sends). A big-packets buffer holds the whole packet in 19
        // mappings (the first page twice) and an indirect table: 20 unmaps, a quarter more per byte.
        let rx = |m: &str| {
            x86(
                "strict",
                &[RX_OFF, &[("workload.virtio_net.mergeable", m)]].concat(),
            )
        };
        let (mrg, big) = (rx("true"), rx("false"));
        // Per MiB the device took in (goodput lags it by what NAPI has not yet handed to the reader).
        let per_mib = |r: &RunResult| r.invalidations.total as f64 / mib(r, r.received_gbps);
        let ratio = per_mib(&big) / per_mib(&mrg);
        assert!((1.1..1.5).contains(&ratio), "{ratio}");
        // The device reads the table's 19 entries and maps 19 pages per buffer: over two translations a
        // page, but one pop of the ring per 18 pages where mergeable buffers take one per page (QEMU's
        // ring accesses, 7 translations a page).
        let per_page = |r: &RunResult| {
            r.emulator.as_ref().unwrap().work.translations as f64 / r.dma_pages as f64
        };
        let (b, m) = (per_page(&big), per_page(&mrg));
        assert!(b > 2.0 && b < 3.0 && m > 6.0, "{b} {m}");
    }

    #[test]
    fn a_6_6_to_6_10_guest_maps_each_rx_page_frag_chunk_once() {
        // Issue 67 item 1. 6.6 to 6.10 map each 32 KiB page_frag chunk once (virtnet_rq_alloc) and carve
        // the mergeable buffers from it; 6.11 turned that off again. With the host's 64 KiB GRO'd packets a
        // buffer is a page (get_mergeable_buf_len: 12 + 4084 rounded to 4096), so a chunk holds 7 buffers
        // after its 24-byte struct virtnet_rq_dma, the last taking the hole: 7 unmaps become 1.
        let rx = |kernel: &'static str, mergeable: &'static str| {
            let ov = [
                RX_OFF,
                &[
                    ("os.kernel", kernel),
                    ("workload.virtio_net.mergeable", mergeable),
                ],
            ]
            .concat();
            let r = x86("strict", &ov);
            r.invalidations.total as f64 / mib(&r, r.received_gbps)
        };
        let (premapped, each) = (rx("6.8", "true"), rx("6.12", "true"));
        // Per MiB: 256 buffers (or 256 / 7 chunks) and the guest's 16 ACKs, one mapping each.
        let want = (256.0 / 7.0 + 16.0) / (256.0 + 16.0);
        let ratio = premapped / each;
        assert!((ratio / want - 1.0).abs() < 0.15, "{ratio} against {want}");
        // Big-packets buffers are never premapped ("disable for big mode").
        let ratio = rx("6.8", "false") / rx("6.12", "false");
        assert!((ratio - 1.0).abs() < 0.05, "{ratio}");
    }

    #[test]
    fn without_its_ring_cache_vhost_looks_up_every_ring_access_as_qemu_translates_it() {
        // vhost_vq_meta_prefetch keeps the rings' translations: its device IOTLB sees one lookup per buffer
        // page. Without it every ring access is one more, so it looks up exactly what QEMU's device
        // translates (the buffers' pages and every ring access of hw/virtio/virtio.c).
        let lookups = |r: &RunResult| {
            let a = &r.caches.atc;
            (a.hits + a.misses) as f64 / r.dma_pages as f64
        };
        let cache = |on: &'static str| [RX_ON, &[("platform.kvm.vhost_meta_cache", on)]].concat();
        let (kept, lost) = (
            x86("strict", &cache("true")),
            x86("strict", &cache("false")),
        );
        assert!((lookups(&kept) - 1.0).abs() < 0.01, "{}", lookups(&kept));
        let qemu = x86("strict", RX_OFF);
        let translations = qemu.emulator.as_ref().unwrap().work.translations as f64;
        let per_page = translations / qemu.dma_pages as f64;
        assert!(per_page > 6.0, "{per_page}");
        assert!(
            (lookups(&lost) / per_page - 1.0).abs() < 0.02,
            "{} {per_page}",
            lookups(&lost)
        );
    }

    #[test]
    fn without_posted_interrupts_an_interrupt_kicks_a_running_vcpu_out() {
        // guest-arm's ThunderX host injects through the vgic: an interrupt finding the interrupt vCPU at
        // work costs it an in-kernel exit (some find it idle, halted). x86 hosts post them: none.
        let run = |posted: &'static str| {
            let v = builtin_with(
                "guest-arm",
                &[
                    ("workload.virtio_net.direction", "tx"),
                    ("workload.virtio_net.vhost", "false"),
                    ("workload.virtio_net.tool", "iperf3"),
                    ("platform.kvm.posted_interrupts", posted),
                ],
            );
            let v = v
                .iter()
                .find(|v| v.label.starts_with("virtio-iommu"))
                .unwrap();
            run_variant(v)
        };
        let (kicked, posted) = (run("false"), run("true"));
        let irq = exits(&kicked, "irq");
        assert!(irq > 0);
        let vm = kicked.vm_exits.as_ref().unwrap();
        let per = vm.by_cause.iter().find(|c| c.cause == "irq").unwrap();
        assert!((per.mean_us - 2.15).abs() < 0.01, "{}", per.mean_us);
        assert_eq!(exits(&posted, "irq"), 0);
        assert_eq!(exits(&x86("strict", RX_ON), "irq"), 0);
    }

    #[test]
    fn a_vhost_iotlb_miss_is_a_round_trip_to_the_vmm() {
        // Lazy with vhost: every fresh buffer IOVA misses vhost's IOTLB, and the device thread waits for
        // QEMU's answer each time; doubling that round trip costs the device-bound stream accordingly.
        let miss = |ns| [RX_ON, &[("platform.kvm.vhost_iotlb_miss_ns", ns)]].concat();
        let (base, slow) = (x86("lazy", &miss("10000")), x86("lazy", &miss("20000")));
        let misses = base.caches.atc.misses;
        assert!(
            misses as f64 > 0.9 * base.dma_pages as f64,
            "{misses} of {}",
            base.dma_pages
        );
        let vm = base.vm_exits.as_ref().unwrap();
        assert!(
            vm.device_busy > 0.9,
            "the device thread is the bottleneck: {}",
            vm.device_busy
        );
        assert!(slow.throughput_gbps < 0.65 * base.throughput_gbps);
        // Without a vIOMMU vhost translates through its memory table: no misses, the line rate.
        let none = x86("noiommu", RX_ON);
        assert_eq!(none.caches.atc.misses, 0);
        assert!(none.throughput_gbps > 0.9 * none.line_rate_gbps);
    }
}
