//! Which DMA domain each event of a trace belongs to. Every domain has its own IOVA space, page table, flush
//! queue and timer, and every domain allocates top-down from the same limit, so their IOVAs overlap; the
//! trace's own `iommu:map` / `iommu:unmap` lines do not name the device.

use super::ftrace::{Ctx, EventHead};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Which DMA domain an event belongs to. The kprobe lines of a labelled trace name it (`tb_map` /
/// `tb_unmap` just before the event on its CPU); the DMA API's events name the device (its IOMMU group, where
/// the capture noted it), one domain per device or group. An event of a labelled trace without its label (the
/// kernel skips a kprobe hit now and then) is placed by what a domain cannot do: hand out an IOVA it still has
/// mapped or unmap what it has not mapped; among the domains that can, the one holding exactly this mapping,
/// a recently freed IOVA (the rcache), the same task, CPU and context's last. A trace without labels is one
/// domain: inferring several from overlaps alone misplaced enough events to do worse than one (see
/// docs/replay.md).
#[derive(Default)]
pub(super) struct Router {
    /// Domain pointer (from labels) → index.
    ptrs: HashMap<u64, usize>,
    /// Device or IOMMU group (from the DMA API's events) → index: its own, or the one a pointer label gave
    /// an event of it.
    devs: HashMap<String, usize>,
    /// One past the last domain index a label took.
    named: usize,
    /// The last label seen on each CPU: (map?, domain pointer, IOVA).
    pub(super) hints: HashMap<u32, (bool, u64, u64)>,
    /// The domain each mapper (task, CPU, context) used last.
    last: HashMap<(u32, u32, Ctx), usize>,
    /// Per domain, its live mappings: start → (end, sequence number of the map). A domain's never overlap.
    live: Vec<BTreeMap<u64, (u64, u64)>>,
    /// Per domain, the starts of its last ROUTER_RECENT_FREES unmaps (start → sequence number), and the
    /// order they came in: the IOVA allocator hands a domain's freed IOVAs back to it first (the rcache).
    freed: Vec<RecentFrees>,
    seq: u64,
    /// Events a label placed, and events placed by inference.
    pub(super) labelled: u64,
    pub(super) inferred: u64,
}

/// A domain's recent unmaps: start → sequence number, and the order they came in.
type RecentFrees = (BTreeMap<u64, u64>, VecDeque<(u64, u64)>);

/// Unmapped IOVAs a domain remembers for inference (a few rcache magazines' worth).
const ROUTER_RECENT_FREES: usize = 4096;

impl Router {
    /// Whether the trace has shown a domain label yet.
    pub(super) fn labels_seen(&self) -> bool {
        !self.ptrs.is_empty() || !self.hints.is_empty() || !self.devs.is_empty()
    }

    /// The domain a label names: a pointer label's, learnt by the device too; a device's own where the trace
    /// has no pointer labels (with them, a device not yet seen with one is left to inference).
    fn named(&mut self, ptr: Option<u64>, dev: Option<&str>) -> Option<usize> {
        let d = match ptr {
            Some(p) => Some(match self.ptrs.get(&p) {
                Some(&d) => d,
                None => {
                    let d = self.fresh();
                    self.ptrs.insert(p, d);
                    d
                }
            }),
            None => dev.and_then(|n| self.devs.get(n).copied()),
        };
        match (d, dev) {
            (Some(d), Some(n)) => {
                self.devs.entry(n.to_string()).or_insert(d);
                Some(d)
            }
            (None, Some(n)) if self.ptrs.is_empty() => {
                let d = self.fresh();
                self.devs.insert(n.to_string(), d);
                Some(d)
            }
            (d, _) => d,
        }
    }

    /// A domain index for a label not seen before: past every index taken, by labels or by inference (an
    /// inferred domain is not a label's).
    fn fresh(&mut self) -> usize {
        let d = self.named.max(self.live.len());
        self.named = d + 1;
        d
    }

    /// Whether the trace names its domains by device (the DMA API's events) and has shown no pointer label.
    pub(super) fn by_device_only(&self) -> bool {
        !self.devs.is_empty() && self.ptrs.is_empty() && self.hints.is_empty()
    }

    /// The domain a labelled pointer named, if the trace's labels have.
    pub(super) fn ptr_domain(&self, ptr: u64) -> Option<usize> {
        self.ptrs.get(&ptr).copied()
    }

    pub(super) fn domains(&self) -> usize {
        self.live.len().max(1)
    }

    /// Each domain's name and devices, in index order (see `Domains::devices`): its pointer label, else the
    /// device or group its DMA API events name (`groups`: a group's devices), else `_domainN`.
    pub(super) fn names(
        &self,
        groups: &HashMap<String, Vec<String>>,
    ) -> Vec<(Arc<str>, Vec<String>)> {
        let mut out: Vec<(Option<String>, Vec<String>)> = vec![(None, Vec::new()); self.domains()];
        let mut at = |d: usize| {
            if out.len() <= d {
                out.resize(d + 1, (None, Vec::new()));
            }
            d
        };
        // (domain, pointer first, name, devices), sorted: the same name whatever the hash order.
        let mut named: Vec<(usize, bool, String, Vec<String>)> = Vec::new();
        for (&p, &d) in &self.ptrs {
            named.push((at(d), false, format!("{p:#x}"), Vec::new()));
        }
        for (n, &d) in &self.devs {
            let devs = groups.get(n).cloned().unwrap_or_else(|| vec![n.clone()]);
            named.push((at(d), true, n.clone(), devs));
        }
        named.sort();
        for (d, _, name, devs) in named {
            let e = &mut out[d];
            e.0 = e.0.take().or(Some(name));
            e.1.extend(devs);
        }
        out.into_iter()
            .enumerate()
            .map(|(i, (name, mut devs))| {
                devs.sort();
                devs.dedup();
                (name.unwrap_or_else(|| format!("_domain{i}")).into(), devs)
            })
            .collect()
    }

    /// The domains whose live mapping is exactly [a, b).
    fn exact(&self, a: u64, b: u64) -> Vec<usize> {
        (0..self.live.len())
            .filter(|&d| self.live[d].get(&a).is_some_and(|&(e, _)| e == b))
            .collect()
    }

    /// A domain that freed `a` lately (the one that freed it last), if any.
    fn reuse(&self, a: u64, among: &[usize]) -> Option<usize> {
        among
            .iter()
            .filter_map(|&d| {
                self.freed
                    .get(d)
                    .and_then(|(m, _)| m.get(&a))
                    .map(|&s| (d, s))
            })
            .max_by_key(|&(_, s)| s)
            .map(|(d, _)| d)
    }

    /// The live mapping of domain `d` overlapping [a, b) that was made last, if any: its sequence number.
    fn overlap(&self, d: usize, a: u64, b: u64) -> Option<u64> {
        let m = self.live.get(d)?;
        let before = m
            .range(..=a)
            .next_back()
            .filter(|(_, &(e, _))| e > a)
            .map(|(_, &(_, s))| s);
        let inside = m.range(a..b).map(|(_, &(_, s))| s).max();
        before.max(inside)
    }

    /// The domain of a map or unmap event, `dev` the device a DMA API event named for it.
    pub(super) fn route(
        &mut self,
        ev: &EventHead,
        map: bool,
        iova: u64,
        size: u64,
        dev: Option<&str>,
    ) -> usize {
        if dev.is_none() && !self.labels_seen() {
            self.inferred += 1;
            return 0;
        }
        let who = (ev.pid, ev.cpu, ev.ctx);
        let end = iova.saturating_add(size.max(1));
        let ptr = match self.hints.get(&ev.cpu) {
            Some(&(m, ptr, a)) if m == map && a == iova => {
                self.hints.remove(&ev.cpu);
                Some(ptr)
            }
            _ => None,
        };
        let labelled = self.named(ptr, dev);
        let last = self.last.get(&who).copied();
        let n = self.domains();
        let d = if let Some(d) = labelled {
            self.labelled += 1;
            d
        } else {
            self.inferred += 1;
            if map {
                // Domains that could have handed this IOVA out: a freed one of theirs first (the rcache),
                // then the task's own, then the first.
                let free: Vec<usize> = (0..n)
                    .filter(|&d| self.overlap(d, iova, end).is_none())
                    .collect();
                self.reuse(iova, &free)
                    .or_else(|| last.filter(|l| free.contains(l)))
                    .or_else(|| free.first().copied())
                    .unwrap_or(n)
            } else {
                // Domains holding exactly this mapping, then any overlapping it; the task's own, or the one
                // that mapped it last.
                let exact = self.exact(iova, end);
                let here: Vec<(usize, u64)> = if exact.is_empty() {
                    (0..n)
                        .filter_map(|d| self.overlap(d, iova, end).map(|s| (d, s)))
                        .collect()
                } else {
                    exact.iter().map(|&d| (d, self.live[d][&iova].1)).collect()
                };
                last.filter(|l| here.iter().any(|&(d, _)| d == *l))
                    .or_else(|| here.iter().max_by_key(|&&(_, s)| s).map(|&(d, _)| d))
                    .or(last)
                    .unwrap_or(0)
            }
        };
        while self.live.len() <= d {
            self.live.push(BTreeMap::new());
            self.freed.push(Default::default());
        }
        self.last.insert(who, d);
        let m = &mut self.live[d];
        if map {
            self.seq += 1;
            m.insert(iova, (end, self.seq));
        } else {
            // The unmap clears what it covers; a mapping it cuts keeps its parts outside.
            let hit: Vec<(u64, (u64, u64))> = m
                .range(..end)
                .rev()
                .take_while(|(_, &(e, _))| e > iova)
                .map(|(&a, &v)| (a, v))
                .collect();
            for (a, (e, s)) in hit {
                m.remove(&a);
                if a < iova {
                    m.insert(a, (iova, s));
                }
                if e > end {
                    m.insert(end, (e, s));
                }
            }
            self.seq += 1;
            let (f, order) = &mut self.freed[d];
            f.insert(iova, self.seq);
            order.push_back((iova, self.seq));
            if order.len() > ROUTER_RECENT_FREES {
                if let Some((old, s)) = order.pop_front() {
                    // Only if it was not freed again since.
                    if f.get(&old) == Some(&s) {
                        f.remove(&old);
                    }
                }
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(cpu: u32) -> EventHead {
        EventHead {
            pid: 1,
            cpu,
            ctx: Ctx::Task,
            ts_ns: 0,
            line: 1,
        }
    }

    /// A map on `cpu`, labelled with domain pointer `ptr` when given.
    fn map(r: &mut Router, cpu: u32, ptr: Option<u64>, iova: u64) -> usize {
        if let Some(p) = ptr {
            r.hints.insert(cpu, (true, p, iova));
        }
        r.route(&ev(cpu), true, iova, 4096, None)
    }

    #[test]
    fn a_label_seen_after_an_inferred_domain_is_a_domain_of_its_own() {
        // Issue 49: labels and inference numbered domains from separate counters, so the first new pointer
        // after an inferred domain took that domain's number and the two merged.
        let mut r = Router::default();
        assert_eq!(map(&mut r, 0, Some(0xa000), 0x1000), 0);
        // Unlabelled (the kernel skipped the kprobe hit), over IOVA domain 0 holds: another domain.
        assert_eq!(map(&mut r, 1, None, 0x1000), 1);
        assert_eq!(map(&mut r, 0, Some(0xb000), 0x5000), 2);
        assert_eq!(r.domains(), 3);
        assert_eq!(
            map(&mut r, 0, Some(0xa000), 0x9000),
            0,
            "a pointer keeps its domain"
        );
    }
}
