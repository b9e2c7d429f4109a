//! `[workload.l2fwd]`: a DPDK guest forwarding small frames through a vhost-user backend.

#[allow(unused_imports)]
use super::*;
use crate::net::ETH_PREAMBLE_GAP;

/// A DPDK guest (virtio PMD over vfio-pci, its hugepages mapped once through the vIOMMU) forwarding every
/// frame it receives back out of the same port (testpmd macswap, l2fwd on one port), its virtio-net device
/// a host backend with IOMMU support (DPDK vhost-user or vhost-net: device IOTLB, misses sent to QEMU). A generator
/// offers frames of `frame_bytes` at the host's NIC; the result is the forwarded packet rate (Mpps). Needs
/// a guest platform (a profile with `[hypervisor]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct L2fwd {
    /// The host NIC's line rate: the generator's and the forwarded frames' wire.
    pub line_rate_gbps: f64,
    /// The guest's virtio-net device: a DPDK vhost-user backend (a polling host core) or vhost-net (a
    /// host kernel thread, woken by the tap and the guest's kicks).
    #[serde(default)]
    pub backend: Backend,
    /// Ethernet frame size, FCS included (RFC 2544's 64 to 1518).
    #[serde(default = "default_frame_bytes")]
    pub frame_bytes: u64,
    /// Offered load; the line rate at `frame_bytes` when absent.
    #[serde(default)]
    pub offered_mpps: Option<f64>,
    /// Descriptors per virtqueue (QEMU's rx_queue_size / tx_queue_size: 256 by default, 1024 at most).
    #[serde(default = "default_l2fwd_queue_size")]
    pub queue_size: u32,
    /// Packets per burst on either side (testpmd's and l2fwd's MAX_PKT_BURST).
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// mbufs in the guest's pool (l2fwd's floor NB_MBUF 8192).
    #[serde(default = "default_mbufs")]
    pub mbufs: u32,
    /// The guest's hugepage size in KiB (2048 or 1048576; 4 for `--no-huge`): each is one VFIO_IOMMU_MAP_DMA,
    /// and the largest page the vIOMMU can map it with bounds the device IOTLB's entries.
    #[serde(default = "default_hugepage_kb")]
    pub hugepage_kb: u64,
}

/// Who serves the guest's virtqueues on the host.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema, Default)]
pub enum Backend {
    /// DPDK's vhost library (testpmd's net_vhost, OVS-DPDK) with IOMMU support (DPDK 17.11).
    #[default]
    #[serde(rename = "vhost-user")]
    VhostUser,
    /// The host kernel's vhost-net with its device IOTLB (Linux 4.8).
    #[serde(rename = "vhost")]
    Vhost,
}

/// The smallest Ethernet frame (RFC 2544's first size).
fn default_frame_bytes() -> u64 {
    64
}
/// QEMU hw/net/virtio-net.c VIRTIO_NET_RX_QUEUE_DEFAULT_SIZE.
fn default_l2fwd_queue_size() -> u32 {
    256
}
/// DPDK app/test-pmd/testpmd.h and examples/l2fwd/main.c MAX_PKT_BURST.
fn default_burst() -> u32 {
    32
}
/// DPDK examples/l2fwd/main.c: nb_mbufs = RTE_MAX(…, 8192U).
fn default_mbufs() -> u32 {
    8192
}
/// x86-64's and arm64's (4 KiB granule) default hugepage size.
fn default_hugepage_kb() -> u64 {
    2048
}

impl L2fwd {
    pub(super) fn validate(&self) -> Result<(), (Vec<String>, String)> {
        check(
            self.line_rate_gbps.is_finite()
                && (MIN_LINE_RATE_GBPS..=1e6).contains(&self.line_rate_gbps),
            "workload.l2fwd.line_rate_gbps",
            format!("expected {MIN_LINE_RATE_GBPS}..=1000000 Gbps"),
        )?;
        check(
            (64..=9018).contains(&self.frame_bytes),
            "workload.l2fwd.frame_bytes",
            "expected an Ethernet frame of 64..=9018 bytes",
        )?;
        check(
            self.offered_mpps
                .is_none_or(|m| m.is_finite() && m > 0.0 && m <= self.line_mpps() * 1.000_001),
            "workload.l2fwd.offered_mpps",
            format!(
                "expected more than 0 and at most the line rate's {:.3} Mpps",
                self.line_mpps()
            ),
        )?;
        check(
            self.queue_size.is_power_of_two() && (2..=1024).contains(&self.queue_size),
            "workload.l2fwd.queue_size",
            "expected a power of two from 2 to 1024 (a split virtqueue; QEMU's VIRTQUEUE_MAX_SIZE)",
        )?;
        check(
            (1..=512).contains(&self.burst),
            "workload.l2fwd.burst",
            "expected 1..=512 packets per burst",
        )?;
        check(
            self.mbufs >= 2 * self.queue_size + self.burst && self.mbufs <= 1 << 20,
            "workload.l2fwd.mbufs",
            format!(
                "expected enough for both rings and a burst ({}) and at most 1048576",
                2 * self.queue_size + self.burst
            ),
        )?;
        check(
            [4, 64, 2048, 32768, 524288, 1048576].contains(&self.hugepage_kb),
            "workload.l2fwd.hugepage_kb",
            "expected 4 (--no-huge), 64, 2048, 32768, 524288 or 1048576",
        )
    }

    /// Frames per second the line carries at `frame_bytes`, in millions (preamble, SFD and gap included).
    pub fn line_mpps(&self) -> f64 {
        self.line_rate_gbps * 1e3 / ((self.frame_bytes + ETH_PREAMBLE_GAP) * 8) as f64
    }

    /// What the generator offers, Mpps.
    pub fn offered(&self) -> f64 {
        self.offered_mpps.unwrap_or(self.line_mpps())
    }
}
