//! Running a scenario: build the host from the scenario, drive events, take counter snapshots.

use crate::dma::attack::Replay;
use crate::dma::flush_queue::FqOptions;
use crate::dma::iova::IOVA_DEPOT_DELAY_NS;
use crate::dma::{default_domain, DmaCore, DmaLayer};
use crate::host::{Event, Host};
use crate::metrics::{RunInfo, RunResult, Snapshot};
use crate::scenario::{PolicyName, Scenario, Variant};
use crate::sim::{Ctx, Rng, Time, NS_PER_MS};
use crate::workload::{
    l2fwd::L2fwdWorkload, map_benchmark::MapBenchmarkWorkload, nic_rx::NicRxWorkload,
    nic_tx::NicTxWorkload, nvme::NvmeWorkload, rr::RrWorkload, virtio_net::VirtioNetWorkload,
    Workload,
};

/// The malicious device replays in rounds this far apart (a modelling batch like the wire chunk, not a device
/// property: the rate is `attack.replay_per_sec`, carried across rounds).
const ATTACK_TICK_NS: Time = 1000;

pub struct Simulation {
    host: Host,
    workload: Box<dyn Workload>,
    now: Time,
    warmup_end: Time,
    end: Time,
    start: Option<Snapshot>,
    /// Malicious-device probes per second, and the fraction of a probe carried to the next tick.
    attack_rate: f64,
    attack_owed: f64,
    scenario: String,
    label: String,
    policy: PolicyName,
    policy_reason: String,
    /// What the user should know about the policy on this workload (empty: nothing).
    policy_note: String,
    seed: u64,
    /// The DMA map benchmark's options, as its results report them.
    map_benchmark: Option<crate::scenario::MapBenchmark>,
    /// Entries of the platform's last walk cache (PTcache-L3), for the IOVA locality result.
    walk_cache_entries: u64,
    /// Events processed so far, and why the run stopped early (see [`MAX_EVENTS_PER_SIM_MS`]).
    events: u64,
    stopped: Option<String>,
    /// (events per simulated ms, events before it looks): the watchdog's bound.
    watchdog: (u64, u64),
}

/// The watchdog's bound: a run that processes more events than this per simulated millisecond (on
/// average since its start, once it has processed [`WATCHDOG_MIN_EVENTS`]) is stopped with an error. The
/// built-in scenarios take 0.7-10 k events per simulated ms (c2 passthrough the most; 200 Gbps strict RX
/// on 16 queues 1.2 k); a run a hundred times busier than the busiest would take minutes per simulated
/// second. A modelling bound, not a kernel one.
pub const MAX_EVENTS_PER_SIM_MS: u64 = 1_000_000;
/// Events a run may process before the watchdog looks (set-up bursts at time 0 are not a rate).
pub const WATCHDOG_MIN_EVENTS: u64 = 2_000_000;

fn ms_to_ns(ms: f64) -> Time {
    (ms * NS_PER_MS as f64).round() as Time
}

/// The measured window: the run's duration, or the map benchmark's `seconds`.
fn window_ns(sc: &Scenario) -> Time {
    match sc
        .workload
        .dma_map_benchmark
        .as_ref()
        .and_then(|m| m.seconds)
    {
        Some(s) => s as Time * crate::sim::NS_PER_SEC,
        None => ms_to_ns(sc.run.duration_ms),
    }
}

/// A device on real hardware (a NIC, an NVMe drive) rather than the VMM's software: on a guest platform it is
/// VFIO-assigned.
fn hardware_device(sc: &Scenario) -> bool {
    let w = &sc.workload;
    w.nic_rx.is_some() || w.nic_tx.is_some() || w.rr.is_some() || w.nvme.is_some()
}

/// The platform as the device sees it: vhost-net's device IOTLB is the guest's device TLB (QEMU's
/// intel_iommu with device-iotlb=on, its misses and invalidations messages between vhost and QEMU). (A
/// VFIO-assigned device's host IOMMU is in the platform already: the loader takes it from the host profile.)
fn device_platform(sc: &Scenario) -> crate::scenario::Platform {
    let mut p = sc.platform.clone();
    let Some(h) = p.kvm.clone().filter(|_| p.hypervisor.is_some()) else {
        return p;
    };
    // A DPDK guest's backend (vhost-net, or DPDK's vhost-user whose lib/vhost/iotlb.c has vhost-net's
    // IOTLB_CACHE_SIZE and miss path) always has a device IOTLB.
    let vhost = sc.workload.virtio_net.as_ref().is_some_and(|vn| vn.vhost);
    if vhost || sc.workload.l2fwd.is_some() {
        p.pcie.ats = true;
        p.pcie.atc_entries = h.vhost_iotlb_entries;
        p.pcie.atc_ways = h.vhost_iotlb_entries;
        p.pcie.ats_inv_ns = h.vhost_invalidate_ns;
    }
    p
}

/// The simulated machine of a scenario: its IOMMU with the device attached, the DMA layer under the
/// resolved policy (and why it was chosen), CPUs and memory.
pub(crate) fn build_host(sc: &Scenario) -> (Host, PolicyName, String) {
    let p = &device_platform(sc);
    let kernel = crate::scenario::parse_kernel(&sc.os.kernel).expect("validated");
    let (policy, policy_reason) = match sc.os.policy {
        PolicyName::Auto => {
            let r = default_domain::resolve(
                sc.os.arch,
                kernel,
                &sc.os.cmdline,
                p.vendor.driver().caching_mode(&p.iommu),
                p.vendor.driver(),
            );
            (r.policy, r.reason)
        }
        other => (other, "set by os.policy".to_string()),
    };
    let cpus = p.cpu.cores as usize;
    let mut iommu = crate::hw::build(p, cpus, kernel, hardware_device(sc));
    // The device is attached to its DMA domain at probe, before any traffic.
    iommu.attach_dev(0, 0, 1);
    let layer = |iommu, dom| {
        let mut core = DmaCore::new(iommu, cpus, &p.cpu);
        core.iovad.follow_layout_of(kernel.into());
        core.map_pages = crate::kernel::KernelVersion::from(kernel) >= core.iommu.map_pages_since();
        core.dom = dom;
        DmaLayer::new(
            core,
            policy,
            cpus,
            sc.os.hz,
            FqOptions::for_device(p.iommu.shadow_on_flush),
        )
    };
    let mut rng = Rng::new(sc.run.seed);
    let host_rng = rng.fork(1);
    let mut host = Host::new(cpus, layer(iommu, 1), p.clone(), host_rng, {
        let mut cfs = crate::sim::Cfs::for_cores(p.cpu.cores);
        if let Some(us) = sc.os.sched_wakeup_granularity_us {
            cfs.wakeup_granularity = us as u64 * 1000;
        }
        cfs
    });
    // Drives on root ports of their own: an IOMMU group, so a default domain, each (iommu_group_alloc_default_domain).
    for d in 1..domains_of(sc) {
        let dom = d as u16 + 1;
        let i = host.add_domain(layer(crate::hw::stand_in(p, cpus, kernel), dom));
        host.lend(i).core.iommu.attach_dev(0, 0, dom);
    }
    host.lend(0);
    // dma-direct bounces; dma-iommu does not for a trusted device (dev_use_swiotlb).
    if !host.dma.policy.translated() {
        host.dma.swiotlb = swiotlb_of(sc, p, kernel).map(crate::dma::swiotlb::Swiotlb::new);
    }
    if sc.os.coco != crate::scenario::Coco::None {
        host.dma.decrypt_page_ns = p.host_kvm().coco_share_page_ns;
    }
    (host, policy, policy_reason)
}

/// The device's swiotlb pool where its streaming DMA bounces: in a confidential guest
/// (force_dma_unencrypted) or with `swiotlb=force`. NVMe asks for its pages' offsets to be kept
/// (nvme_probe: dma_set_min_align_mask(NVME_CTRL_PAGE_SIZE - 1)).
fn swiotlb_of(
    sc: &Scenario,
    p: &crate::scenario::Platform,
    kernel: (u32, u32),
) -> Option<crate::dma::swiotlb::SwiotlbConfig> {
    use crate::dma::swiotlb::{SwiotlbConfig, SwiotlbCosts, IO_TLB_SHIFT};
    let (coco, o) = (sc.os.coco, &sc.os.swiotlb);
    if coco == crate::scenario::Coco::None && !o.force {
        return None;
    }
    let k = crate::kernel::KernelVersion::from(kernel);
    let memory = p.memory.pages * crate::hw::PAGE_SIZE;
    let areas = if coco.restricted_pool() { 1 } else { o.areas };
    let (slots, areas) = SwiotlbConfig::pool(
        k,
        o.slabs.map(|n| n << IO_TLB_SHIFT),
        areas,
        p.cpu.cores,
        coco.sizes_swiotlb(),
        memory,
    );
    let factor = match (coco, &p.kvm) {
        (crate::scenario::Coco::None, _) | (_, None) => 1.0,
        (_, Some(h)) => h.coco_copy_factor,
    };
    Some(SwiotlbConfig {
        slots,
        areas,
        dynamic: o.dynamic,
        max_slots: memory >> IO_TLB_SHIFT,
        min_align_mask: if sc.workload.nvme.is_some() { 4095 } else { 0 },
        debugfs: o.debugfs,
        costs: SwiotlbCosts {
            op_ns: p.cpu.swiotlb_op_ns,
            slot_ns: p.cpu.swiotlb_slot_ns,
            copy_ns_per_byte: p.cpu.copy_ns_per_byte * factor,
            lock_ns: p.cpu.lock_ns,
            coh: p.cpu.coherence(),
        },
    })
}

/// The DMA domains of a scenario's devices: one per IOMMU group. Drives behind one bridge without ACS share
/// a group (pci_device_group); drives on separate root ports get one each.
pub(crate) fn domains_of(sc: &Scenario) -> usize {
    match &sc.workload.nvme {
        Some(n) if !n.same_bridge => n.drives as usize,
        _ => 1,
    }
}

/// The variants of built-in scenario `name` with `key=value` overrides, for tests.
#[cfg(test)]
pub(crate) fn builtin_with(name: &str, ov: &[(&str, &str)]) -> Vec<Variant> {
    let ov: Vec<(String, String)> = ov
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    crate::scenario::load(crate::scenario::Source::Builtin(name), &ov).unwrap()
}

/// A host of the built-in default scenario under `policy`, for unit tests of workload parts.
#[cfg(test)]
pub(crate) fn test_host(policy: &str) -> Host {
    build_host(&builtin_with("default", &[("os.policy", policy)])[0].scenario).0
}

impl Simulation {
    /// A simulation of `v`, for callers that know it sets up (tests, benches): see [`Simulation::try_new`].
    pub fn new(v: &Variant) -> Self {
        Simulation::try_new(v).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A simulation of `v`, or why it cannot run: the simulated memory ran out while the workload set
    /// up its rings and buffers.
    pub fn try_new(v: &Variant) -> Result<Self, String> {
        let sc = &v.scenario;
        let p = &sc.platform;
        let (mut host, policy, policy_reason) = build_host(sc);
        // FANDS changes only how mlx5's multi-packet RX WQEs are mapped: say so where there are none.
        let fands_blocks = sc
            .workload
            .nic_rx
            .as_ref()
            .is_some_and(|n| n.rq == crate::scenario::RqKind::Mlx5Striding);
        let policy_note = if policy == PolicyName::Fands && !fands_blocks {
            "FANDS maps mlx5 striding-RQ WQEs as IOVA blocks; this workload has none, so every mapping is strict (with the F&S dmar.c IH change)".to_string()
        } else {
            String::new()
        };
        let w = &sc.workload;
        let (link, slots) = (p.pcie.link_gbps, p.pcie.translation_slots);
        let mut workload: Box<dyn Workload> = if let Some(nic) = &w.nic_rx {
            Box::new(NicRxWorkload::new(
                nic,
                link,
                slots,
                p.pcie.device_buffer_bytes,
                p.cpu.cores as usize,
                crate::scenario::parse_kernel(&sc.os.kernel)
                    .expect("validated")
                    .into(),
            ))
        } else if let Some(nic) = &w.nic_tx {
            Box::new(NicTxWorkload::new(nic, link, slots))
        } else if let Some(rr) = &w.rr {
            Box::new(RrWorkload::new(rr, link, slots))
        } else if let Some(nvme) = &w.nvme {
            Box::new(NvmeWorkload::new(nvme, link, slots))
        } else if let Some(mb) = &w.dma_map_benchmark {
            host.lend(0).core.set_dma_mask_bits(mb.dma_bits);
            Box::new(MapBenchmarkWorkload::new(
                mb,
                p.cpu.socket_cores,
                p.cpu.memset_ns_per_byte,
            ))
        } else if let (Some(vn), Some(_)) = (&w.virtio_net, &p.hypervisor) {
            Box::new(VirtioNetWorkload::new(
                vn,
                p.host_kvm(),
                p.cpu.cores as usize,
                crate::scenario::parse_kernel(&sc.os.kernel)
                    .expect("validated")
                    .into(),
            ))
        } else if let (Some(l2), Some(_)) = (&w.l2fwd, &p.hypervisor) {
            Box::new(L2fwdWorkload::new(l2, p.host_kvm(), p.cpu.cores as usize))
        } else {
            unreachable!("validated: a workload is present")
        };
        let attack_rate = sc.attack.replay_per_sec;
        if attack_rate > 0.0 {
            let identity = !host.dma.policy.translated();
            host.dma.attack = Some(Replay::new(sc.attack.recent as usize, identity));
            host.schedule(ATTACK_TICK_NS, Event::Attack);
        }
        // The warm-up counts from when traffic begins (a NIC's bring-up fills every ring first).
        let ready = workload.start(&mut host, 0);
        if host.pages.exhausted {
            return Err(format!(
                "platform.memory.pages = {}: the simulated memory ran out while the workload set up its rings and buffers ({} pages taken); expected more pages",
                p.memory.pages, host.pages.allocated
            ));
        }
        let kernel: crate::kernel::KernelVersion = crate::scenario::parse_kernel(&sc.os.kernel)
            .expect("validated")
            .into();
        if kernel.iova_depot_list() {
            host.schedule(IOVA_DEPOT_DELAY_NS, Event::IovaDepotWork);
        }
        let warmup_end = ready + ms_to_ns(sc.run.warmup_ms);
        Ok(Simulation {
            host,
            workload,
            now: 0,
            warmup_end,
            end: warmup_end + window_ns(sc),
            start: None,
            attack_rate,
            attack_owed: 0.0,
            scenario: sc.name.clone(),
            label: v.label.clone(),
            policy,
            policy_reason,
            policy_note,
            seed: sc.run.seed,
            map_benchmark: sc.workload.dma_map_benchmark.clone(),
            walk_cache_entries: p.iommu.last_walk_cache_entries(),
            events: 0,
            stopped: None,
            watchdog: (MAX_EVENTS_PER_SIM_MS, WATCHDOG_MIN_EVENTS),
        })
    }

    pub fn end_ns(&self) -> Time {
        self.end
    }
    /// When the measured window begins: the warm-up after traffic began.
    pub fn warmup_end_ns(&self) -> Time {
        self.warmup_end
    }
    pub fn now_ns(&self) -> Time {
        self.now
    }
    pub fn done(&self) -> bool {
        self.now >= self.end
    }

    /// Every counter at `at`, summed over the host's DMA domains (locality: the first domain's). The
    /// IOMMU must be with the first domain (`Host::lend(0)`).
    fn snapshot(&self, at: Time) -> Snapshot {
        let d = &self.host.dma.core;
        let mut s = Snapshot {
            time: at,
            iommu: d.iommu.counters().clone(),
            wl: self.workload.stats(),
            cpu_busy_ns: self
                .workload
                .cpus()
                .iter()
                .map(|&c| self.host.cpus[c].busy_ns)
                .collect(),
            attack: self.host.dma.attack.as_ref().map(|a| a.stats.clone()),
            iova_reuse: d.locality.counts.clone(),
            dma_reuse: d.dma_locality.counts.clone(),
            cpus: self.workload.cpus(),
            locks: d.iommu.lock_stats(),
            ..Default::default()
        };
        // A guest's exits: its emulated IOMMU's doorbells and the workload's virtqueue kicks.
        if self.host.platform.hypervisor.is_some() {
            let mut e = d.iommu.exit_stats().unwrap_or_default();
            e.add(&s.wl.exits);
            e.work.iotlb_resets = d.iommu.translator().qemu_iotlb().map_or(0, |h| h.resets);
            s.exits = Some(e);
        }
        // The domains' own locks (the allocator's, the flush queue's), the same name summed over domains.
        let mut domain_locks: Vec<(&'static str, crate::sim::LockStats)> = Vec::new();
        for l in self.host.layers() {
            let c = &l.core;
            s.dma.add(&c.stats);
            s.iova.add(&c.iovad.stats);
            s.safety.add(&c.safety.stats);
            s.exposed_open += c.safety.exposed_open(at);
            if let Some(sw) = &l.swiotlb {
                s.swiotlb = Some(sw.stats.clone());
                s.open_windows = Some(c.safety.open_windows(at));
            }
            let bounce_locks = l.swiotlb.iter().flat_map(|sw| sw.lock_stats());
            for (name, st) in c
                .iovad
                .lock_stats()
                .into_iter()
                .chain(l.policy.lock_stats())
                .chain(bounce_locks)
                .chain([("iommu pgtable lines", c.pte_lines.stats.clone())])
            {
                match domain_locks.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, acc)) => acc.add(&st),
                    None => domain_locks.push((name, st)),
                }
            }
        }
        s.iommu_locks = s.locks.len();
        domain_locks.append(&mut s.locks);
        s.locks = domain_locks;
        s
    }

    fn dispatch(&mut self, t: Time, ev: Event) {
        match ev {
            Event::Workload { kind, id } => self.workload.handle(&mut self.host, t, kind, id),
            Event::DmaTimer { cpu, dom } => self.host.run_dma_timer(t, cpu as usize, dom as usize),
            Event::IovaDepotWork => {
                if self.host.cpu_acquire(0, t, ev, Ctx::Task) {
                    // Every domain's iova_domain has its own depot work.
                    let end = self.host.layers_mut().fold(t, |t, l| {
                        let end = l.core.iovad.depot_work(t, 0).0;
                        l.core.stats.cpu_ns += end - t;
                        end
                    });
                    self.host.cpus[0].account(t, end);
                    self.host
                        .schedule(t + IOVA_DEPOT_DELAY_NS, Event::IovaDepotWork);
                }
            }
            Event::Attack => {
                self.attack_owed += self.attack_rate * ATTACK_TICK_NS as f64 / 1e9;
                let n = self.attack_owed.floor();
                self.attack_owed -= n;
                self.host.dma.replay(n as u64, t);
                self.host.schedule(t + ATTACK_TICK_NS, Event::Attack);
            }
            Event::CpuFree { cpu } => {
                if let Some(next) = self.host.cpu_free(cpu as usize, t) {
                    self.dispatch(t, next);
                    // Work that no longer wants the CPU when handed it (a poll another already ran) leaves
                    // it to the next waiter, not to whatever asks next.
                    self.host.cpu_ungrant(cpu as usize);
                }
            }
        }
    }

    /// Process every event up to `until` (capped at the end of the run).
    pub fn advance_to(&mut self, until: Time) {
        let until = until.min(self.end);
        while let Some(t) = self.host.events.peek_time() {
            if t > until {
                break;
            }
            if self.start.is_none() && t >= self.warmup_end {
                self.host.lend(0);
                self.start = Some(self.snapshot(self.warmup_end));
            }
            let (t, ev) = self.host.events.pop().expect("peeked");
            self.now = t;
            self.dispatch(t, ev);
            self.events += 1;
            let (limit, min_events) = self.watchdog;
            if self.events.is_multiple_of(4096) && self.events >= min_events {
                let per_ms = self.events as f64 / (t.max(1) as f64 / NS_PER_MS as f64);
                if per_ms > limit as f64 {
                    self.stopped = Some(format!(
                        "the simulation takes {:.3e} events per simulated ms ({} events in the first {:.6} ms; \
                         the watchdog stops it above {:.0e}): a rate, size or count in the scenario is far \
                         outside what the model can run",
                        per_ms,
                        self.events,
                        t as f64 / NS_PER_MS as f64,
                        limit as f64
                    ));
                    self.end = t;
                    break;
                }
            }
        }
        self.now = until;
        self.host.lend(0);
        if self.start.is_none() && until >= self.warmup_end {
            self.start = Some(self.snapshot(self.warmup_end));
        }
    }

    pub fn run_to_end(&mut self) {
        self.advance_to(self.end);
    }

    /// Events processed so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// 4 KiB pages the DMA layer has mapped and not yet unmapped.
    pub fn mapped_pages(&self) -> u64 {
        let s = &self.host.dma.core.stats;
        s.pages_mapped - s.iova_pages_unmapped
    }

    /// Why the run stopped before its end (the watchdog), if it did: its result is not to be used.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// A watchdog bound other than the default (tests).
    #[cfg(test)]
    fn set_watchdog(&mut self, events_per_sim_ms: u64, min_events: u64) {
        self.watchdog = (events_per_sim_ms, min_events);
    }

    /// The result between the end of warm-up and now.
    pub fn result(&self) -> RunResult {
        let a = self
            .start
            .clone()
            .unwrap_or_else(|| self.snapshot(self.warmup_end));
        let b = self.snapshot(self.now.max(self.warmup_end + 1));
        let info = RunInfo {
            scenario: &self.scenario,
            label: &self.label,
            policy: self.policy.as_str(),
            policy_reason: &self.policy_reason,
            policy_note: &self.policy_note,
            iommu: self.host.dma.core.iommu.name(),
            inv_kinds: self.host.dma.core.iommu.inv_kinds(),
            seed: self.seed,
            pwc_levels: self.host.dma.core.iommu.translator().format().levels - 1,
            walk_cache_entries: self.walk_cache_entries,
            line_rate_gbps: self.workload.line_rate_gbps(),
            translated: self.host.dma.policy.translated(),
            map_benchmark: self.map_benchmark.as_ref(),
            open_limit: self.workload.open_limit(),
            timer_period_ns: self.host.dma.policy.timer_period_ns(),
            window_key: if self
                .map_benchmark
                .as_ref()
                .is_some_and(|m| m.seconds.is_some())
            {
                "workload.dma_map_benchmark.seconds"
            } else {
                "run.duration_ms"
            },
        };
        RunResult::from_snapshots(&info, &a, &b)
    }
}

/// Run one variant to the end.
pub fn run_variant(v: &Variant) -> RunResult {
    let mut s = Simulation::new(v);
    s.run_to_end();
    if let Some(why) = s.stopped() {
        panic!("{why}");
    }
    s.result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::emul::ExitStats;
    use crate::hw::InvClass;

    /// The default NIC receive, VFIO-assigned to a guest behind QEMU's VT-d with caching mode.
    fn vfio_guest(ov: &[(&str, &str)]) -> Simulation {
        let mut all = vec![
            ("platform.profile", "kvm-vtd-guest"),
            ("platform.iommu.vtd.caching_mode", "true"),
        ];
        all.extend_from_slice(ov);
        vfio_guest_on(&all)
    }

    /// The default NIC receive, VFIO-assigned to a guest whose vIOMMU `ov` sets up.
    fn vfio_guest_on(ov: &[(&str, &str)]) -> Simulation {
        let mut all = vec![
            ("workload.nic_rx.queues", "2"),
            ("workload.nic_rx.flows", "2"),
            ("workload.nic_rx.page_pool", "false"),
            ("run.warmup_ms", "2"),
            ("run.duration_ms", "3"),
        ];
        all.extend_from_slice(ov);
        let v = builtin_with("default", &all);
        let mut s = Simulation::new(&v[0]);
        s.run_to_end();
        s
    }

    /// The vIOMMUs QEMU shadows a VFIO device behind: VT-d and SMMUv3 with caching mode, virtio-iommu.
    const SHADOWED: [&[(&str, &str)]; 3] = [
        &[
            ("platform.profile", "kvm-vtd-guest"),
            ("platform.iommu.vtd.caching_mode", "true"),
        ],
        &[
            ("platform.profile", "kvm-smmuv3-guest"),
            ("os.arch", "arm64"),
            ("platform.iommu.smmuv3.caching_mode", "true"),
        ],
        &[("platform.profile", "virtio-guest")],
    ];

    /// Flush the DMA layer's queues now, as its timer would (fq_flush_timeout()): the guest's exits after.
    fn flush_now(s: &mut Simulation) -> ExitStats {
        let (now, d) = (s.now, &mut s.host.dma);
        d.policy.timer(&mut d.core, now, 0);
        d.core.iommu.exit_stats().expect("a guest")
    }

    #[test]
    fn vfio_shadowing_pins_and_unpins_exactly_the_mapped_pages() {
        // VFIO type1 unpins exactly the pages of each VFIO_IOMMU_UNMAP_DMA (vfio_unmap_unpin); QEMU sends
        // one for pages the guest has unmapped once it has invalidated them (VT-d, SMMUv3: its walk finds
        // them gone) or sent their UNMAP (virtio-iommu).
        for vmmu in SHADOWED {
            for policy in ["strict", "lazy"] {
                // Lazy runs long enough for full flush-queue rings to flush.
                let ms = if policy == "lazy" { "15" } else { "3" };
                let ov = [("os.policy", policy), ("run.duration_ms", ms)];
                let mut s = vfio_guest_on(&[vmmu, &ov[..]].concat());
                let what = format!("{} {policy}", vmmu[0].1);
                let virtio = s.host.dma.core.iommu.name() == "virtio";
                let st = &s.host.dma.core.stats;
                let (mapped, unmapped) = (st.pages_mapped, st.iova_pages_unmapped);
                let flushes = st.fq_flush_full + st.fq_flush_timer;
                let e = s.host.dma.core.iommu.exit_stats().expect("a guest");
                // QEMU sees every map (caching mode, or the MAP request): each page is pinned once, by one
                // VFIO call per 4 KiB leaf QEMU's walk finds, or per MAP request.
                assert_eq!(e.pins, mapped, "{what}");
                assert!(
                    e.vfio_maps == e.pins || virtio && e.vfio_maps < e.pins,
                    "{what}"
                );
                let pending = unmapped
                    .checked_sub(e.unpins)
                    .expect("none unpinned before its unmap");
                // Strict invalidates every unmap before dma_unmap returns. Lazy on VT-d and SMMUv3: QEMU
                // unmaps on a flush's domain-wide invalidation, so the pages unmapped since the last flush
                // are still pinned. (virtio-iommu's UNMAPs go with the next sync, a map's included.)
                if policy == "strict" {
                    assert_eq!(pending, 0, "{what}");
                } else if !virtio {
                    assert!(flushes > 0 && e.unpins > 0 && pending > 0, "{what}");
                }
                // A flush now unpins every page unmapped so far: each exactly once.
                assert_eq!(flush_now(&mut s).unpins, unmapped, "{what}");
            }
        }
    }

    #[test]
    fn a_poll_waiting_for_its_cpu_does_not_starve_the_flush_timer() {
        // While a NAPI poll waits for its CPU it is scheduled (NAPI_STATE_SCHED): interrupts meanwhile add no
        // poll. When they did, tens of copies queued on CPU 0 ahead of the lazy flush timer, which never
        // fired in this run (issue 49); only full rings flushed.
        for vmmu in SHADOWED {
            let ov = [("os.policy", "lazy"), ("run.duration_ms", "25")];
            let s = vfio_guest_on(&[vmmu, &ov[..]].concat());
            let st = &s.host.dma.core.stats;
            assert!(
                st.fq_flush_timer > 0,
                "{}: {} timer flushes, {} full",
                vmmu[0].1,
                st.fq_flush_timer,
                st.fq_flush_full
            );
        }
    }

    #[test]
    fn nested_translation_walks_two_dimensions_and_forwards_invalidations() {
        let shadowed = vfio_guest(&[("os.policy", "strict")]);
        let nested = vfio_guest(&[
            ("os.policy", "strict"),
            ("platform.hypervisor.nested", "true"),
        ]);
        let (es, en) = (
            shadowed.host.dma.core.iommu.exit_stats().unwrap(),
            nested.host.dma.core.iommu.exit_stats().unwrap(),
        );
        // No shadowing: nothing pinned per map; the guest's invalidations still trap.
        assert!(es.pins > 0);
        assert_eq!((en.pins, en.vfio_maps), (0, 0));
        assert!(en.count[0] > 0);
        // vCMDQ: the same guest invalidations, none of them trapping.
        let v = builtin_with(
            "default",
            &[
                ("os.policy", "strict"),
                ("platform.profile", "kvm-smmuv3-guest"),
                ("os.arch", "arm64"),
                ("platform.hypervisor.nested", "true"),
                ("platform.hypervisor.vcmdq", "true"),
                ("workload.nic_rx.queues", "2"),
                ("workload.nic_rx.flows", "2"),
                ("workload.nic_rx.page_pool", "false"),
                ("run.warmup_ms", "2"),
                ("run.duration_ms", "3"),
            ],
        );
        let mut vcmdq = Simulation::new(&v[0]);
        vcmdq.run_to_end();
        assert!(vcmdq.host.dma.core.iommu.exit_stats().is_none());
        assert!(vcmdq.host.dma.core.iommu.counters().invalidations() > 0);
        // A miss walks stage 1 and, for each of its reads and its output, stage 2 (nested_s2_reads = 1 in
        // the profile): the walk's latency, not its counted stage-1 reads, grows.
        let h = nested.host.platform.hypervisor.clone().unwrap();
        let mut host = nested.host;
        let mut flat = shadowed.host;
        let iova = host.dma.map(0, 0, 0x5000, 1).unwrap().0;
        let iova_flat = flat.dma.map(0, 0, 0x5000, 1).unwrap().0;
        // Both walks cold: the nested guest's map (first-stage tables) sent no invalidation, so its walk
        // caches may still hold the upper levels; a domain flush empties both.
        for h in [&mut host, &mut flat] {
            let dom = h.dma.core.dom;
            h.dma.core.iommu.flush_iotlb_all(0, 0, dom);
        }
        let (lat, _) = host.dma_page(crate::sim::NS_PER_SEC, iova);
        let (lat_flat, _) = flat.dma_page(crate::sim::NS_PER_SEC, iova_flat);
        let reads = (lat_flat - flat.platform.pcie.dma_base_ns) / flat.platform.memory.walk_read_ns;
        assert!(reads > 0);
        assert_eq!(
            lat - host.platform.pcie.dma_base_ns,
            (reads + (reads + 1) * h.nested_s2_reads as u64) * host.platform.memory.walk_read_ns
        );
    }

    #[test]
    fn the_watchdog_stops_a_run_whose_event_rate_exceeds_its_bound() {
        let v = &builtin_with(
            "default",
            &[("os.policy", "strict"), ("run.duration_ms", "2")],
        )[0];
        let mut s = Simulation::new(v);
        s.set_watchdog(100, 1000);
        s.run_to_end();
        let why = s
            .stopped()
            .expect("a default run takes over 100 events per simulated ms");
        assert!(why.contains("events per simulated ms"), "{why}");
        assert!(s.done() && s.events() == 4096);
        // The default bound never trips on the built-in scenario.
        let mut s = Simulation::new(v);
        s.run_to_end();
        assert!(s.stopped().is_none() && s.events() > 1000);
    }

    fn default_with(ov: &[(&str, &str)]) -> Vec<Variant> {
        builtin_with("default", ov)
    }

    /// Drives on root ports of their own get a domain each: their own IOVA space (both hand out the same
    /// top-down addresses), their own flush queue flushed by their own timer, and their own cache_lock; drives
    /// behind one bridge share all of it.
    #[test]
    fn drives_under_separate_bridges_get_a_domain_each() {
        let run = |same: &str| {
            let ov = [
                ("os.policy", "lazy"),
                ("workload.nvme.same_bridge", same),
                // Enough jobs that the drives' maps meet on the lock (with 4 it is found held ~0.1 % of the
                // time either way, which says nothing).
                ("workload.nvme.jobs", "16"),
                ("run.duration_ms", "30"),
                ("run.warmup_ms", "2"),
            ];
            let mut s = Simulation::new(&builtin_with("nvme", &ov)[0]);
            s.run_to_end();
            s
        };
        let apart = run("false");
        assert_eq!(apart.host.domains(), 2);
        let layers: Vec<_> = apart.host.layers().collect();
        let firsts: Vec<u64> = layers
            .iter()
            .map(|l| l.core.iovad.allocated().map(|(_, hi)| hi).max().unwrap())
            .collect();
        assert_eq!(
            firsts[0], firsts[1],
            "each domain allocates from the top of its own space"
        );
        for l in &layers {
            assert!(l.core.stats.maps > 0);
            assert!(l.core.stats.fq_flush_timer + l.core.stats.fq_flush_full > 0);
        }
        let shared = run("true");
        assert_eq!(shared.host.domains(), 1);
        // One cache_lock for both drives' maps: found held more often than either of two locks.
        let held = |s: &Simulation| {
            let c = s.result().contention;
            let l = c
                .iter()
                .find(|c| c.name == "vt-d domain cache_lock")
                .unwrap();
            (l.acquisitions, l.contended_share)
        };
        let (a_acq, a_held) = held(&apart);
        let (s_acq, s_held) = held(&shared);
        assert!(a_acq > 0 && s_acq > 0);
        assert!(
            s_held > a_held,
            "one lock for both drives: {s_held} vs {a_held}"
        );
    }

    /// The NIC opens every channel's coherent rings before it posts any RX buffer (mlx5e_open_channels, then
    /// mlx5e_activate_channels triggering each NAPI), so with the top-down allocator every channel's RX
    /// buffers lie below the lowest multi-page ring; set up channel by channel, only the last one's would.
    #[test]
    fn every_channels_rings_are_mapped_before_any_rx_buffer() {
        let s = Simulation::new(&builtin_with("c3", &[("os.policy", "strict")])[0]);
        let ranges: Vec<(u64, u64)> = s.host.dma.core.iovad.allocated().collect();
        let below_rings = ranges.iter().take_while(|(lo, hi)| hi == lo).count();
        let rings = ranges.iter().filter(|(lo, hi)| hi > lo).count();
        // c3: 64 channels of 8 WQEs of 64 pages.
        assert!(rings >= 64, "{rings} multi-page rings");
        assert_eq!(below_rings, 64 * 8 * 64, "pages below the lowest ring");
    }

    /// A NIC's bring-up fills every channel's ring before the peers send, and the warm-up counts from then:
    /// C3's 64 channels of 2048-frame rings map 262,144 pages through the allocator's lock first, and a
    /// 5 ms warm-up after that still measures the link busy.
    #[test]
    fn the_warm_up_counts_from_when_traffic_begins() {
        let ov = [
            ("os.policy", "strict"),
            ("workload.nic_rx.ring_size", "2048"),
            ("run.warmup_ms", "5"),
            ("run.duration_ms", "5"),
        ];
        let v = &builtin_with("c3", &ov)[0];
        let bring_up = Simulation::new(v).warmup_end_ns() - ms_to_ns(5.0);
        assert!(bring_up > ms_to_ns(20.0), "{bring_up} ns");
        let r = run_variant(v);
        assert!(r.throughput_gbps > 70.0, "{}", r.throughput_gbps);
    }

    /// The channels fill their rings at once, each mapping a page in turn, so consecutive buffers of one
    /// busy ring lie one per channel apart in IOVA: C3's 64 channels put every 8 pages of a 512-page ring
    /// in a PT-L3 entry of their own, and the device's writes cycle through about 64 entries (F&S
    /// Figure 2e's 5-flow trace reaches about 65). With one channel per busy queue they cycle through few,
    /// and so they do when the bring-up fills the rings one after another (ENA's ena_up_complete).
    #[test]
    fn channels_filled_at_once_spread_each_ring_over_the_pt_l3_entries() {
        let run = |channels: &str, fill: &str| {
            let ov = [
                ("os.policy", "strict"),
                ("run.duration_ms", "10"),
                ("run.warmup_ms", "10"),
                ("workload.nic_rx.channels", channels),
                ("workload.nic_rx.ring_fill", fill),
            ];
            run_variant(&builtin_with("c3", &ov)[0]).dma_locality.walk
        };
        let (five, all) = (run("5", "napi"), run("64", "napi"));
        let in_turn = run("64", "in_turn");
        assert!(in_turn.reuse_distance_max <= 8, "{in_turn:?}");
        assert!(five.reuse_distance_max <= 8, "{five:?}");
        assert!((60..=72).contains(&all.reuse_distance_max), "{all:?}");
        assert!(all.reuse_distance_p99 >= 48, "{all:?}");
    }

    /// mlx5's RX cache churn reorders the rings' IOVAs as traffic goes on: a busy head maps a fresh page
    /// with whatever IOVA the CPU's rcache took back last, a full cache unmaps another. So the device's
    /// walk-cache locality degrades with the layout's age. With C3's own 256-page cache the head is free at
    /// nearly every refill (the reuse slack says by how much), and the layout stays as bring-up left it.
    #[test]
    fn driver_cache_churn_ages_the_rings_iova_layout() {
        let run = |cache: &str, warmup: &str| {
            let ov = [
                ("os.policy", "strict"),
                ("run.duration_ms", "10"),
                ("run.warmup_ms", warmup),
                ("workload.nic_rx.driver_page_cache", cache),
            ];
            run_variant(&builtin_with("c3", &ov)[0])
        };
        let (young, old) = (run("128", "10"), run("128", "150"));
        let (y, o) = (&young.dma_locality.walk, &old.dma_locality.walk);
        assert!(
            old.rx_page_cache.busy > 0 && old.rx_page_cache.full > 0,
            "{:?}",
            old.rx_page_cache
        );
        assert!(o.reuse_distance_p50 > y.reuse_distance_p50, "{y:?} {o:?}");
        assert!(
            o.beyond_walk_cache_share > 1.5 * y.beyond_walk_cache_share,
            "{y:?} {o:?}"
        );
        assert!(
            old.pwc_misses_per_page[2] > 1.2 * young.pwc_misses_per_page[2],
            "{:?} {:?}",
            young.pwc_misses_per_page,
            old.pwc_misses_per_page
        );
        let c3 = run("256", "150");
        let c = &c3.rx_page_cache;
        assert!(c.busy * 1000 < c.reuse, "{c:?}");
        let slack = c3
            .rx_cache_reuse_slack
            .expect("the driver cache served refills");
        assert_eq!(slack.reuses, c.reuse);
        assert!(
            0.0 < slack.min_us && slack.min_us <= slack.p1_us && slack.p1_us <= slack.p50_us,
            "{slack:?}"
        );
        assert!(
            c3.dma_locality.walk.reuse_distance_p50 <= 1,
            "{:?}",
            c3.dma_locality
        );
    }

    /// Readers on CPUs of their own take the copy off the queues' CPUs, which keep NAPI's work; aRFS keeps
    /// every reader on its queue's CPU.
    #[test]
    fn readers_on_their_own_cpus_take_the_copy_off_the_queues_cpus() {
        let busy = |readers: &str| {
            let ov = [
                ("run.duration_ms", "4"),
                ("run.warmup_ms", "2"),
                ("os.policy", "passthrough"),
                ("workload.nic_rx.readers", readers),
            ];
            let mut s = Simulation::new(&builtin_with("c2", &ov)[0]);
            s.advance_to(Time::MAX);
            let cpus = s.workload.cpus();
            let busy: Vec<u64> = s.host.cpus.iter().map(|c| c.busy_ns).collect();
            (cpus, busy)
        };
        let (cpus_q, q) = busy("queue");
        let (cpus_o, o) = busy("own");
        assert_eq!(cpus_q, (0..8).collect::<Vec<_>>());
        assert_eq!(cpus_o, (0..16).collect::<Vec<_>>());
        assert!(q[8..].iter().all(|&b| b == 0), "{q:?}");
        assert!(o[8..16].iter().all(|&b| b > 0), "{o:?}");
        let napi = |b: &[u64]| b[..8].iter().sum::<u64>();
        assert!(napi(&o) * 10 < napi(&q) * 8, "{o:?} {q:?}");
    }

    #[test]
    fn deterministic_for_a_seed_and_different_across_seeds() {
        let short = [
            ("run.duration_ms", "5"),
            ("run.warmup_ms", "2"),
            ("os.policy", "lazy"),
        ];
        let a = run_variant(&default_with(&short)[0]);
        let b = run_variant(&default_with(&short)[0]);
        assert_eq!(a, b);
        let mut other = short.to_vec();
        other.push(("run.seed", "99"));
        let c = run_variant(&default_with(&other)[0]);
        assert_ne!(a, c);
    }

    #[test]
    fn strict_invalidates_per_unmap_passthrough_never_and_lazy_batches() {
        let base = [("run.duration_ms", "10"), ("run.warmup_ms", "5")];
        let by = |p: &str| {
            let mut o = base.to_vec();
            o.push(("os.policy", p));
            run_variant(&default_with(&o)[0])
        };
        let pt = by("passthrough");
        let strict = by("strict");
        let lazy = by("lazy");
        assert_eq!(pt.invalidations.total, 0);
        assert_eq!(pt.iotlb_misses_per_page, 0.0);
        assert!(strict.iova_pages_unmapped > 0, "{strict:?}");
        // One PSI + one wait descriptor per single-page unmap.
        assert_eq!(
            strict.invalidations.class(InvClass::Range),
            strict.iova_pages_unmapped
        );
        assert_eq!(strict.syncs, strict.invalidations.total);
        assert!(
            lazy.invalidations.class(InvClass::Range) == 0
                && lazy.invalidations.class(InvClass::Domain) > 0
        );
        assert!(lazy.inv_per_page < strict.inv_per_page);
    }

    #[test]
    fn a_result_with_every_part_holds_every_key_some_runs_report() {
        // Strict on the default scenario reports none of them: no latency, attack, guest, driver cache or
        // exposed page.
        let r = run_variant(
            &builtin_with(
                "default",
                &[("os.policy", "strict"), ("run.duration_ms", "0.2")],
            )[0],
        );
        let keys = |r: &RunResult| serde_json::to_value(r).expect("serialises");
        let before = keys(&r);
        let after = keys(&r.clone().with_every_part());
        for k in [
            "latency",
            "attack",
            "swiotlb",
            "vm_exits",
            "emulator",
            "rx_cache_reuse_slack",
        ] {
            assert!(before.get(k).is_none() && after[k].is_object(), "{k}");
        }
        assert!(
            before["safety"].get("window").is_none() && after["safety"]["window"]["p99_us"] == 0.0
        );
    }

    fn c2(policy: &str, duration_ms: &str) -> RunResult {
        // Past the RX page cache's warm-up churn.
        let ov = [
            ("run.duration_ms", duration_ms),
            ("run.warmup_ms", "6"),
            ("os.policy", policy),
        ];
        run_variant(&builtin_with("c2", &ov)[0])
    }

    #[test]
    fn fands_unmaps_whole_wqe_blocks_and_xsmmu_syncs_domain_wide() {
        let strict = c2("strict", "3");
        let fands = c2("fands", "3");
        let xsmmu = c2("xsmmu", "3");
        // FANDS: no recycling, so every RX page is unmapped, 64 at a time with one PSI, beside one-page ACK
        // heads with one PSI each: unmapped pages - PSIs = 63 per block.
        let psi = fands.invalidations.class(InvClass::Range);
        let extra = fands.iova_pages_unmapped - psi;
        assert!(extra > 0 && extra.is_multiple_of(63), "{fands:?}");
        assert!(fands.inv_per_page < strict.inv_per_page);
        // xSMMU: domain-wide invalidations only, at most one per poll end or TX completion batch.
        assert_eq!(xsmmu.invalidations.class(InvClass::Range), 0);
        assert!(xsmmu.invalidations.class(InvClass::Domain) > 0);
        assert!(xsmmu.invalidations.total <= xsmmu.iova_pages_unmapped);
        for r in [&strict, &fands, &xsmmu] {
            assert!(r.safety.protected && r.safety.pages_settled > 0, "{r:?}");
            assert_eq!(
                (r.safety.pages_exposed, r.safety.pages_exposed_at_end),
                (0, 0)
            );
        }
    }

    /// C3 strict, whose DMA translation cannot keep up with the line rate: senders that only keep to the
    /// receive window overrun the NIC's buffer all the time; DCTCP senders halve their window on each loss
    /// they hear of, so the device drops a small fraction as much, and the gaps they leave are ACKed at once.
    #[test]
    fn dctcp_senders_back_off_on_loss_and_the_device_drops_far_less() {
        let run = |sender: &str| {
            let ov = [
                ("os.policy", "strict"),
                ("workload.nic_rx.sender", sender),
                ("run.duration_ms", "30"),
            ];
            run_variant(&builtin_with("c3", &ov)[0])
        };
        let (window, dctcp) = (run("window"), run("dctcp"));
        let drop_rate = |r: &RunResult| r.drops.device as f64 / (r.packets_per_sec * r.sim_seconds);
        assert_eq!(window.loss_recoveries, 0);
        assert!(dctcp.loss_recoveries > 0, "{dctcp:?}");
        assert!(drop_rate(&window) > 0.1, "{}", drop_rate(&window));
        assert!(
            drop_rate(&dctcp) * 20.0 < drop_rate(&window),
            "{} vs {}",
            drop_rate(&dctcp),
            drop_rate(&window)
        );
        assert!(dctcp.throughput_gbps > window.throughput_gbps);
    }

    /// C2 at steady state: NAPI runs ahead of the readers (softirq first, `sim::sched`), so sockets fill to
    /// the receive window and hold their pages longer than mlx5's 256-page cache reaches back. Under lazy
    /// and xSMMU most RX pages then leave the cache and are unmapped; FANDS, which never recycles, unmaps
    /// every one, with the fewest invalidations per page.
    #[test]
    fn c2_sockets_fill_and_rx_pages_leave_the_mlx5_cache() {
        let run = |p: &str| run_variant(&builtin_with("c2", &[("os.policy", p)])[0]);
        let (lazy, fands, xsmmu) = (run("lazy"), run("fands"), run("xsmmu"));
        // FANDS unmaps every page; the others only those that miss the cache, which is most of them here.
        assert!(fands.iova_pages_unmapped > xsmmu.iova_pages_unmapped);
        for r in [&lazy, &xsmmu] {
            assert!(
                2 * r.iova_pages_unmapped > fands.iova_pages_unmapped,
                "{} vs {}",
                r.iova_pages_unmapped,
                fands.iova_pages_unmapped
            );
        }
        assert!(fands.inv_per_page < xsmmu.inv_per_page * 2.0 && fands.inv_per_page < 0.1);
        // The cache's head is held by a socket at most refills (rx_cache_busy), so its puts find it full.
        for r in [&lazy, &xsmmu] {
            let c = &r.rx_page_cache;
            assert!(c.busy > 2 * c.reuse && c.full > 2 * c.reuse, "{c:?}");
        }
        assert_eq!(fands.rx_page_cache.reuse + fands.rx_page_cache.busy, 0);
    }

    /// Every page mapped in the window is an RX refill that missed mlx5's cache or an ACK's head, and each
    /// is one IOVA allocation the locality measure sees. Lazy holds freed IOVAs in the flush queue, so the
    /// allocator hands out IOVAs from more PT-L3 pages than strict, which gets each back at once.
    #[test]
    fn c2_maps_tie_out_and_lazy_spreads_iovas_over_more_walk_cache_entries() {
        let (strict, lazy) = (c2("strict", "20"), c2("lazy", "20"));
        for r in [&strict, &lazy] {
            let (c, l) = (&r.rx_page_cache, &r.iova_locality);
            assert_eq!(
                c.busy + c.empty + r.tx_packets,
                r.iova_pages_mapped,
                "{c:?}"
            );
            assert_eq!(
                l.allocations + l.walk.first_use,
                r.iova_pages_mapped,
                "{l:?}"
            );
            assert!(l.walk.reuse_distance_p50 <= l.walk.reuse_distance_p99);
            assert!(l.walk.reuse_distance_p99 <= l.walk.reuse_distance_max);
        }
        let (s, l) = (&strict.iova_locality.walk, &lazy.iova_locality.walk);
        assert!(l.reuse_distance_p99 > s.reuse_distance_p99, "{s:?} {l:?}");
        assert!(
            l.beyond_walk_cache_share > 2.0 * s.beyond_walk_cache_share,
            "{s:?} {l:?}"
        );
    }

    /// With one page per packet and no ACKs, every page the device writes is one access the locality of
    /// accesses sees; eight queues, whose rings were filled at once and so interleave in IOVA space, spread
    /// the device's writes over more walk-cache entries than one queue cycling through its own ring.
    /// Without translation nothing is counted.
    #[test]
    fn dma_locality_sees_each_page_written_and_interleaved_queues_spread_it() {
        let run = |policy: &str, queues: &str| {
            let ov = [
                ("run.duration_ms", "5"),
                ("run.warmup_ms", "2"),
                ("os.policy", policy),
                ("workload.nic_rx.acks", "false"),
                ("workload.nic_rx.queues", queues),
                ("workload.nic_rx.flows", queues),
                ("workload.nic_rx.page_pool", "true"),
            ];
            run_variant(&default_with(&ov)[0])
        };
        let (one, eight) = (run("strict", "1"), run("strict", "8"));
        for r in [&one, &eight] {
            let l = &r.dma_locality;
            assert!(r.dma_pages > 0);
            assert_eq!(l.accesses + l.walk.first_use, r.dma_pages, "{l:?}");
        }
        let (o, e) = (&one.dma_locality.walk, &eight.dma_locality.walk);
        assert!(e.reuse_distance_p99 > o.reuse_distance_p99, "{o:?} {e:?}");
        assert!(e.first_use > o.first_use, "{o:?} {e:?}");
        let pt = run("passthrough", "8");
        assert!(pt.dma_pages > 0);
        assert_eq!(
            (pt.dma_locality.accesses, pt.dma_locality.walk.first_use),
            (0, 0)
        );
    }

    #[test]
    fn lazy_exposes_pages_for_at_most_the_flush_queue_timeout_and_passthrough_is_unprotected() {
        // Long enough for the 10 ms flush-queue timer to settle what was queued.
        let lazy = c2("lazy", "30");
        let w = lazy.safety.window.as_ref().expect("lazy exposes pages");
        assert!(
            lazy.safety.pages_exposed > 0 && w.max_us <= 10_000.0 + 2.0 * 4_000.0 + 1_000.0,
            "{w:?}"
        );
        assert!(!c2("passthrough", "1").safety.protected);
    }

    /// Where the timer decides it: at 1 Gbps no per-CPU ring of 255 fills within the 10 ms timeout, so every
    /// flush is the timer's and a page waits up to the timeout (rounded up to jiffies, HZ=250) after its
    /// unmap. A timer that fired early, late or never would move the window out of this band.
    #[test]
    fn at_a_low_rate_the_flush_timer_sets_the_lazy_exposure_window() {
        let ov = [
            ("os.policy", "lazy"),
            ("workload.nic_rx.page_pool", "false"),
            ("workload.nic_rx.line_rate_gbps", "1"),
            ("run.duration_ms", "60"),
            ("run.warmup_ms", "5"),
        ];
        let r = run_variant(&default_with(&ov)[0]);
        assert_eq!(r.flush_queue_flushes.full, 0, "{:?}", r.flush_queue_flushes);
        assert!(
            r.flush_queue_flushes.timer >= 4,
            "{:?}",
            r.flush_queue_flushes
        );
        let w = r.safety.window.as_ref().expect("lazy exposes pages");
        // IOVA_DEFAULT_FQ_TIMEOUT 10 ms plus the wheel's rounding (up to two 4 ms jiffies) and the flush.
        assert!(
            w.max_us > 10_000.0 && w.max_us <= 10_000.0 + 2.0 * 4_000.0 + 1_000.0,
            "{w:?}"
        );
        assert!(
            w.p50_us > 1_000.0,
            "pages wait for the timer, not for a full ring: {w:?}"
        );
    }

    #[test]
    fn a_replaying_device_reaches_released_pages_only_under_lazy_and_passthrough() {
        let by = |p: &str| {
            let ov = [
                ("os.policy", p),
                ("run.duration_ms", "40"),
                ("run.warmup_ms", "5"),
                ("attack.replay_per_sec", "1e6"),
                ("attack.recent", "256"),
                ("workload.nic_rx.page_pool", "false"),
                ("workload.nic_rx.line_rate_gbps", "1"),
            ];
            let r = run_variant(&default_with(&ov)[0]);
            r.attack.expect("the attack ran")
        };
        let (lazy, pt) = (by("lazy"), by("passthrough"));
        assert!(
            lazy.probes >= 39_000 && lazy.reached_released > 0,
            "{lazy:?}"
        );
        assert!(pt.reached_released > lazy.reached_released, "{pt:?}");
        for p in ["strict", "xsmmu", "fands", "fns", "blocks"] {
            assert_eq!(by(p).reached_released, 0, "{p}");
        }
        // Until the IOMMU has processed the invalidation the device may still use a cached translation,
        // but these schemes hold the page until then: a few probes land in that gap, none on a released page.
        for p in ["strict", "fns", "blocks"] {
            let a = by(p);
            assert!(
                a.reached_unmapped * 10 < lazy.reached_unmapped,
                "{p}: {a:?}"
            );
        }
    }

    /// Each scheme in the commands of either vendor: xSMMU's domain-wide sync is a DSI on VT-d and a TLBI by
    /// ASID on SMMUv3; the chunk schemes invalidate ranges (PSI; TLBI by VA). Blocks keeps recycling and
    /// invalidates once per chunk and batch, so it runs near lazy's rate with nothing exposed; F&S and blocks
    /// keep the walk caches (IH on VT-d, Leaf on SMMUv3). On C2 every RX page is unmapped (no page_pool, no
    /// mlx5 cache), so what blocks batches is the RX traffic, not only the ACKs that a holding cache leaves.
    #[test]
    fn every_scheme_on_both_vendors() {
        let short = [("run.duration_ms", "8"), ("run.warmup_ms", "4")];
        let no_recycling = [
            ("workload.nic_rx.page_pool", "false"),
            ("workload.nic_rx.driver_page_cache", "0"),
        ];
        let on = |scenario: &str, p: &str| {
            let mut ov = short.to_vec();
            if scenario == "c2" {
                ov.extend_from_slice(&no_recycling);
            }
            ov.push(("os.policy", p));
            run_variant(&builtin_with(scenario, &ov)[0])
        };
        for (scenario, domain_wide, range) in [
            ("c2", InvClass::Domain, InvClass::Range),
            ("c1", InvClass::Domain, InvClass::Range),
        ] {
            let lazy = on(scenario, "lazy");
            let xsmmu = on(scenario, "xsmmu");
            assert_eq!(xsmmu.invalidations.class(range), 0, "{scenario}");
            assert!(xsmmu.invalidations.class(domain_wide) > 0, "{scenario}");
            for p in ["fands", "fns", "blocks"] {
                let r = on(scenario, p);
                assert_eq!(r.invalidations.class(domain_wide), 0, "{scenario} {p}");
                assert!(r.invalidations.class(range) > 0, "{scenario} {p}");
                assert_eq!(
                    r.pwc_misses_per_page[0], 0.0,
                    "{scenario} {p}: walk caches kept"
                );
                assert!(r.safety.pages_settled > 0, "{scenario} {p}");
                assert_eq!(r.safety.pages_exposed, 0, "{scenario} {p}");
                assert_eq!(r.stale_translations, 0, "{scenario} {p}");
            }
            let blocks = on(scenario, "blocks");
            assert!(
                blocks.inv_per_page < 0.5,
                "{scenario}: {}",
                blocks.inv_per_page
            );
            assert!(
                blocks.throughput_gbps > 0.95 * lazy.throughput_gbps,
                "{scenario}: blocks {} lazy {}",
                blocks.throughput_gbps,
                lazy.throughput_gbps
            );
        }
    }

    fn coco(ov: &[(&str, &str)]) -> Vec<RunResult> {
        let mut o = vec![("run.duration_ms", "10"), ("run.warmup_ms", "5")];
        o.extend_from_slice(ov);
        builtin_with("coco-net", &o)
            .iter()
            .map(run_variant)
            .collect()
    }

    /// Issue 68: a confidential guest's virtio-net bounces every buffer through swiotlb, copied in on map
    /// and (received data) back on unmap; an ordinary guest does not.
    #[test]
    fn a_confidential_guest_bounces_every_buffer_and_says_so() {
        let rx = coco(&[("workload.virtio_net.direction", "rx")]);
        let (guest, snp, small) = (&rx[0], &rx[1], &rx[2]);
        assert!(guest.swiotlb.is_none());
        let sw = snp.swiotlb.as_ref().expect("bounces");
        // Each received buffer copied twice, each ACK once; nothing failed in a 1 GiB pool.
        assert!(sw.bounces > 1000 && sw.full_events == 0, "{sw:?}");
        assert!(
            sw.copies > sw.bounces && sw.copies < 2 * sw.bounces,
            "{sw:?}"
        );
        assert_eq!(
            sw.pool_slots,
            1 << 19,
            "16 GiB of memory: 6 %, rounded up to 1 GiB"
        );
        // The copy costs the receiving vCPU: lower goodput than the ordinary guest, bound at the DMA API.
        assert!(
            snp.throughput_gbps < 0.9 * guest.throughput_gbps,
            "{} {}",
            snp.throughput_gbps,
            guest.throughput_gbps
        );
        assert_eq!(snp.limited_by, "cpu.dma_api");
        // What stays readable: every bounced buffer's copy until its slots are reused; a small pool reuses
        // them sooner.
        assert!(snp.safety.protected && snp.safety.exposed_share == 1.0);
        let p99 = |r: &RunResult| r.safety.window.as_ref().expect("exposed").p99_us;
        assert!(p99(small) < p99(snp) / 10.0, "{} {}", p99(small), p99(snp));
        assert!(!guest.safety.protected);
    }

    /// Issue 68: a pool the RX ring's buffers fill leaves nothing for transmit: every send's mapping fails,
    /// the driver drops it (tx_dropped) and the run is bound by the full pool.
    #[test]
    fn a_pool_too_small_for_the_queues_drops_and_binds_the_run() {
        let tx = coco(&[("workload.virtio_net.direction", "tx")]);
        let (snp, small) = (&tx[1], &tx[2]);
        assert_eq!(snp.drops.dma_map, 0);
        let sw = small.swiotlb.as_ref().expect("bounces");
        assert_eq!(sw.pool_slots, 512);
        assert!(
            sw.full_events > 0 && small.drops.dma_map == sw.full_events,
            "{sw:?} {:?}",
            small.drops
        );
        assert_eq!(small.limited_by, "swiotlb.full");
        assert!(small.throughput_gbps < 0.1 * snp.throughput_gbps);
    }

    /// Issue 68: an NVMe drive whose pool is full gets BLK_STS_RESOURCE: the I/O is requeued, not lost.
    #[test]
    fn a_full_pool_requeues_block_io() {
        let ov = [
            ("os.policy", "passthrough"),
            ("os.swiotlb.force", "true"),
            ("os.swiotlb.slabs", "128"),
            ("os.swiotlb.areas", "1"),
            ("run.duration_ms", "5"),
            ("run.warmup_ms", "1"),
        ];
        let v = &builtin_with("nvme", &ov)[0];
        let r = run_variant(v);
        let sw = r.swiotlb.as_ref().expect("swiotlb=force bounces");
        assert!(
            sw.full_events > 0 && r.drops.requeued == sw.full_events,
            "{sw:?} {:?}",
            r.drops
        );
        assert!(r.drops.dma_map == 0 && r.throughput_gbps > 0.0);
        // A pool large enough for every I/O in flight: nothing requeued.
        let mut big = ov.to_vec();
        big[2] = ("os.swiotlb.slabs", "262144");
        let r = run_variant(&builtin_with("nvme", &big)[0]);
        assert_eq!(r.drops.requeued, 0);
    }

    /// Issue 68: where a confidential guest or swiotlb=force cannot be: each refused in one line naming the
    /// key.
    #[test]
    fn bouncing_is_refused_where_the_kernel_does_not_bounce() {
        let err = |name: &str, ov: &[(&str, &str)]| {
            let ov: Vec<(String, String)> = ov
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            crate::scenario::load(crate::scenario::Source::Builtin(name), &ov)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let e = err("coco-net", &[("os.policy", "strict")]);
        assert!(e.contains("os.coco") && e.contains("passthrough"), "{e}");
        let e = err(
            "default",
            &[("os.coco", "sev-snp"), ("os.policy", "passthrough")],
        );
        assert!(e.contains("os.coco") && e.contains("guest"), "{e}");
        let e = err("coco-net", &[("os.coco", "cca")]);
        assert!(e.contains("os.coco") && e.contains("arm64"), "{e}");
        let e = err("coco-net", &[("os.kernel", "5.15")]);
        assert!(e.contains("os.coco") && e.contains("5.19"), "{e}");
        let e = err(
            "default",
            &[("os.swiotlb.force", "true"), ("os.policy", "strict")],
        );
        assert!(
            e.contains("os.swiotlb.force") && e.contains("dev_use_swiotlb"),
            "{e}"
        );
        let e = err(
            "nvme",
            &[
                ("os.swiotlb.force", "true"),
                ("os.policy", "passthrough"),
                ("workload.nvme.bs_kb", "1024"),
            ],
        );
        assert!(
            e.contains("workload.nvme.bs_kb") && e.contains("252"),
            "{e}"
        );
        let e = err("coco-net", &[("attack.replay_per_sec", "1000")]);
        assert!(
            e.contains("attack.replay_per_sec") && e.contains("swiotlb"),
            "{e}"
        );
        let e = err(
            "coco-net",
            &[("os.kernel", "6.1"), ("os.swiotlb.dynamic", "true")],
        );
        assert!(e.contains("os.swiotlb.dynamic") && e.contains("6.6"), "{e}");
    }

    /// Issue 68: with CONFIG_SWIOTLB_DYNAMIC (6.6+) the pool grows instead of failing.
    #[test]
    fn a_dynamic_pool_grows_instead_of_dropping() {
        let tx = coco(&[
            ("workload.virtio_net.direction", "tx"),
            ("os.swiotlb.dynamic", "true"),
        ]);
        let small = &tx[2];
        let sw = small.swiotlb.as_ref().expect("bounces");
        // Grown during the warm-up: a pool of the default pool's size added in the background.
        assert_eq!(sw.pool_slots, 1024, "{sw:?}");
        assert_eq!(small.drops.dma_map, 0);
        assert!(small.throughput_gbps > 0.9 * tx[1].throughput_gbps);
    }
}
