use super::coherence::{Coherence, NO_CPU};
use super::hist::Histogram;
use super::per_cpu::PerCpu;
use super::split_deque::SplitDeque;
use super::Time;

/// How far behind the latest request an earlier-timed request may still arrive. A CPU's work runs ahead of the
/// event being processed by at most one work item (a NAPI poll, a read); booked intervals older than this are
/// forgotten. A modelling bound, not a kernel constant.
pub const LOOKBEHIND_NS: Time = 2_000_000;

/// What a lock or a shared line cost its users: acquisitions, how many found it busy and how long they
/// spun, the cache-line transfers they stalled on. Cumulative: a window is the difference of two snapshots.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LockStats {
    pub acquisitions: u64,
    pub contended: u64,
    /// Time spent spinning while another holder had it.
    pub wait_ns: u64,
    /// Acquisitions that had to pull the line from another core, and the stall that cost.
    pub transfers: u64,
    pub transfer_ns: u64,
    /// Every acquisition's spin (zero when it found the lock free).
    pub waits: Histogram,
    /// Spin plus transfer stall, per CPU.
    pub spin_by_cpu: Vec<u64>,
    /// Time it was held (a lock) or serving (a hardware queue), line transfers to its holders included: one
    /// entry per instance summed into these figures (per-CPU locks, the same lock of several domains). Empty
    /// reads as one instance never busy (`instances`), so a sum's entries line up across snapshots.
    pub busy_ns: Vec<u64>,
    /// A hardware queue (the IOMMU serves it; no CPU spins on it), not a lock or line CPUs take.
    pub queue: bool,
}

impl LockStats {
    pub fn since(&self, e: &LockStats) -> LockStats {
        LockStats {
            acquisitions: self.acquisitions - e.acquisitions,
            contended: self.contended - e.contended,
            wait_ns: self.wait_ns - e.wait_ns,
            transfers: self.transfers - e.transfers,
            transfer_ns: self.transfer_ns - e.transfer_ns,
            busy_ns: self
                .instances()
                .iter()
                .zip(e.instances())
                .map(|(v, w)| v - w)
                .collect(),
            queue: self.queue,
            waits: self.waits.since(&e.waits),
            spin_by_cpu: self
                .spin_by_cpu
                .iter()
                .enumerate()
                .map(|(i, &v)| v - e.spin_by_cpu.get(i).copied().unwrap_or(0))
                .collect(),
        }
    }
    /// Add another lock's figures (the same lock of several domains).
    pub fn add(&mut self, o: &LockStats) {
        self.acquisitions += o.acquisitions;
        self.contended += o.contended;
        self.wait_ns += o.wait_ns;
        self.transfers += o.transfers;
        self.transfer_ns += o.transfer_ns;
        // One entry per instance, used or not, so that two snapshots' entries line up.
        self.busy_ns = [self.instances(), o.instances()].concat();
        self.queue |= o.queue;
        self.waits.add(&o.waits);
        if self.spin_by_cpu.len() < o.spin_by_cpu.len() {
            self.spin_by_cpu.resize(o.spin_by_cpu.len(), 0);
        }
        for (a, b) in self.spin_by_cpu.iter_mut().zip(&o.spin_by_cpu) {
            *a += b;
        }
    }
    /// This instance was busy `ns` more.
    pub(super) fn busy(&mut self, ns: u64) {
        match self.busy_ns.first_mut() {
            Some(b) => *b += ns,
            None => self.busy_ns.push(ns),
        }
    }
    /// The figures of `n` instances summed, `locks` the first of them (the rest not created yet: owners make
    /// locks as CPUs or domains first need them). Their busy times line up with a later snapshot's.
    pub fn sum_of<'a>(locks: impl Iterator<Item = &'a LockStats>, n: usize) -> LockStats {
        let mut s: LockStats = locks.sum();
        // The sum starts from one empty instance (see `add`).
        s.busy_ns
            .resize(1 + n.max(s.busy_ns.len().saturating_sub(1)), 0);
        s
    }
    /// Each instance's busy time.
    fn instances(&self) -> &[u64] {
        if self.busy_ns.is_empty() {
            &[0]
        } else {
            &self.busy_ns
        }
    }
    /// The busiest instance's busy time.
    pub fn busiest_ns(&self) -> u64 {
        self.busy_ns.iter().copied().max().unwrap_or(0)
    }
    pub(super) fn record(&mut self, cpu: u32, wait: u64, xfer: u64) {
        self.acquisitions += 1;
        self.waits.record(wait);
        if wait > 0 {
            self.contended += 1;
            self.wait_ns += wait;
        }
        if xfer > 0 {
            self.transfers += 1;
            self.transfer_ns += xfer;
        }
        self.stall(cpu, wait + xfer);
    }
    /// `cpu` lost `ns` spinning or waiting for a line.
    pub(crate) fn stall(&mut self, cpu: u32, ns: u64) {
        if cpu != NO_CPU && ns > 0 {
            let c = cpu as usize;
            if self.spin_by_cpu.len() <= c {
                self.spin_by_cpu.resize(c + 1, 0);
            }
            self.spin_by_cpu[c] += ns;
        }
    }
}

/// The figures of several locks together (a lock of every domain, every command queue).
impl<'a> std::iter::Sum<&'a LockStats> for LockStats {
    fn sum<I: Iterator<Item = &'a LockStats>>(iter: I) -> LockStats {
        iter.fold(LockStats::default(), |mut acc, s| {
            acc.add(s);
            acc
        })
    }
}

/// Line transfers on the critical path of a contended qspinlock hand-off: the holder's unlock takes the lock
/// word back from the spinning head (RFO), the head re-reads it, then writes the locked byte
/// (kernel/locking/qspinlock.c: smp_store_release in queued_spin_unlock, atomic_cond_read_acquire on the
/// lock word, set_locked). The MCS node hand-off to the next waiter overlaps the critical section. An
/// uncontended acquire pulls the line once (the fast path's cmpxchg).
pub const QSPINLOCK_HANDOFF_TRANSFERS: u64 = 3;

/// A resource used by one holder at a time (a spinlock, a hardware queue, a cache line taken by an atomic),
/// booked as a calendar of busy intervals. CPUs run their work ahead of the event clock, so requests do not
/// arrive in time order: a request at time t takes the first free gap at or after t that is long enough,
/// as it would have in real time. Holders are served in time order, as a ticket/queued spinlock serves
/// them in arrival order (qspinlock's MCS queue). A holder on another core than the previous one first
/// pulls the lock's cache line over (`Coherence`): the transfer is part of the booking, so under
/// contention every hand-off between cores lengthens the lock's busy time, as it does on real hosts.
/// Simplification: a request slotted into a gap before a later booking does not re-price that booking's
/// transfer.
#[derive(Debug, Clone, Default)]
pub struct SpinLock {
    /// Busy intervals in time order, none overlapping or touching.
    busy: SplitDeque<Booking>,
    latest: Time,
    /// The last holder of everything forgotten.
    owner: u32,
    coh: Coherence,
    /// Writes so far, and per CPU the write count when it last had the line (`read_on`).
    version: u64,
    seen: PerCpu<u64>,
    pub stats: LockStats,
}

/// [start, end), held last by `cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Booking {
    s: Time,
    e: Time,
    cpu: u32,
}

impl SpinLock {
    /// A lock whose line moves between cores at `coh`'s costs.
    pub fn new(coh: Coherence) -> Self {
        SpinLock {
            owner: NO_CPU,
            coh,
            ..Default::default()
        }
    }

    /// Acquire at `at`, hold for `hold` ns, by no CPU in particular (no transfer). Returns (acquired_at,
    /// released_at).
    pub fn acquire(&mut self, at: Time, hold: u64) -> (Time, Time) {
        self.acquire_on(at, NO_CPU, hold)
    }

    /// A kernel spinlock (qspinlock) taken by `cpu` at `at` and held for `hold` ns: as
    /// [`SpinLock::acquire_on`], but a CPU that found it held gets it through the queued hand-off, which
    /// moves the lock word QSPINLOCK_HANDOFF_TRANSFERS times.
    pub fn lock_on(&mut self, at: Time, cpu: u32, hold: u64) -> (Time, Time) {
        self.take(at, cpu, hold, QSPINLOCK_HANDOFF_TRANSFERS)
    }

    /// `cpu` takes the resource at `at` and holds it for `hold` ns, after pulling the line from the
    /// previous holder's core once. Returns (acquired_at, released_at); the CPU spins from `at` to
    /// acquired_at.
    pub fn acquire_on(&mut self, at: Time, cpu: u32, hold: u64) -> (Time, Time) {
        self.take(at, cpu, hold, 1)
    }

    /// `cpu` reads the line at `at` (atomic_read, READ_ONCE of a shared counter): a copy it read since the
    /// last write costs nothing; otherwise it fetches the line from the last writer's core. Reads share the
    /// line, so nothing waits for them. Returns when the value is in hand.
    pub fn read_on(&mut self, at: Time, cpu: u32) -> Time {
        if cpu == NO_CPU {
            return at;
        }
        let seen = self.seen.get_mut(cpu as usize);
        if *seen == self.version {
            return at;
        }
        *seen = self.version;
        let last = self.busy.back().map_or(self.owner, |b| b.cpu);
        let xfer = self.coh.transfer_ns(last, cpu);
        if xfer > 0 {
            self.stats.transfers += 1;
            self.stats.transfer_ns += xfer;
            self.stats.stall(cpu, xfer);
        }
        at + xfer
    }

    /// Take at `at`; a contended take (one that waits) moves the line `handoff` times.
    fn take(&mut self, at: Time, cpu: u32, hold: u64, handoff: u64) -> (Time, Time) {
        self.version += 1;
        if cpu != NO_CPU {
            *self.seen.get_mut(cpu as usize) = self.version;
        }
        self.latest = self.latest.max(at);
        let floor = self.latest.saturating_sub(LOOKBEHIND_NS);
        while let Some(f) = self.busy.front() {
            if f.e > floor {
                break;
            }
            self.owner = f.cpu;
            self.busy.pop_front();
        }
        // Fast path: at or after everything booked (requests mostly come in time order).
        match self.busy.back() {
            Some(last) if at < last.e => {}
            last => {
                let prev = last.map_or(self.owner, |l| l.cpu);
                let xfer = self.coh.transfer_ns(prev, cpu);
                let len = xfer + hold;
                if len == 0 && prev == NO_CPU && cpu != NO_CPU {
                    // The first toucher takes the line over at no cost; later ones pay for it.
                    match self.busy.back_mut() {
                        Some(l) => l.cpu = cpu,
                        None => self.owner = cpu,
                    }
                }
                if len > 0 {
                    match self.busy.back_mut() {
                        Some(l) if l.e == at => {
                            l.e = at + len;
                            l.cpu = cpu;
                        }
                        _ => self.busy.push_back(Booking {
                            s: at,
                            e: at + len,
                            cpu,
                        }),
                    }
                }
                self.stats.record(cpu, 0, xfer);
                self.stats.busy(len);
                return (at + xfer, at + len);
            }
        }
        // First gap at or after `at` long enough for the transfer from the gap's previous holder and the hold.
        let mut i = self.busy.partition_from_back(|b| b.s <= at);
        let (mut start, mut prev) = (at, self.owner);
        if i > 0 {
            let b = self.busy.get(i - 1);
            if b.e > at {
                start = b.e;
            }
            prev = b.cpu;
        }
        let moves = |start: Time| if start > at { handoff } else { 1 };
        let mut xfer = self.coh.transfer_ns(prev, cpu) * moves(start);
        while i < self.busy.len() {
            let b = self.busy.get(i);
            if b.s >= start + (xfer + hold).max(1) {
                break;
            }
            start = start.max(b.e);
            prev = b.cpu;
            xfer = self.coh.transfer_ns(prev, cpu) * moves(start);
            i += 1;
        }
        let wait = start - at;
        self.stats.record(cpu, wait, xfer);
        self.stats.busy(xfer + hold);
        if xfer + hold > 0 {
            self.book(i, start, start + xfer + hold, cpu);
        }
        (start + xfer, start + xfer + hold)
    }

    /// An atomic read-modify-write of the line by `cpu` at `at` (cmpxchg, atomic_inc, a bitmap update):
    /// it waits for the line and pulls it over. Returns when it has been done.
    pub fn rmw_on(&mut self, at: Time, cpu: u32) -> Time {
        self.acquire_on(at, cpu, 0).1
    }

    /// Keep the resource busy over [s, e) as well (a holder that learns its release time only after
    /// acquiring, e.g. a lock held across a wait), merging with every booking it touches or overlaps.
    pub fn extend(&mut self, s: Time, e: Time) {
        if e <= s {
            return;
        }
        self.latest = self.latest.max(s);
        // Mostly a holder extending the latest booking, its own: the only one [s, e] can touch.
        if let Some(last) = self.busy.back_mut().filter(|l| l.s <= s && s <= l.e) {
            self.stats.busy(e.saturating_sub(last.e));
            last.e = last.e.max(e);
            return;
        }
        self.extend_merging(s, e);
    }

    /// [`SpinLock::extend`] over the bookings [s, e] touches, wherever they are.
    fn extend_merging(&mut self, s: Time, e: Time) {
        // Bookings touching or overlapping [s, e]: those ending at or after s and starting at or before e.
        let lo = self.busy.partition_from_back(|b| b.e < s);
        let hi = self.busy.partition_from_back(|b| b.s <= e);
        let mut owner_end = 0;
        let m = Booking { s, e, cpu: NO_CPU };
        // Busy time grows by the merged span less what the bookings it swallows already covered.
        let (mut covered, mut lo_s, mut hi_e) = (0, s, e);
        for i in lo..hi.max(lo) {
            let b = self.busy.get(i);
            covered += b.e - b.s;
            lo_s = lo_s.min(b.s);
            hi_e = hi_e.max(b.e);
        }
        self.stats.busy((hi_e - lo_s) - covered);
        self.busy.merge(lo, hi.max(lo), m, |mut m, b| {
            // The holder who extends is the one whose booking ends last among those merged.
            if b.e >= owner_end {
                owner_end = b.e;
                m.cpu = b.cpu;
            }
            m.s = m.s.min(b.s);
            m.e = m.e.max(b.e);
            m
        });
    }

    /// Insert [s, e) held last by `cpu` before booking `i` (which starts at or after e), merging with
    /// neighbours that touch it.
    fn book(&mut self, i: usize, s: Time, e: Time, cpu: u32) {
        let joins_prev = i > 0 && self.busy.get(i - 1).e == s;
        let joins_next = i < self.busy.len() && self.busy.get(i).s == e;
        match (joins_prev, joins_next) {
            (true, true) => {
                let next = self.busy.remove(i);
                let p = self.busy.get_mut(i - 1);
                p.e = next.e;
                p.cpu = next.cpu;
            }
            (true, false) => {
                let p = self.busy.get_mut(i - 1);
                p.e = e;
                p.cpu = cpu;
            }
            (false, true) => self.busy.get_mut(i).s = s,
            (false, false) => self.busy.insert(i, Booking { s, e, cpu }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Extending the latest booking in place leaves the calendar as merging through it would, among
        /// takes from any CPU at any time and extensions anywhere.
        #[test]
        fn extending_in_place_is_merging(ops in proptest::collection::vec(
            (any::<bool>(), 0u64..2_000, 0u64..300, 0u32..3), 1..120,
        )) {
            let mut fast = SpinLock::new(Coherence { cluster_cores: 1, socket_cores: 2, cluster_ns: 7, socket_ns: 7, remote_ns: 20 });
            let mut slow = fast.clone();
            for (take, at, len, cpu) in ops {
                if take {
                    prop_assert_eq!(fast.lock_on(at, cpu, len), slow.lock_on(at, cpu, len));
                } else {
                    fast.extend(at, at + len);
                    if at + len > at {
                        slow.latest = slow.latest.max(at);
                        slow.extend_merging(at, at + len);
                    }
                }
                let calendar = |l: &SpinLock| (0..l.busy.len()).map(|i| l.busy.get(i)).collect::<Vec<_>>();
                prop_assert_eq!(calendar(&fast), calendar(&slow));
                prop_assert_eq!(fast.latest, slow.latest);
                // Busy time is the calendar's length (nothing here is old enough to be forgotten).
                let held: u64 = calendar(&fast).iter().map(|b| b.e - b.s).sum();
                prop_assert_eq!(fast.stats.busiest_ns(), held);
                prop_assert_eq!(slow.stats.busiest_ns(), held);
            }
        }
    }

    #[test]
    fn instances_made_later_line_up_with_an_earlier_snapshot() {
        // Two owners (domains) of per-CPU locks made as CPUs need them: the first has made one of its two.
        let mut a = vec![SpinLock::default()];
        let b = [SpinLock::default(), SpinLock::default()];
        a[0].acquire(0, 10);
        let snap = |a: &[SpinLock]| {
            let mut s = LockStats::sum_of(a.iter().map(|l| &l.stats), 2);
            s.add(&LockStats::sum_of(b.iter().map(|l| &l.stats), 2));
            s
        };
        let before = snap(&a);
        a.push(SpinLock::default());
        a[1].acquire(100, 30);
        let w = snap(&a).since(&before);
        assert_eq!(w.busy_ns, vec![0, 0, 30, 0, 0, 0]);
        assert_eq!(w.busiest_ns(), 30);
    }

    #[test]
    fn second_acquirer_waits_for_first() {
        let mut l = SpinLock::default();
        assert_eq!(l.acquire(100, 50), (100, 150));
        assert_eq!(l.acquire(120, 10), (150, 160));
        assert_eq!(l.stats.contended, 1);
        assert_eq!(l.stats.wait_ns, 30);
        assert_eq!(l.acquire(500, 10), (500, 510));
    }
    #[test]
    fn earlier_request_fits_in_a_gap_before_a_later_booking() {
        let mut l = SpinLock::default();
        assert_eq!(l.acquire(1000, 100), (1000, 1100));
        // A CPU whose clock is behind asks at 200: the lock was free then.
        assert_eq!(l.acquire(200, 100), (200, 300));
        // Asking at 950 for 100 ns overlaps [1000,1100): it goes after.
        assert_eq!(l.acquire(950, 100), (1100, 1200));
        assert_eq!(l.stats.contended, 1);
    }
    #[test]
    fn extend_merges_overlapping_bookings() {
        let mut l = SpinLock::default();
        l.acquire(100, 50);
        l.acquire(300, 50);
        l.extend(140, 320);
        assert_eq!(l.busy.len(), 1);
        assert_eq!(l.acquire(0, 10), (0, 10));
        assert_eq!(l.acquire(200, 10), (350, 360));
    }
    #[test]
    fn adjacent_bookings_merge() {
        let mut l = SpinLock::default();
        for _ in 0..1000 {
            l.acquire(0, 10);
        }
        assert_eq!(l.busy.len(), 1);
        assert_eq!(
            l.busy.back(),
            Some(Booking {
                s: 0,
                e: 10_000,
                cpu: NO_CPU
            })
        );
    }

    fn xeon() -> Coherence {
        Coherence {
            cluster_cores: 8,
            socket_cores: 8,
            cluster_ns: 50,
            socket_ns: 50,
            remote_ns: 140,
        }
    }

    /// `n` CPUs take the lock in turn as fast as they can for `rounds` rounds: the lock's busy time per
    /// acquisition (hold plus transfers).
    fn hammer(coh: Coherence, cpus: &[u32], rounds: u64) -> (f64, LockStats) {
        let mut l = SpinLock::new(coh);
        let mut free_at = vec![0u64; cpus.len()];
        let mut last = 0;
        for _ in 0..rounds {
            for (i, &c) in cpus.iter().enumerate() {
                let (_, rel) = l.lock_on(free_at[i], c, 20);
                free_at[i] = rel;
                last = last.max(rel);
            }
        }
        (last as f64 / (rounds * cpus.len() as u64) as f64, l.stats)
    }

    #[test]
    fn an_uncontended_acquire_on_the_same_core_costs_only_the_hold() {
        let mut l = SpinLock::new(xeon());
        assert_eq!(l.acquire_on(100, 3, 20), (100, 120));
        assert_eq!(l.acquire_on(500, 3, 20), (500, 520));
        assert_eq!((l.stats.transfers, l.stats.contended), (0, 0));
        // Another core of the socket pulls the line over first.
        assert_eq!(l.acquire_on(1000, 4, 20), (1050, 1070));
        assert_eq!((l.stats.transfers, l.stats.transfer_ns), (1, 50));
    }

    #[test]
    fn cores_hammering_a_lock_pay_transfers_that_grow_with_cores_and_sockets() {
        let (one, s1) = hammer(xeon(), &[0], 100);
        let (two, s2) = hammer(xeon(), &[0, 1], 100);
        let (_, s4) = hammer(xeon(), &[0, 1, 2, 3], 100);
        let (cross, sx) = hammer(xeon(), &[0, 8], 100);
        assert_eq!(s1.transfers, 0);
        assert!((one - 20.0).abs() < 1e-9, "{one}");
        // Every hand-off is a queued one: hold + QSPINLOCK_HANDOFF_TRANSFERS transfers per acquisition.
        assert!(s2.transfers >= 199 && (two - 170.0).abs() < 2.0, "{two}");
        assert!(s4.transfers > s2.transfers);
        assert!(s4.wait_ns > s2.wait_ns, "more waiters spin longer");
        assert!(
            cross > two + 80.0,
            "across sockets each hand-off costs more: {cross}"
        );
        assert!(sx.transfer_ns > s2.transfer_ns);
        // Waiters' spinning is charged to their CPUs.
        assert!(s4.spin_by_cpu.iter().take(4).all(|&v| v > 0));
    }

    #[test]
    fn a_rmw_waits_for_the_line_and_books_the_transfer() {
        let mut l = SpinLock::new(xeon());
        assert_eq!(l.rmw_on(0, 0), 0);
        assert_eq!(l.rmw_on(10, 1), 60);
        assert_eq!(
            l.rmw_on(20, 2),
            110,
            "the second remote RMW waits for the first transfer"
        );
        assert_eq!(l.stats.contended, 1);
    }
}
