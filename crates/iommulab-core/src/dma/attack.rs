//! A malicious device: besides its ordinary DMA it replays every IOVA it has ever been handed (or only the
//! `recent` last ones), round robin, at a configured rate, and counts what still reaches memory. A probe of a page that is mapped reaches the
//! device's own buffer (allowed); one served by a translation the page table no longer holds reaches a page
//! the driver unmapped, and if the owner already got it back (released, not yet invalidated) a page that
//! may now belong to anyone. Under an identity domain every probe reaches memory, and a page not currently
//! mapped for the device belongs to someone else.

use super::DmaLayer;
use crate::sim::Time;
use std::collections::{HashMap, HashSet, VecDeque};

/// What the replayed probes reached.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttackStats {
    pub probes: u64,
    /// Probes of IOVAs mapped at the time (the device's own buffers).
    pub reached_mapped: u64,
    /// Probes that reached memory though the IOVA was unmapped (a stale translation, or no translation at all).
    pub reached_unmapped: u64,
    /// Of those, pages already back with their owner (released before their invalidation, or any page
    /// outside the device's mappings under an identity domain).
    pub reached_released: u64,
}

#[derive(Debug, Default)]
pub struct Replay {
    /// Replay only the last `recent` IOVA pages handed out (0: every one ever seen).
    recent: usize,
    seen: VecDeque<u64>,
    known: HashSet<u64>,
    /// An identity domain has no translation to ask, so the device's live mappings are counted here:
    /// IOVA pfn → live mappings of it (kept only then).
    identity: bool,
    live: HashMap<u64, u32>,
    cursor: usize,
    pub stats: AttackStats,
}

impl Replay {
    pub fn new(recent: usize, identity: bool) -> Self {
        Replay {
            recent,
            identity,
            ..Default::default()
        }
    }

    /// The device was handed [iova, iova + pages).
    pub fn mapped(&mut self, iova: u64, pages: u64) {
        for p in iova..iova + pages {
            if self.recent > 0 {
                if self.seen.len() == self.recent {
                    self.seen.pop_front();
                }
                self.seen.push_back(p);
            } else if self.known.insert(p) {
                self.seen.push_back(p);
            }
            if self.identity {
                *self.live.entry(p).or_insert(0) += 1;
            }
        }
    }

    pub fn unmapped(&mut self, iova: u64, pages: u64) {
        if !self.identity {
            return;
        }
        for p in iova..iova + pages {
            if let Some(n) = self.live.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.live.remove(&p);
                }
            }
        }
    }

    /// One probe of the next IOVA seen, through the device's translation.
    pub fn probe(&mut self, dma: &mut DmaLayer, now: Time) {
        if self.seen.is_empty() {
            return;
        }
        self.cursor %= self.seen.len();
        let iova = self.seen[self.cursor];
        self.cursor += 1;
        self.stats.probes += 1;
        match dma.translate(now, iova) {
            None if self.live.contains_key(&iova) => self.stats.reached_mapped += 1,
            None => {
                self.stats.reached_unmapped += 1;
                self.stats.reached_released += 1;
            }
            Some(tr) if tr.phys.is_none() => {}
            Some(tr) if tr.stale => {
                self.stats.reached_unmapped += 1;
                if dma.core.safety.released_unflushed(iova, now) {
                    self.stats.reached_released += 1;
                }
            }
            Some(_) => self.stats.reached_mapped += 1,
        }
    }
}
