//! Replay of a real kernel's DMA-mapping trace: the `iommu:map` / `iommu:unmap` events a Linux host recorded
//! drive the DMA layer's policy and the IOMMU model at the trace's own addresses and times, and what reached
//! the IOMMU is counted per phase (phases are bracketed by `TB_BEGIN name` / `TB_END name` trace markers).
//!
//! What the trace gives and what is inferred:
//! - Addresses: the kernel's own IOVAs and physical addresses are mapped and unmapped as traced (the
//!   simulated allocator is not used). An unmap of a range mapped before tracing began (a device's rings
//!   set up at probe) is honoured: its PTEs are reconstructed from the unmap event before they are cleared.
//! - `iotlb_sync_map` grouping: `iommu_map_sg()` traces one `map` per physically contiguous segment but
//!   calls `iotlb_sync_map` once, over IOVA it allocated in one piece, in a loop on one CPU in one context;
//!   and `dma_unmap_sg()` unmaps that whole IOVA range with one `unmap`. So `map` events of the same pid, CPU
//!   and context (interrupts may cut in) whose IOVA continues the previous one are a candidate group; the
//!   unmaps then settle it: each unmap covering some of its segments shows that those were one mapping call
//!   (one `iotlb_sync_map`). Contiguity alone is not enough: an IOVA freed by an interrupt is often handed
//!   out right above the previous mapping. The sync is issued when the group is settled and counted in the
//!   phase its maps were in. A candidate that no unmap of its own will settle (never unmapped, or overlapped
//!   by a later map, which shows it to be another device's domain: one domain never hands out an IOVA it
//!   still has mapped) is split as the settled groups of its phase were: one call if that phase saw a
//!   multi-segment group, else one call per map event.
//! - Time: the trace clock drives the flush queue's timer, which fires on a scheduler tick. Where the ticks
//!   fall on the trace clock (and how late the timer softirq runs) is not in the trace, but the trace shows
//!   its effect: a lazily unmapped IOVA is handed out again only after a flush. So a lazy replay runs
//!   [`TICK_CANDIDATES`] tick phases side by side and, per phase of the trace, reports the one whose flushes
//!   leave the fewest IOVAs mapped again while the model still holds them queued ("early reuses").
//! - Devices: the trace's `iommu:map` / `iommu:unmap` events do not say which device they belong to; kprobe
//!   labels and the DMA API's events do (route.rs, hold.rs). Without them all events go to one DMA domain
//!   (the IOVA collisions between devices' domains are only used to keep their map groups apart).
//! - Whose timer fired: a recorded firing names its domain by pointer; in a trace that names its domains by
//!   device only, the pointer is tied to the domain whose unmaps armed its timer (tie.rs).

mod bounce;
pub mod ftrace;
mod group;
mod hold;
mod replayer;
mod result;
mod route;
mod tie;
mod warnings;

use crate::dma::flush_queue::{FlushQueue, FqOptions};
use crate::dma::locality::ReuseDistance;
use crate::dma::{default_domain, DmaCore, DmaLayer};
use crate::hw::{self, PAGE_SHIFT};
use crate::input::InputError;
use crate::metrics::IovaLocality;
use crate::scenario::{load, PolicyName, Source, Vendor};
use crate::sim::{PerCpu, Time};
pub use bounce::{BounceGuest, BounceModel, BouncePhase, BounceSummary, SwiotlbParam};
use ftrace::{EventHead, Record};
use group::{marked, meeting, Grouper, Marked, Op, PhaseName};
use hold::{Held, Holdback};
use replayer::{pfn, Queued, Replayer};
use result::{pick_tick_phases, Totals};
pub use result::{
    Anomalies, Counts, Domains, Lines, Named, Phase, Phases, RecordedTimer, ReplayResult, TickFit,
};
use route::Router;
use smallvec::SmallVec;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::sync::Arc;
use tie::{Ties, Waiting};
use warnings::{warnings, PassedOver};

/// What the replayed host was.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub vendor: Vendor,
    pub caching_mode: bool,
    pub ats: bool,
    /// With `ats`: the phases whose traffic comes from a device using ATS (empty: every device uses it).
    pub ats_phases: Vec<String>,
    /// `MAJOR.MINOR`.
    pub kernel: String,
    /// The kernel command line (default-domain rules), unless `mode` says the policy outright.
    pub cmdline: String,
    pub mode: Option<PolicyName>,
    /// CONFIG_HZ of the traced kernel.
    pub hz: u32,
    /// Where the traced kernel's scheduler tick fell on the trace clock, in ns mod one jiffy; None: inferred
    /// per phase from the trace (lazy mode only; see [`TICK_CANDIDATES`]).
    pub jiffy_phase_ns: Option<u64>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            vendor: crate::hw::drivers()[0].vendor(),
            caching_mode: false,
            ats: false,
            ats_phases: Vec::new(),
            kernel: "6.12".into(),
            cmdline: String::new(),
            mode: None,
            // Debian's x86-64 and arm64 kernels: CONFIG_HZ_250.
            hz: 250,
            jiffy_phase_ns: None,
        }
    }
}

/// Tick phases tried across one jiffy in a lazy replay.
pub const TICK_CANDIDATES: u64 = 16;

/// The phase events outside every marker pair belong to.
pub const OUTSIDE: &str = "_outside";
const BAD_EXAMPLES: usize = 5;
/// The most leaf entries one map event may write in the replay: 2^26 (256 GiB at 4 KiB, about 512 MiB of
/// modelled page table). A modelling bound that keeps an event within a second and a gigabyte; VFIO's
/// guest-RAM maps, larger than that in bytes, use 2 MiB or 1 GiB leaves and stay far below it.
pub const REPLAY_MAX_EVENT_PAGES: u64 = 1 << 26;
/// The most 4 KiB pages one unmap event may clear in the replay (1 TiB), for the same reason.
pub const REPLAY_MAX_UNMAP_PAGES: u64 = 1 << 28;

/// A replay fed line by line (or in arbitrary chunks of bytes), in constant memory.
pub struct ReplaySession {
    name: String,
    /// The replayers, here or on the model's thread.
    model: Model,
    /// Phases `--ats-phases` names.
    ats_phases: Vec<String>,
    /// Steps read and grouped, not yet replayed.
    batch: Batch,
    /// Per domain, its map events grouped into mapping calls.
    groups: Vec<Grouper>,
    /// Which domain each event goes to.
    router: Router,
    /// Records waiting for the DMA API event that names their device.
    hold: Holdback,
    lines: Lines,
    iommu: String,
    kernel: String,
    policy: PolicyName,
    policy_reason: String,
    hz: u32,
    /// The traced IOVAs' walk-cache locality (the same for every replayer: the trace chose the IOVAs), and
    /// that cache's size.
    locality: ReuseDistance,
    walk_cache_entries: u64,
    /// Bytes of a line not yet terminated (chunked input).
    partial: Vec<u8>,
    /// The IOMMU's input address space, in bytes: IOVAs at or above it cannot be mapped.
    iova_limit: u64,
    /// The page-table format, to count the leaf entries a map writes.
    fmt: hw::PtFormat,
    anomalies: Anomalies,
    last_ts: u64,
    /// The flush queue's timer, when the trace records it.
    recorded_timer: Option<RecordedTimer>,
    /// Whether recorded firings drive the timer, decided at the first: not in a trace with domain labels (it
    /// may show several domains, and a firing does not say whose) unless its firings name their domains.
    timer_drives: Option<bool>,
    /// The capture noted that each firing is followed by its flush naming the domain.
    timer_domains: bool,
    /// Recorded firings drive every domain's timer (not one domain's at a time, as they are tied to it).
    timer_global: bool,
    /// Firings' domain pointers tied to the domains a trace names by device only.
    ties: Ties,
    /// Firings waiting for their pointer to be tied, and the batches held back with them.
    waiting: Waiting,
    /// A recorded firing named its domain by pointer.
    timer_named_seen: bool,
    /// The newest kernel modelled, when the traced one is newer (replayed with that one's rules).
    newer_than: Option<(u32, u32)>,
    /// Per CPU, whether a recorded firing waits for the flush that names its domain.
    firing: PerCpu<bool>,
    /// Per CPU, whether the next unmap is an IOVA-API unlink (a `dma_iova_unlink()` kprobe line came first).
    unlinking: PerCpu<bool>,
    /// The swiotlb pool, driven by the DMA API's events where the trace bounces.
    bounce: bounce::BounceReplay,
}

/// Steps read before they are handed to the model together (small enough to stay in a core's cache on
/// its way from the reading thread to the model's).
const REPLAY_BATCH: usize = 1 << 12;
/// Batches read ahead of the model's threads at most (bounds the memory a fast reader can fill).
const REPLAY_BATCHES_AHEAD: usize = 4;

/// What the replayers do, in trace order.
#[derive(Debug, Clone)]
enum Step {
    /// An event at `ts` begins, when `known` domains have been seen: the timers due and the invalidations
    /// processed by then act first.
    At { ts: Time, known: usize },
    /// A step of domain `dom`'s replay.
    Do { dom: usize, op: Op },
    /// A marker line, to every domain.
    Marker(String),
    /// The trace records the flush queue's timer: the model's own timer stands down, in every domain (in one
    /// domain, its first recorded firing stands it down).
    TimerRecorded,
    /// The flush queue's timer of domain `dom` fired, as the trace recorded it (None: a firing passed over, its
    /// domain never known).
    Timer {
        ts: Time,
        cpu: u32,
        dom: Option<usize>,
    },
}

/// Steps read and grouped, for the model.
type Batch = Vec<Step>;

/// Where a domain's grouper puts its ops: straight into the batch, as that domain's steps.
struct ToBatch<'a> {
    batch: &'a mut Batch,
    dom: usize,
}

impl Extend<Op> for ToBatch<'_> {
    fn extend<I: IntoIterator<Item = Op>>(&mut self, ops: I) {
        let dom = self.dom;
        self.batch
            .extend(ops.into_iter().map(|op| Step::Do { dom, op }));
    }
}

/// Per tick phase tried (one unless lazy with the phase left to inference), one replayer per DMA domain the
/// trace shows: each its own IOVA space, page table, flush queue and timer.
type Replayers = Vec<(u64, Vec<Replayer>)>;

/// A model thread: the batches it is sent, and its share of the tick phases when it is done.
struct Worker {
    tx: std::sync::mpsc::SyncSender<Arc<Batch>>,
    done: std::thread::JoinHandle<Replayers>,
}

/// Where the replayers run: on the caller's thread (one core), or on threads of their own, each replaying
/// its share of the tick phases, fed the same batches through bounded channels, so that reading and
/// parsing the next batch overlaps replaying this one. The results do not depend on which: each replayer
/// sees the same events in the same order.
enum Model {
    Here(Box<Maker>, Replayers),
    Threads {
        workers: Vec<Worker>,
        /// Batches every worker is done with, for the reader to fill again (behind a lock only so that a
        /// session may be shared between threads, as Python objects are).
        spent: std::sync::Mutex<std::sync::mpsc::Receiver<Batch>>,
    },
}

impl Model {
    /// The replayers on up to `cores` threads of their own (on the caller's with one core).
    fn new(make: Maker, mut rs: Replayers, cores: usize) -> Self {
        if cores < 2 {
            return Model::Here(Box::new(make), rs);
        }
        let make = Arc::new(make);
        let (back, spent) = std::sync::mpsc::channel::<Batch>();
        let per = rs.len().div_ceil(cores.min(rs.len()));
        let mut workers = Vec::new();
        while !rs.is_empty() {
            let mut mine: Replayers = rs.drain(..per.min(rs.len())).collect();
            let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Batch>>(REPLAY_BATCHES_AHEAD);
            let (make, back) = (make.clone(), back.clone());
            let done = std::thread::spawn(move || {
                for batch in rx {
                    for (phase, doms) in mine.iter_mut() {
                        replay_events(&make, *phase, doms, &batch);
                    }
                    // The last worker done with a batch returns it (its buffer) to the reader.
                    if let Ok(b) = Arc::try_unwrap(batch) {
                        let _ = back.send(b);
                    }
                }
                mine
            });
            workers.push(Worker { tx, done });
        }
        Model::Threads {
            workers,
            spent: std::sync::Mutex::new(spent),
        }
    }

    /// An empty batch to fill: one the workers are done with, or a new one.
    fn empty_batch(&self) -> Batch {
        let mut b = match self {
            Model::Threads { spent, .. } => spent
                .lock()
                .ok()
                .and_then(|r| r.try_recv().ok())
                .unwrap_or_default(),
            Model::Here(..) => Vec::new(),
        };
        b.clear();
        b.reserve(REPLAY_BATCH);
        b
    }

    fn send(&mut self, batch: Batch) {
        match self {
            Model::Here(make, rs) => {
                for (phase, doms) in rs.iter_mut() {
                    replay_events(make, *phase, doms, &batch);
                }
            }
            Model::Threads { workers, .. } => {
                let batch = Arc::new(batch);
                for w in workers.iter() {
                    // A worker only stops by panicking: its panic comes out of the join in `finish`.
                    let _ = w.tx.send(batch.clone());
                }
            }
        }
    }

    /// Wait for every batch sent to be replayed; the replayers, in tick-phase order.
    fn finish(self) -> Replayers {
        match self {
            Model::Here(_, rs) => rs,
            Model::Threads { workers, .. } => workers
                .into_iter()
                .flat_map(|Worker { tx, done }| {
                    drop(tx);
                    done.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
                })
                .collect(),
        }
    }
}

/// One tick phase's replay of `batch`: each domain's steps to its replayer (created when first seen, in
/// the phase the others are in), markers and timers to all.
fn replay_events(make: &Maker, phase: u64, doms: &mut Vec<Replayer>, batch: &[Step]) {
    for step in batch {
        match step {
            &Step::At { ts, known } => {
                while doms.len() < known {
                    let mut r = make.replayer(phase);
                    r.phase = doms[0].phase.clone();
                    r.recorded = doms[0].recorded_all;
                    r.recorded_all = doms[0].recorded_all;
                    doms.push(r);
                }
                for r in doms.iter_mut() {
                    r.serve_phase();
                    r.fire_timers(ts);
                    // No device translates here: the invalidations the IOMMU had processed by this event
                    // act now, so they do not pile up over a long trace.
                    r.dma.core.iommu.translator_mut().settle(ts);
                }
            }
            Step::Do { dom, op } => doms[*dom].apply(op),
            Step::Marker(text) => doms.iter_mut().for_each(|r| r.marker(text)),
            Step::TimerRecorded => doms.iter_mut().for_each(|r| {
                r.recorded_all = true;
                r.timer_recorded();
            }),
            &Step::Timer { ts, cpu, dom } => {
                if let Some(d) = dom {
                    doms[d].recorded_timer(ts, cpu)
                }
            }
        }
    }
}

/// What a domain's replayer is built from.
struct Maker {
    platform: crate::scenario::Platform,
    kernel: (u32, u32),
    policy: PolicyName,
    hz: u32,
    vendor: Vendor,
    ats_phases: Vec<String>,
}

impl Maker {
    /// A replayer of one domain, its flush timer's tick at `phase` ns into each jiffy.
    fn replayer(&self, phase: u64) -> Replayer {
        let p = &self.platform;
        let mut core = DmaCore::new(hw::build(p, 1, self.kernel, false), 1, &p.cpu);
        core.iova_from_trace = true;
        // Replay reports what reached the IOMMU, not exposure windows.
        core.safety = crate::dma::safety::SafetyLog::off();
        let fq = FqOptions::for_device(p.iommu.shadow_on_flush);
        let mut dma = DmaLayer::new(core, self.policy, 1, self.hz, fq);
        if self.policy == PolicyName::Lazy {
            dma.policy = Box::new(FlushQueue::with_options(1, self.hz, fq).with_jiffy_phase(phase));
        }
        let mut r = Replayer {
            dma,
            totals: Totals {
                vendor: Some(self.vendor),
                ..Totals::default()
            },
            mark: Totals::default(),
            phase: None,
            phases: Phases::default(),
            queued: Queued::default(),
            queued_flushes: 0,
            timers: BTreeMap::new(),
            recorded: false,
            recorded_all: false,
            seq: 0,
            ats_phases: self.ats_phases.clone(),
            untraced_pages: 0,
            maps_over_live: 0,
            unmatched_markers: 0,
        };
        r.mark = r.counters();
        r
    }
}

impl ReplaySession {
    /// Set up the DMA layer and IOMMU for `opts`. `name` labels errors (the trace's file name).
    pub fn new(name: &str, opts: &ReplayOptions) -> Result<Self, InputError> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::on_cores(name, opts, cores)
    }

    /// As [`ReplaySession::new`], the model on up to `cores` threads (the results do not depend on it).
    fn on_cores(name: &str, opts: &ReplayOptions, cores: usize) -> Result<Self, InputError> {
        let drv = opts.vendor.driver();
        let (profile, arch) = drv.replay_profile();
        // A kernel after the newest modelled replays with that one's rules (scenario::rules_kernel).
        let kernel = crate::scenario::rules_kernel(&opts.kernel)
            .map_err(|m| InputError::new("--kernel", m))?;
        let mut ov: Vec<(String, String)> = vec![
            ("platform.profile".into(), profile.into()),
            ("platform.pcie.ats".into(), opts.ats.to_string()),
            ("os.kernel".into(), format!("\"{}.{}\"", kernel.0, kernel.1)),
            ("os.arch".into(), arch.as_str().into()),
            ("os.hz".into(), opts.hz.to_string()),
            ("workload.nic_rx.page_pool".into(), "false".into()),
            // The workload never runs; one queue fits every profile's CPUs (a guest's are few).
            ("workload.nic_rx.queues".into(), "1".into()),
            ("workload.nic_rx.flows".into(), "1".into()),
            ("os.policy".into(), "strict".into()),
        ];
        if let Some(key) = drv.caching_mode_key() {
            ov.push((
                format!("platform.iommu.{key}"),
                opts.caching_mode.to_string(),
            ));
        }
        let v = load(Source::Builtin("default"), &ov)?;
        let sc = &v[0].scenario;
        let (policy, policy_reason) = match opts.mode {
            Some(m) => (m, format!("set by --mode {}", m.as_str())),
            None => {
                let r = default_domain::resolve(
                    arch,
                    kernel,
                    &opts.cmdline,
                    opts.caching_mode,
                    opts.vendor.driver(),
                );
                (r.policy, r.reason)
            }
        };
        let make = Maker {
            platform: sc.platform.clone(),
            kernel,
            policy,
            hz: opts.hz,
            vendor: opts.vendor,
            ats_phases: opts.ats_phases.clone(),
        };
        let jiffy = 1_000_000_000 / opts.hz.max(1) as u64;
        let phases: Vec<u64> = match opts.jiffy_phase_ns {
            Some(p) => vec![p % jiffy],
            None if policy == PolicyName::Lazy => (0..TICK_CANDIDATES)
                .map(|k| k * jiffy / TICK_CANDIDATES)
                .collect(),
            None => vec![0],
        };
        let rs: Replayers = phases
            .into_iter()
            .map(|p| (p, vec![make.replayer(p)]))
            .collect();
        let iommu_name = rs[0].1[0].dma.core.iommu.name().to_string();
        let translated = rs[0].1[0].dma.policy.translated();
        let fmt = *rs[0].1[0].dma.core.iommu.translator().format();
        let entry_shift = fmt.walk_entry_shift();
        let iova_limit = (fmt.max_gpfn() + 1) << fmt.granule_shift;
        let ats_phases = make.ats_phases.clone();
        Ok(ReplaySession {
            name: name.to_string(),
            model: Model::new(make, rs, cores),
            ats_phases,
            batch: Vec::new(),
            groups: vec![Grouper::new(translated)],
            router: Router::default(),
            hold: Holdback::default(),
            lines: Lines::default(),
            iommu: iommu_name,
            kernel: opts.kernel.clone(),
            policy,
            policy_reason,
            hz: opts.hz,
            locality: ReuseDistance::new(entry_shift),
            walk_cache_entries: sc.platform.iommu.last_walk_cache_entries(),
            partial: Vec::new(),
            iova_limit,
            fmt,
            anomalies: Anomalies::default(),
            last_ts: 0,
            recorded_timer: None,
            timer_drives: None,
            timer_domains: false,
            timer_global: false,
            ties: Ties::new(opts.hz),
            waiting: Waiting::default(),
            timer_named_seen: false,
            newer_than: crate::scenario::parse_kernel(&opts.kernel)
                .is_err()
                .then_some(crate::scenario::KERNEL_NEWEST),
            firing: PerCpu::default(),
            unlinking: PerCpu::default(),
            bounce: bounce::BounceReplay::new(kernel, &opts.cmdline),
        })
    }

    /// Leaf entries a map of [iova, iova + size) at `paddr` writes, page sizes chosen as iommu_pgsize() does.
    fn leaves(&self, iova: u64, paddr: u64, size: u64) -> u64 {
        let g = self.fmt.granule_shift;
        let (mut i, mut p, mut left) = (iova >> g, paddr >> g, size.div_ceil(1 << g));
        let mut n = 0;
        while left > 0 {
            let (level, count) = self.fmt.pgsize(i, p, left);
            let step = (count << self.fmt.span_shift(level)).clamp(1, left);
            n += count.max(1);
            i += step;
            p += step;
            left -= step;
        }
        n
    }

    /// Why an event cannot be what the kernel did to this IOMMU, if it cannot: an empty range, or one that
    /// wraps or leaves the IOMMU's input address space (the page table cannot map it).
    fn out_of_range(&self, rec: &Record) -> Option<&'static str> {
        let within = |a: u64, n: u64| a.checked_add(n).is_some_and(|e| e <= self.iova_limit);
        match *rec {
            Record::Map {
                iova, paddr, size, ..
            } => {
                if size == 0 {
                    Some("a map of size 0")
                } else if !within(iova, size) {
                    Some("a map beyond the IOMMU's input address space")
                } else if paddr.checked_add(size).is_none() {
                    Some("a map whose physical range wraps past 2^64")
                } else if self.leaves(iova, paddr, size) > REPLAY_MAX_EVENT_PAGES {
                    Some("a map of more leaf entries than one event may write in the replay (2^26)")
                } else {
                    None
                }
            }
            Record::Unmap {
                iova,
                size,
                unmapped,
                ..
            } => {
                if !within(iova, size.max(unmapped)) {
                    Some("an unmap beyond the IOMMU's input address space")
                } else if size.max(unmapped) / hw::PAGE_SIZE > REPLAY_MAX_UNMAP_PAGES {
                    Some("an unmap of more than 1 TiB, more than one event may clear in the replay")
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// One line of the trace (without its line ending; a trailing CR is dropped).
    pub fn line(&mut self, text: &str) {
        self.lines.total += 1;
        let mut rec = ftrace::parse_line(text.trim_end_matches(['\n', '\r']), self.lines.total);
        if let Some(why) = self.out_of_range(&rec) {
            rec = Record::Bad {
                line: self.lines.total,
                why,
            };
        }
        match &rec {
            Record::Bounced { ev, dev } => {
                self.lines.events += 1;
                return self.bounce.bounced(ev, dev);
            }
            Record::SwiotlbNote(n) => return self.bounce.note(n),
            Record::Device { .. } if self.bounce.active() || self.bounce.forced() => {
                self.bounce.dma_line(text, self.lines.total)
            }
            Record::Marker { text, .. } => self.bounce.marker(text),
            _ => {}
        }
        match rec {
            Record::Other => return,
            Record::Bad { line, why } => {
                self.lines.bad += 1;
                if self.lines.bad_examples.len() < BAD_EXAMPLES {
                    self.lines.bad_examples.push(format!("{line}: {why}"));
                }
                return;
            }
            rec if self.hold.bypass() => return self.record(rec, None),
            rec => self.hold.push(rec),
        }
        self.release(false);
    }

    /// Replay the records the hold-back lets go (all of them at the end).
    fn release(&mut self, end: bool) {
        while let Some(Held { rec, dev }) = self.hold.pop(end) {
            self.record(rec, dev.as_deref());
        }
    }

    /// One record, in trace order, with the device a DMA API event named for it.
    fn record(&mut self, rec: Record, dev: Option<&str>) {
        let ev = match &rec {
            Record::Map { ev, .. } | Record::Unmap { ev, .. } | Record::Marker { ev, .. } => ev,
            Record::Domain {
                ev, map, dom, iova, ..
            } => {
                self.router.hints.insert(ev.cpu, (*map, *dom, *iova));
                return;
            }
            Record::Timer { ev, dom } => return self.timer_line(ev, *dom),
            Record::FlushAll { ev, dom } => {
                // The flush of a recorded firing on this CPU (any other is a full ring's, replayed already).
                if self.timer_domains && std::mem::take(self.firing.get_mut(ev.cpu as usize)) {
                    self.timer_named(ev.ts_ns, ev.cpu, *dom);
                }
                return;
            }
            Record::TimerDomains => {
                self.timer_domains = true;
                return;
            }
            Record::IovaUnlink { ev } => {
                *self.unlinking.get_mut(ev.cpu as usize) = true;
                return;
            }
            Record::Other
            | Record::Bad { .. }
            | Record::Device { .. }
            | Record::Group { .. }
            | Record::Bounced { .. }
            | Record::SwiotlbNote(_) => return,
        };
        self.lines.events += 1;
        if ev.ts_ns < self.last_ts {
            self.anomalies.time_backwards += 1;
        }
        self.last_ts = self.last_ts.max(ev.ts_ns);
        if let Record::Map { iova, .. } | Record::Unmap { iova, .. } = &rec {
            if iova % hw::PAGE_SIZE != 0 {
                self.anomalies.unaligned += 1;
            }
        }
        if let Record::Map { iova, .. } = &rec {
            self.locality.allocated(pfn(*iova));
        }
        // The event's domain, the same for every tick phase tried (the trace decides it, not the timers).
        let dom = match &rec {
            Record::Map { ev, iova, size, .. } => {
                Some(self.router.route(ev, true, *iova, *size, dev))
            }
            Record::Unmap {
                ev,
                iova,
                size,
                unmapped,
            } => Some(
                self.router
                    .route(ev, false, *iova, (*unmapped).max(*size), dev),
            ),
            _ => None,
        };
        if let (Some(d), Record::Unmap { ev, .. }) = (dom, &rec) {
            if self.router.by_device_only() {
                self.ties.unmapped(d, ev.ts_ns);
            }
        }
        let known = self.router.domains();
        while self.groups.len() < known {
            let g = self.groups[0].another_domain();
            self.groups.push(g);
        }
        self.batch.push(Step::At {
            ts: ev.ts_ns,
            known,
        });
        // Which map events were one call is the trace's to tell (the same for every tick phase tried).
        let mut ops = ToBatch {
            batch: &mut self.batch,
            dom: dom.unwrap_or(0),
        };
        match rec {
            Record::Map {
                ref ev,
                iova,
                paddr,
                size,
            } => self.groups[dom.expect("routed")].map(ev, iova, paddr, size, &mut ops),
            Record::Unmap {
                ref ev,
                iova,
                size,
                unmapped,
            } => {
                let synced = std::mem::take(self.unlinking.get_mut(ev.cpu as usize));
                self.groups[dom.expect("routed")].unmap(ev, iova, size, unmapped, synced, &mut ops)
            }
            Record::Marker { text, .. } => {
                self.groups.iter_mut().for_each(|g| g.marker(&text));
                self.batch.push(Step::Marker(text));
            }
            _ => {}
        }
        if self.batch.len() >= REPLAY_BATCH {
            self.replay_batch(false);
        }
    }

    /// A kprobe line of fq_flush_timeout(): the flush queue's timer fired on its CPU, naming its domain's
    /// pointer where the capture read it.
    fn timer_line(&mut self, ev: &EventHead, dom: Option<u64>) {
        if self.policy != PolicyName::Lazy {
            return;
        }
        self.timer_record();
        if self.timer_domains {
            // Its flush, next on this CPU, names the domain.
            if !std::mem::replace(self.firing.get_mut(ev.cpu as usize), true) {
                return;
            }
            // The CPU's last firing saw no flush, and fq_flush_timeout() always flushes: the probe is on a
            // driver not in use (a capture that probed one driver only). The firings waiting are lost; from
            // now on each names its domain by its fq_domain.
            self.timer_domains = false;
            self.drop_waiting_firings();
        }
        if let Some(ptr) = dom {
            self.timer_named(ev.ts_ns, ev.cpu, ptr);
        } else {
            let d = (self.router.domains() == 1).then_some(0);
            self.timer_fired(ev.ts_ns, ev.cpu, false, d);
        }
    }

    /// A recorded firing at `ts` that names its domain by pointer: the domain of that pointer's kprobe labels,
    /// the device-named domain the pointer is tied to (a trace that names devices only), or the one domain of a
    /// trace without labels.
    fn timer_named(&mut self, ts: Time, cpu: u32, ptr: u64) {
        self.timer_named_seen = true;
        if self.router.by_device_only() {
            return self.tied_firing(ts, cpu, ptr);
        }
        let d = if self.router.labels_seen() {
            self.router.ptr_domain(ptr)
        } else {
            Some(0)
        };
        self.timer_fired(ts, cpu, true, d);
    }

    /// A recorded firing naming pointer `ptr` in a trace that names its domains by device only: replayed on the
    /// domain the pointer is tied to, or waiting, with the steps after it, until the pointer is tied. A domain's
    /// own timer stands down at its first firing; the others keep theirs.
    fn tied_firing(&mut self, ts: Time, cpu: u32, ptr: u64) {
        let dom = self.ties.fired(ptr, ts);
        self.timer_drives = Some(true);
        self.timer_record().by_domain = true;
        let known = self.router.domains();
        self.batch.push(Step::At { ts, known });
        self.batch.push(Step::Timer { ts, cpu, dom });
        match dom {
            Some(_) => self.timer_record().firings += 1,
            None => self.waiting.wait(&self.batch, ptr),
        }
        for (p, d) in self.ties.take_tied() {
            let n = self.waiting.tied(&mut self.batch, p, d);
            self.timer_record().firings += n;
        }
    }

    /// A recorded firing of domain `dom`'s flush timer at `ts` (its flush's time, where the trace names the
    /// domain that way), or of an unknown domain's: replayed if recorded firings drive the timer. `named`:
    /// the firing named a domain.
    fn timer_fired(&mut self, ts: Time, cpu: u32, named: bool, dom: Option<usize>) {
        let drives = match (self.timer_drives, named, dom) {
            (Some(d), ..) => d,
            // A domain the labels do not know (yet: its queue may hold unmaps from before tracing began)
            // decides nothing; the first firing of a known one does.
            (None, true, None) if self.router.labels_seen() => false,
            _ => self.timer_drives(named && dom.is_some()),
        };
        match dom {
            Some(dom) if drives => {
                let known = self.router.domains();
                self.timer_record().firings += 1;
                self.batch.push(Step::At { ts, known });
                self.batch.push(Step::Timer {
                    ts,
                    cpu,
                    dom: Some(dom),
                });
            }
            _ => self.timer_ignored(),
        }
    }

    fn timer_ignored(&mut self) {
        self.timer_record().ignored += 1;
    }

    /// Firings still waiting for the flush that names their domain are lost: passed over.
    fn drop_waiting_firings(&mut self) {
        let waiting = self
            .firing
            .iter_mut()
            .map(std::mem::take)
            .filter(|&f| f)
            .count();
        if waiting > 0 {
            self.timer_record().ignored += waiting as u64;
        }
    }

    /// What the trace's record of the flush timer came to so far (it has one).
    fn timer_record(&mut self) -> &mut RecordedTimer {
        self.recorded_timer
            .get_or_insert_with(RecordedTimer::default)
    }

    /// Whether recorded firings drive the flush timer, decided once, at the first firing that can decide: when
    /// the trace shows no domain labels (its firings are then its one domain's), or the firing named a domain
    /// the labels know (`named`; a domain read at the wrong offset never is, and then the model's own timers
    /// keep running). Deciding yes stands the model's own timer down.
    fn timer_drives(&mut self, named: bool) -> bool {
        if let Some(d) = self.timer_drives {
            return d;
        }
        let labels = self.router.labels_seen();
        let d = named || !labels;
        self.timer_drives = Some(d);
        if d {
            // A domain named by device only stands its own timer down at its first tied firing.
            if !self.router.by_device_only() {
                self.timer_global = true;
                self.batch.push(Step::TimerRecorded);
            }
            if let Some(t) = self.recorded_timer.as_mut() {
                t.by_domain = named && labels;
            }
        }
        d
    }

    /// Hand the events read so far to the model (but those behind a firing whose domain is not known yet,
    /// unless this is the `end`).
    fn replay_batch(&mut self, end: bool) {
        let batch = std::mem::replace(&mut self.batch, self.model.empty_batch());
        let (ready, passed) = self.waiting.ready(batch, end);
        if passed > 0 {
            self.timer_record().ignored += passed;
        }
        for b in ready.into_iter().filter(|b| !b.is_empty()) {
            self.model.send(b);
        }
    }

    /// A chunk of trace bytes, cut anywhere (a line split across chunks is joined). A line longer than
    /// [`ftrace::MAX_LINE_BYTES`] is an error, wherever the chunks cut it: nothing longer is buffered.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), InputError> {
        while let Some(nl) = memchr::memchr(b'\n', bytes) {
            let (head, rest) = bytes.split_at(nl);
            bytes = &rest[1..];
            if self.partial.len() + head.len() > ftrace::MAX_LINE_BYTES {
                return Err(self.line_too_long());
            }
            if self.partial.is_empty() {
                // Valid UTF-8 (the usual case) is read in place; anything else with replacement characters.
                match std::str::from_utf8(head) {
                    Ok(text) => self.line(text),
                    Err(_) => self.line(&String::from_utf8_lossy(head)),
                }
            } else {
                let mut l = std::mem::take(&mut self.partial);
                l.extend_from_slice(head);
                let text = String::from_utf8_lossy(&l).into_owned();
                self.line(&text);
            }
        }
        if self.partial.len() + bytes.len() > ftrace::MAX_LINE_BYTES {
            return Err(self.line_too_long());
        }
        self.partial.extend_from_slice(bytes);
        Ok(())
    }

    /// The error of a line over [`ftrace::MAX_LINE_BYTES`] (the line after the last one read).
    fn line_too_long(&self) -> InputError {
        InputError::new(
            format!("{}:{}", self.name, self.lines.total + 1),
            format!(
                "a line longer than {} bytes; expected ftrace text",
                ftrace::MAX_LINE_BYTES
            ),
        )
    }

    /// End of the trace: close the last map group, run the timers still armed, and report. A trace in which
    /// nothing could be read is an error.
    pub fn finish(mut self) -> Result<ReplayResult, InputError> {
        if !self.partial.is_empty() {
            let l = std::mem::take(&mut self.partial);
            self.line(&String::from_utf8_lossy(&l));
        }
        self.release(true);
        self.drop_waiting_firings();
        // The candidates still waiting for unmaps, synced as their phases' settled ones were.
        for (dom, g) in self.groups.iter_mut().enumerate() {
            g.sync_leftovers(&mut ToBatch {
                batch: &mut self.batch,
                dom,
            });
        }
        self.replay_batch(true);
        let lines = self.lines;
        if lines.events == 0 {
            return Err(InputError::new(
                &self.name,
                format!(
                    "no iommu:map, iommu:unmap or trace-marker events in {} lines ({} unreadable{}); expected them as tracefs's trace or trace_pipe, `trace-cmd report` or `perf script` print them",
                    lines.total,
                    lines.bad,
                    lines
                        .bad_examples
                        .first()
                        .map(|e| format!(", first at line {e}"))
                        .unwrap_or_default()
                ),
            ));
        }
        let rs = self.model.finish();
        let mut anomalies = self.anomalies;
        let ats_phases = self.ats_phases;
        anomalies.untraced_unmapped_pages = rs[0].1.iter().map(|r| r.untraced_pages).sum();
        anomalies.maps_over_live = rs[0].1.iter().map(|r| r.maps_over_live).sum();
        anomalies.unmatched_markers = rs[0].1[0].unmatched_markers;
        let names = self.router.names(&self.hold.groups());
        let domains = Domains {
            count: self.router.domains() as u64,
            labelled_events: self.router.labelled,
            inferred_events: self.router.inferred,
            devices: Named(names.clone()),
        };
        // Domains the recorded firings drove: all, or those their pointers were tied to.
        let driven = if self.timer_global {
            domains.count
        } else {
            self.ties.tied
        };
        let recorded_timer = self.recorded_timer.map(|t| RecordedTimer {
            tied: self.ties.tied,
            own_timer_domains: domains.count.saturating_sub(driven),
            ..t
        });
        let fit = rs.len() > 1;
        // Per tick phase tried: every domain's counts, added up phase by phase.
        let mut done: Vec<(u64, Phases)> = rs
            .into_iter()
            .map(|(phase, doms)| {
                let mut sum = Phases::default();
                for (mut r, (name, _)) in doms.into_iter().zip(&names) {
                    r.fire_timers(Time::MAX);
                    r.commit();
                    sum.add(name, &r.phases);
                }
                (phase, sum)
            })
            .collect();
        let mut phases = if fit {
            pick_tick_phases(&done)
        } else {
            done.swap_remove(0).1
        };
        let swiotlb = self.bounce.summary();
        if swiotlb.is_some() {
            for (name, b) in std::mem::take(&mut self.bounce.phases) {
                phases.entry(&name).swiotlb = Some(b);
            }
        }
        // Every phase the trace began has an entry (the replay commits it at its end).
        if let Some(p) = ats_phases.iter().find(|p| phases.get(p).is_none()) {
            let names: Vec<&str> = phases
                .iter()
                .map(|(n, _)| n)
                .filter(|n| *n != OUTSIDE)
                .collect();
            let names = if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            };
            return Err(InputError::new(
                &self.name,
                format!(
                    "--ats-phases {p}: the trace has no phase of that name (its phases: {names})"
                ),
            ));
        }
        let passed_over = if self.ties.seen() {
            PassedOver::Untied
        } else if self.timer_named_seen {
            PassedOver::Unnamed
        } else {
            PassedOver::NotSaid
        };
        let mut r = ReplayResult {
            iommu: self.iommu,
            kernel: self.kernel,
            policy: self.policy.as_str().to_string(),
            policy_reason: self.policy_reason,
            hz: self.hz,
            lines,
            anomalies,
            iova_locality: IovaLocality::new(&self.locality.counts, self.walk_cache_entries),
            domains,
            recorded_timer,
            swiotlb,
            phases,
            warnings: Vec::new(),
        };
        r.warnings = warnings(&r, self.newer_than, passed_over);
        Ok(r)
    }
}

/// Replay a whole trace from a reader (fed as it is buffered, so a line is as bounded as in [`ReplaySession::feed`]).
pub fn replay<R: BufRead>(
    mut input: R,
    name: &str,
    opts: &ReplayOptions,
) -> Result<ReplayResult, InputError> {
    let mut s = ReplaySession::new(name, opts)?;
    loop {
        let buf = input
            .fill_buf()
            .map_err(|e| InputError::new(name, format!("cannot read: {e}")))?;
        if buf.is_empty() {
            break;
        }
        let n = buf.len();
        s.feed(buf)?;
        input.consume(n);
    }
    s.finish()
}

#[cfg(test)]
mod tests;
