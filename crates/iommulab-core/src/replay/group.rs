//! Which map events were one mapping call (one `iotlb_sync_map`): a driver's map_sg writes several
//! contiguous ranges, each traced as its own `map` event, and syncs once; only the unmaps show which went
//! together. This depends on the trace alone, not on the flush timer's phase, so it runs once per domain, on
//! the reading thread, and hands every replayer the same [`Op`]s.

use super::ftrace::{Ctx, EventHead};
use crate::sim::Time;
use smallvec::{smallvec, SmallVec};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// A trace phase's name (`TB_BEGIN NAME`), shared by the candidates mapped in it; None outside every phase.
pub(super) type PhaseName = Option<Arc<str>>;

/// Who is mapping: a candidate continues only in the same task, CPU and context.
type Mapper = (u32, u32, Ctx);

/// What a replayer does, in order, for one domain.
#[derive(Debug, Clone)]
pub(super) enum Op {
    /// A map event, after the syncs its overlaps settled.
    Map { iova: u64, paddr: u64, size: u64 },
    /// One iotlb_sync_map over IOVA bytes [start, end), by `cpu` at `ts` (the group's last map), counted in
    /// `phase` (where it was mapped).
    Sync {
        phase: PhaseName,
        cpu: u32,
        ts: Time,
        start: u64,
        end: u64,
    },
    /// An unmap event of `bytes` at `iova`; `cleared`: the kernel reported what it unmapped (PTEs set
    /// before tracing began are reconstructed then); `synced`: an IOVA-API unlink, invalidated at once.
    Unmap {
        ts: Time,
        cpu: u32,
        iova: u64,
        bytes: u64,
        cleared: bool,
        synced: bool,
    },
}

/// `map` events that may be one mapping call, until their unmaps tell.
#[derive(Debug, Clone)]
struct Candidate {
    /// Segments (IOVA bytes, size), contiguous and ascending (mostly one: kept inline).
    segs: SmallVec<[(u64, u64); 2]>,
    phase: PhaseName,
    cpu: u32,
    ts: Time,
}

impl Candidate {
    fn start(&self) -> u64 {
        self.segs[0].0
    }
    fn end(&self) -> u64 {
        let (a, n) = *self.segs.last().expect("non-empty");
        a + n
    }
}

/// Candidates an event overlaps (rarely more than one), each with its mapper if it was still open.
type Overlapping = SmallVec<[(Candidate, Option<Mapper>); 2]>;

/// Split `c` around [a, b): the segments before it, those overlapping it, those after it.
fn split(
    c: Candidate,
    a: u64,
    b: u64,
) -> (Option<Candidate>, Option<Candidate>, Option<Candidate>) {
    let part = |keep: &dyn Fn(u64, u64) -> bool| {
        let segs: SmallVec<[(u64, u64); 2]> = c
            .segs
            .iter()
            .copied()
            .filter(|&(s, n)| keep(s, n))
            .collect();
        (!segs.is_empty()).then(|| Candidate {
            segs,
            phase: c.phase.clone(),
            cpu: c.cpu,
            ts: c.ts,
        })
    };
    (
        part(&|s, n| s + n <= a),
        part(&|s, n| s < b && s + n > a),
        part(&|s, _| s >= b),
    )
}

/// Of ranges that never overlap one another, the ones meeting [a, b): given (start, end) of those starting
/// before b, last first, the run back to the first that ends by a; their starts, ascending.
pub(super) fn meeting(before_b: impl Iterator<Item = (u64, u64)>, a: u64) -> SmallVec<[u64; 4]> {
    // A loop, not a collect: SmallVec's extend cost the reading thread more than the search.
    let mut met: SmallVec<[u64; 4]> = SmallVec::new();
    for (start, end) in before_b {
        if end <= a {
            break;
        }
        met.push(start);
    }
    met.reverse();
    met
}

/// Closed candidates waiting for their unmaps, ordered by start IOVA. The order holds slot numbers and the
/// candidates stay put in their slots: moving a candidate in and out of the tree's nodes on every insert
/// cost the reading thread more than the search.
#[derive(Default)]
struct Pending {
    by_start: BTreeMap<u64, u32>,
    slots: Vec<Option<Candidate>>,
    free: Vec<u32>,
}

impl Pending {
    fn insert(&mut self, c: Candidate) {
        let k = c.start();
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(c);
                i
            }
            None => {
                self.slots.push(Some(c));
                (self.slots.len() - 1) as u32
            }
        };
        if let Some(old) = self.by_start.insert(k, slot) {
            // Candidates never overlap, so never share a start; should one, the later replaces it as a map's
            // entry would.
            self.slots[old as usize] = None;
            self.free.push(old);
        }
    }

    fn remove(&mut self, k: u64) -> Option<Candidate> {
        let slot = self.by_start.remove(&k)?;
        self.free.push(slot);
        self.slots[slot as usize].take()
    }

    fn get(&self, slot: u32) -> &Candidate {
        self.slots[slot as usize]
            .as_ref()
            .expect("a slot in the order holds its candidate")
    }

    /// The candidates starting before `b`, last first.
    fn before(&self, b: u64) -> impl Iterator<Item = (u64, &Candidate)> {
        self.by_start
            .range(..b)
            .rev()
            .map(|(&k, &s)| (k, self.get(s)))
    }

    /// Every candidate, by start.
    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &Candidate> {
        self.by_start.values().map(|&s| self.get(s))
    }

    fn take_all(&mut self) -> Vec<Candidate> {
        let Pending {
            by_start,
            mut slots,
            ..
        } = std::mem::take(self);
        by_start
            .into_values()
            .filter_map(|s| slots[s as usize].take())
            .collect()
    }
}

/// What a marker line does to the current phase.
pub(super) enum Marked {
    Begin(Arc<str>),
    End,
    /// A TB_END of a phase not begun.
    Unmatched,
    Nothing,
}

/// `TB_BEGIN NAME` / `TB_END NAME` against the current phase.
pub(super) fn marked(phase: &PhaseName, text: &str) -> Marked {
    let mut w = text.split_whitespace();
    let (Some(kind), Some(name)) = (w.next(), w.next()) else {
        return Marked::Nothing;
    };
    match kind {
        "TB_BEGIN" => Marked::Begin(name.into()),
        "TB_END" if phase.as_deref() == Some(name) => Marked::End,
        "TB_END" => Marked::Unmatched,
        _ => Marked::Nothing,
    }
}

/// One domain's map events grouped into mapping calls.
pub(super) struct Grouper {
    /// Whether the domain maps through the IOMMU (not passthrough: then nothing is grouped or synced).
    translated: bool,
    phase: PhaseName,
    /// Candidates still being extended, by who is mapping.
    open: Vec<(Mapper, Candidate)>,
    /// Closed candidates waiting for their unmaps, by start IOVA.
    pending: Pending,
    /// Phases in which an unmap showed several map events to be one mapping call (a map_sg).
    sg_phases: BTreeSet<PhaseName>,
}

impl Grouper {
    /// The grouper of the first domain: outside every phase.
    pub fn new(translated: bool) -> Self {
        Grouper {
            translated,
            phase: None,
            open: Vec::new(),
            pending: Pending::default(),
            sg_phases: BTreeSet::new(),
        }
    }

    /// The grouper of a domain seen for the first time, in the phase this one is in.
    pub fn another_domain(&self) -> Self {
        Grouper {
            phase: self.phase.clone(),
            ..Grouper::new(self.translated)
        }
    }

    /// A settled group: one iotlb_sync_map over its range, counted where it was mapped.
    fn sync_map(&mut self, c: &Candidate, out: &mut impl Extend<Op>) {
        if c.segs.len() > 1 {
            self.sg_phases.insert(c.phase.clone());
        }
        out.extend([Op::Sync {
            phase: c.phase.clone(),
            cpu: c.cpu,
            ts: c.ts,
            start: c.start(),
            end: c.end(),
        }]);
    }

    /// A candidate no unmap of its own will settle, split as the settled ones of its phase were: if an unmap
    /// in that phase showed several map events to be one call (a map_sg), it is one call; if every unmap
    /// covered a single map event (virtio rings map each buffer with its own dma_map_page()), each of its
    /// map events is.
    fn sync_unsettled(&mut self, c: Candidate, out: &mut impl Extend<Op>) {
        if self.sg_phases.contains(&c.phase) {
            self.sync_map(&c, out);
        } else {
            for &seg in &c.segs {
                let one = Candidate {
                    segs: smallvec![seg],
                    ..c.clone()
                };
                self.sync_map(&one, out);
            }
        }
    }

    /// End of the trace: the candidates still waiting for unmaps.
    pub fn sync_leftovers(&mut self, out: &mut impl Extend<Op>) {
        let left: Vec<Candidate> = self
            .open
            .drain(..)
            .map(|(_, c)| c)
            .chain(self.pending.take_all())
            .collect();
        for c in left {
            self.sync_unsettled(c, out);
        }
    }

    /// Stop extending `who`'s candidate (it waits for its unmaps).
    fn close(&mut self, who: Mapper) {
        if let Some(i) = self.open.iter().position(|(k, _)| *k == who) {
            let (_, c) = self.open.swap_remove(i);
            self.pending.insert(c);
        }
    }

    /// Take the candidates overlapping [a, b): pending ones, and open ones (the mapping loop may still be
    /// running when an interrupt unmaps under it), with the mapper of the open ones.
    fn take_overlapping(&mut self, a: u64, b: u64) -> Overlapping {
        let mut hits = Overlapping::new();
        // Candidates never overlap one another (a map first settles what it overlaps).
        let keys = meeting(self.pending.before(b).map(|(k, c)| (k, c.end())), a);
        for k in keys {
            if let Some(c) = self.pending.remove(k) {
                hits.push((c, None));
            }
        }
        let mut i = 0;
        while i < self.open.len() {
            let c = &self.open[i].1;
            if c.start() < b && c.end() > a {
                let (who, c) = self.open.swap_remove(i);
                hits.push((c, Some(who)));
            } else {
                i += 1;
            }
        }
        hits
    }

    /// Settle candidates with the unmap of [a, b): the segments it covers were one mapping call; what is left
    /// either side stays a candidate (the tail of an open one stays open for its mapper).
    fn settle(&mut self, a: u64, b: u64, out: &mut impl Extend<Op>) {
        let hits = self.take_overlapping(a, b);
        for (c, who) in hits {
            if a <= c.start() && c.end() <= b {
                // Mostly the unmap of exactly one candidate: all of it inside.
                self.sync_map(&c, out);
                continue;
            }
            let (before, inside, after) = split(c, a, b);
            if let Some(p) = inside {
                self.sync_map(&p, out);
            }
            if let Some(p) = before {
                self.pending.insert(p);
            }
            match (after, who) {
                (Some(p), Some(who)) => self.open.push((who, p)),
                (Some(p), None) => {
                    self.pending.insert(p);
                }
                (None, _) => {}
            }
        }
    }

    /// A map event: the syncs it settles, then the map.
    pub fn map(
        &mut self,
        ev: &EventHead,
        iova: u64,
        paddr: u64,
        size: u64,
        out: &mut impl Extend<Op>,
    ) {
        let op = Op::Map { iova, paddr, size };
        if !self.translated {
            out.extend([op]);
            return;
        }
        // One domain never hands out an IOVA it still has mapped: a candidate this map overlaps belongs to
        // another device's domain, whose unmaps the trace cannot tell from this one's. Settle it now.
        for (c, _) in self.take_overlapping(iova, iova + size) {
            self.sync_unsettled(c, out);
        }
        out.extend([op]);
        let who = (ev.pid, ev.cpu, ev.ctx);
        if let Some((_, c)) = self.open.iter_mut().find(|(k, _)| *k == who) {
            if c.end() == iova {
                c.segs.push((iova, size));
                c.ts = ev.ts_ns;
                return;
            }
        }
        self.close(who);
        self.open.push((
            who,
            Candidate {
                segs: smallvec![(iova, size)],
                phase: self.phase.clone(),
                cpu: ev.cpu,
                ts: ev.ts_ns,
            },
        ));
    }

    /// An unmap event: the syncs it settles, then the unmap.
    pub fn unmap(
        &mut self,
        ev: &EventHead,
        iova: u64,
        size: u64,
        unmapped: u64,
        synced: bool,
        out: &mut impl Extend<Op>,
    ) {
        let bytes = if unmapped > 0 { unmapped } else { size };
        if self.translated {
            // An unmap in the mapping task's own context ends its mapping loop.
            self.close((ev.pid, ev.cpu, ev.ctx));
            self.settle(iova, iova + bytes, out);
        }
        out.extend([Op::Unmap {
            ts: ev.ts_ns,
            cpu: ev.cpu,
            iova,
            bytes,
            cleared: unmapped > 0,
            synced,
        }]);
    }

    pub fn marker(&mut self, text: &str) {
        match marked(&self.phase, text) {
            Marked::Begin(name) => self.phase = Some(name),
            Marked::End => self.phase = None,
            Marked::Unmatched | Marked::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::ftrace::Ctx;
    use proptest::prelude::*;

    fn ev(who: u32, ts: u64) -> EventHead {
        EventHead {
            pid: who,
            cpu: who % 2,
            ctx: Ctx::Task,
            ts_ns: ts,
            line: ts,
        }
    }

    /// Every candidate, open or waiting for its unmaps, with its range.
    fn ranges(g: &Grouper) -> Vec<(u64, u64)> {
        let mut r: Vec<(u64, u64)> = g
            .open
            .iter()
            .map(|(_, c)| c)
            .chain(g.pending.values())
            .map(|c| (c.start(), c.end()))
            .collect();
        r.sort_unstable();
        r
    }

    proptest! {
        /// Candidates never overlap one another, whatever the maps and unmaps of several mappers: what
        /// `take_overlapping` relies on to find an unmap's candidates in one ordered pass.
        #[test]
        fn candidates_never_overlap(ops in proptest::collection::vec((any::<bool>(), 0u32..3, 0u64..64, 1u64..6), 1..200)) {
            let mut g = Grouper::new(true);
            let mut out: Vec<Op> = Vec::new();
            let mut syncs = 0;
            for (k, (map, who, at, n)) in ops.into_iter().enumerate() {
                let (iova, size) = (at << 12, n << 12);
                let e = ev(who, k as u64);
                // The candidates before the event: an unmap's syncs cover exactly the ones it meets.
                let before = ranges(&g);
                if map {
                    g.map(&e, iova, 0, size, &mut out);
                } else {
                    g.unmap(&e, iova, size, size, false, &mut out);
                    let met = before.iter().filter(|&&(s, t)| s < iova + size && t > iova).count();
                    let new_syncs = out.iter().filter(|o| matches!(o, Op::Sync { .. })).count() - syncs;
                    prop_assert_eq!(new_syncs, met, "an unmap settles each candidate it overlaps once");
                }
                syncs = out.iter().filter(|o| matches!(o, Op::Sync { .. })).count();
                let r = ranges(&g);
                for w in r.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "candidates {:?} and {:?} overlap", w[0], w[1]);
                }
            }
        }
    }
}
