//! `[workload.virtio_net]`: a guest's virtio-net device, in QEMU or vhost.

#[allow(unused_imports)]
use super::*;

/// Which way a guest's TCP stream runs, from the guest's side.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// The guest receives (netperf TCP_MAERTS / iperf3 -R from the guest's view).
    Rx,
    /// The guest sends (netperf TCP_STREAM).
    Tx,
}

/// The benchmark the guest's application is, for what changes the mapping pattern: the size of each write
/// to the socket (direction tx). The receiving side reads whatever has arrived.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Tool {
    /// netperf TCP_STREAM: sends of the socket's initial send buffer, 16 KiB (`tcp_wmem[1]`).
    #[default]
    Netperf,
    /// iperf3: sends of its TCP block size, 128 KiB (DEFAULT_TCP_BLKSIZE).
    Iperf3,
}

impl Tool {
    /// Bytes per send() (netperf's "Send Message Size" defaults to SO_SNDBUF at start, 16384 with
    /// Linux's `tcp_wmem[1]`; iperf3 src/iperf.h DEFAULT_TCP_BLKSIZE 128 KiB).
    pub fn message_bytes(self) -> u64 {
        match self {
            Tool::Netperf => 16384,
            Tool::Iperf3 => 128 << 10,
        }
    }
}

/// A guest's virtio-net device (virtio-net-pci with VIRTIO_F_ACCESS_PLATFORM, so its buffers go through
/// the guest's DMA API and the vIOMMU) carrying one bulk TCP stream to or from a peer host. The device is
/// the VMM's (QEMU's virtio-net, vhost = false) or the host kernel's (vhost-net, vhost = true). Needs a
/// guest platform (a profile with `[hypervisor]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VirtioNet {
    /// The peer's link (the host's NIC).
    pub line_rate_gbps: f64,
    pub direction: Direction,
    /// vhost-net does the device's work in a host kernel thread, translating through its own device
    /// IOTLB; without it QEMU's virtio-net does, translating through the vIOMMU's emulated translation.
    #[serde(default)]
    pub vhost: bool,
    /// Descriptors per virtqueue (QEMU's rx_queue_size / tx_queue_size default: 256).
    #[serde(default = "default_virtqueue_size")]
    pub queue_size: u32,
    /// TSO/GRO size: the guest's largest TSO skb, and the host's GRO'd skbs handed to the tap.
    #[serde(default = "default_gro_max")]
    pub gso_max_bytes: u32,
    /// The guest's MTU.
    pub mtu: u32,
    /// The application (direction tx): its writes' size unless `message_bytes` sets it.
    #[serde(default)]
    pub tool: Tool,
    /// Bytes per send() on the guest's socket (direction tx); `tool`'s default when absent.
    #[serde(default)]
    pub message_bytes: Option<u64>,
    /// TCP segmentation offload negotiated with the device (VIRTIO_NET_F_HOST_TSO4, `ethtool -K tso`): off,
    /// the guest segments each GSO skb itself (validate_xmit_skb → skb_gso_segment) and the driver maps
    /// every MSS segment on its own.
    #[serde(default = "default_true")]
    pub tso: bool,
    /// Checksum offload offered by the device (VIRTIO_NET_F_CSUM). QEMU clears it, with every other offload,
    /// when its network backend has no virtio-net header (`-netdev user`, slirp: virtio_net_get_features,
    /// peer_has_vnet_hdr). Off, the guest's device lacks NETIF_F_SG and NETIF_F_HW_CSUM: TCP still builds
    /// its skbs in page frags (sk_setup_caps gives a GSO socket SG), but validate_xmit_skb() segments,
    /// linearizes and checksums each frame in software, so a frame is one mapping (the virtio-net header
    /// pushed before it), and there is no TSO (virtnet_probe offers it only with CSUM).
    #[serde(default = "default_true")]
    pub csum: bool,
    /// Mergeable RX buffers (VIRTIO_NET_F_MRG_RXBUF, QEMU's mrg_rxbuf=on by default): page-sized
    /// buffers, one mapping each. Off, the guest (with its GSO offloads on) posts big-packets buffers
    /// (add_recvbuf_big): 18 pages in 19 scatterlist entries, each mapped, and their indirect table.
    #[serde(default = "default_true")]
    pub mergeable: bool,
    /// virtio-net's `napi_tx` module parameter (virtio_net.napi_tx=): TX completions reaped by a NAPI of
    /// their own on a TX interrupt, the skbs holding their socket's memory until then. Off, start_xmit
    /// orphans each skb (skb_orphan), so TCP Small Queues and autocorking never hold a write back and each
    /// write leaves as skbs of its own; used skbs are reaped by the next start_xmit, with no TX interrupt
    /// unless the ring is nearly full. Default: the guest kernel's (on from 5.3,
    /// `KernelVersion::virtio_net_napi_tx`).
    #[serde(default)]
    pub napi_tx: Option<bool>,
    /// TCP Small Queues budget of the guest's sending socket (direction tx), as `workload.nic_tx` (binds only
    /// with `napi_tx`).
    #[serde(default = "default_tsq_bytes")]
    pub tsq_bytes: u64,
    /// The receiver ACKs once per this many bytes (about once per GRO skb).
    #[serde(default = "default_gro_max_u64")]
    pub ack_bytes: u64,
    /// From the guest's data leaving the host's NIC to the peer's ACK arriving, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
}
/// QEMU hw/net/virtio-net.c VIRTIO_NET_RX_QUEUE_DEFAULT_SIZE / VIRTIO_NET_TX_QUEUE_DEFAULT_SIZE.
fn default_virtqueue_size() -> u32 {
    256
}

impl VirtioNet {
    pub(super) fn validate(&self) -> Result<(), (Vec<String>, String)> {
        check(
            self.line_rate_gbps.is_finite()
                && (MIN_LINE_RATE_GBPS..=1e6).contains(&self.line_rate_gbps),
            "workload.virtio_net.line_rate_gbps",
            format!("expected {MIN_LINE_RATE_GBPS}..=1000000 Gbps"),
        )?;
        check(
            self.queue_size.is_power_of_two() && (2..=1024).contains(&self.queue_size),
            "workload.virtio_net.queue_size",
            "expected a power of two from 2 to 1024 (a split virtqueue; QEMU's VIRTQUEUE_MAX_SIZE)",
        )?;
        check(
            (68..=65535).contains(&self.mtu),
            "workload.virtio_net.mtu",
            "expected an MTU of 68..=65535 bytes",
        )?;
        check(
            self.gso_max_bytes >= self.mtu && self.gso_max_bytes <= 65536,
            "workload.virtio_net.gso_max_bytes",
            "expected at least one MTU and at most 65536 (GSO_MAX_SIZE)",
        )?;
        check(
            self.tsq_bytes >= self.gso_max_bytes as u64 && self.tsq_bytes <= 1 << 30,
            "workload.virtio_net.tsq_bytes",
            "expected at least gso_max_bytes and at most 1 GiB",
        )?;
        check(
            self.csum || !self.tso,
            "workload.virtio_net.tso",
            "expected false with csum = false (virtio-net offers TSO only with VIRTIO_NET_F_CSUM)",
        )?;
        check(
            self.ack_bytes >= 1,
            "workload.virtio_net.ack_bytes",
            "expected at least 1 byte",
        )?;
        check(
            self.message_bytes
                .is_none_or(|m| (1..=1 << 30).contains(&m)),
            "workload.virtio_net.message_bytes",
            "expected 1 byte to 1 GiB per send",
        )?;
        check_rtt(self.rtt_us, "workload.virtio_net.rtt_us")
    }

    /// Bytes per send() of the guest's application.
    pub fn send_bytes(&self) -> u64 {
        self.message_bytes.unwrap_or(self.tool.message_bytes())
    }
}
