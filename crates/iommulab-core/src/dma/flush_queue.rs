//! Lazy (IOMMU_DOMAIN_DMA_FQ): unmapped IOVAs wait on a per-CPU flush queue until a whole-domain flush that
//! began after they were queued has completed (drivers/iommu/dma-iommu.c, 6.7+ layout).

use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::{Time, NS_PER_MS};
use std::collections::VecDeque;

/// dma-iommu.c IOVA_DEFAULT_FQ_SIZE: ring entries per CPU (one slot stays empty: 255 usable).
pub const IOVA_DEFAULT_FQ_SIZE: usize = 256;
/// dma-iommu.c IOVA_DEFAULT_FQ_TIMEOUT: ms until the one-shot flush timer fires.
pub const IOVA_DEFAULT_FQ_TIMEOUT_MS: u64 = 10;

#[derive(Debug, Clone, Copy)]
struct FqEntry {
    iova_pfn: u64,
    pages: u64,
    /// fq_flush_start_cnt when queued.
    counter: u64,
}

pub struct FlushQueue {
    rings: Vec<VecDeque<FqEntry>>,
    flush_start_cnt: u64,
    flush_finish_cnt: u64,
    timer_on: bool,
    jiffy_ns: u64,
    /// Where the scheduler tick falls on the clock `now` is measured by: ticks at `jiffy_phase_ns + k·jiffy`.
    jiffy_phase_ns: u64,
}

impl FlushQueue {
    pub fn new(cpus: usize, hz: u32) -> Self {
        FlushQueue {
            rings: vec![VecDeque::with_capacity(IOVA_DEFAULT_FQ_SIZE); cpus.max(1)],
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

    /// fq_flush_iotlb(): start count, flush_iotlb_all, finish count.
    fn flush(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        self.flush_start_cnt += 1;
        let t = core.iommu.flush_iotlb_all(now, cpu, core.dom);
        self.flush_finish_cnt += 1;
        t
    }

    /// fq_ring_free_locked(): free entries queued before the last completed flush began. IOVAs go to the
    /// rcache of the CPU running this (raw_cpu_ptr in free_iova_fast), not of the ring's owner.
    fn ring_free(&mut self, core: &mut DmaCore, now: Time, ring: usize, cpu: usize) -> Time {
        let mut t = now;
        while let Some(e) = self.rings[ring].front() {
            if e.counter >= self.flush_finish_cnt {
                break;
            }
            let e = self.rings[ring].pop_front().expect("front exists");
            t = core.free_iova(t, cpu, e.iova_pfn, e.pages);
        }
        t
    }

    /// mod_timer(jiffies + msecs_to_jiffies(10)): the timer wheel files it one jiffy later still
    /// (kernel/time/timer.c calc_index(): "Round up with level granularity" so it never fires early), and
    /// it runs on that tick.
    pub fn expiry(&self, now: Time) -> Time {
        let n = (IOVA_DEFAULT_FQ_TIMEOUT_MS * NS_PER_MS).div_ceil(self.jiffy_ns);
        let since = now + self.jiffy_ns - self.jiffy_phase_ns;
        let jiffies = since / self.jiffy_ns;
        (jiffies + n + 1) * self.jiffy_ns + self.jiffy_phase_ns - self.jiffy_ns
    }

    /// Entries waiting on `cpu`'s ring.
    pub fn queued(&self, cpu: usize) -> usize {
        self.rings[cpu].len()
    }
}

impl DmaPolicy for FlushQueue {
    fn name(&self) -> PolicyName {
        PolicyName::Lazy
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
        let (_g, t) = core.unmap_ptes(now, cpu, iova_pfn, pages);
        // queue_iova(): this CPU's ring under its lock (rings for CPUs beyond the first ones on demand).
        if cpu >= self.rings.len() {
            self.rings.resize_with(cpu + 1, VecDeque::new);
        }
        let mut t = t + core.costs.lock_ns;
        t = self.ring_free(core, t, cpu, cpu);
        if self.rings[cpu].len() >= IOVA_DEFAULT_FQ_SIZE - 1 {
            core.stats.fq_flush_full += 1;
            t = self.flush(core, t, cpu);
            t = self.ring_free(core, t, cpu, cpu);
        }
        self.rings[cpu].push_back(FqEntry {
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

    /// fq_flush_timeout(): one flush, then every CPU's ring is drained.
    fn timer(&mut self, core: &mut DmaCore, now: Time, cpu: usize) -> Time {
        self.timer_on = false;
        core.stats.fq_flush_timer += 1;
        let mut t = self.flush(core, now, cpu);
        for ring in 0..self.rings.len() {
            t = self.ring_free(core, t + core.costs.lock_ns, ring, cpu);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(c.iommu.counters().get(crate::hw::InvKind::Dsi), 1);
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
