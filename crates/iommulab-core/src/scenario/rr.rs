//! `[workload.rr]`: request/response at a fixed rate.

#[allow(unused_imports)]
use super::*;

/// Request/response over TCP (memcached- or HTTP-like): small requests in, a server thread per queue sends
/// each response (mapped per send, unmapped on TX completion); closed loop or a fixed rate as wrk2.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rr {
    /// The NIC's line rate.
    pub line_rate_gbps: f64,
    /// NIC queues; queue q's NAPI and server thread run on CPU q.
    pub queues: u32,
    /// Client connections; connection c is steered to queue c % queues.
    pub connections: u32,
    /// Packet size on the wire.
    #[serde(default = "default_rr_mtu")]
    pub mtu: u32,
    /// Request payload (one segment).
    #[serde(default = "default_request_bytes")]
    pub request_bytes: u32,
    /// Response payload: one segment (head and frag mapped) or a TSO skb (frags mapped).
    #[serde(default = "default_response_bytes")]
    pub response_bytes: u32,
    /// Requests per second over all connections, due at a constant rate (wrk2 -R); latency counts from when
    /// each was due. 0: closed loop, each connection sends its next request when its response arrives.
    #[serde(default)]
    pub rate_rps: f64,
    /// The server application's own CPU per request besides the network stack and the send (parse, look
    /// up, build), ns: part of the workload, as fio's think time is.
    pub service_ns: u64,
    /// Client-to-server round trip outside the host (wire, switch, the client's stack), µs.
    #[serde(default = "default_rtt_us")]
    pub rtt_us: f64,
    /// Kept-mapped RX pages the requests land in, one per request in turn.
    #[serde(default = "default_tx_rx_ring")]
    pub rx_ring_size: u32,
    /// NAPI weight: packets per poll before it yields (NAPI_POLL_WEIGHT, 64).
    #[serde(default = "default_budget")]
    pub napi_budget: u32,
    /// RX completion-event moderation (CQE period mode). Default: mlx5's static 3 µs / 32 packets (en.h
    /// MLX5E_PARAMS_DEFAULT_RX_CQ_MODERATION_USEC_FROM_CQE, _PKTS), DIM off as latency-tuned servers run.
    #[serde(default = "default_rr_irq_usecs")]
    pub irq_usecs: u32,
    /// Completions pending that fire the RX interrupt at once.
    #[serde(default = "default_rr_irq_frames")]
    pub irq_frames: u32,
}
fn default_rr_mtu() -> u32 {
    1500
}
fn default_request_bytes() -> u32 {
    128
}
fn default_response_bytes() -> u32 {
    1024
}
fn default_rr_irq_usecs() -> u32 {
    3
}
fn default_rr_irq_frames() -> u32 {
    32
}

impl Rr {
    pub(super) fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        check_nic(
            "workload.rr",
            self.line_rate_gbps,
            self.queues,
            cores,
            self.napi_budget,
            self.irq_usecs,
            self.irq_frames,
        )?;
        check(
            (1..=1 << 20).contains(&self.connections),
            "workload.rr.connections",
            "expected 1..=1048576 connections",
        )?;
        check(
            (128..=65536).contains(&self.mtu),
            "workload.rr.mtu",
            "expected an MTU of 128..=65536 bytes",
        )?;
        check(
            self.request_bytes >= 1 && self.request_bytes as u64 <= crate::net::mss(self.mtu),
            "workload.rr.request_bytes",
            "expected 1 byte up to one segment (the MTU less 52 bytes of headers)",
        )?;
        check(
            (1..=16 << 20).contains(&self.response_bytes),
            "workload.rr.response_bytes",
            "expected 1 byte to 16 MiB",
        )?;
        check(
            self.rate_rps >= 0.0 && self.rate_rps <= 1e9,
            "workload.rr.rate_rps",
            "expected 0 (closed loop) or a rate up to 1e9 requests per second",
        )?;
        check(
            self.service_ns <= 1_000_000_000,
            "workload.rr.service_ns",
            "expected 0..=1e9 ns",
        )?;
        check_rtt(self.rtt_us, "workload.rr.rtt_us")?;
        check(
            (1..=65536).contains(&self.rx_ring_size),
            "workload.rr.rx_ring_size",
            "expected 1..=65536 pages",
        )?;
        Ok(())
    }
}
