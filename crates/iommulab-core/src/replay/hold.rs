//! Which device each map and unmap belongs to, from the DMA API's own events (include/trace/events/dma.h,
//! Linux 6.12+, kernel/dma/mapping.c). A map-side event (`dma_map_page`, `dma_map_sg`, `dma_alloc`, …) comes
//! right after the `iommu:map` lines of its call on the same CPU; an unmap-side one before its `iommu:unmap`
//! (`dma_unmap_sg`, `dma_free`) or after it (`dma_unmap_page`). Records wait here until their device is
//! named or until `HOLD_WINDOW` later records have been read, and leave in trace order.

use super::ftrace::Record;
use crate::sim::PerCpu;
use std::collections::{HashMap, VecDeque};

/// Records a map or unmap waits at most for its DMA API event (a modelling bound on memory, ~0.5 MB). A
/// mapping call's events on its CPU can be hundreds of lines apart once every CPU's events are interleaved by
/// time: a two-vCPU arm64 guest's 32-page NVMe `dma_map_sg` came 560 lines after its first `iommu:map`.
pub(super) const HOLD_WINDOW: usize = 4096;

/// A trace whose first this many records hold no DMA API event has none (a capture enables them from its
/// start or not at all): its records skip the hold-back.
const HOLD_PROBE: u64 = 256;

/// A record and the device (its IOMMU group, where the capture noted it) a DMA API event named for it.
pub(super) struct Held {
    pub rec: Record,
    pub dev: Option<String>,
}

/// A DMA API event that named no held record: it names the next map (`map`) or unmap on its CPU whose range
/// meets its own (any, without one).
struct Ahead {
    map: bool,
    dev: String,
    range: Option<(u64, u64)>,
}

#[derive(Default)]
pub(super) struct Holdback {
    q: VecDeque<Held>,
    /// Sequence number of the front of `q`.
    base: u64,
    /// Per CPU, the held maps and unmaps without a device yet: sequence numbers, oldest first.
    open: PerCpu<VecDeque<u64>>,
    ahead: PerCpu<Option<Ahead>>,
    /// Devices sharing an IOMMU group share its domain: device → the group's name.
    group_of: HashMap<String, String>,
    /// Records taken so far, and whether a DMA API event was among them.
    taken: u64,
    named: bool,
}

/// The CPU, side (map or unmap) and IOVA range of a map or unmap record.
fn event_of(rec: &Record) -> Option<(u32, bool, u64, u64)> {
    match *rec {
        Record::Map {
            ref ev, iova, size, ..
        } => Some((ev.cpu, true, iova, iova.saturating_add(size.max(1)))),
        Record::Unmap {
            ref ev,
            iova,
            size,
            unmapped,
        } => Some((
            ev.cpu,
            false,
            iova,
            iova.saturating_add(size.max(unmapped).max(1)),
        )),
        _ => None,
    }
}

fn meets(a: (u64, u64), b: Option<(u64, u64)>) -> bool {
    b.is_none_or(|(s, e)| a.0 < e && s < a.1)
}

impl Holdback {
    /// Each IOMMU group the capture noted (by the name its events are given) → its devices, sorted.
    pub(super) fn groups(&self) -> HashMap<String, Vec<String>> {
        let mut g: HashMap<String, Vec<String>> = HashMap::new();
        for (dev, group) in &self.group_of {
            g.entry(group.clone()).or_default().push(dev.clone());
        }
        g.values_mut().for_each(|d| d.sort());
        g
    }

    /// Whether records may skip the hold-back: the trace's first `HOLD_PROBE` records had no DMA API event
    /// and none is still held.
    pub(super) fn bypass(&self) -> bool {
        !self.named && self.taken > HOLD_PROBE && self.q.is_empty()
    }

    /// Take a record read from the trace (DMA API events and group notes label, everything else waits).
    pub(super) fn push(&mut self, rec: Record) {
        self.taken += 1;
        match rec {
            Record::Group { id, devs } => {
                for d in devs {
                    self.group_of.insert(d, format!("iommu group {id}"));
                }
            }
            Record::Device {
                ev,
                map,
                dev,
                range,
            } => {
                self.named = true;
                let dev = self.group_of.get(&dev).cloned().unwrap_or(dev);
                if !(range.is_some() && self.name_held(ev.cpu, map, &dev, range)) {
                    *self.ahead.get_mut(ev.cpu as usize) = Some(Ahead { map, dev, range });
                }
            }
            rec => {
                let mut dev = None;
                if let Some((cpu, map, a, b)) = event_of(&rec) {
                    let ahead = self.ahead.get_mut(cpu as usize);
                    match ahead {
                        Some(h) if h.map == map && meets((a, b), h.range) => {
                            dev = ahead.take().map(|h| h.dev);
                        }
                        _ => self
                            .open
                            .get_mut(cpu as usize)
                            .push_back(self.base + self.q.len() as u64),
                    }
                }
                self.q.push_back(Held { rec, dev });
            }
        }
    }

    /// Name `dev` for the latest held records of this side on `cpu` that meet `range` (a mapping call's
    /// `iommu:map` lines are consecutive on its CPU). Whether any was.
    fn name_held(&mut self, cpu: u32, map: bool, dev: &str, range: Option<(u64, u64)>) -> bool {
        let open = self.open.get_mut(cpu as usize);
        let mut named = false;
        while let Some(&seq) = open.back() {
            let h = &mut self.q[(seq - self.base) as usize];
            match event_of(&h.rec) {
                Some((_, m, a, b)) if m == map && meets((a, b), range) => {
                    h.dev = Some(dev.to_string());
                    open.pop_back();
                    named = true;
                }
                _ => break,
            }
        }
        named
    }

    /// The next record ready to leave: named, not a map or unmap, or waited long enough (all, at the end).
    pub(super) fn pop(&mut self, end: bool) -> Option<Held> {
        let h = self.q.front()?;
        let waiting = h.dev.is_none() && event_of(&h.rec).is_some();
        let may_be_named = self.named || self.taken <= HOLD_PROBE;
        if waiting && !end && may_be_named && self.q.len() <= HOLD_WINDOW {
            return None;
        }
        let h = self.q.pop_front()?;
        if waiting {
            if let Some((cpu, ..)) = event_of(&h.rec) {
                let o = self.open.get_mut(cpu as usize);
                if o.front() == Some(&self.base) {
                    o.pop_front();
                }
            }
        }
        self.base += 1;
        Some(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::ftrace::parse_line;

    fn feed(h: &mut Holdback, lines: &[&str]) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        for (i, l) in lines.iter().enumerate() {
            h.push(parse_line(l, i as u64 + 1));
            while let Some(x) = h.pop(false) {
                out.push((format!("{:?}", x.rec).chars().take(5).collect(), x.dev));
            }
        }
        while let Some(x) = h.pop(true) {
            out.push((format!("{:?}", x.rec).chars().take(5).collect(), x.dev));
        }
        out
    }

    #[test]
    fn a_trace_without_dma_api_events_stops_waiting_for_them() {
        let mut h = Holdback::default();
        let map = "  t-1 [000] ..... 5.000001: map: IOMMU: iova=0x00000000fffff000 - 0x0000000100000000 paddr=0x1000 size=4096";
        let mut out = 0;
        for i in 0..HOLD_PROBE + 10 {
            assert_eq!(h.bypass(), i > HOLD_PROBE);
            if h.bypass() {
                out += 1; // the session replays it straight away
                continue;
            }
            h.push(parse_line(map, i + 1));
            while h.pop(false).is_some() {
                out += 1;
            }
            // The first HOLD_PROBE records wait; then every one leaves as it comes.
            assert_eq!(out, if i < HOLD_PROBE { 0 } else { i + 1 });
        }
        assert!(h.bypass());
    }

    #[test]
    fn dma_api_events_name_their_calls_maps_and_unmaps_in_trace_order() {
        let l =
            |cpu: u32, t: u32, body: &str| format!("  dd-271 [{cpu:03}] ..... 5.{t:06}: {body}");
        let lines = [
            "# iommulab capture: iommu group 1: 0000:00:02.0 0000:00:02.1".to_string(),
            // A dma_map_sg call's two iommu:map lines on CPU 0, the NIC's map and its event on CPU 1 between.
            l(0, 1, "map: IOMMU: iova=0x00000000fffa0000 - 0x00000000fffa1000 paddr=0x1000 size=4096"),
            l(1, 2, "map: IOMMU: iova=0x00000000fffa0000 - 0x00000000fffa1000 paddr=0x9000 size=4096"),
            l(0, 3, "map: IOMMU: iova=0x00000000fffa1000 - 0x00000000fffa2000 paddr=0x5000 size=4096"),
            l(1, 4, "dma_map_page: 0000:00:02.1 dir=FROM_DEVICE dma_addr=fffa0000 size=4096 phys_addr=9000 attrs="),
            l(0, 5, "dma_map_sg: 0000:00:03.0 dir=FROM_DEVICE nents=2/2 ents=1/1 dma_addrs={0xfffa0000} sizes={0x2000} phys_addrs={0x1000,0x5000} attrs="),
            // dma_unmap_sg comes before its unmap; dma_unmap_page after.
            l(0, 6, "dma_unmap_sg: 0000:00:03.0 dir=FROM_DEVICE phys_addrs={0x1000,0x5000} attrs="),
            l(0, 7, "unmap: IOMMU: iova=0x00000000fffa0000 - 0x00000000fffa2000 size=8192 unmapped_size=8192"),
            l(1, 8, "unmap: IOMMU: iova=0x00000000fffa0000 - 0x00000000fffa1000 size=4096 unmapped_size=4096"),
            l(1, 9, "dma_unmap_page: 0000:00:02.0 dir=FROM_DEVICE dma_addr=fffa0000 size=4096 attrs="),
            // Nothing names this one: it leaves unnamed at the end.
            l(1, 10, "map: IOMMU: iova=0x00000000fff00000 - 0x00000000fff01000 paddr=0x9000 size=4096"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let g = Some("iommu group 1".to_string());
        let nvme = Some("0000:00:03.0".to_string());
        assert_eq!(
            feed(&mut Holdback::default(), &lines),
            vec![
                ("Map {".into(), nvme.clone()),
                ("Map {".into(), g.clone()),
                ("Map {".into(), nvme.clone()),
                ("Unmap".into(), nvme),
                ("Unmap".into(), g),
                ("Map {".into(), None),
            ]
        );
    }
}
