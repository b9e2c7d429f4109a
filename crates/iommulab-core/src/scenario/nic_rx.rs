//! `[workload.nic_rx]`: a multi-queue NIC receiving bulk TCP.

#[allow(unused_imports)]
use super::*;

/// A multi-queue NIC receiving bulk TCP (iperf3-like) into page_pool-backed rings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NicRx {
    /// The NIC's line rate (the senders' aggregate).
    pub line_rate_gbps: f64,
    /// RSS queues; queue q's interrupt and NAPI run on CPU q.
    pub queues: u32,
    /// Channels the driver opens (`ethtool -L combined`); omitted: one per queue. Those past `queues`
    /// carry no flows, but their rings are allocated and filled when the interface comes up, taking IOVAs
    /// between the busy queues' (mlx5's default is one channel per CPU: en_main.c mlx5e_build_nic_params).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels: Option<u32>,
    /// How the rings are filled when the interface comes up; omitted: `napi` with `rq = "mlx5_striding"`,
    /// else `in_turn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_fill: Option<RingFill>,
    /// TCP flows, hashed onto queues by RSS (collisions happen, as on real NICs).
    pub flows: u32,
    /// Packet size on the wire; one RX buffer of 4 KiB pages per packet.
    pub mtu: u32,
    /// RX descriptors per queue.
    pub ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// Keep pages mapped in a page_pool and recycle them (false: map on refill, unmap on every packet).
    #[serde(default = "default_true")]
    pub page_pool: bool,
    /// page_pool ptr_ring size.
    #[serde(default = "default_pool_size")]
    pub pool_size: u32,
    /// The reader copies this much per recvmsg() (iperf3's default read length is 128 KiB).
    #[serde(default = "default_read_bytes")]
    pub read_bytes: u32,
    /// The most window a flow's socket offers: tcp_win_from_space(sk_rcvbuf), half of the buffer before Linux
    /// 6.6 (tcp_adv_win_scale = 1), so half of `tcp_rmem[2]`; from 6.6 the buffer scaled by the measured
    /// payload/truesize. The socket holds up to the whole buffer in skb truesize (tcp_space()), so before 6.6
    /// the payload it holds depends on the RX layout (`nic_rx::tcp`).
    #[serde(default = "default_rcvbuf")]
    pub rcvbuf_bytes: u64,
    /// RX queue layout: `cyclic` (one page per descriptor, ring_size pages) or `mlx5_striding` (mlx5
    /// multi-packet WQEs of 64 pages, frames packed on stride boundaries; ring_size counts frames as
    /// `ethtool -G rx` does).
    #[serde(default)]
    pub rq: RqKind,
    /// Pages of the driver's own RX page cache in front of page_pool, which then does no DMA mapping
    /// (mlx5 in Linux 6.0: MLX5E_CACHE_SIZE = 256). 0: none (page_pool keeps pages mapped).
    #[serde(default)]
    pub driver_page_cache: u32,
    /// TCP ACKs go back out through the NIC (each mapped when sent and unmapped on TX completion).
    #[serde(default = "default_true")]
    pub acks: bool,
    /// GRO's largest merged skb (GRO_MAX_SIZE: 64 KiB without BIG TCP).
    #[serde(default = "default_gro_max")]
    pub gro_max_bytes: u32,
    /// RX completion-event moderation (CQE period mode): the interrupt fires this long after the latest
    /// completion, or at `irq_frames` pending. Used when `dim` is false, with TX completions at mlx5's static
    /// 16 µs / 32 (EQE mode). Default: DIM's top CQE-mode RX profile, 64 µs / 64 packets (lib/dim/net_dim.c
    /// rx_profile), a stand-in for DIM settled under a bulk stream. mlx5 with DIM off
    /// (`ethtool -C adaptive-rx off`): 3 µs / 32 (en.h MLX5E_PARAMS_DEFAULT_RX_CQ_MODERATION_USEC_FROM_CQE,
    /// _PKTS).
    #[serde(default = "default_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_irq_frames")]
    pub irq_frames: u32,
    /// DIM's adaptation (lib/dim/net_dim.c) tunes the RX and TX completion queues' moderation, as mlx5 does
    /// by default (en_main.c mlx5e_build_nic_params sets rx_dim_enabled and tx_dim_enabled); false: the
    /// static moderation above.
    #[serde(default = "default_true")]
    pub dim: bool,
    /// Where each flow's reader runs: on its queue's CPU (aRFS steers the flow to the reader's CPU), or on
    /// a CPU of its own past the queues' (IRQs and applications kept apart; RSS hashes the flow).
    #[serde(default)]
    pub readers: Readers,
    /// The peers' senders: `window` sends whenever the receive window allows, hears each ACK at once and
    /// resends a dropped segment at once without backing off; `dctcp` keeps a congestion window (DCTCP
    /// without ECN marks: slow start, additive increase, halving on loss), hears ACKs and losses `rtt_us`
    /// late, and segments arriving before a loss's retransmission wait in the out-of-order queue.
    #[serde(default)]
    pub sender: SenderModel,
    /// The round trip outside the receiving host (wire, switch, the senders' stack and NIC): with
    /// `sender = "dctcp"`, ACKs and losses reach the senders this long after the receiver's device sent or
    /// dropped them, µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SenderModel {
    #[default]
    Window,
    Dctcp,
}
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Readers {
    #[default]
    Queue,
    Own,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RqKind {
    #[default]
    Cyclic,
    Mlx5Striding,
}
/// How a NIC fills its RX rings when the interface comes up.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RingFill {
    /// Every channel's NAPI posts its own ring, all at once, each on its CPU (mlx5e_activate_channels
    /// triggering each NAPI): the channels' dma_map calls take IOVAs in turn, so their rings interleave.
    Napi,
    /// The bring-up refills the rings one after another (ENA: ena_up_complete, ena_refill_all_rx_bufs).
    InTurn,
}

impl NicRx {
    /// The ring fill in force (`ring_fill`, or the driver's own).
    pub fn ring_fill(&self) -> RingFill {
        self.ring_fill.unwrap_or(match self.rq {
            RqKind::Mlx5Striding => RingFill::Napi,
            RqKind::Cyclic => RingFill::InTurn,
        })
    }
}

/// mlx5's upper bound on channels (en.h MLX5E_MAX_NUM_CHANNELS, 6.12).
pub const MAX_CHANNELS: u32 = 256;
fn default_pool_size() -> u32 {
    1024
}
fn default_read_bytes() -> u32 {
    128 * 1024
}
fn default_rcvbuf() -> u64 {
    6 * 1024 * 1024
}

impl NicRx {
    pub(super) fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        let nic = self;
        check_nic(
            "workload.nic_rx",
            nic.line_rate_gbps,
            nic.queues,
            cores,
            nic.napi_budget,
            nic.irq_usecs,
            nic.irq_frames,
        )?;
        check(
            nic.channels
                .is_none_or(|c| (nic.queues..=MAX_CHANNELS).contains(&c)),
            "workload.nic_rx.channels",
            format!(
                "expected {}..={MAX_CHANNELS} channels (at least one per queue)",
                nic.queues
            ),
        )?;
        check(
            (1..=65536).contains(&nic.flows),
            "workload.nic_rx.flows",
            "expected 1..=65536 flows",
        )?;
        check(
            (64..=65536).contains(&nic.mtu),
            "workload.nic_rx.mtu",
            "expected an MTU of 64..=65536 bytes",
        )?;
        // Drivers size rings in powers of two: mlx5e_ethtool_set_ringparam() takes order_base_2 of the
        // request, ENA's ena_set_ringparam() rounds down to a power of two.
        check(
            (2..=65536).contains(&nic.ring_size) && nic.ring_size.is_power_of_two(),
            "workload.nic_rx.ring_size",
            "expected a power of two from 2 to 65536 descriptors (drivers size rings in powers of two)",
        )?;
        check(
            (1..=PP_MAX_POOL_SIZE).contains(&nic.pool_size),
            "workload.nic_rx.pool_size",
            format!("expected 1..={PP_MAX_POOL_SIZE} (page_pool's ptr_ring limit)"),
        )?;
        check(
            nic.read_bytes >= 1,
            "workload.nic_rx.read_bytes",
            "expected at least 1 byte",
        )?;
        check(
            nic.driver_page_cache == 0
                || (nic.page_pool
                    && nic.driver_page_cache.is_power_of_two()
                    && (2..=65536).contains(&nic.driver_page_cache)),
            "workload.nic_rx.driver_page_cache",
            "expected 0, or a power of two in 2..=65536 with page_pool = true",
        )?;
        check(
            nic.gro_max_bytes >= nic.mtu,
            "workload.nic_rx.gro_max_bytes",
            "expected at least one MTU",
        )?;
        check(
            nic.rcvbuf_bytes >= nic.mtu as u64,
            "workload.nic_rx.rcvbuf_bytes",
            "expected at least one MTU",
        )?;
        check_rtt(nic.rtt_us, "workload.nic_rx.rtt_us")?;
        check(
            nic.readers == Readers::Queue || cores > nic.queues,
            "workload.nic_rx.readers",
            format!(
                "expected \"queue\", or \"own\" with more cores than queues ({cores} cores, {} queues)",
                nic.queues
            ),
        )?;
        Ok(())
    }
}
