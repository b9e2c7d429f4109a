//! A DPDK guest forwarding small frames (testpmd macswap, l2fwd on one port) through a host backend: PVP, a
//! generator's frames entering the host, put by the backend into the guest's RX virtqueue, sent back by
//! the guest through its TX virtqueue, taken by the backend and out of the host's NIC.
//!
//! The guest maps its memory once: DPDK's EAL maps its hugepages through VFIO (IOVA-as-VA: one
//! IOVA-contiguous range), the guest kernel puts them in the vIOMMU's table with the largest pages the
//! vIOMMU takes (QEMU's VT-d and SMMUv3 map 2 MiB and 1 GiB leaves; virtio-iommu's translations are
//! answered at its smallest page), and nothing is unmapped while it runs. The mbufs live in that memory
//! and are recycled through the pool's per-lcore cache (last freed, first allocated). The virtio PMD
//! polls and asks for no interrupts (VRING_AVAIL_F_NO_INTERRUPT).
//!
//! The backend (`backend`) is either
//! - a DPDK vhost-user backend, one polling host core: per loop a burst from the NIC enqueued to the guest
//!   (rte_vhost_enqueue_burst: a frame that finds no posted RX buffer is dropped) and a burst dequeued
//!   from it (rte_vhost_dequeue_burst). It asks for no kicks (rte_vhost_enable_guest_notification(…, 0)).
//!   Its device IOTLB (lib/vhost/iotlb.c) is a list in IOVA order, walked on every lookup; it translates
//!   the rings once and keeps them (vring_translate);
//! - vhost-net, a host kernel thread woken by the tap's frames and by the guest's kicks (when it has
//!   nothing to do it turns the guest's notifications back on: vhost_enable_notify), handling each frame
//!   through the tap socket (handle_rx, handle_tx). Its device IOTLB is an interval tree; it keeps the
//!   rings' translations only with `kvm.vhost_meta_cache` (vhost_vq_meta_prefetch), else every ring access
//!   is a lookup (the ring steps as `vring` counts them).
//!
//! With VIRTIO_F_IOMMU_PLATFORM each buffer address is a guest IOVA, looked up in the backend's device
//! IOTLB (the platform's ATC stands for it, `Host` builds it from `[kvm]`); a miss is a message to QEMU,
//! which translates under the BQL and sends the update (vhost_device_iotlb_miss), and the backend's burst
//! stops there until it comes.
//!
//! Simplifications: the host NIC's own DMA, its driver and (with vhost-net) the bridge and tap are not
//! modelled: frames arrive in front of the backend at a constant rate into a queue of NIC_RX_DESC and
//! leave at the line rate; a polling core's busy share is its work (polling an empty ring is free); a
//! buffer's translation is looked up once per 4 KiB page it spans, whatever the IOTLB entry's size;
//! after a miss the backend waits for the update (DPDK polls on, finding the same descriptor
//! unresolved; vhost-net's worker sleeps); vhost-net's ring steps are QEMU's split-ring sequence with
//! event indices, which the virtio PMD does not negotiate.

use super::vring::Vring;
use super::{event, Workload, WorkloadStats};
use crate::host::Host;
use crate::hw::emul::ExitCause;
use crate::hw::{pages_spanned, PAGE_SIZE as PAGE};
use crate::net::ETH_PREAMBLE_GAP;
use crate::scenario::{Backend, KvmProfile, L2fwd};
use crate::sim::{Ctx, Time};
use std::collections::VecDeque;

/// struct virtio_net_hdr_mrg_rxbuf: the device writes it before each received frame and reads it before
/// each sent one (in the mbuf's headroom).
const VNET_HDR_BYTES: u64 = 12;
/// A mempool element of the default pktmbuf pool (rte_mempool_calc_obj_size): the object header (one cache
/// line), struct rte_mbuf (two) and RTE_MBUF_DEFAULT_BUF_SIZE (2048 + RTE_PKTMBUF_HEADROOM 128).
const MBUF_ELT_BYTES: u64 = 64 + 128 + 2048 + 128;
/// Where a frame's virtio-net header starts in its element: after the object header, the mbuf and the
/// headroom, less the header itself (virtio_rxq/xmit put it at data_off - hdr_size).
const MBUF_HDR_OFF: u64 = 64 + 128 + 128 - VNET_HDR_BYTES;
/// The queue in front of the backend: the host NIC's receive ring a vhost-user backend's core polls (DPDK
/// examples/l2fwd/main.c RTE_TEST_RX_DESC_DEFAULT), about a tap's (txqueuelen 1000) for vhost-net.
const NIC_RX_DESC: u64 = 1024;

/// IOTLB entries an L1 data cache of 32 KiB holds (struct vhost_iotlb_entry with its list link is one 64-byte
/// line; Haswell to Cascade Lake and ThunderX have 32 KiB L1D): the list's entries past them come from L2.
const L1D_IOTLB_ENTRIES: u64 = 32 * 1024 / 64;

const EV_BACKEND: u16 = 0;
const EV_GUEST: u16 = 1;

pub struct L2fwdWorkload {
    cfg: L2fwd,
    /// The host's costs (the backend's per packet, its IOTLB lookups and misses).
    h: KvmProfile,
    /// The guest's forwarding lcore.
    fwd_cpu: usize,
    /// Each mbuf's DMA address, bytes (where its virtio-net header goes).
    mbuf_dma: Vec<u64>,
    /// The pool's free mbufs, last freed on top (the per-lcore cache).
    pool: Vec<u32>,
    /// Posted in the RX virtqueue; filled by the backend, not yet taken by the guest.
    rx_avail: VecDeque<u32>,
    rx_used: VecDeque<u32>,
    /// Added to the TX virtqueue; sent by the backend, not yet reclaimed by the guest.
    tx_avail: VecDeque<u32>,
    tx_used: VecDeque<u32>,
    /// When traffic began (the generator's first frame), and the frames the queue in front of the
    /// backend has handed it or dropped since.
    start: Time,
    taken: u64,
    nic_dropped: u64,
    /// The backend: busy until; its next loop pending (when, and which scheduling: an earlier wake-up
    /// supersedes a later one); asleep with the guest's notifications on (vhost-net).
    backend_free: Time,
    backend_scheduled: bool,
    backend_at: Time,
    backend_gen: u32,
    asleep: bool,
    /// The guest's lcore has a loop pending.
    guest_scheduled: bool,
    /// vhost-net went to sleep with frames queued and no RX buffer: it waits for the guest's kick.
    rx_starved: bool,
    /// The virtqueues as the backend steps through them, and where their rings are mapped (DMA pfn).
    rxq: Vring,
    txq: Vring,
    rx_ring: u64,
    tx_ring: u64,
    /// The forwarded frames' wire, free from.
    wire_free: Time,
    /// The emulated IOMMU keeps an IOTLB (its hits and misses are counted).
    emul_iotlb: bool,
    stats: WorkloadStats,
}

impl L2fwdWorkload {
    pub fn new(cfg: &L2fwd, h: &KvmProfile, vcpus: usize) -> Self {
        L2fwdWorkload {
            cfg: cfg.clone(),
            h: h.clone(),
            fwd_cpu: if vcpus > 1 { 1 } else { 0 },
            mbuf_dma: Vec::new(),
            pool: Vec::new(),
            rx_avail: VecDeque::new(),
            rx_used: VecDeque::new(),
            tx_avail: VecDeque::new(),
            tx_used: VecDeque::new(),
            start: 0,
            taken: 0,
            nic_dropped: 0,
            backend_free: 0,
            backend_scheduled: false,
            backend_at: 0,
            backend_gen: 0,
            asleep: false,
            guest_scheduled: false,
            rx_starved: false,
            rxq: Vring::new(cfg.queue_size),
            txq: Vring::new(cfg.queue_size),
            rx_ring: 0,
            tx_ring: 0,
            wire_free: 0,
            emul_iotlb: false,
            stats: WorkloadStats::default(),
        }
    }

    /// ns between the generator's frames.
    fn gap_ns(&self) -> f64 {
        1e3 / self.cfg.offered()
    }

    /// Frames the generator has sent by `t`.
    fn arrived(&self, t: Time) -> u64 {
        if t < self.start {
            return 0;
        }
        ((t - self.start) as f64 / self.gap_ns()) as u64 + 1
    }

    /// When frame `n` (from 0) reaches the NIC.
    fn arrival(&self, n: u64) -> Time {
        self.start + (n as f64 * self.gap_ns()).ceil() as Time
    }

    /// Frames waiting in the NIC's ring at `t`; what overflowed it since the last look is dropped.
    fn nic_backlog(&mut self, t: Time) -> u64 {
        let waiting = self.arrived(t) - self.taken - self.nic_dropped;
        if waiting > NIC_RX_DESC {
            self.nic_dropped += waiting - NIC_RX_DESC;
            self.stats.drops_device += waiting - NIC_RX_DESC;
        }
        waiting.min(NIC_RX_DESC)
    }

    /// ns the wire takes for one frame.
    fn frame_wire_ns(&self) -> f64 {
        ((self.cfg.frame_bytes + ETH_PREAMBLE_GAP) * 8) as f64 / self.cfg.line_rate_gbps
    }

    /// The backend's lookup of one guest page in its device IOTLB: when it may go on, or on a miss when
    /// QEMU's update arrives.
    fn lookup(&mut self, host: &mut Host, t: Time, pfn: u64) -> Result<Time, Time> {
        let Some(tr) = host.sw_translate(t, pfn) else {
            // No vIOMMU: the backend reaches guest memory through its own mapping of it.
            return Ok(t);
        };
        let h = &self.h;
        let t = t + match self.cfg.backend {
            Backend::Vhost => h.vhost_iotlb_lookup_ns,
            Backend::VhostUser => {
                // vhost_user_iotlb_cache_find walks the entries in IOVA order up to the one it wants:
                // half of them, for buffers spread over the pool; each step a dependent load, from L1
                // for the entries L1 holds and from L2 past them.
                let walked = host.sw_iotlb_len() as u64 / 2;
                let hot = walked.min(L1D_IOTLB_ENTRIES);
                let cold = walked - hot;
                let walk = hot as f64 * h.vhost_user_iotlb_entry_l1_ns
                    + (cold * h.vhost_user_iotlb_entry_ns) as f64;
                h.vhost_user_iotlb_lookup_ns + walk.round() as u64
            }
        };
        if tr.fault() {
            self.stats.dma_faults += 1;
        }
        if !tr.ats_request {
            return Ok(t);
        }
        // QEMU's translation of the miss, through its own IOTLB where the emulated IOMMU keeps one.
        self.stats
            .exits
            .work
            .translated(self.emul_iotlb, tr.iotlb_hit);
        let (back, wait) = host.vhost_iotlb_miss(t, &tr);
        self.stats.exits.bql_wait_ns += wait;
        Err(back)
    }

    /// The backend's access to mbuf `m` (header and frame): each page it spans looked up.
    fn translate(&mut self, host: &mut Host, t: Time, m: u32) -> Result<Time, Time> {
        let at = self.mbuf_dma[m as usize];
        let len = VNET_HDR_BYTES + self.cfg.frame_bytes;
        (0..pages_spanned(at % PAGE, len)).try_fold(t, |t, p| self.lookup(host, t, at / PAGE + p))
    }

    /// vhost-net's accesses to a virtqueue's ring since the last: each a lookup without its ring cache.
    fn ring_accesses(&mut self, host: &mut Host, t: Time, tx: bool) -> Result<Time, Time> {
        let (pages, base) = if tx {
            (self.txq.take(), self.tx_ring)
        } else {
            (self.rxq.take(), self.rx_ring)
        };
        if self.cfg.backend == Backend::VhostUser || self.h.vhost_meta_cache {
            return Ok(t);
        }
        pages
            .into_iter()
            .try_fold(t, |t, p| self.lookup(host, t, base + p))
    }

    /// One packet through the backend: its ring steps and its buffer. Ok: done at; Err: stalled until.
    fn backend_packet(&mut self, host: &mut Host, t: Time, m: u32, tx: bool) -> Result<Time, Time> {
        let per_pkt = match self.cfg.backend {
            Backend::VhostUser => self.h.vhost_user_packet_ns,
            Backend::Vhost => self.h.vhost_packet_ns,
        };
        let q = if tx { &mut self.txq } else { &mut self.rxq };
        q.pop();
        q.fill();
        let t = self.ring_accesses(host, t + per_pkt, tx)?;
        let t = self.translate(host, t, m)?;
        let bytes = VNET_HDR_BYTES + self.cfg.frame_bytes;
        Ok(t + (bytes as f64 * host.platform.cpu.copy_ns_per_byte).round() as u64)
    }

    /// Up to `max` frames through the backend from a virtqueue's posted buffers to its used ones (the TX
    /// side's out to the wire): how many, when it is done, and when a miss lets it go on.
    fn backend_burst(
        &mut self,
        host: &mut Host,
        mut t: Time,
        tx: bool,
        max: u64,
    ) -> (u64, Time, Option<Time>) {
        let mut done = 0;
        while done < max {
            let avail = if tx { &self.tx_avail } else { &self.rx_avail };
            let Some(&m) = avail.front() else {
                break;
            };
            match self.backend_packet(host, t, m, tx) {
                Ok(t2) => t = t2,
                Err(ready) => return (done, t, Some(ready)),
            }
            done += 1;
            if !tx {
                self.rx_avail.pop_front();
                self.rx_used.push_back(m);
                self.stats.bytes_received += self.cfg.frame_bytes;
                self.stats.dma_pages += 1;
                continue;
            }
            self.tx_avail.pop_front();
            self.tx_used.push_back(m);
            let start = self.wire_free.max(t);
            self.wire_free = (start as f64 + self.frame_wire_ns()).ceil() as Time;
            self.stats.wire_ns += self.wire_free - start;
            self.stats.packets_delivered += 1;
            self.stats.bytes_delivered += self.cfg.frame_bytes;
            self.stats.tx_packets += 1;
        }
        (done, t, None)
    }

    /// One loop of the backend: a burst from the host into the guest, a burst from the guest out.
    fn backend(&mut self, host: &mut Host, now: Time) {
        self.backend_scheduled = false;
        self.asleep = false;
        let burst = self.cfg.burst as u64;
        let mut t = now;
        // rte_eth_rx_burst and rte_vhost_enqueue_burst (handle_rx): a frame without a buffer is freed
        // by a vhost-user backend; vhost-net leaves it queued and waits for the guest's kick.
        let backlog = self.nic_backlog(now);
        let n = match self.cfg.backend {
            Backend::VhostUser => backlog.min(burst),
            Backend::Vhost => backlog.min(burst).min(self.rx_avail.len() as u64),
        };
        self.taken += n;
        let (done, t2, mut stalled) = self.backend_burst(host, t, false, n);
        t = t2;
        if self.cfg.backend == Backend::Vhost {
            // vhost-net took only what it could place; the rest stays queued.
            self.taken -= n - done;
        } else {
            self.stats.drops_ring += n - done;
        }
        if done > 0 {
            self.rxq.flush();
            self.rxq.notify();
            t = self
                .ring_accesses(host, t, false)
                .unwrap_or_else(|r| r.max(t));
            self.wake_guest(host, t);
        }
        // rte_vhost_dequeue_burst (handle_tx), then out of the NIC.
        if stalled.is_none() {
            let (sent, t2, s) = self.backend_burst(host, t, true, burst);
            (t, stalled) = (t2, s);
            if sent > 0 {
                self.txq.flush();
                self.txq.notify();
                t = self
                    .ring_accesses(host, t, true)
                    .unwrap_or_else(|r| r.max(t));
            }
        }
        // Waiting for QEMU's update, a polling core retries the descriptor (busy); vhost-net's worker
        // sleeps until the update requeues it.
        let end = stalled.map_or(t, |ready| ready.max(t));
        self.stats.exits.device_ns += match self.cfg.backend {
            Backend::VhostUser => end - now,
            Backend::Vhost => t - now,
        };
        self.backend_free = end;
        // vhost-net leaves frames queued while the guest has posted no buffer for them.
        let can_rx = self.cfg.backend == Backend::VhostUser || !self.rx_avail.is_empty();
        let backlog = self.nic_backlog(end);
        let work = (backlog > 0 && can_rx) || !self.tx_avail.is_empty();
        match (stalled, self.cfg.backend) {
            (Some(_), _) => self.poll_backend(host, end),
            (None, _) if work => self.poll_backend(host, end),
            // A polling core finds the next frame as it arrives.
            (None, Backend::VhostUser) => {
                let next = self.arrival(self.taken + self.nic_dropped).max(end + 1);
                self.poll_backend(host, next)
            }
            // vhost-net sleeps with notifications on: the tap's next frame wakes it, or, when frames wait
            // for RX buffers, the guest's kick as it posts them.
            (None, Backend::Vhost) => {
                self.txq.set_notification(true);
                self.asleep = true;
                self.rx_starved = backlog > 0;
                if !self.rx_starved {
                    let next = self.arrival(self.taken + self.nic_dropped).max(end + 1);
                    self.poll_backend(host, next + host.platform.cpu.wakeup_ns);
                }
            }
        }
    }

    /// Make sure the backend's loop runs at `at` (or when it is free), or earlier if it already will.
    fn poll_backend(&mut self, host: &mut Host, at: Time) {
        let at = at.max(self.backend_free);
        if !self.backend_scheduled || at < self.backend_at {
            self.backend_scheduled = true;
            self.backend_at = at;
            self.backend_gen = self.backend_gen.wrapping_add(1);
            host.schedule(at, event(EV_BACKEND, self.backend_gen as usize));
        }
    }

    /// vhost-net's worker sleeps with the guest's notifications on.
    fn backend_sleeps(&self) -> bool {
        self.cfg.backend == Backend::Vhost && self.asleep
    }

    /// The guest's notification (virtqueue_notify: an ioeventfd exit) to a sleeping vhost-net worker.
    /// Returns the vCPU's release time.
    fn kick(&mut self, host: &mut Host, t: Time) -> Time {
        let exit = self.h.kick_exit_ns;
        self.stats.exits.record(ExitCause::Kick, 1, exit);
        // KVM signals the eventfd between the exit and the re-entry; the worker wakes from there.
        self.poll_backend(host, t + exit / 2 + host.platform.cpu.wakeup_ns);
        t + exit
    }

    /// Make sure the guest's lcore polls at or after `at`.
    fn wake_guest(&mut self, host: &mut Host, at: Time) {
        if !self.guest_scheduled {
            self.guest_scheduled = true;
            host.schedule(at, event(EV_GUEST, 0));
        }
    }

    /// One loop of the guest's lcore: rte_eth_rx_burst (the used buffers taken, the ring refilled from the
    /// pool), the MAC swap, rte_eth_tx_burst (the used TX descriptors reclaimed first, the packets added;
    /// what finds no free descriptor is freed). Each side notifies a backend that asked for it
    /// (virtqueue_kick_prepare: VRING_USED_F_NO_NOTIFY clear).
    fn guest(&mut self, host: &mut Host, now: Time) {
        let cpu = self.fwd_cpu;
        if !host.cpu_acquire(cpu, now, event(EV_GUEST, 0), Ctx::Task) {
            return;
        }
        self.guest_scheduled = false;
        let n = self.rx_used.len().min(self.cfg.burst as usize);
        let pkts: Vec<u32> = self.rx_used.drain(..n).collect();
        let mut t = now + n as u64 * host.platform.cpu.pmd_packet_ns;
        // virtio_recv_pkts refills as many buffers as it took (virtqueue_enqueue_recv_refill).
        for _ in 0..n {
            let m = self
                .pool
                .pop()
                .expect("the pool holds both rings and a burst");
            self.rx_avail.push_back(m);
            self.rxq.posted += 1;
        }
        if n > 0 && std::mem::take(&mut self.rx_starved) && self.backend_sleeps() {
            t = self.kick(host, t);
        }
        // virtio_xmit_cleanup: used TX descriptors' mbufs back to the pool.
        while let Some(m) = self.tx_used.pop_front() {
            self.pool.push(m);
        }
        let q = self.cfg.queue_size as usize;
        let mut added = 0;
        for m in pkts {
            if self.tx_avail.len() + self.tx_used.len() < q {
                self.tx_avail.push_back(m);
                self.txq.posted += 1;
                added += 1;
            } else {
                self.stats.drops_ring += 1;
                self.pool.push(m);
            }
        }
        self.stats.packets_offered += n as u64;
        if added > 0 {
            if self.backend_sleeps() {
                t = self.kick(host, t);
            } else if self.cfg.backend == Backend::VhostUser {
                self.poll_backend(host, t);
            }
        }
        host.cpus[cpu].account(now, t);
        if !self.rx_used.is_empty() {
            self.wake_guest(host, t);
        }
    }
}

impl Workload for L2fwdWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        self.emul_iotlb = host.emulator_iotlb();
        // The EAL's memory: the mbuf pool and both rings in hugepages. With VFIO DPDK runs IOVA-as-VA, so the
        // hugepages are one IOVA-contiguous range, the pool's elements laid end to end across them; the
        // vIOMMU maps it with the largest pages both sides' alignment allows.
        let huge = self.cfg.hugepage_kb * 1024 / PAGE;
        let q = self.cfg.queue_size;
        let ring_pages = 2 * super::vring::Vring::new(q).pages();
        let pool_pages = (self.cfg.mbufs as u64 * MBUF_ELT_BYTES).div_ceil(PAGE);
        let pages = (pool_pages + ring_pages).next_multiple_of(huge);
        // 4 KiB pages (`--no-huge`) are wherever the guest's allocator put them: one 4 KiB leaf each.
        let mapped = if huge == 1 && host.dma.policy.translated() {
            let Some(phys) = (0..pages)
                .map(|_| host.pages.alloc())
                .collect::<Option<Vec<u64>>>()
            else {
                return now;
            };
            host.dma_map_block(now, self.fwd_cpu, &phys)
        } else {
            let Some(phys) = host.pages.alloc_aligned(pages, huge) else {
                return now;
            };
            host.dma_map(now, self.fwd_cpu, phys, pages)
        };
        let Some((dma, t)) = mapped else {
            return now;
        };
        self.mbuf_dma = (0..self.cfg.mbufs as u64)
            .map(|i| dma * PAGE + i * MBUF_ELT_BYTES + MBUF_HDR_OFF)
            .collect();
        // The rings' memzones after the pool.
        self.rx_ring = dma + pool_pages;
        self.tx_ring = self.rx_ring + ring_pages / 2;
        self.pool = (0..self.cfg.mbufs).rev().collect();
        // virtio_dev_start: the RX ring filled.
        for _ in 0..q {
            let m = self.pool.pop().expect("validated: mbufs cover the rings");
            self.rx_avail.push_back(m);
            self.rxq.posted += 1;
        }
        self.start = t;
        self.poll_backend(host, t);
        t
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            // A loop superseded by an earlier wake-up is dropped.
            EV_BACKEND if id == self.backend_gen => self.backend(host, now),
            EV_BACKEND => {}
            EV_GUEST => self.guest(host, now),
            _ => unreachable!("l2fwd event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        self.stats.clone()
    }

    fn cpus(&self) -> Vec<usize> {
        vec![self.fwd_cpu]
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.line_rate_gbps
    }

    fn open_limit(&self) -> super::OpenLimit {
        super::OpenLimit::OfferedLoad
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::RunResult;
    use crate::run::{builtin_with, run_variant};

    /// guest-dpdk's run of CONFIG at 2 MiB hugepages (unless `ov` sets them) with `ov` pinned.
    fn dpdk(config: &str, ov: &[(&str, &str)]) -> RunResult {
        let v = builtin_with(
            "guest-dpdk",
            &[&[("workload.l2fwd.hugepage_kb", "2048")], ov].concat(),
        );
        let v = v
            .iter()
            .find(|v| v.label.split(' ').next() == Some(config))
            .expect("config");
        run_variant(v)
    }

    fn mpps(r: &RunResult) -> f64 {
        r.packets_per_sec / 1e6
    }

    fn kicks(r: &RunResult) -> u64 {
        let vm = r.vm_exits.as_ref().expect("a guest reports its exits");
        vm.by_cause
            .iter()
            .find(|c| c.cause == "kick")
            .map_or(0, |c| c.count)
    }

    const VHOST: &[(&str, &str)] = &[("workload.l2fwd.backend", "vhost")];

    #[test]
    fn static_mappings_leave_the_backend_no_iotlb_miss_after_warm_up() {
        // The pool is mapped once in 2 MiB leaves: a cold device IOTLB misses a few times, then never.
        for backend in [&[][..], VHOST] {
            let warm = dpdk("vtd", backend);
            assert!(warm.packets_per_sec > 1e5, "{}", warm.packets_per_sec);
            assert_eq!(warm.caches.atc.misses, 0);
            assert_eq!(warm.emulator.as_ref().unwrap().work.translations, 0);
            assert_eq!(warm.invalidations.total, 0);
            let cold = dpdk("vtd", &[backend, &[("run.warmup_ms", "0")]].concat());
            let misses = cold.caches.atc.misses;
            assert!((1..=20).contains(&misses), "{misses}");
            // Each miss asked QEMU once, and QEMU, which had not translated that page before, walked.
            let work = &cold.emulator.as_ref().unwrap().work;
            assert_eq!(work.translations, misses);
            assert_eq!((work.iotlb_misses, work.walks), (misses, misses));
        }
    }

    #[test]
    fn a_polling_backend_takes_no_kick_and_a_sleeping_vhost_net_is_kicked() {
        // vhost-user polls and asks for no notifications: the guest never exits. vhost-net, given less
        // than it can carry, sleeps between frames with notifications on: the guest's sends kick it.
        let light = [("workload.l2fwd.offered_mpps", "0.05")];
        let user = dpdk("vtd", &light);
        assert_eq!(kicks(&user), 0);
        assert!((mpps(&user) / 0.05 - 1.0).abs() < 0.02, "{}", mpps(&user));
        assert_eq!(user.limited_by, "offered_load");
        let net = dpdk("vtd", &[VHOST, &light].concat());
        assert!((mpps(&net) / 0.05 - 1.0).abs() < 0.02, "{}", mpps(&net));
        let per_packet = kicks(&net) as f64 / net.packets_per_sec / net.sim_seconds;
        assert!(per_packet > 0.3, "{per_packet} kicks per packet");
    }

    #[test]
    fn without_its_ring_cache_vhost_net_looks_up_every_ring_access() {
        // With vhost_vq_meta_prefetch the device IOTLB sees one lookup per buffer: two per forwarded
        // frame (in and out). Without it, every step through either ring is one more; a DPDK backend
        // keeps its rings' translations always.
        let lookups = |r: &RunResult| {
            let a = &r.caches.atc;
            (a.hits + a.misses) as f64 / (r.packets_per_sec * r.sim_seconds)
        };
        let cache = |on: &'static str| [VHOST, &[("platform.kvm.vhost_meta_cache", on)]].concat();
        let (kept, lost) = (dpdk("vtd", &cache("true")), dpdk("vtd", &cache("false")));
        assert!((lookups(&kept) - 2.0).abs() < 0.05, "{}", lookups(&kept));
        assert!(lookups(&lost) > 2.0 + 4.0, "{}", lookups(&lost));
        assert!(mpps(&lost) < 0.9 * mpps(&kept));
        let user = dpdk("vtd", &[("platform.kvm.vhost_meta_cache", "false")]);
        assert!((lookups(&user) - 2.0).abs() < 0.05, "{}", lookups(&user));
    }

    #[test]
    fn four_kib_translations_make_the_vhost_user_iotlb_a_long_list() {
        // With 4 KiB IOMMU pages (--no-huge, or virtio-iommu answering at 4 KiB) the mbufs in flight
        // take hundreds of entries, and every lookup walks half of them; hugepages need one or two.
        // Without a vIOMMU the page size changes nothing.
        let huge = dpdk("vtd", &[]);
        let small = dpdk("vtd", &[("workload.l2fwd.hugepage_kb", "4")]);
        let viommu = dpdk("virtio-iommu", &[]);
        assert!(
            mpps(&small) < 0.5 * mpps(&huge),
            "{} {}",
            mpps(&small),
            mpps(&huge)
        );
        assert!((mpps(&viommu) / mpps(&small) - 1.0).abs() < 0.1);
        let none = |kb| dpdk("noiommu", &[("workload.l2fwd.hugepage_kb", kb)]);
        assert_eq!(mpps(&none("4")), mpps(&none("2048")));
        assert!(mpps(&huge) < mpps(&none("2048")));
        assert_eq!(huge.limited_by, "device_thread");
    }
}
