//! Counters, snapshots and the result of a run: what was measured between the end of warm-up and the end.

pub use crate::sim::hist;
pub mod limits;

use crate::dma::attack::AttackStats;
use crate::dma::iova::IovaStats;
use crate::dma::locality::ReuseCounts;
use crate::dma::safety::SafetyStats;
use crate::dma::DmaStats;
use crate::hw::emul::{EmulatorWork, ExitCause, ExitStats};
use crate::hw::{InvClass, InvKind, IommuCounters};
use crate::sim::hist::Histogram;
use crate::sim::LockStats;
use crate::workload::OpenLimit;
pub use crate::workload::RxPageCache;
use crate::workload::WorkloadStats;
use limits::{CpuBreakdown, Utilisation};
use serde::ser::SerializeMap;
use serde::Serialize;

/// Every counter of the simulated host at one instant.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub time: u64,
    pub iommu: IommuCounters,
    pub dma: DmaStats,
    pub iova: IovaStats,
    pub wl: WorkloadStats,
    /// Busy ns of each CPU the workload uses.
    pub cpu_busy_ns: Vec<u64>,
    /// Every shared lock and line of the DMA path, by name (the same name summed over domains).
    pub locks: Vec<(&'static str, LockStats)>,
    /// How many of `locks`, at its end, are the IOMMU driver's (taken on the invalidation path, so their spin
    /// is inside `iommu.inv_wait_ns` and `iommu.cmdq_insert_ns`).
    pub iommu_locks: usize,
    /// The workload's CPUs, in `cpu_busy_ns` order.
    pub cpus: Vec<usize>,
    pub safety: SafetyStats,
    /// Pages released and not yet covered by a completed invalidation, at `time`.
    pub exposed_open: u64,
    /// Where data outlives its mapping until something overwrites it (swiotlb's slots): those pages' time
    /// exposed so far, at `time`.
    pub open_windows: Option<Histogram>,
    /// The malicious device's counts, when one runs.
    pub attack: Option<AttackStats>,
    /// Walk-cache reuse of the IOVAs handed out, and of the device's data-page accesses.
    pub iova_reuse: ReuseCounts,
    pub dma_reuse: ReuseCounts,
    /// An emulated IOMMU's exits to the hypervisor (a guest platform only).
    pub exits: Option<ExitStats>,
    /// swiotlb's counts, where the device's DMA bounces.
    pub swiotlb: Option<crate::dma::swiotlb::SwiotlbStats>,
}

/// What an emulated IOMMU cost a guest: its exits to the hypervisor.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VmExits {
    pub total: u64,
    pub per_sec: f64,
    /// Per cause (the doorbell that trapped): exits, exits per second, and the mean vCPU time one cost, µs
    /// (exit, the emulator's work and any wait for the BQL, re-entry).
    pub by_cause: Vec<ExitsOfCause>,
    /// vCPU time lost to exits over the workload's vCPU time in the window.
    pub vcpu_share: f64,
    /// The emulator's work (consuming commands) over the window: the share of one host thread.
    pub emulator_busy: f64,
    /// The software device's thread (QEMU's virtio-net or vhost's worker) busy over the window.
    pub device_busy: f64,
    /// QEMU's big lock held over the window: the emulator's handlers and QEMU's own device work.
    pub bql_busy: f64,
    /// The software device waiting for the BQL over the window (held by the vCPUs' IOMMU handlers): QEMU's
    /// virtio-net before its work, vhost for QEMU's answer to its IOTLB misses.
    pub device_bql_wait: f64,
    /// A VFIO device's shadow mappings: VFIO map and unmap calls, pages pinned and unpinned.
    pub vfio_maps: u64,
    pub vfio_unmaps: u64,
    pub pages_pinned: u64,
    pub pages_unpinned: u64,
}

/// A guest's emulator, counted as QEMU's trace counts it (the testbed holds these to QEMU's): its work and
/// the guest's accesses to the IOMMU's registers.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EmulatorCounts {
    #[serde(flatten)]
    pub work: EmulatorWork,
    pub mmio_exits: u64,
}

impl EmulatorCounts {
    fn new(d: &ExitStats) -> Self {
        EmulatorCounts {
            work: d.work,
            mmio_exits: d.mmio_exits(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitsOfCause {
    pub cause: &'static str,
    pub count: u64,
    pub per_sec: f64,
    pub mean_us: f64,
}

impl VmExits {
    fn new(d: &ExitStats, dt: u64, cpus: usize) -> Self {
        let secs = dt as f64 / 1e9;
        let vcpu_ns: u64 = d.vcpu_ns.iter().sum();
        VmExits {
            total: d.total(),
            per_sec: r6(d.total() as f64 / secs),
            by_cause: ExitCause::ALL
                .iter()
                .map(|&c| ExitsOfCause {
                    cause: c.name(),
                    count: d.count[c as usize],
                    per_sec: r6(d.count[c as usize] as f64 / secs),
                    mean_us: r6(ratio(d.vcpu_ns[c as usize], d.count[c as usize]) / 1e3),
                })
                .collect(),
            vcpu_share: r6(ratio(vcpu_ns, dt * cpus.max(1) as u64)),
            emulator_busy: r6(ratio(d.emulator_ns, dt).min(1.0)),
            device_busy: r6(ratio(d.device_ns, dt).min(1.0)),
            bql_busy: r6(ratio(d.emulator_ns + d.bql_ns, dt).min(1.0)),
            device_bql_wait: r6(ratio(d.bql_wait_ns, dt).min(1.0)),
            vfio_maps: d.vfio_maps,
            vfio_unmaps: d.vfio_unmaps,
            pages_pinned: d.pins,
            pages_unpinned: d.unpins,
        }
    }
}

/// `{"total": n, "<type>": n, ...}` with the IOMMU's own invalidation types, in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalidations {
    pub total: u64,
    pub by_kind: Vec<(InvKind, u64)>,
}

impl Invalidations {
    pub fn get(&self, k: InvKind) -> u64 {
        self.by_kind
            .iter()
            .find(|(x, _)| *x == k)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    }
    /// Commands of one class, whatever the vendor calls them.
    pub fn class(&self, c: InvClass) -> u64 {
        self.by_kind
            .iter()
            .filter(|(k, _)| k.class == c)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Serialize for Invalidations {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.by_kind.len() + 1))?;
        m.serialize_entry("total", &self.total)?;
        for (k, n) in &self.by_kind {
            m.serialize_entry(k.name, n)?;
        }
        m.end()
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Drops {
    pub ring: u64,
    pub device: u64,
    /// Dropped by the driver because their DMA mapping failed (no IOVA space, the bounce pool full).
    pub dma_map: u64,
    /// Block I/Os requeued because their mapping failed (not lost: blk-mq retries them).
    pub requeued: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HitMiss {
    pub hits: u64,
    pub misses: u64,
}

/// Lookups of each translation cache: the IOTLB, each walk cache top level first, the device ATC.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Caches {
    pub iotlb: HitMiss,
    pub pwc: Vec<HitMiss>,
    pub atc: HitMiss,
}

/// What a malicious device replaying every IOVA it saw reached (dma::attack), in the window.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Attack {
    pub probes: u64,
    pub reached_mapped: u64,
    pub reached_unmapped: u64,
    pub reached_unmapped_bytes: u64,
    pub reached_released: u64,
}

/// Bounce buffering through swiotlb (dma::swiotlb), in the window; the pool's sizes and high-water mark
/// over the whole run, as debugfs keeps them.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Swiotlb {
    /// swiotlb_map() calls (the `swiotlb_bounced` tracepoint), and the bytes copied in and back.
    pub bounces: u64,
    pub bounced_bytes: u64,
    /// Copies made, and their rate of bytes (Gbit/s).
    pub copies: u64,
    pub bounced_gbps: f64,
    /// Maps that found no room ("swiotlb buffer is full"), those larger than a segment among them.
    pub full_events: u64,
    pub too_large: u64,
    /// The most slots in use at once since the start (io_tlb_used_hiwater), and the pool's slots
    /// (io_tlb_nslabs, with any pools dynamic growth added), each 2 KiB.
    pub high_water_slots: u64,
    pub pool_slots: u64,
    /// Slots in use when the run ended (io_tlb_used).
    pub used_slots: u64,
    /// CONFIG_SWIOTLB_DYNAMIC: transient pools made in the window and pools the background worker added.
    pub transient_pools: u64,
    pub pools_added: u64,
    /// Slots the searches looked at, per map.
    pub slots_searched_per_map: f64,
}

/// How long freed pages stayed reachable by the device (dma::safety).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Safety {
    /// False for an identity domain: the device reaches all of memory, always.
    pub protected: bool,
    /// Unmapped pages released to their owner and covered by a completed invalidation in the window.
    pub pages_settled: u64,
    /// Of those, pages released before the invalidation completed, and their share.
    pub pages_exposed: u64,
    pub exposed_share: f64,
    /// Pages released and still not invalidated when the run ended.
    pub pages_exposed_at_end: u64,
    /// Exposure window per exposed page (release to invalidation completion), µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<hist::Latency>,
    /// Buffers mapped in the window whose pages hold other data the device could reach meanwhile.
    pub sub_page: SubPage,
}

/// Sub-page exposure: small buffers (skb heads in a slab page, frags sharing a page) mapped whole pages.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SubPage {
    pub buffers: u64,
    /// Per such buffer, bytes of other data in its mapped granules: p50, p99, max.
    pub bytes_p50: u64,
    pub bytes_p99: u64,
    pub bytes_max: u64,
    /// Those bytes integrated over the time each buffer stayed mapped, divided by the window: how much
    /// unrelated memory the device could reach at any instant, on average.
    pub mean_reachable_bytes: f64,
}

/// Reuse distances over last-level walk-cache entries (PT-L3 pages: 2 MiB of IOVA with 4 KiB pages) in the
/// window (dma::locality), against the size of the last walk cache.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WalkLocality {
    /// Events on an entry not seen before (no distance).
    pub first_use: u64,
    /// Entries of the last walk cache (the platform's PTcache-L3) the distances compare with.
    pub walk_cache_entries: u64,
    pub reuse_distance_p50: u64,
    pub reuse_distance_p99: u64,
    pub reuse_distance_max: u64,
    /// Share of events whose entry had more distinct entries in between than the walk cache holds.
    pub beyond_walk_cache_share: f64,
}

/// Locality of the IOVAs handed to buffers in the window, as F&S (SOSP'24 §2.2, Figures 2e/3e) measure it:
/// per allocation, the distinct last-level walk-cache entries allocated from since its own entry last was.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IovaLocality {
    /// Allocations from an entry used before.
    pub allocations: u64,
    #[serde(flatten)]
    pub walk: WalkLocality,
}

/// Locality of the data pages the device read or wrote in the window, in the order the IOMMU translated
/// them (F&S Figure 2e's "IOVA accesses"): per page, the distinct last-level walk-cache entries the
/// device's data touched since its own entry last was. Consecutive accesses to one page count once.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DmaLocality {
    /// Page accesses in an entry touched before.
    pub accesses: u64,
    #[serde(flatten)]
    pub walk: WalkLocality,
}

/// How long before each rx_cache_reuse the stack had let go of the cache's head page, in µs: the margin by
/// which a later release (a reader delayed that much) would have made the refill rx_cache_busy and
/// mapped a fresh page. Quantiles to the histogram's resolution (about 3 %).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ReuseSlack {
    pub reuses: u64,
    pub min_us: f64,
    #[serde(rename = "p0.1_us")]
    pub p0_1_us: f64,
    pub p1_us: f64,
    pub p50_us: f64,
}

impl ReuseSlack {
    /// None when nothing was reused from a driver cache in the window.
    pub fn new(h: &hist::Histogram) -> Option<Self> {
        let us = |q: f64| r6(h.quantile(q) as f64 / 1000.0);
        (h.count() > 0).then(|| ReuseSlack {
            reuses: h.count(),
            min_us: us(0.0),
            p0_1_us: us(0.001),
            p1_us: us(0.01),
            p50_us: us(0.5),
        })
    }
}

impl WalkLocality {
    /// From what was counted and the walk cache's size.
    pub fn new(c: &ReuseCounts, walk_cache_entries: u64) -> Self {
        let h = &c.hist;
        WalkLocality {
            first_use: c.first_use,
            walk_cache_entries,
            reuse_distance_p50: h.quantile(0.5),
            reuse_distance_p99: h.quantile(0.99),
            reuse_distance_max: h.max(),
            beyond_walk_cache_share: r6(ratio(h.count_at_least(walk_cache_entries), h.count())),
        }
    }
}

impl IovaLocality {
    pub fn new(c: &ReuseCounts, walk_cache_entries: u64) -> Self {
        IovaLocality {
            allocations: c.hist.count(),
            walk: WalkLocality::new(c, walk_cache_entries),
        }
    }
}

impl DmaLocality {
    pub fn new(c: &ReuseCounts, walk_cache_entries: u64) -> Self {
        DmaLocality {
            accesses: c.hist.count(),
            walk: WalkLocality::new(c, walk_cache_entries),
        }
    }
}

/// What one shared lock or cache line cost in the window (sim::lock): how often it was taken, how often
/// it was found held, the spin, and the cache-line transfers its takers stalled on.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Contention {
    pub name: String,
    pub acquisitions: u64,
    pub contended_share: f64,
    pub wait_mean_ns: f64,
    pub wait_p99_ns: u64,
    pub transfers: u64,
    pub transfer_ns_mean: f64,
    /// Spin plus transfer stalls, summed over CPUs, as a share of the window (1.0 = one CPU's whole time).
    pub cpu_share: f64,
    /// Share of the window it was held (a lock), or serving (a hardware queue): its busiest instance's
    /// (per-CPU locks, the same lock of several domains, several queues).
    pub busy_share: f64,
    /// A hardware queue the IOMMU serves, not a lock or line CPUs take.
    pub hardware_queue: bool,
}

impl Contention {
    fn new(name: &str, w: &LockStats, dt: u64) -> Self {
        let spin: u64 = w.spin_by_cpu.iter().sum();
        Contention {
            name: name.to_string(),
            acquisitions: w.acquisitions,
            contended_share: r6(ratio(w.contended, w.acquisitions)),
            wait_mean_ns: r6(ratio(w.wait_ns, w.acquisitions)),
            wait_p99_ns: w.waits.quantile(0.99),
            transfers: w.transfers,
            transfer_ns_mean: r6(ratio(w.transfer_ns, w.transfers)),
            cpu_share: r6(ratio(spin, dt)),
            busy_share: r6(ratio(w.busiest_ns(), dt).min(1.0)),
            hardware_queue: w.queue,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FlushQueueFlushes {
    pub full: u64,
    pub timer: u64,
}

/// The documented result of one run (docs/scenarios.md, "Output keys").
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RunResult {
    pub scenario: String,
    pub label: String,
    pub policy: String,
    pub policy_reason: String,
    /// What to know about the policy on this workload (e.g. FANDS without multi-packet WQEs); empty if nothing.
    pub policy_note: String,
    pub iommu: String,
    pub seed: u64,
    pub sim_seconds: f64,
    /// Application goodput: payload the readers copied out.
    pub throughput_gbps: f64,
    /// Payload the device accepted from the wire (differs from goodput by the change in socket backlog).
    pub received_gbps: f64,
    pub line_rate_gbps: f64,
    pub packets_per_sec: f64,
    pub cpu_busy: f64,
    /// Share of that busy time spent invalidating, from the request to its completion (a command queue's
    /// insertion included).
    pub cpu_inv_wait_share: f64,
    /// Of it, the share of the busy time spent inserting into a shared command queue until the IOMMU can see
    /// the commands (SMMUv3's arm_smmu_cmdq_issue_cmdlist() before its CMD_SYNC poll; 0 elsewhere).
    pub cpu_cmdq_insert_share: f64,
    pub invalidations: Invalidations,
    /// Synchronisations CPUs waited for: VT-d wait descriptors, SMMUv3 CMD_SYNCs.
    pub syncs: u64,
    /// Mean time a CPU waited from submitting invalidations to seeing them complete, per sync (µs).
    pub sync_wait_mean_us: f64,
    /// Of it, the mean time in a shared command queue's insertion, per sync (µs; 0 where not split out).
    pub cmdq_insert_mean_us: f64,
    pub iova_pages_mapped: u64,
    pub iova_pages_unmapped: u64,
    pub inv_per_page: f64,
    pub dma_pages: u64,
    /// Packets the host sent (TCP ACKs).
    pub tx_packets: u64,
    /// Per 4 KiB of data delivered (as F&S count them): IOTLB misses, page-walk memory reads and walk-cache
    /// misses per level.
    pub iotlb_misses_per_page: f64,
    pub walk_reads_per_page: f64,
    pub pwc_misses_per_page: Vec<f64>,
    pub caches: Caches,
    /// Translations served from a cached entry the page table no longer held (IOTLB, walk cache or ATC).
    pub stale_translations: u64,
    pub dma_faults: u64,
    pub drops: Drops,
    /// Share of wire time the senders were held back by used-up receive or congestion windows.
    pub window_limited_share: f64,
    /// TCP senders' loss-recovery episodes (each halves a congestion window).
    pub loss_recoveries: u64,
    pub flush_queue_flushes: FlushQueueFlushes,
    pub rx_page_cache: RxPageCache,
    /// Only with a driver page cache that served a refill in the window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rx_cache_reuse_slack: Option<ReuseSlack>,
    pub iova_rcache_hit_rate: f64,
    /// Every shared lock and cache line of the DMA path, in a fixed order.
    pub contention: Vec<Contention>,
    /// Per CPU of the workload: the share of the window it spent spinning on locks or stalled on line
    /// transfers (waits for invalidation completion are in cpu_inv_wait_share).
    pub cpu_spin_share: Vec<f64>,
    /// SMMUv3 shared command queue: cmpxchg attempts on llq per successful slot reservation.
    pub cmdq_cas_attempts_per_success: f64,
    /// SMMUv3 shared command queue: share of issues another CPU (the owner) rang the doorbell for.
    pub cmdq_gathered_share: f64,
    pub iova_locality: IovaLocality,
    pub dma_locality: DmaLocality,
    pub safety: Safety,
    /// Request latency percentiles (request/response workloads only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency: Option<hist::Latency>,
    /// The DMA map benchmark's average map and unmap latency with their standard deviations, as
    /// dma_map_benchmark prints them (only for `[workload.dma_map_benchmark]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map_latency_us: Option<AvgStddev>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unmap_latency_us: Option<AvgStddev>,
    /// The map benchmark's loops (one map and one unmap each) and failed maps in the window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map_benchmark: Option<MapBenchmarkCounts>,
    /// Malicious-device replay counts (only with `attack.replay_per_sec`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attack: Option<Attack>,
    /// Bounce buffering (only where the device's DMA bounces through swiotlb).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swiotlb: Option<Swiotlb>,
    /// A guest's exits to the hypervisor (only on a platform with `[hypervisor]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_exits: Option<VmExits>,
    /// A guest's emulator: what QEMU did, as its own trace counts it (only with `[hypervisor]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub emulator: Option<EmulatorCounts>,
    /// Where the workload CPUs' time went (shares of it).
    pub cpu_breakdown: CpuBreakdown,
    /// Each resource's busy share over the window.
    pub utilisation: Utilisation,
    /// The resource that bound the run (limits::limited_by): line, link, iommu.queue, emulator,
    /// device_thread, lock:NAME, iommu.translation, cpu.dma_api|cmdq_insert|inv_wait|lock_spin|stack, or the
    /// workload's own bound (senders, offered_load, queue_depth).
    pub limited_by: String,
    /// Why this run's figures may not be read as they are (a window too short, …); empty if none.
    pub warnings: Vec<String>,
}

/// An average and a standard deviation, µs.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct AvgStddev {
    pub avg: f64,
    pub stddev: f64,
}

impl AvgStddev {
    /// From the kernel's 100 ns units (dma_map_benchmark prints them divided by 10.0).
    fn of_100ns((avg, stddev): (u64, u64)) -> Self {
        AvgStddev {
            avg: avg as f64 / 10.0,
            stddev: stddev as f64 / 10.0,
        }
    }
}

/// The DMA map benchmark's options (as dma_map_benchmark prints them; `seconds` the window) and counts in a
/// window.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct MapBenchmarkCounts {
    pub threads: u32,
    pub seconds: f64,
    pub node: i32,
    pub dma_dir: &'static str,
    pub granule: u32,
    /// Map-and-unmap loops completed, over every thread.
    pub loops: u64,
    /// Maps that failed over the whole run, warm-up included (the kernel's thread then stops and its ioctl
    /// fails: the tool prints no figures).
    pub map_failures: u64,
    /// Loops per second per thread (the per-CPU map+unmap rate).
    pub loops_per_sec_per_thread: f64,
    /// Mean map and unmap times in ns, exact (the kernel's figures above truncate each loop to 100 ns).
    pub map_ns_mean: f64,
    pub unmap_ns_mean: f64,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Round to 6 significant digits so printed results are stable and readable. Goes through Rust's exact
/// decimal formatting rather than libm (log10/powi), so it is bit-identical on every platform.
fn r6(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    format!("{x:.5e}").parse().expect("formatted float parses")
}

pub struct RunInfo<'a> {
    pub scenario: &'a str,
    pub label: &'a str,
    pub policy: &'a str,
    pub policy_reason: &'a str,
    pub policy_note: &'a str,
    pub iommu: &'a str,
    pub inv_kinds: &'a [InvKind],
    pub seed: u64,
    /// Walk caches (non-leaf levels) of the IOMMU's table format.
    pub pwc_levels: u32,
    /// Entries of the last walk cache.
    pub walk_cache_entries: u64,
    pub line_rate_gbps: f64,
    /// The device's DMA goes through translation (not an identity domain).
    pub translated: bool,
    /// The DMA map benchmark's options (its workload only).
    pub map_benchmark: Option<&'a crate::scenario::MapBenchmark>,
    /// What bounds the workload when no accounted resource saturates.
    pub open_limit: OpenLimit,
    /// The policy's timer period (a flush queue's fq_timeout), if it runs one.
    pub timer_period_ns: Option<u64>,
    /// The scenario key that sets the measured window's length.
    pub window_key: &'static str,
}

impl RunResult {
    /// This result with every part only some runs report (`latency`, `attack`, `vm_exits`, `emulator`,
    /// `rx_cache_reuse_slack`, `safety.window`) present, zero where absent: every key a result can hold, so a
    /// sweep can check the columns its derived expressions name before it runs anything.
    pub fn with_every_part(mut self) -> Self {
        self.latency.get_or_insert_with(Default::default);
        self.map_latency_us.get_or_insert_with(Default::default);
        self.unmap_latency_us.get_or_insert_with(Default::default);
        self.map_benchmark.get_or_insert_with(Default::default);
        self.attack.get_or_insert_with(Default::default);
        self.swiotlb.get_or_insert_with(Default::default);
        self.vm_exits.get_or_insert_with(Default::default);
        self.emulator.get_or_insert_with(Default::default);
        self.rx_cache_reuse_slack
            .get_or_insert_with(Default::default);
        self.safety.window.get_or_insert_with(Default::default);
        self
    }

    pub fn from_snapshots(info: &RunInfo<'_>, a: &Snapshot, b: &Snapshot) -> Self {
        let dt = (b.time - a.time).max(1);
        let secs = dt as f64 / 1e9;
        let map_bench =
            b.wl.map_bench
                .map(|y| y.since(&a.wl.map_bench.unwrap_or_default()));
        let io = |f: fn(&IommuCounters) -> u64| f(&b.iommu) - f(&a.iommu);
        let wl = |f: fn(&WorkloadStats) -> u64| f(&b.wl) - f(&a.wl);
        // From each invalidation's request to its completion: the queue's insertion and the wait after it.
        let invalidating = io(|c| c.cmdq_insert_ns + c.inv_wait_ns);
        let total = b.iommu.invalidations() - a.iommu.invalidations();
        let by_kind = info
            .inv_kinds
            .iter()
            .map(|&k| (k, b.iommu.get(k) - a.iommu.get(k)))
            .collect();
        let unmapped = b.dma.iova_pages_unmapped - a.dma.iova_pages_unmapped;
        let dma_pages = wl(|w| w.dma_pages);
        let data_pages = wl(|w| w.bytes_delivered) as f64 / crate::hw::PAGE_SIZE as f64;
        let per_data_page = |n: u64| {
            if data_pages > 0.0 {
                r6(n as f64 / data_pages)
            } else {
                0.0
            }
        };
        let busy: u64 = b
            .cpu_busy_ns
            .iter()
            .zip(&a.cpu_busy_ns)
            .map(|(x, y)| x - y)
            .sum();
        let ncpu = b.cpu_busy_ns.len().max(1) as u64;
        let npwc = info.pwc_levels as usize;
        let rc_hits = b.iova.rcache_hits - a.iova.rcache_hits;
        let rc_total = rc_hits + b.iova.rbtree_allocs - a.iova.rbtree_allocs;
        let contention: Vec<Contention> = b
            .locks
            .iter()
            .map(|(name, lb)| {
                let la = a
                    .locks
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, l)| l.clone())
                    .unwrap_or_default();
                Contention::new(name, &lb.since(&la), dt)
            })
            .collect();
        // Spin and line stalls on the workload's CPUs, per CPU: on every lock, and on the IOMMU driver's.
        let spin_on = |c: usize, iommu_only: bool| {
            let at = |s: &Snapshot| -> u64 {
                let skip = if iommu_only {
                    s.locks.len() - s.iommu_locks
                } else {
                    0
                };
                s.locks
                    .iter()
                    .skip(skip)
                    .map(|(_, l)| l.spin_by_cpu.get(c).copied().unwrap_or(0))
                    .sum()
            };
            at(b) - at(a)
        };
        let spins: Vec<u64> = b.cpus.iter().map(|&c| spin_on(c, false)).collect();
        let iommu_spin: u64 = b.cpus.iter().map(|&c| spin_on(c, true)).sum();
        let cpu_breakdown = {
            let cb = CpuBreakdown::new(
                ncpu * dt,
                busy,
                b.dma.cpu_ns - a.dma.cpu_ns,
                // The invalidation wait counts from the request, spins on the IOMMU driver's locks included;
                // the lock spin left is on the DMA layer's own (the IOVA allocator's, the flush queue's).
                io(|c| c.cmdq_insert_ns),
                io(|c| c.inv_wait_ns),
                spins.iter().sum::<u64>() - iommu_spin,
            );
            CpuBreakdown {
                dma_api: r6(cb.dma_api),
                cmdq_insert: r6(cb.cmdq_insert),
                inv_wait: r6(cb.inv_wait),
                lock_spin: r6(cb.lock_spin),
                stack: r6(cb.stack),
                idle: r6(cb.idle),
            }
        };
        let exits = b
            .exits
            .as_ref()
            .map(|y| y.since(&a.exits.unwrap_or_default()));
        let vm_exits = exits.as_ref().map(|d| VmExits::new(d, dt, b.cpus.len()));
        let emulator = exits.as_ref().map(EmulatorCounts::new);
        let utilisation = {
            let (slots, link) = b.wl.device.since(&a.wl.device).shares(dt);
            let busiest = |hw: bool| {
                contention
                    .iter()
                    .filter(|c| c.hardware_queue == hw)
                    .fold((0.0, ""), |m, c| {
                        if c.busy_share > m.0 {
                            (c.busy_share, c.name.as_str())
                        } else {
                            m
                        }
                    })
            };
            let accepted = wl(|w| w.bytes_received).max(wl(|w| w.bytes_delivered));
            let (lock, lock_name) = busiest(false);
            Utilisation {
                // The wire's occupancy where the workload has one; else data over the device's rate.
                line: r6(match wl(|w| w.wire_ns) {
                    0 if info.line_rate_gbps > 0.0 => {
                        accepted as f64 * 8.0 / dt as f64 / info.line_rate_gbps
                    }
                    ns => ratio(ns, dt),
                }
                .min(1.0)),
                link: r6(link.min(1.0)),
                translation_slots: r6(slots.min(1.0)),
                iommu_queue: busiest(true).0,
                lock,
                lock_name: lock_name.to_string(),
                cpu: r6(b
                    .cpu_busy_ns
                    .iter()
                    .zip(&a.cpu_busy_ns)
                    .map(|(x, y)| ratio(x - y, dt).min(1.0))
                    .fold(0.0, f64::max)),
                emulator: vm_exits.as_ref().map_or(0.0, |v| v.emulator_busy.min(1.0)),
                device_thread: vm_exits.as_ref().map_or(0.0, |v| v.device_busy.min(1.0)),
                bql: vm_exits.as_ref().map_or(0.0, |v| v.bql_busy),
            }
        };
        let mut limited_by = limits::limited_by(&utilisation, &cpu_breakdown, info.open_limit);
        if let (Some(x), Some(y)) = (&a.swiotlb, &b.swiotlb) {
            let (full, tries) = (y.full_events - x.full_events, y.bounces - x.bounces);
            if limits::pool_full(&utilisation, full, tries) {
                limited_by = "swiotlb.full".into();
            }
        }
        let mut warnings = limits::warnings(
            wl(|w| w.packets_delivered),
            b.cpus.len() as u64,
            dt,
            info.timer_period_ns,
            info.window_key,
        );
        // A full bounce pool, not the window, is why little got through: a longer run would not help.
        if limited_by == "swiotlb.full" {
            warnings
                .retain(|w| !w.starts_with("short window: ") || w.contains("flush-queue timer"));
        }
        RunResult {
            scenario: info.scenario.to_string(),
            label: info.label.to_string(),
            policy: info.policy.to_string(),
            policy_reason: info.policy_reason.to_string(),
            policy_note: info.policy_note.to_string(),
            iommu: info.iommu.to_string(),
            seed: info.seed,
            sim_seconds: r6(secs),
            throughput_gbps: r6(wl(|w| w.bytes_delivered) as f64 * 8.0 / dt as f64),
            received_gbps: r6(wl(|w| w.bytes_received) as f64 * 8.0 / dt as f64),
            line_rate_gbps: r6(info.line_rate_gbps),
            packets_per_sec: r6(wl(|w| w.packets_delivered) as f64 / secs),
            cpu_busy: r6((busy as f64 / (ncpu * dt) as f64).min(1.0)),
            cpu_inv_wait_share: r6(ratio(invalidating, busy)),
            cpu_cmdq_insert_share: r6(ratio(io(|c| c.cmdq_insert_ns), busy)),
            invalidations: Invalidations { total, by_kind },
            syncs: io(|c| c.syncs),
            sync_wait_mean_us: r6(ratio(invalidating, io(|c| c.syncs)) / 1e3),
            cmdq_insert_mean_us: r6(ratio(io(|c| c.cmdq_insert_ns), io(|c| c.syncs)) / 1e3),
            iova_pages_mapped: b.dma.pages_mapped - a.dma.pages_mapped,
            iova_pages_unmapped: unmapped,
            inv_per_page: r6(ratio(total, unmapped)),
            dma_pages,
            tx_packets: wl(|w| w.tx_packets),
            iotlb_misses_per_page: per_data_page(io(|c| c.iotlb_misses)),
            walk_reads_per_page: per_data_page(io(|c| c.walk_reads)),
            pwc_misses_per_page: (0..npwc)
                .map(|i| per_data_page(b.iommu.pwc_misses[i] - a.iommu.pwc_misses[i]))
                .collect(),
            caches: Caches {
                iotlb: HitMiss {
                    hits: io(|c| c.translations - c.atc_hits - c.iotlb_misses),
                    misses: io(|c| c.iotlb_misses),
                },
                pwc: (0..npwc)
                    .map(|i| HitMiss {
                        hits: b.iommu.pwc_hits[i] - a.iommu.pwc_hits[i],
                        misses: b.iommu.pwc_misses[i] - a.iommu.pwc_misses[i],
                    })
                    .collect(),
                atc: HitMiss {
                    hits: io(|c| c.atc_hits),
                    misses: io(|c| c.atc_misses),
                },
            },
            stale_translations: io(|c| c.stale_hits),
            dma_faults: wl(|w| w.dma_faults),
            drops: Drops {
                ring: wl(|w| w.drops_ring),
                device: wl(|w| w.drops_device),
                dma_map: wl(|w| w.drops_map),
                requeued: wl(|w| w.requeued),
            },
            window_limited_share: r6(ratio(
                wl(|w| w.window_closed),
                wl(|w| w.window_closed) + wl(|w| w.packets_offered),
            )),
            loss_recoveries: wl(|w| w.loss_recoveries),
            flush_queue_flushes: FlushQueueFlushes {
                full: b.dma.fq_flush_full - a.dma.fq_flush_full,
                timer: b.dma.fq_flush_timer - a.dma.fq_flush_timer,
            },
            rx_page_cache: b.wl.rx_cache.since(&a.wl.rx_cache),
            rx_cache_reuse_slack: ReuseSlack::new(&b.wl.rx_cache_slack.since(&a.wl.rx_cache_slack)),
            iova_rcache_hit_rate: r6(ratio(rc_hits, rc_total)),
            contention,
            cpu_spin_share: spins.iter().map(|&x| r6(ratio(x, dt))).collect(),
            cmdq_cas_attempts_per_success: r6(ratio(
                io(|c| c.cas_attempts),
                io(|c| c.cas_successes),
            )),
            cmdq_gathered_share: r6(ratio(io(|c| c.gathered), io(|c| c.cas_successes))),
            iova_locality: IovaLocality::new(
                &b.iova_reuse.since(&a.iova_reuse),
                info.walk_cache_entries,
            ),
            dma_locality: DmaLocality::new(
                &b.dma_reuse.since(&a.dma_reuse),
                info.walk_cache_entries,
            ),
            safety: {
                let mut settled = b.safety.pages_settled - a.safety.pages_settled;
                let mut exposed = b.safety.pages_exposed - a.safety.pages_exposed;
                let mut window = b.safety.window.since(&a.safety.window);
                // Bounce slots keep their data until reused, which a large pool may not do within the
                // window: what is still readable counts too, exposed until the end (a lower bound).
                if let Some(open) = &b.open_windows {
                    settled += b.exposed_open;
                    exposed += b.exposed_open;
                    window.add(open);
                }
                Safety {
                    // A bounced device reaches only the shared pool, never the buffers themselves.
                    protected: info.translated || b.swiotlb.is_some(),
                    pages_settled: settled,
                    pages_exposed: exposed,
                    exposed_share: r6(ratio(exposed, settled)),
                    pages_exposed_at_end: b.exposed_open,
                    window: window.latency(r6),
                    sub_page: {
                        let h = b.safety.subpage_bytes.since(&a.safety.subpage_bytes);
                        let byte_ns = b.safety.subpage_byte_ns - a.safety.subpage_byte_ns;
                        SubPage {
                            buffers: b.safety.subpage_buffers - a.safety.subpage_buffers,
                            bytes_p50: h.quantile(0.5),
                            bytes_p99: h.quantile(0.99),
                            bytes_max: h.max(),
                            mean_reachable_bytes: r6(
                                byte_ns as f64 / (b.time - a.time).max(1) as f64
                            ),
                        }
                    },
                }
            },
            latency: b.wl.latency.since(&a.wl.latency).latency(r6),
            map_latency_us: map_bench.map(|m| AvgStddev::of_100ns(m.map_100ns())),
            unmap_latency_us: map_bench.map(|m| AvgStddev::of_100ns(m.unmap_100ns())),
            map_benchmark: map_bench
                .zip(info.map_benchmark)
                .map(|(m, o)| MapBenchmarkCounts {
                    threads: o.threads,
                    seconds: r6(secs),
                    node: o.node,
                    dma_dir: o.dma_dir.as_str(),
                    granule: o.granule,
                    loops: m.loops,
                    map_failures: m.map_failures,
                    loops_per_sec_per_thread: r6(m.loops as f64
                        / secs
                        / b.cpus.len().max(1) as f64),
                    map_ns_mean: r6(ratio(m.sum_map_ns, m.loops)),
                    unmap_ns_mean: r6(ratio(m.sum_unmap_ns, m.loops)),
                }),
            swiotlb: b.swiotlb.as_ref().map(|y| {
                let x = a.swiotlb.clone().unwrap_or_default();
                let bytes = y.bounced_bytes - x.bounced_bytes;
                let maps = (y.bounces - x.bounces) - (y.full_events - x.full_events);
                Swiotlb {
                    bounces: y.bounces - x.bounces,
                    bounced_bytes: bytes,
                    copies: y.copies - x.copies,
                    bounced_gbps: r6(bytes as f64 * 8.0 / secs / 1e9),
                    full_events: y.full_events - x.full_events,
                    too_large: y.too_large - x.too_large,
                    high_water_slots: y.high_water_slots,
                    pool_slots: y.pool_slots,
                    used_slots: y.used_slots,
                    transient_pools: y.transient_pools - x.transient_pools,
                    pools_added: y.pools_added - x.pools_added,
                    slots_searched_per_map: r6(ratio(y.slots_searched - x.slots_searched, maps)),
                }
            }),
            attack: b.attack.as_ref().map(|y| {
                let x = a.attack.clone().unwrap_or_default();
                let unmapped = y.reached_unmapped - x.reached_unmapped;
                Attack {
                    probes: y.probes - x.probes,
                    reached_mapped: y.reached_mapped - x.reached_mapped,
                    reached_unmapped: unmapped,
                    reached_unmapped_bytes: unmapped * crate::hw::PAGE_SIZE,
                    reached_released: y.reached_released - x.reached_released,
                }
            }),
            vm_exits,
            emulator,
            cpu_breakdown,
            utilisation,
            limited_by,
            warnings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn r6_keeps_six_significant_digits() {
        assert_eq!(r6(1.23456789), 1.23457);
        assert_eq!(r6(98765.4321), 98765.4);
        assert_eq!(r6(0.000123456789), 0.000123457);
        assert_eq!(r6(0.0), 0.0);
    }
}
