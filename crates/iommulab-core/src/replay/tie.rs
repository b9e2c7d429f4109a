//! Whose flush-queue timer a recorded firing was, when the firing names its domain by pointer (the cookie's
//! `fq_domain`, or the domain its `flush_iotlb_all` flushes) but the trace names its events' domains by device
//! only (the DMA API's events, no kprobe labels): nothing in the trace pairs a pointer with a device, so each
//! pointer is tied to the domain whose unmaps armed its timer.
//!
//! dma-iommu.c (6.1 to 6.18): queue_iova() arms the timer only while it is off (`fq_timer_on`), with
//! mod_timer(jiffies + msecs_to_jiffies(IOVA_DEFAULT_FQ_TIMEOUT)), and fq_flush_timeout() turns it off before it
//! flushes. So between two firings of one pointer its domain unmapped at least once, at least the timeout
//! before the second firing (the timer wheel never fires early: kernel/time/timer.c calc_index()). A domain with
//! no unmap in that window is not the pointer's. A domain has one cookie, so one pointer: a pointer left with
//! one candidate is tied to it, and that domain is no other pointer's. What is inferred: only the pairing;
//! every tied firing is replayed where and when the trace recorded it. A firing of a pointer not tied yet
//! waits, and the steps after it with it, until its pointer is (see [`Waiting`]).

use super::{Batch, Step};
use crate::dma::flush_queue::IOVA_DEFAULT_FQ_TIMEOUT_MS;
use crate::sim::Time;
use std::collections::{HashMap, VecDeque};

/// How long before the previous firing's trace line an unmap may be traced and still arm the timer again:
/// iommu_unmap()'s event and its queue_iova() on another CPU can straddle fq_flush_timeout()'s reset of
/// `fq_timer_on`. They are microseconds apart; a modelling bound, not a kernel constant (it covers CPUs'
/// trace clocks a little apart too).
const ARM_RACE_NS: u64 = 1_000_000;

/// The latest a timer fires after the unmap that armed it, as far as the first firing of a pointer can tell:
/// one that comes sooner after the trace began may have been armed before it, by an unmap the trace does not
/// hold, and says nothing. A modelling bound: 2.5 times the latest firing the testbed measured (41 ms after
/// arming, on a loaded host; docs/replay.md).
const LATEST_FIRING_NS: u64 = 100_000_000;

/// A domain pointer the firings name.
#[derive(Default)]
struct Pointer {
    /// Its last firing.
    last: Option<Time>,
    /// The domains it may be: None before its first firing that says anything.
    candidates: Option<Vec<usize>>,
    tied: Option<usize>,
}

/// Pointers tied to domains, and the unmaps that tie them.
pub(super) struct Ties {
    /// A firing comes at least this long after the unmap that armed it: msecs_to_jiffies(timeout) jiffies, less
    /// one for a trace clock that drifts from the tick.
    min_delay_ns: u64,
    /// The first unmap or firing the trace showed.
    start: Option<Time>,
    /// Per domain, its recent unmaps: the last at least `min_delay_ns` before the latest, and all after it.
    unmaps: Vec<VecDeque<Time>>,
    pointers: HashMap<u64, Pointer>,
    /// Per domain, the pointer tied to it.
    owner: Vec<Option<u64>>,
    /// Pointers tied so far.
    pub(super) tied: u64,
    /// Pointers tied since [`Ties::take_tied`] last looked, with their domains.
    new: Vec<(u64, usize)>,
}

impl Ties {
    /// Ties for a kernel of CONFIG_HZ `hz`.
    pub(super) fn new(hz: u32) -> Self {
        let jiffy_ns = 1_000_000_000 / hz.max(1) as u64;
        let jiffies = (IOVA_DEFAULT_FQ_TIMEOUT_MS * 1_000_000).div_ceil(jiffy_ns);
        Ties {
            min_delay_ns: jiffies.saturating_sub(1) * jiffy_ns,
            start: None,
            unmaps: Vec::new(),
            pointers: HashMap::new(),
            owner: Vec::new(),
            tied: 0,
            new: Vec::new(),
        }
    }

    /// Domain `dom` unmapped at `ts` (its queue_iova() may have armed its timer).
    pub(super) fn unmapped(&mut self, dom: usize, ts: Time) {
        self.start.get_or_insert(ts);
        if self.unmaps.len() <= dom {
            self.unmaps.resize(dom + 1, VecDeque::new());
            self.owner.resize(dom + 1, None);
        }
        let u = &mut self.unmaps[dom];
        u.push_back(ts);
        // A firing looks for the last unmap at least min_delay before it: older ones never are, for a firing
        // stamped after `ts` (or up to ARM_RACE_NS before it: CPUs' clocks).
        while u.len() > 1 && u[1] + self.min_delay_ns + ARM_RACE_NS <= ts {
            u.pop_front();
        }
    }

    /// The domain whose timer fired at `ts`, naming pointer `ptr`, if the unmaps have tied them.
    pub(super) fn fired(&mut self, ptr: u64, ts: Time) -> Option<usize> {
        let start = *self.start.get_or_insert(ts);
        let p = self.pointers.entry(ptr).or_default();
        let last = p.last.replace(ts);
        if p.tied.is_some() {
            return p.tied;
        }
        // Its first firing says something only if its timer cannot have been armed before the trace began.
        if last.is_none() && ts < start + LATEST_FIRING_NS {
            return None;
        }
        let since = last.map(|l| l.saturating_sub(ARM_RACE_NS));
        let before = ts.saturating_sub(self.min_delay_ns);
        let armed: Vec<usize> = (0..self.unmaps.len())
            .filter(|&d| self.owner[d].is_none() && self.armed(d, since, before))
            .collect();
        let p = self.pointers.get_mut(&ptr).expect("entered above");
        let c = p.candidates.get_or_insert(armed.clone());
        c.retain(|d| armed.contains(d));
        self.settle();
        self.pointers[&ptr].tied
    }

    /// Whether domain `d` unmapped after `since` (any time, if None) and no later than `before`.
    fn armed(&self, d: usize, since: Option<Time>, before: Time) -> bool {
        self.unmaps[d]
            .iter()
            .rev()
            .find(|&&t| t <= before)
            .is_some_and(|&t| since.is_none_or(|s| t > s))
    }

    /// Tie every pointer left with one candidate, and take its domain from the others, until none changes.
    fn settle(&mut self) {
        loop {
            let owner = &self.owner;
            let one = self.pointers.iter_mut().find_map(|(&ptr, p)| {
                let c = p.candidates.as_mut()?;
                c.retain(|&d| owner[d].is_none());
                (p.tied.is_none() && c.len() == 1).then(|| (ptr, c[0]))
            });
            let Some((ptr, d)) = one else { return };
            self.pointers.get_mut(&ptr).expect("found").tied = Some(d);
            self.owner[d] = Some(ptr);
            self.tied += 1;
            self.new.push((ptr, d));
        }
    }

    /// Whether a firing has named a pointer.
    pub(super) fn seen(&self) -> bool {
        !self.pointers.is_empty()
    }

    /// The pointers tied since the last look, with their domains.
    pub(super) fn take_tied(&mut self) -> Vec<(u64, usize)> {
        std::mem::take(&mut self.new)
    }
}

/// Batches of steps held back from the model for a recorded firing whose pointer is not tied yet: when it is,
/// the firing's step is given its domain, and the batches go on to the model as if it had been tied all
/// along. A modelling bound on memory: at most [`TIE_WAIT_BATCHES`] are held; then the oldest goes on with
/// its firings passed over (its domain keeps its own timer until a firing is tied to it).
#[derive(Default)]
pub(super) struct Waiting {
    held: VecDeque<Batch>,
    /// Sequence number of the front of `held` (the batch being filled comes after the held ones).
    base: u64,
    /// The firings waiting: (batch sequence number, step index, pointer).
    firings: Vec<(u64, usize, u64)>,
}

/// Batches held back for firings whose pointer is not tied yet, at most (4096 steps each: a few MB).
const TIE_WAIT_BATCHES: usize = 64;

impl Waiting {
    /// The firing just pushed (the last step of `batch`, the one being filled) waits for `ptr` to be tied.
    pub(super) fn wait(&mut self, batch: &Batch, ptr: u64) {
        let seq = self.base + self.held.len() as u64;
        self.firings.push((seq, batch.len() - 1, ptr));
    }

    /// `ptr` is tied to domain `dom`: its waiting firings (in `held`, or in `batch`, the one being filled) are
    /// that domain's. How many.
    pub(super) fn tied(&mut self, batch: &mut Batch, ptr: u64, dom: usize) -> u64 {
        let filling = self.base + self.held.len() as u64;
        let mut n = 0;
        for &(seq, i, _) in self.firings.iter().filter(|f| f.2 == ptr) {
            let b = if seq == filling {
                &mut *batch
            } else {
                &mut self.held[(seq - self.base) as usize]
            };
            if let Step::Timer { dom: d, .. } = &mut b[i] {
                *d = Some(dom);
            }
            n += 1;
        }
        self.firings.retain(|f| f.2 != ptr);
        n
    }

    /// The batches the model may have, `batch` the one just filled (all of them at the `end`), and how many
    /// firings they pass over, their pointers still not tied.
    pub(super) fn ready(&mut self, batch: Batch, end: bool) -> (Vec<Batch>, u64) {
        self.held.push_back(batch);
        let mut out = Vec::new();
        let mut passed = 0;
        while !self.held.is_empty() {
            let base = self.base;
            let waits = self.firings.iter().any(|f| f.0 == base);
            if waits && !end && self.held.len() <= TIE_WAIT_BATCHES {
                break;
            }
            let before = self.firings.len();
            self.firings.retain(|f| f.0 != base);
            passed += (before - self.firings.len()) as u64;
            out.extend(self.held.pop_front());
            self.base += 1;
        }
        (out, passed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_pointer_is_tied_to_the_one_domain_that_unmapped_before_each_of_its_firings() {
        // HZ 250: msecs_to_jiffies(10) is 3 jiffies; a firing comes at least 8 ms after its arming unmap here.
        // Domain 0 unmaps every ms for 400 ms, domain 1 for the first 200; pointer A fires every 15 ms.
        let mut t = Ties::new(250);
        for ms in 0..400u64 {
            t.unmapped(0, ms * MS);
            if ms < 200 {
                t.unmapped(1, ms * MS + MS / 2);
            }
            if ms % 15 == 14 {
                // Its firings in the first 100 ms may have been armed before the trace began: they say nothing.
                // Then both domains unmapped before each, until the one at 224 ms: domain 1's last unmap came
                // before A's previous firing (209 ms).
                let d = t.fired(0xa, ms * MS + MS / 4);
                assert_eq!(d, (ms >= 224).then_some(0), "{ms} ms");
            }
        }
        assert_eq!(t.tied, 1);
        // Domain 0 is A's; another pointer that fires is domain 1's, the one other that unmapped.
        assert_eq!(t.fired(0xb, 399 * MS), Some(1));
    }

    #[test]
    fn a_domain_tied_to_one_pointer_is_no_other_pointers() {
        // Two domains unmap together for 300 ms, then domain 1 alone; A fires every 20 ms while domain 0
        // unmaps, B every 20 ms throughout.
        let mut t = Ties::new(250);
        let mut got = HashMap::new();
        for ms in 0..500u64 {
            t.unmapped(1, ms * MS);
            if ms < 300 {
                t.unmapped(0, ms * MS);
            }
            for (ptr, at, until) in [(0xa, 5, 310), (0xb, 15, 500)] {
                if ms % 20 == at && ms < until {
                    if let Some(d) = t.fired(ptr, ms * MS + 1) {
                        got.entry(ptr).or_insert((d, ms));
                    }
                }
            }
        }
        // Both were candidates for both until B fired a second time with domain 0 quiet (335 ms: its unmap at
        // 299 ms was before B's firing at 315): B is 1, so A, silent since, is 0.
        assert_eq!((got[&0xb], got.get(&0xa)), ((1, 335), None));
        assert_eq!(t.tied, 2);
        assert_eq!(t.fired(0xa, 500 * MS), Some(0));
    }
}
