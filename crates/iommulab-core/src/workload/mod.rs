//! Workloads: event sources that drive the DMA layer and the device. One file per workload.

pub mod desc_ring;
pub mod napi;
pub mod nic_rx;
pub mod nvme;

use crate::host::Host;
use crate::sim::Time;
use serde::Serialize;

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
    /// Wire slots left idle because every flow's receive window was closed (readers fell behind).
    pub window_closed: u64,
    /// Dropped because the device's buffer overflowed waiting for DMA (translation or link bound).
    pub drops_device: u64,
    /// 4 KiB pages written by the device.
    pub dma_pages: u64,
    /// Pages that entered the page pool (allocated and DMA-mapped) and left it (DMA-unmapped and freed).
    pub pool_pages_mapped: u64,
    pub pool_pages_unmapped: u64,
    /// Packets the host sent (TCP ACKs).
    pub tx_packets: u64,
    /// DMA writes that hit no valid translation.
    pub dma_faults: u64,
}

pub trait Workload: Send + Sync {
    /// Set up (fill rings, map buffers) and schedule the first events.
    fn start(&mut self, host: &mut Host, now: Time);
    /// Handle one of this workload's events.
    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32);
    fn stats(&self) -> WorkloadStats;
    /// CPUs this workload runs on (CPU busy is reported over them).
    fn cpus(&self) -> Vec<usize>;
    /// The device-side rate limit the results are read against (the NIC's line rate, the drives' bandwidth).
    fn line_rate_gbps(&self) -> f64;
}
