//! What a replay reports: per phase, what reached the IOMMU in the vendor's own names, the tick phase chosen
//! for a lazy replay, and what the trace itself showed (its lines, oddities, domains, recorded timer).

use crate::hw::driver::Column;
use crate::hw::Vendor;
use crate::hw::{InvClass, IommuCounters, INV_CLASSES};
use crate::metrics::IovaLocality;
use serde::ser::SerializeMap;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// What reached the IOMMU in one phase: commands by what they do, the synchronisations waited for and the
/// doorbells rung, serialised in the vendor's own names (its driver's `replay_columns`: VT-d's `iotlb_psi`,
/// `wait`..., SMMUv3's `tlbi_nh_va`, `cmd_sync`, `doorbells`..., virtio-iommu's `virtio_map`...).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub vendor: Option<Vendor>,
    pub map_events: u64,
    pub unmap_events: u64,
    /// `iotlb_sync_map` calls (map groups).
    pub map_syncs: u64,
    /// Commands by class (`InvClass as usize`).
    pub by_class: [u64; INV_CLASSES],
    /// Synchronisations waited for (wait descriptors, CMD_SYNCs).
    pub syncs: u64,
    /// Doorbell writes: submissions the IOMMU was told of (an SMMUv3 owner's CMDQ_PROD write carries the
    /// commands it gathered from other CPUs).
    pub doorbells: u64,
}

impl Counts {
    pub fn class(&self, c: InvClass) -> u64 {
        self.by_class[c as usize]
    }
    /// Range invalidations (VT-d PSI, SMMUv3 TLBI by address, virtio-iommu UNMAP).
    pub fn range(&self) -> u64 {
        self.class(InvClass::Range)
    }
    /// Whole-domain invalidations (VT-d DSI, SMMUv3 TLBI by ASID).
    pub fn domain(&self) -> u64 {
        self.class(InvClass::Domain)
    }
    fn column(&self, c: Column) -> u64 {
        match c {
            Column::Class(k) => self.class(k),
            Column::Classes(ks) => ks.iter().map(|&k| self.class(k)).sum(),
            Column::Syncs => self.syncs,
            Column::Doorbells => self.doorbells,
        }
    }
}

impl Serialize for Counts {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("map_events", &self.map_events)?;
        m.serialize_entry("unmap_events", &self.unmap_events)?;
        m.serialize_entry("map_syncs", &self.map_syncs)?;
        let columns = self.vendor.map_or(&[][..], |v| v.driver().replay_columns());
        for &(name, c) in columns {
            m.serialize_entry(name, &self.column(c))?;
        }
        m.end()
    }
}

/// Running totals the per-phase counts are differences of.
#[derive(Debug, Clone, Default)]
pub(super) struct Totals {
    pub(super) vendor: Option<Vendor>,
    pub(super) early_reuses: u64,
    pub(super) map_events: u64,
    pub(super) unmap_events: u64,
    pub(super) map_syncs: u64,
    pub(super) iommu: IommuCounters,
}

impl Totals {
    pub(super) fn counts_since(&self, a: &Totals) -> Counts {
        let (n, o) = (&self.iommu, &a.iommu);
        Counts {
            vendor: self.vendor,
            doorbells: (n.submissions - o.submissions) - (n.gathered - o.gathered),
            map_events: self.map_events - a.map_events,
            unmap_events: self.unmap_events - a.unmap_events,
            map_syncs: self.map_syncs - a.map_syncs,
            by_class: std::array::from_fn(|i| n.by_class[i] - o.by_class[i]),
            syncs: n.syncs - o.syncs,
        }
    }
}

impl std::ops::AddAssign<&Counts> for Counts {
    fn add_assign(&mut self, o: &Counts) {
        self.map_events += o.map_events;
        self.unmap_events += o.unmap_events;
        self.map_syncs += o.map_syncs;
        for (a, b) in self.by_class.iter_mut().zip(o.by_class) {
            *a += b;
        }
        self.syncs += o.syncs;
        self.doorbells += o.doorbells;
        self.vendor = self.vendor.or(o.vendor);
    }
}

/// One phase's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Phase {
    pub counts: Counts,
    /// Lazy mode: the tick phase chosen for this phase of the trace and what it left unexplained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tick_fit: Option<TickFit>,
    /// IOVAs the trace maps again while the model still holds them in a flush queue.
    #[serde(skip)]
    pub(super) early_reuses: u64,
    /// The same counts per DMA domain the phase saw (its replayer existed), keyed by the domain's name (see
    /// [`Domains::devices`]), in the order the domains appeared.
    pub by_domain: Named<Counts>,
    /// Where the trace bounces: the model's swiotlb pool beside what the kernel recorded (bounce.rs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swiotlb: Option<super::bounce::BouncePhase>,
}

/// Values keyed by name, in the order they were added, serialised as a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct Named<T>(pub Vec<(Arc<str>, T)>);

impl<T> Default for Named<T> {
    fn default() -> Self {
        Named(Vec::new())
    }
}

impl<T> Named<T> {
    pub fn get(&self, name: &str) -> Option<&T> {
        self.0.iter().find(|(n, _)| &**n == name).map(|(_, v)| v)
    }
}

impl<T: Serialize> Serialize for Named<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(&**k, v)?;
        }
        m.end()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TickFit {
    /// The tick's offset on the trace clock, µs into each jiffy.
    pub tick_phase_us: f64,
    pub early_reuses: u64,
}

/// Phases in the order they first appeared, serialised as a JSON object. Looked up by name through an index:
/// a trace may hold tens of thousands of phases, and every marker and every domain's sum looks one up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Phases {
    list: Vec<(String, Phase)>,
    index: HashMap<String, usize>,
}

impl Phases {
    pub fn get(&self, name: &str) -> Option<&Phase> {
        self.index.get(name).map(|&i| &self.list[i].1)
    }

    /// The phases, in the order they first appeared.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Phase)> {
        self.list.iter().map(|(n, p)| (n.as_str(), p))
    }

    /// Add domain `dom`'s phases, phase by phase: to the totals, and as that domain's counts.
    pub(super) fn add(&mut self, dom: &Arc<str>, o: &Phases) {
        for (name, p) in &o.list {
            let e = self.entry(name);
            e.counts += &p.counts;
            e.early_reuses += p.early_reuses;
            e.by_domain.0.push((dom.clone(), p.counts.clone()));
        }
    }

    pub(super) fn entry(&mut self, name: &str) -> &mut Phase {
        let i = match self.index.get(name) {
            Some(&i) => i,
            None => {
                self.index.insert(name.to_string(), self.list.len());
                self.list.push((name.to_string(), Phase::default()));
                self.list.len() - 1
            }
        };
        &mut self.list[i].1
    }
}

impl Serialize for Phases {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.list.len()))?;
        for (k, v) in &self.list {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Lines the reader saw.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Lines {
    pub total: u64,
    pub events: u64,
    pub bad: u64,
    /// The first few bad lines: "LINE: why".
    pub bad_examples: Vec<String>,
}

/// Oddities of a trace that a real host can produce (lost events, merged buffers), replayed as they are and
/// counted.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Anomalies {
    /// Map or unmap events whose IOVA is not 4 KiB aligned (iommu_map and iommu_unmap refuse those).
    pub unaligned: u64,
    /// Events stamped earlier than the event before them.
    pub time_backwards: u64,
    /// TB_END markers of a phase not begun.
    pub unmatched_markers: u64,
    /// Unmapped pages the trace never mapped: mapped before tracing began, or map events lost (replayed as
    /// mapped then).
    pub untraced_unmapped_pages: u64,
    /// Map events on IOVA their domain still had mapped. A domain's allocator never hands out a live IOVA
    /// (and iommu_map() refuses to map over one), so the trace has domains the replay merged (no labels), or
    /// lost unmap events.
    pub maps_over_live: u64,
}

/// The flush queue's timer as the trace recorded it (kprobe lines on `fq_flush_timeout`): how many firings
/// drove the model's timer, and how many were passed over (a trace of several domains that does not say whose
/// timer fired; a firing whose flush the trace lost; a firing of a pointer not yet tied to a domain);
/// `by_domain`: each firing named its domain (the cookie's `fq_domain`, or the driver's `flush_iotlb_all` that
/// followed it), one the labels know.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RecordedTimer {
    pub firings: u64,
    pub ignored: u64,
    pub by_domain: bool,
    /// Domain pointers the firings name, tied to the device-named domain whose unmaps armed their timer (a
    /// trace whose events name their device only; each domain ran its own timer until its first tied firing).
    pub tied: u64,
    /// Domains no recorded firing drove: each ran the model's own timer throughout.
    pub own_timer_domains: u64,
}

/// The DMA domains the trace showed: how many, and how many events a label placed and how many were inferred.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Domains {
    pub count: u64,
    pub labelled_events: u64,
    pub inferred_events: u64,
    /// Each domain by the name the trace gives it, with the devices the trace showed in it (sorted): the
    /// pointer its kprobe labels name (`0xffff…`), else the device or IOMMU group its DMA API events name
    /// (`0000:00:02.0`, `iommu group 3`: the group's devices), else `_domainN` (N its place in the order the
    /// domains appeared: the one domain of a trace without labels, or one inferred).
    pub devices: Named<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    pub iommu: String,
    pub kernel: String,
    pub policy: String,
    pub policy_reason: String,
    pub hz: u32,
    pub lines: Lines,
    pub anomalies: Anomalies,
    /// Walk-cache locality of the traced kernel's IOVA allocations, over the whole trace.
    pub iova_locality: IovaLocality,
    pub domains: Domains,
    /// Present when the trace recorded the flush queue's timer (lazy replays): the model's timer stood down.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded_timer: Option<RecordedTimer>,
    /// Present when the trace bounces through swiotlb: the pool the replay modelled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swiotlb: Option<super::bounce::BounceSummary>,
    pub phases: Phases,
    /// What the reader should know, one line each (see `warnings.rs`).
    pub warnings: Vec<String>,
}

/// Per phase of the trace, the tick phase whose replay left the fewest early reuses (the middle of the
/// best run of candidates when several tie), with that replay's counts.
pub(super) fn pick_tick_phases(done: &[(u64, Phases)]) -> Phases {
    let names: Vec<String> = done[0].1.iter().map(|(n, _)| n.to_string()).collect();
    let k = done.len();
    let mut out = Phases::default();
    for name in names {
        let early: Vec<u64> = done
            .iter()
            .map(|(_, p)| p.get(&name).map_or(0, |x| x.early_reuses))
            .collect();
        let best = *early.iter().min().expect("candidates");
        // The longest circular run of minima; its middle.
        let (mut run_start, mut run_len) = (0, 0);
        for s in 0..k {
            if early[s] != best
                || early[(s + k - 1) % k] == best && k > 1 && early.iter().any(|&e| e != best)
            {
                continue;
            }
            let len = (0..k).take_while(|&j| early[(s + j) % k] == best).count();
            if len > run_len {
                (run_start, run_len) = (s, len);
            }
        }
        let i = (run_start + run_len.saturating_sub(1) / 2) % k;
        let (phase, p) = &done[i];
        let mut ph = p.get(&name).cloned().unwrap_or_default();
        ph.tick_fit = Some(TickFit {
            tick_phase_us: *phase as f64 / 1000.0,
            early_reuses: best,
        });
        *out.entry(&name) = ph;
    }
    out
}
