//! Bounce buffering replayed: the DMA API's events of a trace (include/trace/events/dma.h, 6.12+) drive the
//! model's swiotlb pool (dma/swiotlb.rs), and what the pool did is set beside what the kernel recorded of its
//! own: the `swiotlb:swiotlb_bounced` tracepoint (one per swiotlb_map() call, a failed one too), the maps that
//! returned DMA_MAPPING_ERROR, the slot each bounce got (its DMA address) and the capture's notes of debugfs's
//! io_tlb_used and io_tlb_used_hiwater.
//!
//! What the model decides: which maps bounce (every streaming map of a device under `swiotlb=force`: a
//! dma_map_page, each segment of a dma_map_sg; never a resource or a coherent allocation, dma-direct), the
//! slots each bounce takes (swiotlb_find_slots from the area's `index`, with the kernel's alignment), and
//! whether a map fails ("swiotlb buffer is full"). What follows the trace: the driver's reaction to a map the
//! kernel failed or made (the model releases slots the driver never had, and frees what the trace unmaps).

use super::ftrace::{dma_call, DmaKind, EventHead, SwiotlbNote, DMA_MAPPING_ERROR};
use crate::dma::swiotlb::{
    Swiotlb, SwiotlbConfig, SwiotlbCosts, IO_TLB_SHIFT, IO_TLB_SIZE, SWIOTLB_DMA_BASE,
};
use crate::kernel::KernelVersion;
use crate::sim::Coherence;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// `swiotlb=` on a kernel command line (kernel/dma/swiotlb.c setup_io_tlb_npages):
/// `[<slabs>][,<areas>][,force|noforce]`, the last one given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwiotlbParam {
    pub slabs: Option<u64>,
    pub areas: Option<u32>,
    pub force: bool,
}

impl SwiotlbParam {
    pub fn parse(cmdline: &str) -> Option<Self> {
        let v = cmdline
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("swiotlb="))
            .next_back()?;
        // simple_strtoul(str, &str, 0): a leading number, decimal or 0x hex.
        let number = |s: &str| -> (Option<u64>, usize) {
            let (digits, radix, skip) = match s.strip_prefix("0x") {
                Some(h) => (h, 16, 2),
                None => (s, 10, 0),
            };
            let n = digits.chars().take_while(|c| c.is_digit(radix)).count();
            if n == 0 {
                return (None, 0);
            }
            (u64::from_str_radix(&digits[..n], radix).ok(), skip + n)
        };
        let mut rest = v;
        let (slabs, used) = number(rest);
        rest = &rest[used..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
        let (areas, used) = number(rest);
        rest = &rest[used..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
        Some(SwiotlbParam {
            slabs,
            areas: areas.map(|a| a.min(u32::MAX as u64) as u32),
            force: rest == "force",
        })
    }
}

/// One phase's bounces, the model's beside the kernel's.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BouncePhase {
    pub model: BounceModel,
    pub guest: BounceGuest,
    /// Bounces both made, whose slot the model chose as the kernel did (`same`) out of those compared.
    pub slots_compared: u64,
    pub slots_same: u64,
    /// Maps one failed and the other made.
    pub model_full_kernel_mapped: u64,
    pub model_mapped_kernel_full: u64,
    /// Bounces the model then placed where the kernel had (its slot differed, or it found none), and the
    /// mappings it dropped for them: over the kernel's slots, so unmapped where the trace did not show it.
    pub followed: u64,
    pub untraced_frees: u64,
}

/// What the model's pool did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BounceModel {
    /// swiotlb_map() calls: bounces attempted (the `swiotlb_bounced` tracepoint's count).
    pub bounces: u64,
    /// Of those, found no slots.
    pub full_events: u64,
    /// Slots in use at the capture's end note, and the most in use after any allocation since its start note
    /// (debugfs io_tlb_used, io_tlb_used_hiwater after it was reset), where the capture noted them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used_slots: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub high_water_slots: Option<u64>,
}

/// What the kernel recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BounceGuest {
    /// `swiotlb:swiotlb_bounced` events.
    pub swiotlb_bounced: u64,
    /// Maps of a bouncing device that returned DMA_MAPPING_ERROR ("swiotlb buffer is full"; a dma_map_sg
    /// that fails is not traced, 6.12's __dma_map_sg_attrs).
    pub map_errors: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used_slots: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub high_water_slots: Option<u64>,
    /// The high-water mark when the capture started (0: reset before it, so the end note's is the capture's
    /// own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub high_water_at_start: Option<u64>,
}

/// The pool the replay modelled and where its geometry came from.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BounceSummary {
    pub pool_slots: u64,
    pub areas: u32,
    pub dynamic: bool,
    /// Every device's streaming maps bounce (`swiotlb=force`); else only those of the devices the trace's
    /// `swiotlb_bounced` events name.
    pub force: bool,
    /// The pool's slots the kernel reported (the capture's note), where it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_pool_slots: Option<u64>,
    /// How the geometry was decided, for the reader.
    pub from: String,
}

/// A live bounce as the kernel's events name it: a page map by the DMA address it returned, a dma_map_sg
/// segment by its physical address (dma_unmap_sg prints only those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Bounced {
    Dma(u64),
    Phys(u64),
}

impl Bounced {
    fn of(kind: DmaKind, addr: u64, phys: u64) -> Self {
        match kind {
            DmaKind::MapSg | DmaKind::UnmapSg => Bounced::Phys(phys),
            _ => Bounced::Dma(addr),
        }
    }
}

/// The bounce replay of one trace.
pub(super) struct BounceReplay {
    pool: Option<Swiotlb>,
    param: Option<SwiotlbParam>,
    kernel: KernelVersion,
    summary: BounceSummary,
    /// The capture's first note (geometry), until the pool is made.
    note: Option<SwiotlbNote>,
    /// Devices whose maps bounce when not every device's does.
    bouncing: HashSet<String>,
    /// A live bounce as the kernel's events name it → the model's DMA page number for it, and back.
    live: HashMap<Bounced, u64>,
    links: HashMap<u64, Bounced>,
    /// The kernel pool's start (bytes), from the capture's note or the first bounce both made.
    kernel_start: Option<u64>,
    /// Every phase's counts in order of appearance, their index by name, the phase open and the one begun
    /// last (a capture's end note follows its phase's end).
    pub(super) phases: Vec<(String, BouncePhase)>,
    index: HashMap<String, usize>,
    open: Option<usize>,
    last_begun: Option<usize>,
    /// The most slots used since the capture's last start note.
    window_high: u64,
    /// The kernel's high-water mark at the capture's last start note.
    start_high: Option<u64>,
    highest_cpu: u32,
}

impl BounceReplay {
    pub(super) fn new(kernel: (u32, u32), cmdline: &str) -> Self {
        BounceReplay {
            pool: None,
            param: SwiotlbParam::parse(cmdline),
            kernel: KernelVersion::from(kernel),
            summary: BounceSummary::default(),
            note: None,
            bouncing: HashSet::new(),
            live: HashMap::new(),
            links: HashMap::new(),
            kernel_start: None,
            phases: Vec::new(),
            index: HashMap::new(),
            open: None,
            last_begun: None,
            window_high: 0,
            start_high: None,
            highest_cpu: 0,
        }
    }

    /// Whether the command line forces bouncing (the replay then runs the pool from the first event).
    pub(super) fn forced(&self) -> bool {
        self.param.is_some_and(|p| p.force)
    }

    /// Whether anything bounced or was set up to.
    pub(super) fn active(&self) -> bool {
        self.pool.is_some()
    }

    /// Phase `name`'s place in `phases` (added at its first sight), looked up through an index: a trace may
    /// hold tens of thousands of phases.
    fn index_of(&mut self, name: &str) -> usize {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        self.phases.push((name.to_string(), BouncePhase::default()));
        self.index.insert(name.to_string(), self.phases.len() - 1);
        self.phases.len() - 1
    }

    /// The phase open (or `_outside`).
    fn cur(&mut self) -> &mut BouncePhase {
        let i = match self.open {
            Some(i) => i,
            None => self.index_of(super::OUTSIDE),
        };
        &mut self.phases[i].1
    }

    /// The pool, made at the first event that needs it: its slots and areas from `swiotlb=` as the kernel
    /// sizes them (else the capture's note, else 64 MiB), its areas from the possible CPUs the note gives (else
    /// the CPUs the trace showed so far), dynamic growth where the note shows io_tlb_transient_nslabs.
    fn pool(&mut self) -> &mut Swiotlb {
        if self.pool.is_none() {
            let note = self.note.clone().unwrap_or_default();
            let param = self.param.unwrap_or_default();
            let cpus = note.possible_cpus.unwrap_or(self.highest_cpu + 1);
            let size = param.slabs.or(note.nslabs).map(|n| n << IO_TLB_SHIFT);
            let (slots, areas) = SwiotlbConfig::pool(
                self.kernel,
                size,
                param.areas.unwrap_or(0),
                cpus,
                false,
                u64::MAX,
            );
            let dynamic = note.transient.is_some() && self.kernel.swiotlb_dynamic();
            let from = [
                match (param.slabs, note.nslabs) {
                    (Some(_), _) => "slots from swiotlb=",
                    (None, Some(_)) => "slots from the capture's note",
                    (None, None) => "the default 64 MiB pool",
                },
                match (param.areas, note.possible_cpus) {
                    (Some(_), _) => "areas from swiotlb=",
                    (None, Some(_)) => "areas from the possible CPUs the capture noted",
                    (None, None) => "areas from the CPUs the trace showed",
                },
                if dynamic {
                    "dynamic (the capture saw io_tlb_transient_nslabs)"
                } else {
                    "not dynamic"
                },
            ]
            .join(", ");
            self.summary = BounceSummary {
                pool_slots: slots,
                areas,
                dynamic,
                force: self.forced(),
                kernel_pool_slots: note.nslabs,
                from,
            };
            self.kernel_start = note.start;
            // Counts only: the replay reports what the pool did, not what it cost.
            let costs = SwiotlbCosts {
                op_ns: 0,
                slot_ns: 0,
                copy_ns_per_byte: 0.0,
                lock_ns: 0,
                coh: Coherence {
                    cluster_cores: 1,
                    socket_cores: 1,
                    cluster_ns: 0,
                    socket_ns: 0,
                    remote_ns: 0,
                },
            };
            self.pool = Some(Swiotlb::new(SwiotlbConfig {
                slots,
                areas,
                dynamic,
                // A device's min_align_mask (NVMe's 4 KiB) is not in the trace.
                min_align_mask: 0,
                max_slots: u64::MAX >> IO_TLB_SHIFT,
                debugfs: false,
                costs,
            }));
        }
        self.pool.as_mut().expect("made above")
    }

    pub(super) fn marker(&mut self, text: &str) {
        if let Some(p) = text.strip_prefix("TB_BEGIN ") {
            let i = self.index_of(p.trim());
            (self.open, self.last_begun) = (Some(i), Some(i));
        } else if text.starts_with("TB_END") {
            self.open = None;
        }
    }

    /// The capture's note at its start (the geometry, and the high-water mark the kernel then had) or at its
    /// end (what the kernel had used, to set beside the model's since the start note).
    pub(super) fn note(&mut self, n: &SwiotlbNote) {
        if !n.end {
            if self.note.is_none() {
                self.note = Some(n.clone());
            }
            self.window_high = 0;
            self.start_high = n.hiwater;
            return;
        }
        let used = self.pool.as_ref().map(|p| p.stats.used_slots);
        let high = self.window_high;
        let start_hw = self.start_high.take();
        let i = match self.last_begun {
            Some(i) => i,
            None => self.index_of(super::OUTSIDE),
        };
        let e = &mut self.phases[i].1;
        e.guest.used_slots = n.used;
        e.guest.high_water_slots = n.hiwater;
        e.guest.high_water_at_start = start_hw;
        e.model.used_slots = used;
        e.model.high_water_slots = used.map(|_| high);
    }

    /// A `swiotlb_bounced` event: the kernel attempted a bounce for `dev`.
    pub(super) fn bounced(&mut self, ev: &EventHead, dev: &str) {
        self.highest_cpu = self.highest_cpu.max(ev.cpu);
        if !self.forced() && !self.bouncing.contains(dev) {
            self.bouncing.insert(dev.to_string());
        }
        self.pool();
        self.cur().guest.swiotlb_bounced += 1;
    }

    /// A DMA API event line (`text`), once the pool runs.
    pub(super) fn dma_line(&mut self, text: &str, line: u64) {
        let Some((ev, dev, call)) = dma_call(text, line) else {
            return;
        };
        self.highest_cpu = self.highest_cpu.max(ev.cpu);
        if !(self.forced() || self.bouncing.contains(&dev)) {
            return;
        }
        let (now, cpu) = (ev.ts_ns, ev.cpu as usize);
        match call.kind {
            DmaKind::MapPage | DmaKind::MapSg => {
                for &(addr, bytes, phys) in &call.segs {
                    self.map(
                        now,
                        cpu,
                        addr,
                        bytes,
                        phys,
                        call.kind,
                        call.dir,
                        call.skip_cpu_sync,
                    );
                }
            }
            DmaKind::UnmapPage | DmaKind::UnmapSg => {
                for &(addr, _, phys) in &call.segs {
                    let key = Bounced::of(call.kind, addr, phys);
                    if let Some(m) = self.live.remove(&key) {
                        self.links.remove(&m);
                        self.pool().unmap(now, cpu, m);
                    }
                }
            }
            DmaKind::MapOther | DmaKind::UnmapOther => {}
        }
    }

    /// One bounce the kernel made (or failed: `addr` DMA_MAPPING_ERROR), the model's beside it. Where the
    /// kernel put it elsewhere, or made it where the model found no room, the model then follows the kernel
    /// (its slots, and its area's next search after them): the trace shows the pool's state, and each
    /// bounce is predicted from it, so a capture that starts with the pool in use, or misses events between
    /// phases, does not set every later slot apart.
    #[allow(clippy::too_many_arguments)]
    fn map(
        &mut self,
        now: u64,
        cpu: usize,
        addr: u64,
        bytes: u64,
        phys: u64,
        kind: DmaKind,
        dir: crate::scenario::MapDir,
        skip: bool,
    ) {
        let pool = self.pool();
        let index_before = pool.next_index(cpu);
        let got = pool.map(
            now,
            cpu,
            phys & (crate::hw::PAGE_SIZE - 1),
            bytes,
            dir,
            skip,
        );
        let kernel_failed = addr == DMA_MAPPING_ERROR;
        let mut e = BouncePhase::default();
        e.model.bounces = 1;
        let mut made = None;
        match (got, kernel_failed) {
            (Ok((dma, _, _)), false) => {
                let slot = dma - SWIOTLB_DMA_BASE;
                // The kernel's pool start: noted, else where the first bounce both made puts it.
                let start = *self
                    .kernel_start
                    .get_or_insert(addr.wrapping_sub(slot << IO_TLB_SHIFT) & !(IO_TLB_SIZE - 1));
                let kslot = addr.wrapping_sub(start) >> IO_TLB_SHIFT;
                e.slots_compared = 1;
                made = Some(dma);
                if kslot == slot {
                    e.slots_same = 1;
                } else {
                    self.pool().unmap(now, cpu, dma);
                    made = self.follow(now, cpu, kslot, bytes, dir, skip, &mut e);
                }
            }
            (Ok((dma, _, _)), true) => {
                // The driver never had this mapping: the model gives its slots back at once, and its next
                // search starts where the kernel's failed one left it.
                e.model_mapped_kernel_full = 1;
                e.guest.map_errors = 1;
                let pool = self.pool();
                pool.unmap(now, cpu, dma);
                pool.set_next_index(cpu, index_before);
            }
            (Err(_), false) => {
                e.model.full_events = 1;
                e.model_full_kernel_mapped = 1;
                if let Some(start) = self.kernel_start {
                    let kslot = addr.wrapping_sub(start) >> IO_TLB_SHIFT;
                    made = self.follow(now, cpu, kslot, bytes, dir, skip, &mut e);
                }
            }
            (Err(_), true) => {
                e.model.full_events = 1;
                e.guest.map_errors = 1;
            }
        }
        if let Some(dma) = made {
            let key = Bounced::of(kind, addr, phys);
            self.live.insert(key, dma);
            self.links.insert(dma, key);
        }
        let used = self.pool().stats.used_slots;
        self.window_high = self.window_high.max(used);
        self.cur().add(&e);
    }

    /// The model takes the kernel's slot `kslot` for this bounce: the mappings it held there are dropped
    /// (their unmaps were not traced). Returns the model's DMA page number, None where the slot is not the
    /// default pool's.
    #[allow(clippy::too_many_arguments)]
    fn follow(
        &mut self,
        now: u64,
        cpu: usize,
        kslot: u64,
        bytes: u64,
        dir: crate::scenario::MapDir,
        skip: bool,
        e: &mut BouncePhase,
    ) -> Option<u64> {
        let (dma, released) = self.pool().occupy(now, cpu, kslot, bytes, dir, skip)?;
        e.followed = 1;
        e.untraced_frees = released.len() as u64;
        for r in released {
            if let Some(k) = self.links.remove(&r) {
                self.live.remove(&k);
            }
        }
        Some(dma)
    }

    pub(super) fn summary(&self) -> Option<BounceSummary> {
        self.pool.as_ref().map(|_| self.summary.clone())
    }
}

impl BouncePhase {
    fn add(&mut self, o: &BouncePhase) {
        self.model.bounces += o.model.bounces;
        self.model.full_events += o.model.full_events;
        self.guest.map_errors += o.guest.map_errors;
        self.slots_compared += o.slots_compared;
        self.slots_same += o.slots_same;
        self.model_full_kernel_mapped += o.model_full_kernel_mapped;
        self.model_mapped_kernel_full += o.model_mapped_kernel_full;
        self.followed += o.followed;
        self.untraced_frees += o.untraced_frees;
    }
}
