//! `[workload.nic_tx]`: bulk TCP send through a multi-queue NIC (TSO skbs, page-frag mappings).

#[allow(unused_imports)]
use super::*;

/// A multi-queue NIC sending bulk TCP (iperf3 client): TSO skbs whose data sits in page frags, each frag
/// mapped per send and unmapped on TX completion; the peer's ACKs come back through a kept-mapped RX ring.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NicTx {
    /// The NIC's line rate.
    pub line_rate_gbps: f64,
    /// TX queues (XPS): queue q's completions, and the senders of its flows, run on CPU q.
    pub queues: u32,
    /// TCP flows, flow f on queue f % queues.
    pub flows: u32,
    /// Packet size on the wire.
    pub mtu: u32,
    /// The largest TSO skb (GSO_MAX_SIZE: 64 KiB without BIG TCP).
    #[serde(default = "default_gro_max")]
    pub tso_max_bytes: u32,
    /// TCP Small Queues: bytes a socket may have queued below TCP (qdisc, driver, NIC) before it waits for
    /// TX completions (net.ipv4.tcp_limit_output_bytes, 1 MiB since Linux 5.0).
    #[serde(default = "default_tsq_bytes")]
    pub tsq_bytes: u64,
    /// Size of the socket's page-frag chunks that hold the data (sk_page_frag: SKB_FRAG_PAGE_ORDER 3 = 32 KiB).
    #[serde(default = "default_frag_kb")]
    pub frag_kb: u32,
    /// The peer sends one ACK per this many bytes received (a Linux receiver ACKs about once per GRO skb).
    #[serde(default = "default_gro_max_u64")]
    pub peer_ack_bytes: u64,
    /// From a segment leaving the wire to the peer's ACK arriving, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
    /// RX pages the ACKs land in, one per ACK in turn; page_pool keeps them mapped.
    #[serde(default = "default_tx_rx_ring")]
    pub rx_ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// RX (ACK) completion-event moderation, as `workload.nic_rx`; TX completions use mlx5's defaults.
    #[serde(default = "default_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_irq_frames")]
    pub irq_frames: u32,
}
fn default_frag_kb() -> u32 {
    (crate::net::SKB_FRAG_PAGE_BYTES / 1024) as u32
}

impl NicTx {
    pub(super) fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        let nic = self;
        check_nic(
            "workload.nic_tx",
            nic.line_rate_gbps,
            nic.queues,
            cores,
            nic.napi_budget,
            nic.irq_usecs,
            nic.irq_frames,
        )?;
        check(
            (1..=65536).contains(&nic.flows),
            "workload.nic_tx.flows",
            "expected 1..=65536 flows",
        )?;
        check(
            (128..=65536).contains(&nic.mtu),
            "workload.nic_tx.mtu",
            "expected an MTU of 128..=65536 bytes",
        )?;
        check(
            nic.tso_max_bytes >= nic.mtu && nic.tso_max_bytes <= 512 * 1024,
            "workload.nic_tx.tso_max_bytes",
            "expected at least one MTU and at most 512 KiB",
        )?;
        check(
            nic.tsq_bytes >= 1 && nic.tsq_bytes <= 1 << 30,
            "workload.nic_tx.tsq_bytes",
            "expected 1 byte to 1 GiB",
        )?;
        check(
            nic.frag_kb.is_power_of_two() && (4..=1024).contains(&nic.frag_kb),
            "workload.nic_tx.frag_kb",
            "expected a power of two from 4 to 1024 KiB",
        )?;
        check(
            nic.peer_ack_bytes >= 1,
            "workload.nic_tx.peer_ack_bytes",
            "expected at least 1 byte",
        )?;
        check_rtt(nic.rtt_us, "workload.nic_tx.rtt_us")?;
        check(
            (1..=65536).contains(&nic.rx_ring_size),
            "workload.nic_tx.rx_ring_size",
            "expected 1..=65536 pages",
        )?;
        Ok(())
    }
}
