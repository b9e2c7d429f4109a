//! Workloads: event sources that drive the DMA layer and the device. One file per workload.

pub mod desc_ring;
mod dim;
pub mod l2fwd;
pub mod map_benchmark;
pub mod napi;
/// Ethernet, IP and TCP sizes live below the workloads (the schema reads them too).
pub use crate::net;
pub mod nic_rx;
pub mod nic_tx;
pub mod nvme;
pub mod rr;
pub mod rxq;
pub mod sq;
pub mod virtio_net;
pub mod vring;

use crate::host::{Event, Host};
use crate::hw::emul::ExitStats;
use crate::sim::hist::Histogram;
use crate::sim::{DmaEngine, EngineBusy, Path, Time};
use desc_ring::DescRing;
use serde::Serialize;

/// What the workload does when no accounted resource saturates (its own bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenLimit {
    /// TCP senders: their windows and loss recovery set the rate.
    Senders,
    /// A fixed offered load (requests per second) that the host keeps up with.
    OfferedLoad,
    /// A fixed number of I/Os in flight: latency sets the rate (Little's law).
    QueueDepth,
}

impl OpenLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            OpenLimit::Senders => "senders",
            OpenLimit::OfferedLoad => "offered_load",
            OpenLimit::QueueDepth => "queue_depth",
        }
    }
}

/// A workload's own event: its kind and the queue, flow or slot it concerns.
pub fn event(kind: u16, id: usize) -> Event {
    Event::Workload {
        kind,
        id: id as u32,
    }
}

/// A device's side of DMA: its engine (translation slots, link) and the faults its accesses hit.
pub struct Device {
    pub engine: DmaEngine,
    pub faults: u64,
}

impl Device {
    pub fn new(translation_slots: u32, link_gbps: f64) -> Self {
        Device {
            engine: DmaEngine::new(translation_slots, link_gbps),
            faults: 0,
        }
    }

    /// Its engine's translation-slot and link time so far.
    pub fn busy(&self) -> EngineBusy {
        self.engine.busy
    }

    /// The device writes or reads `bytes` of data at DMA page `dma` on `path` no earlier than `t`: its
    /// completion time.
    pub fn access(&mut self, host: &mut Host, path: Path, t: Time, dma: u64, bytes: u64) -> Time {
        self.access_in(host, 0, path, t, dma, bytes)
    }

    /// [`Device::access`] for a device in DMA domain `dom` of the host.
    pub fn access_in(
        &mut self,
        host: &mut Host,
        dom: usize,
        path: Path,
        t: Time,
        dma: u64,
        bytes: u64,
    ) -> Time {
        let (lat, fault) = host.dma_access_in(dom, t, dma);
        self.faults += fault as u64;
        self.engine.issue_on(path, t, lat, bytes)
    }

    /// The next entry of a descriptor or completion ring: its translation, without the per-packet DMA base.
    pub fn ring_access(
        &mut self,
        host: &mut Host,
        path: Path,
        t: Time,
        ring: &mut DescRing,
    ) -> Time {
        let (lat, fault) = host.dma_translation(t, ring.next_page());
        self.faults += fault as u64;
        self.engine.issue_on(path, t, lat, ring.entry_bytes())
    }
}

/// Counters every workload reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkloadStats {
    /// Payload bytes delivered to the application.
    pub bytes_delivered: u64,
    pub packets_delivered: u64,
    pub packets_offered: u64,
    /// Payload bytes the device accepted (written to memory or queued for DMA).
    pub bytes_received: u64,
    /// Dropped for lack of a posted RX descriptor (the CPU did not refill in time).
    pub drops_ring: u64,
    /// Wire slots left idle because every flow's sender had used up its receive or congestion window.
    pub window_closed: u64,
    /// Times a sender entered loss recovery (halving its congestion window).
    pub loss_recoveries: u64,
    /// Dropped because the device's buffer overflowed waiting for DMA (translation or link bound).
    pub drops_device: u64,
    /// Packets the driver dropped because their DMA mapping failed (no IOVA space; "swiotlb buffer is
    /// full"): virtio-net's start_xmit counts tx_dropped, mlx5's a dropped send.
    pub drops_map: u64,
    /// Block I/Os whose mapping failed and that blk-mq requeued (BLK_STS_RESOURCE).
    pub requeued: u64,
    /// 4 KiB pages written by the device.
    pub dma_pages: u64,
    /// Pages that entered the page pool (allocated and DMA-mapped) and left it (DMA-unmapped and freed).
    pub pool_pages_mapped: u64,
    pub pool_pages_unmapped: u64,
    /// mlx5's RX page cache (Linux 6.0 en_rx.c): rx_cache_reuse, rx_cache_busy, rx_cache_empty,
    /// rx_cache_full.
    pub rx_cache: RxPageCache,
    /// For each rx_cache_reuse, how long before it the stack had let go of the cache's head page.
    #[serde(skip)]
    pub rx_cache_slack: Histogram,
    /// Packets the host sent (TCP segments on the wire, or ACKs).
    pub tx_packets: u64,
    /// DMA writes that hit no valid translation.
    pub dma_faults: u64,
    /// A guest's virtqueue notifications (kicks), as exits to the hypervisor.
    pub exits: ExitStats,
    /// Latency of each request served (request/response workloads), ns.
    #[serde(skip)]
    pub latency: Histogram,
    /// The DMA map benchmark's sums (kernel/dma/map_benchmark.c); only that workload has them.
    pub map_bench: Option<map_benchmark::MapBenchSums>,
    /// The devices' DMA engines: translation-slot and link time (zero for a software device).
    pub device: EngineBusy,
    /// Time the wire carried the workload's frames, Ethernet overheads included (zero without a wire).
    pub wire_ns: u64,
}

pub trait Workload: Send + Sync {
    /// Set up (fill rings, map buffers) and schedule the first events. Returns when traffic begins (the
    /// warm-up counts from then).
    fn start(&mut self, host: &mut Host, now: Time) -> Time;
    /// Handle one of this workload's events.
    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32);
    fn stats(&self) -> WorkloadStats;
    /// CPUs this workload runs on (CPU busy is reported over them).
    fn cpus(&self) -> Vec<usize>;
    /// The device-side rate limit the results are read against (the NIC's line rate, the drives' bandwidth).
    fn line_rate_gbps(&self) -> f64;
    /// What bounds the workload when no resource the model accounts is saturated.
    fn open_limit(&self) -> OpenLimit {
        OpenLimit::Senders
    }
}

/// mlx5's RX page cache in the window, as `ethtool -S` names them (rx_cache_reuse, rx_cache_busy,
/// rx_cache_empty, rx_cache_full): refills served from the cache; refills that found its head still held
/// by a socket, or found it empty, and mapped a new page; releases that found it full and unmapped the
/// page. Zero without a driver page cache. Cumulative in the workload's counters; a window is the
/// difference of two (`since`).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct RxPageCache {
    pub reuse: u64,
    pub busy: u64,
    pub empty: u64,
    pub full: u64,
}

impl RxPageCache {
    /// What was counted after `earlier`.
    pub fn since(&self, earlier: &RxPageCache) -> RxPageCache {
        RxPageCache {
            reuse: self.reuse - earlier.reuse,
            busy: self.busy - earlier.busy,
            empty: self.empty - earlier.empty,
            full: self.full - earlier.full,
        }
    }
}
