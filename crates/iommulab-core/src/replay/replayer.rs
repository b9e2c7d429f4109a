//! One DMA domain's replayer: its DMA layer and IOMMU, the phases it counted, what it has queued lazily
//! and its flush timers.

use super::*;

pub(super) struct Replayer {
    pub(super) dma: DmaLayer,
    pub(super) totals: Totals,
    /// Totals when the current phase began.
    pub(super) mark: Totals,
    pub(super) phase: PhaseName,
    pub(super) phases: Phases,
    /// Lazily unmapped IOVA still waiting for a flush. Every flush frees all of it.
    pub(super) queued: Queued,
    /// Flush-queue flushes when `queued` was last emptied.
    pub(super) queued_flushes: u64,
    /// Armed flush-queue timers: (expiry, sequence) → CPU.
    pub(super) timers: BTreeMap<(Time, u64), usize>,
    /// The trace records when this domain's flush queue timer fires: the model's own timer stands down.
    pub(super) recorded: bool,
    /// It does for every domain, those yet to appear too.
    pub(super) recorded_all: bool,
    pub(super) seq: u64,
    /// Phases whose device uses ATS (empty: all).
    pub(super) ats_phases: Vec<String>,
    /// Unmapped pages the trace never mapped, and TB_END markers of a phase not begun.
    pub(super) untraced_pages: u64,
    pub(super) unmatched_markers: u64,
    /// Map events that wrote over a translation still present in their domain.
    pub(super) maps_over_live: u64,
}

/// Ranges of pfns unmapped lazily and not yet flushed: first pfn → end pfn.
#[derive(Default)]
pub(super) struct Queued {
    pub(super) by_first: BTreeMap<u64, u64>,
    /// Some ranges overlap (a trace that unmaps what it already unmapped): the ranges a map meets are then
    /// not one run of the order, and are looked for among all that start before its end.
    pub(super) overlapping: bool,
}

impl Queued {
    pub(super) fn clear(&mut self) {
        self.by_first.clear();
        self.overlapping = false;
    }

    pub(super) fn insert(&mut self, first: u64, end: u64) {
        // While the ranges are disjoint, [first, end) meets one exactly when the last starting before its
        // end ends after its first.
        self.overlapping = self.overlapping
            || self
                .by_first
                .range(..end)
                .next_back()
                .is_some_and(|(_, &e)| e > first);
        self.by_first.insert(first, end);
    }

    /// Drop the ranges [first, end) meets; how many.
    pub(super) fn take_overlapping(&mut self, first: u64, end: u64) -> u64 {
        let hit: SmallVec<[u64; 4]> = if self.overlapping {
            self.by_first
                .range(..end)
                .filter(|(_, &e)| e > first)
                .map(|(&a, _)| a)
                .collect()
        } else {
            meeting(
                self.by_first.range(..end).rev().map(|(&a, &e)| (a, e)),
                first,
            )
        };
        for a in &hit {
            self.by_first.remove(a);
        }
        hit.len() as u64
    }
}

pub(super) fn pfn(bytes: u64) -> u64 {
    bytes >> PAGE_SHIFT
}

pub(super) fn pages(bytes: u64) -> u64 {
    bytes.div_ceil(1 << PAGE_SHIFT)
}

impl Replayer {
    pub(super) fn counters(&self) -> Totals {
        Totals {
            iommu: self.dma.core.iommu.counters().clone(),
            ..self.totals.clone()
        }
    }

    /// Add what happened since the phase began to it.
    pub(super) fn commit(&mut self) {
        let now = self.counters();
        let c = now.counts_since(&self.mark);
        let p = self.phases.entry(self.phase.as_deref().unwrap_or(OUTSIDE));
        p.counts += &c;
        p.early_reuses += now.early_reuses - self.mark.early_reuses;
        self.mark = now;
    }

    /// The device behind the current phase's events: with ATS unless `--ats-phases` leaves this phase out.
    pub(super) fn serve_phase(&mut self) {
        let on = self.ats_phases.is_empty()
            || self
                .phase
                .as_ref()
                .is_some_and(|p| self.ats_phases.iter().any(|a| **a == **p));
        self.dma.core.iommu.translator_mut().set_ats_active(on);
    }

    pub(super) fn take_timer(&mut self) {
        if let Some((exp, cpu)) = self.dma.core.timer_request.take() {
            if self.recorded {
                return;
            }
            self.seq += 1;
            self.timers.insert((exp, self.seq), cpu);
        }
    }

    /// From now on the trace says when the flush queue's timer fires; what the model armed is dropped.
    pub(super) fn timer_recorded(&mut self) {
        self.recorded = true;
        self.timers.clear();
    }

    /// fq_flush_timeout() ran on `cpu` at `ts`, as the trace recorded it: the flush and the rings' frees.
    pub(super) fn recorded_timer(&mut self, ts: Time, cpu: u32) {
        self.timer_recorded();
        self.dma.timer(ts, cpu as usize);
    }

    /// Fire the timers due by `t` (they run before anything traced at or after their expiry).
    pub(super) fn fire_timers(&mut self, t: Time) {
        while let Some((&(exp, seq), &cpu)) = self.timers.first_key_value() {
            if exp > t {
                break;
            }
            self.timers.remove(&(exp, seq));
            self.dma.timer(exp, cpu);
            self.take_timer();
        }
    }

    /// Run `f` and count what it did in `phase` (not necessarily the current one).
    pub(super) fn attributed(&mut self, phase: &PhaseName, f: impl FnOnce(&mut Self)) {
        if *phase == self.phase {
            f(self);
            return;
        }
        self.commit();
        let cur = std::mem::replace(&mut self.phase, phase.clone());
        f(self);
        self.commit();
        self.phase = cur;
    }

    /// One iotlb_sync_map over IOVA bytes [start, end), counted in the phase it was mapped in.
    pub(super) fn sync_map(&mut self, phase: &PhaseName, cpu: u32, ts: Time, start: u64, end: u64) {
        self.attributed(phase, |r| {
            r.totals.map_syncs += 1;
            let core = &mut r.dma.core;
            core.iommu
                .iotlb_sync_map(ts, cpu as usize, core.dom, pfn(start), pages(end - start));
        });
    }

    /// One step of this domain's replay.
    pub(super) fn apply(&mut self, op: &Op) {
        match *op {
            Op::Map { iova, paddr, size } => self.map(iova, paddr, size),
            Op::Sync {
                ref phase,
                cpu,
                ts,
                start,
                end,
            } => self.sync_map(phase, cpu, ts, start, end),
            Op::Unmap {
                ts,
                cpu,
                iova,
                bytes,
                cleared,
                synced,
            } => self.unmap(ts, cpu, iova, bytes, cleared, synced),
        }
    }

    /// Flush-queue flushes so far (full ring or timer).
    pub(super) fn flushes(&self) -> u64 {
        let s = &self.dma.core.stats;
        s.fq_flush_full + s.fq_flush_timer
    }

    /// Forget what the flushes since the last look have freed (a flush frees everything queued before it).
    pub(super) fn prune_queued(&mut self) {
        let f = self.flushes();
        if f != self.queued_flushes {
            self.queued.clear();
            self.queued_flushes = f;
        }
    }

    /// A map of [first, end) pfns: any of it the model still holds queued for a flush is an early reuse.
    pub(super) fn check_reuse(&mut self, first: u64, end: u64) {
        self.prune_queued();
        self.totals.early_reuses += self.queued.take_overlapping(first, end);
    }

    /// A map event (the syncs it settled came first).
    pub(super) fn map(&mut self, iova: u64, paddr: u64, size: u64) {
        self.totals.map_events += 1;
        if !self.dma.policy.translated() {
            return;
        }
        self.check_reuse(pfn(iova), pfn(iova) + pages(size));
        let c = &mut self.dma.core;
        let replaced = c.iommu.counters().leaves_replaced;
        c.iommu.map_pages(c.dom, pfn(iova), pfn(paddr), pages(size));
        self.maps_over_live += (c.iommu.counters().leaves_replaced != replaced) as u64;
        c.stats.maps += 1;
        c.stats.pages_mapped += pages(size);
    }

    /// An unmap event of `bytes` (the syncs it settled came first); `synced`: an IOVA-API unlink.
    pub(super) fn unmap(
        &mut self,
        ts: Time,
        cpu: u32,
        iova: u64,
        bytes: u64,
        cleared: bool,
        synced: bool,
    ) {
        self.totals.unmap_events += 1;
        if !self.dma.policy.translated() {
            return;
        }
        let (first, n) = (pfn(iova), pages(bytes));
        // PTEs set before tracing began: reconstruct them (identity-mapped placeholders) so the unmap clears
        // what the kernel cleared.
        if cleared {
            let c = &mut self.dma.core;
            let mut p = first;
            while p < first + n {
                if c.iommu.iova_to_phys(c.dom, p).is_some() {
                    p += 1;
                    continue;
                }
                let run = (p..first + n)
                    .take_while(|&q| c.iommu.iova_to_phys(c.dom, q).is_none())
                    .count() as u64;
                c.iommu.map_untraced(c.dom, p, p, run);
                self.untraced_pages += run;
                p += run;
            }
        }
        if synced {
            // dma_iova_unlink(): synced at once, in a lazy domain too, nothing queued.
            self.dma.iova_unlink_free(ts, cpu as usize, first, n);
            return;
        }
        self.dma.unmap(ts, cpu as usize, first, n);
        if self.dma.policy.name() == PolicyName::Lazy {
            self.prune_queued();
            self.queued.insert(first, first + n);
        }
        self.take_timer();
    }

    pub(super) fn marker(&mut self, text: &str) {
        match marked(&self.phase, text) {
            Marked::Begin(name) => {
                self.commit();
                self.phase = Some(name);
            }
            Marked::End => {
                self.commit();
                self.phase = None;
            }
            Marked::Unmatched => self.unmatched_markers += 1,
            Marked::Nothing => {}
        }
    }
}
