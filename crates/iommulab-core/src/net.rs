//! Ethernet, IP and TCP sizes shared by the network workloads and the scenario schema (below both).

/// include/uapi/linux/if_ether.h ETH_HLEN: the Ethernet header the NIC writes before the IP packet.
pub const ETH_HLEN: u64 = 14;
/// IEEE 802.3 per-frame wire overhead: preamble 7 + SFD 1 + header 14 + FCS 4 + inter-frame gap 12 bytes.
pub const ETH_WIRE_OVERHEAD: u64 = 38;
/// IEEE 802.3: preamble 7 + SFD 1 + inter-frame gap 12 bytes around every frame (FCS counted in the frame).
pub const ETH_PREAMBLE_GAP: u64 = 20;
/// IPv4 (20) + TCP (20) + TCP timestamp option (12) header bytes per packet.
pub const TCPIP_HLEN: u64 = 52;
/// A pure ACK frame: Ethernet + IPv4 + TCP with timestamps.
pub const ACK_FRAME: u64 = ETH_HLEN + TCPIP_HLEN;

/// TCP payload per packet at `mtu` (the MSS with timestamps).
pub fn mss(mtu: u32) -> u64 {
    mtu as u64 - TCPIP_HLEN.min(mtu as u64 - 1)
}

/// Picoseconds one frame of `mtu` occupies the wire at `gbps`, overheads included.
pub fn frame_wire_ps(mtu: u32, gbps: f64) -> u64 {
    let bits = (mtu as u64 + ETH_WIRE_OVERHEAD) * 8;
    ((bits as f64 * 1000.0) / gbps).round().max(1.0) as u64
}

/// A NIC port's transmit side: an skb's segments leave back to back at the line rate once the port is free,
/// and the last cannot leave before the skb's data has been read from memory.
pub struct Port {
    free: u64,
    gbps: f64,
    /// Time the port has carried frames (ns).
    pub busy_ns: u64,
}

impl Port {
    pub fn new(gbps: f64) -> Self {
        Port {
            free: 0,
            gbps,
            busy_ns: 0,
        }
    }

    /// An skb of `payload` bytes in `segs` TCP segments, posted at `t`, its data read by `read`: when its
    /// last frame has left the port (ns).
    pub fn send(&mut self, t: u64, payload: u64, segs: u64, read: u64) -> u64 {
        let segs = segs.max(1);
        let bytes = payload + segs * (ETH_WIRE_OVERHEAD + TCPIP_HLEN);
        let ns = (bytes as f64 * 8.0 / self.gbps).ceil() as u64;
        self.busy_ns += ns;
        let end = (self.free.max(t) + ns).max(read + ns / segs);
        self.free = end;
        end
    }
}

/// sk_page_frag()'s chunks: SKB_FRAG_PAGE_ORDER 3, 32 KiB (include/net/sock.h, net/core/sock.c
/// skb_page_frag_refill).
pub const SKB_FRAG_PAGE_BYTES: u64 = 32 * 1024;
