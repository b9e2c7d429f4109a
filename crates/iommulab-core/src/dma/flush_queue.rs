//! Lazy (IOMMU_DOMAIN_DMA_FQ): unmapped IOVAs wait on a flush queue until a whole-domain flush that began
//! after they were queued has completed (drivers/iommu/dma-iommu.c, 6.7+ layout): per-CPU rings of 256 with
//! a 10 ms timer, or, for devices whose IOTLB flushes a hypervisor shadows (`shadow_on_flush`), one ring of
//! 32768 with a 1 s timer.

use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::PerCpu;
use crate::sim::{LockStats, SpinLock, Time, NS_PER_MS};
use std::collections::VecDeque;

/// dma-iommu.c IOVA_DEFAULT_FQ_SIZE: ring entries per CPU (one slot stays empty: 255 usable).
pub const IOVA_DEFAULT_FQ_SIZE: usize = 256;
/// dma-iommu.c IOVA_DEFAULT_FQ_TIMEOUT: ms until the one-shot flush timer fires.
pub const IOVA_DEFAULT_FQ_TIMEOUT_MS: u64 = 10;
/// dma-iommu.c IOVA_SINGLE_FQ_SIZE: entries of the single queue.
pub const IOVA_SINGLE_FQ_SIZE: usize = 32768;
/// dma-iommu.c IOVA_SINGLE_FQ_TIMEOUT: its timer, in ms.
pub const IOVA_SINGLE_FQ_TIMEOUT_MS: u64 = 1000;

/// The flush queue a device gets (dma-iommu.c struct iommu_dma_options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FqOptions {
    /// IOMMU_DMA_OPTS_SINGLE_QUEUE: one ring for all CPUs (else one per CPU).
    pub single_queue: bool,
    pub size: usize,
    pub timeout_ms: u64,
}

impl FqOptions {
    /// iommu_dma_init_options(): "Shadowing IOTLB flushes do better with a single large queue" — the s390
    /// driver sets dev->iommu->shadow_on_flush for zPCI devices that need TLB refreshes (under z/VM or KVM).
    pub fn for_device(shadow_on_flush: bool) -> Self {
        if shadow_on_flush {
            FqOptions {
                single_queue: true,
                size: IOVA_SINGLE_FQ_SIZE,
                timeout_ms: IOVA_SINGLE_FQ_TIMEOUT_MS,
            }
        } else {
            FqOptions {
                single_queue: false,
                size: IOVA_DEFAULT_FQ_SIZE,
                timeout_ms: IOVA_DEFAULT_FQ_TIMEOUT_MS,
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct FqEntry {
    iova_pfn: u64,
    pages: u64,
    /// fq_flush_start_cnt when queued.
    counter: u64,
}

pub struct FlushQueue {
    opts: FqOptions,
    /// One ring per CPU, or the single queue at index 0.
    rings: PerCpu<VecDeque<FqEntry>>,
    /// Each ring's fq->lock (its cache line moves when the timer, on another CPU, drains the ring).
    locks: Vec<SpinLock>,
    /// The cookie's line holding fq_flush_start_cnt, fq_flush_finish_cnt and the timer (dma-iommu.c struct
    /// iommu_dma_cookie): every queue_iova reads the counters, every flush writes them.
    cookie: SpinLock,
    flush_start_cnt: u64,
    flush_finish_cnt: u64,
    timer_on: bool,
    jiffy_ns: u64,
    /// Where the scheduler tick falls on the clock `now` is measured by: ticks at `jiffy_phase_ns + k·jiffy`.
    jiffy_phase_ns: u64,
}

/// msecs_to_jiffies(): a timeout in whole jiffies, rounded up.
fn timeout_jiffies(timeout_ms: u64, jiffy_ns: u64) -> u64 {
    (timeout_ms * NS_PER_MS).div_ceil(jiffy_ns)
}

/// The longest a queued IOVA waits for the timer at CONFIG_HZ `hz` (as `FlushQueue::expiry` files it): the
/// timeout in whole jiffies, and one jiffy more.
pub fn longest_timer_wait_ns(timeout_ms: u64, hz: u32) -> u64 {
    let jiffy_ns = 1_000_000_000 / hz.max(1) as u64;
    (timeout_jiffies(timeout_ms, jiffy_ns) + 1) * jiffy_ns
}

impl FlushQueue {
    /// Per-CPU rings (the default).
    pub fn new(cpus: usize, hz: u32) -> Self {
        Self::with_options(cpus, hz, FqOptions::for_device(false))
    }

    pub fn with_options(cpus: usize, hz: u32, opts: FqOptions) -> Self {
        let rings = if opts.single_queue { 1 } else { cpus.max(1) };
        FlushQueue {
            opts,
            rings: PerCpu::new(rings),
            locks: Vec::new(),
            cookie: SpinLock::default(),
            flush_start_cnt: 0,
            flush_finish_cnt: 0,
            timer_on: false,
            jiffy_ns: 1_000_000_000 / hz.max(1) as u64,
            jiffy_phase_ns: 0,
        }
    }

    /// Put the scheduler tick at `phase_ns` (mod one jiffy) on the caller's clock (a replayed trace's
    /// clock need not tick at multiples of the jiffy).
    pub fn with_jiffy_phase(mut self, phase_ns: u64) -> Self {
        self.jiffy_phase_ns = phase_ns % self.jiffy_ns;
        self
    }

    /// fq_flush_iotlb(): start count, flush_iotlb_all, finish count (atomic64_inc on the cookie's line each).
    fn flush(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        self.flush_start_cnt += 1;
        let t = self.cookie.rmw_on(now, cpu as u32);
        let t = core.flush_iotlb_all(t, cpu);
        self.flush_finish_cnt += 1;
        self.cookie.rmw_on(t, cpu as u32)
    }

    /// Ring `ring`'s fq->lock, its line moving between cores at the platform's costs.
    fn lock(&mut self, core: &DmaCore, ring: usize) -> &mut SpinLock {
        let coh = core.costs.coherence();
        if self.locks.is_empty() {
            self.cookie = SpinLock::new(coh);
        }
        if self.locks.len() <= ring {
            self.locks.resize_with(ring + 1, || SpinLock::new(coh));
        }
        &mut self.locks[ring]
    }

    /// fq_ring_free_locked(): free entries queued before the last completed flush began. IOVAs go to the
    /// rcache of the CPU running this (raw_cpu_ptr in free_iova_fast), not of the ring's owner.
    fn ring_free(&mut self, core: &mut DmaCore, now: Time, ring: usize, cpu: usize) -> Time {
        let mut t = now;
        let finished = self.flush_finish_cnt;
        let entries = self.rings.get_mut(ring);
        while let Some(e) = entries.front() {
            if e.counter >= finished {
                break;
            }
            let e = entries.pop_front().expect("front exists");
            t = core.free_iova(t, cpu, e.iova_pfn, e.pages);
        }
        t
    }

    /// mod_timer(jiffies + msecs_to_jiffies(fq_timeout)): the timer wheel files it one jiffy later still
    /// (kernel/time/timer.c calc_index(): "Round up with level granularity" so it never fires early), and
    /// it runs on that tick.
    pub fn expiry(&self, now: Time) -> Time {
        let n = timeout_jiffies(self.opts.timeout_ms, self.jiffy_ns);
        let since = now + self.jiffy_ns - self.jiffy_phase_ns;
        let jiffies = since / self.jiffy_ns;
        (jiffies + n + 1) * self.jiffy_ns + self.jiffy_phase_ns - self.jiffy_ns
    }

    /// The ring `cpu` queues on: its own, or the single queue.
    fn ring_of(&self, cpu: usize) -> usize {
        if self.opts.single_queue {
            0
        } else {
            cpu
        }
    }

    /// Entries waiting on the ring `cpu` queues on.
    pub fn queued(&self, cpu: usize) -> usize {
        self.rings.get(self.ring_of(cpu)).map_or(0, VecDeque::len)
    }
}

impl DmaPolicy for FlushQueue {
    fn name(&self) -> PolicyName {
        PolicyName::Lazy
    }

    fn timer_period_ns(&self) -> Option<u64> {
        Some(self.opts.timeout_ms * NS_PER_MS)
    }

    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        // The gather is queued: io-pgtable and intel skip range gathering and no sync is issued here.
        let (_g, t, _) = core.unmap_ptes(now, cpu, iova_pfn, pages);
        // queue_iova(): this CPU's ring (or the single queue) under its lock, held across a full ring's
        // flush; fq_ring_free_locked() reads fq_flush_finish_cnt. fq_full(): one slot stays empty.
        let ring = self.ring_of(cpu);
        let lock_ns = core.costs.lock_ns;
        let (start, mut t) = self.lock(core, ring).lock_on(t, cpu as u32, lock_ns);
        t = self.cookie.read_on(t, cpu as u32);
        t = self.ring_free(core, t, ring, cpu);
        if self.rings.get_mut(ring).len() >= self.opts.size - 1 {
            core.stats.fq_flush_full += 1;
            t = self.flush(core, t, cpu);
            t = self.ring_free(core, t, ring, cpu);
        }
        self.locks[ring].extend(start, t);
        self.rings.get_mut(ring).push_back(FqEntry {
            iova_pfn,
            pages,
            counter: self.flush_start_cnt,
        });
        t += core.costs.fq_entry_ns;
        if !self.timer_on {
            self.timer_on = true;
            core.timer_request = Some((self.expiry(t), cpu));
        }
        t
    }

    /// fq_flush_timeout(): one flush, then every ring is drained under its owner's fq->lock, taken from
    /// this CPU.
    fn timer(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        self.timer_on = false;
        core.stats.fq_flush_timer += 1;
        let mut t = self.flush(core, now, cpu);
        let lock_ns = core.costs.lock_ns;
        for ring in 0..self.rings.cpus() {
            let (start, rel) = self.lock(core, ring).lock_on(t, cpu as u32, lock_ns);
            t = self.ring_free(core, rel, ring, cpu);
            self.locks[ring].extend(start, t);
        }
        t
    }

    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        vec![
            (
                "flush queue fq->lock",
                LockStats::sum_of(self.locks.iter().map(|l| &l.stats), self.rings.len()),
            ),
            ("flush queue cookie counters", self.cookie.stats.clone()),
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The timer, on one CPU, drains every CPU's ring under that ring's fq->lock: the lock words move to
    /// it and back, and the flush's counter writes cost every CPU a fetch at its next queue_iova.
    #[test]
    fn the_timer_pulls_every_rings_lock_and_the_counters_move() {
        let mut costs = crate::dma::tests::costs(2);
        costs.line_cluster_ns = 50;
        costs.line_socket_ns = 50;
        let io = crate::hw::vtd::tests::cfg();
        let mut c = DmaCore::new(Box::new(crate::hw::vtd::tests::vtd(&io)), 2, &costs);
        let mut fq = FlushQueue::new(2, 250);
        let (a, t) = c.iommu_map(0, 0, 100, 1).unwrap();
        let (b, t) = c.iommu_map(t, 1, 200, 1).unwrap();
        let t = fq.unmap(&mut c, t, 0, a, 1);
        let t = fq.unmap(&mut c, t, 1, b, 1);
        let locks = |fq: &FlushQueue| fq.lock_stats()[0].1.clone();
        assert_eq!(
            locks(&fq).transfers,
            0,
            "each CPU takes its own ring's lock"
        );
        let t = fq.timer(&mut c, t + 20_000_000, 0);
        assert_eq!(locks(&fq).transfers, 1, "CPU 0 takes CPU 1's ring lock");
        let (d, t) = c.iommu_map(t, 1, 300, 1).unwrap();
        let before = fq.lock_stats()[1].1.transfers;
        fq.unmap(&mut c, t, 1, d, 1);
        assert_eq!(locks(&fq).transfers, 2, "and CPU 1 takes it back");
        assert_eq!(
            fq.lock_stats()[1].1.transfers,
            before + 1,
            "CPU 1 fetches the counters CPU 0's flush wrote"
        );
    }

    pub(crate) fn core(cpus: usize) -> DmaCore {
        let io = crate::hw::vtd::tests::cfg();
        DmaCore::new(
            Box::new(crate::hw::vtd::tests::vtd(&io)),
            cpus,
            &crate::dma::tests::costs(cpus),
        )
    }

    #[test]
    fn full_ring_flushes_synchronously_at_255() {
        let mut c = core(1);
        let mut fq = FlushQueue::new(1, 250);
        let mut iovas = vec![];
        for i in 0..256 {
            let (iova, _) = c.iommu_map(0, 0, 1000 + i, 1).unwrap();
            iovas.push(iova);
        }
        for (i, &iova) in iovas.iter().enumerate() {
            fq.unmap(&mut c, 0, 0, iova, 1);
            let expect = if i < 255 { 0 } else { 1 };
            assert_eq!(c.stats.fq_flush_full, expect, "after {} unmaps", i + 1);
        }
        assert_eq!(c.iommu.counters().class(crate::hw::InvClass::Domain), 1);
        assert_eq!(fq.queued(0), 1, "255 freed by the flush, the 256th queued");
    }

    #[test]
    fn timer_is_one_shot_and_rounded_to_jiffies() {
        let mut c = core(2);
        let mut fq = FlushQueue::new(2, 250); // 4 ms jiffies: 10 ms → 3 jiffies
        let (iova, _) = c.iommu_map(0, 0, 5, 1).unwrap();
        fq.unmap(&mut c, 5_000_000, 0, iova, 1);
        let (exp, cpu) = c.timer_request.take().unwrap();
        assert_eq!(
            (exp, cpu),
            (20_000_000, 0),
            "jiffy 1 (4 ms) + 3 jiffies + the wheel's round-up"
        );
        // With the tick at 1 ms past each 4 ms: armed at 5 ms in jiffy [5, 9) → tick 5 + 4·4 = 21 ms.
        assert_eq!(
            FlushQueue::new(1, 250)
                .with_jiffy_phase(1_000_000)
                .expiry(5_000_000),
            21_000_000
        );
        assert_eq!(
            FlushQueue::new(1, 250)
                .with_jiffy_phase(1_000_000)
                .expiry(4_999_999),
            17_000_000
        );
        let (iova2, _) = c.iommu_map(0, 1, 6, 1).unwrap();
        fq.unmap(&mut c, 6_000_000, 1, iova2, 1);
        assert!(
            c.timer_request.is_none(),
            "armed once per domain, not sliding"
        );
        fq.timer(&mut c, exp, 0);
        assert_eq!(
            (fq.queued(0), fq.queued(1)),
            (0, 0),
            "the timer drains every CPU's ring"
        );
        assert_eq!(c.stats.fq_flush_timer, 1);
    }

    #[test]
    fn shadow_on_flush_gives_one_queue_of_32768_and_a_one_second_timer() {
        let mut c = core(2);
        let mut fq = FlushQueue::with_options(2, 250, FqOptions::for_device(true));
        let n = IOVA_SINGLE_FQ_SIZE as u64;
        for i in 0..n {
            let (iova, _) = c.iommu_map(0, 0, 1000 + i, 1).unwrap();
            // Both CPUs feed the one queue: 32767 entries fit, the 32768th finds it full.
            fq.unmap(&mut c, 0, (i % 2) as usize, iova, 1);
            let expect = u64::from(i + 1 == n);
            assert_eq!(c.stats.fq_flush_full, expect, "after {} unmaps", i + 1);
        }
        assert_eq!(
            (fq.queued(0), fq.queued(1)),
            (1, 1),
            "one ring, seen from both CPUs"
        );
        // msecs_to_jiffies(1000) at HZ 250 = 250 jiffies, plus the wheel's round-up.
        assert_eq!(fq.expiry(0), 251 * 4_000_000);
        let per_cpu = FlushQueue::new(2, 250);
        assert_eq!(per_cpu.expiry(0), 4 * 4_000_000);
    }

    #[test]
    fn iova_not_reusable_before_flush() {
        let mut c = core(1);
        let mut fq = FlushQueue::new(1, 250);
        let (iova, _) = c.iommu_map(0, 0, 5, 1).unwrap();
        fq.unmap(&mut c, 0, 0, iova, 1);
        let (again, _) = c.iommu_map(0, 0, 6, 1).unwrap();
        assert_ne!(again, iova, "queued IOVA must not be handed out");
        fq.timer(&mut c, 10, 0);
        let (third, _) = c.iommu_map(0, 0, 7, 1).unwrap();
        assert_eq!(third, iova, "after the flush it is back in the rcache");
    }
}
