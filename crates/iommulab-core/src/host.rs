//! The simulated machine: CPUs, the page allocator, the device's DMA layer, and the event queue.

use crate::dma::DmaLayer;
use crate::scenario::Platform;
use crate::sim::{Cfs, Cpu, Ctx, EventQueue, Rng, RunQueue, Time};

/// Events of the engine. Workloads own their kinds; the DMA layer and IOVA allocator have their own timers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Workload {
        kind: u16,
        id: u32,
    },
    /// A timer the DMA policy armed (flush-queue timeout), run in softirq on `cpu`.
    DmaTimer {
        cpu: u32,
    },
    /// iova.c iova_depot_work_func(), a delayed work item.
    IovaDepotWork,
    /// The malicious device's next round of IOVA replays.
    Attack,
    /// A CPU finished its current work: run the work waiting for it that `sim::sched` picks.
    CpuFree {
        cpu: u32,
    },
}

/// Physical 4 KiB pages: LIFO reuse, as the per-CPU free lists hand back the most recently freed page.
pub struct PageAllocator {
    free: Vec<u64>,
    next_fresh: u64,
    limit: u64,
    pub allocated: u64,
    pub freed: u64,
}

/// First pfn handed out (pages below stand for the kernel image and firmware).
const FIRST_PFN: u64 = 0x10000;

impl PageAllocator {
    pub fn new(pages: u64) -> Self {
        PageAllocator {
            free: Vec::new(),
            next_fresh: FIRST_PFN,
            limit: FIRST_PFN + pages,
            allocated: 0,
            freed: 0,
        }
    }
    pub fn alloc(&mut self) -> Option<u64> {
        let p = match self.free.pop() {
            Some(p) => p,
            None if self.next_fresh < self.limit => {
                self.next_fresh += 1;
                self.next_fresh - 1
            }
            None => return None,
        };
        self.allocated += 1;
        Some(p)
    }
    /// `n` physically contiguous pages (a higher-order allocation), taken from never-used memory.
    pub fn alloc_contiguous(&mut self, n: u64) -> Option<u64> {
        if self.next_fresh + n > self.limit {
            return None;
        }
        self.next_fresh += n;
        self.allocated += n;
        Some(self.next_fresh - n)
    }
    pub fn free(&mut self, pfn: u64) {
        self.freed += 1;
        self.free.push(pfn);
    }
}

pub struct Host {
    pub cpus: Vec<Cpu>,
    /// Work that found its CPU busy: softirq work first, then ksoftirqd and tasks in turns (`sim::sched`).
    waiting: Vec<RunQueue<Event>>,
    free_pending: Vec<bool>,
    /// The CPU was just handed to waiting work: its next cpu_acquire succeeds.
    granted: Vec<bool>,
    pub dma: DmaLayer,
    pub pages: PageAllocator,
    pub platform: Platform,
    pub rng: Rng,
    pub events: EventQueue<Event>,
}

impl Host {
    pub fn new(cpus: usize, dma: DmaLayer, platform: Platform, rng: Rng, cfs: Cfs) -> Self {
        Host {
            cpus: vec![Cpu::default(); cpus],
            waiting: vec![RunQueue::new(cfs); cpus],
            free_pending: vec![false; cpus],
            granted: vec![false; cpus],
            dma,
            pages: PageAllocator::new(platform.memory.pages),
            platform,
            rng,
            events: EventQueue::default(),
        }
    }

    /// Work `ev`, running in `ctx`, wants `cpu` at `now`. True: run it now. False: it waits its turn
    /// (`sim::sched`) and is delivered again (as the same event) when the CPU is free and chooses it.
    pub fn cpu_acquire(&mut self, cpu: usize, now: Time, ev: Event, ctx: Ctx) -> bool {
        let prev_end = self.cpus[cpu].busy_until;
        if std::mem::take(&mut self.granted[cpu]) {
            return true;
        }
        if prev_end <= now && self.waiting[cpu].is_empty() {
            self.waiting[cpu].started(ctx, now, prev_end);
            return true;
        }
        self.waiting[cpu].push(ctx, ev, now, prev_end);
        if !self.free_pending[cpu] {
            self.free_pending[cpu] = true;
            let at = prev_end.max(now);
            self.events.push(at, Event::CpuFree { cpu: cpu as u32 });
        }
        false
    }

    /// A CPU-free event: hand the work chosen to run next back (to be dispatched now), or wait longer.
    pub fn cpu_free(&mut self, cpu: usize, now: Time) -> Option<Event> {
        self.free_pending[cpu] = false;
        let prev_end = self.cpus[cpu].busy_until;
        if prev_end > now {
            self.free_pending[cpu] = true;
            self.events
                .push(prev_end, Event::CpuFree { cpu: cpu as u32 });
            return None;
        }
        let ev = self.waiting[cpu].pick(now, prev_end)?;
        self.granted[cpu] = true;
        if !self.waiting[cpu].is_empty() {
            self.free_pending[cpu] = true;
            // Pushed after the dispatched work runs; it re-checks busy_until then.
            self.events.push(now, Event::CpuFree { cpu: cpu as u32 });
        }
        Some(ev)
    }

    pub fn schedule(&mut self, at: Time, ev: Event) {
        self.events.push(at, ev);
    }

    fn take_timer_request(&mut self) {
        if let Some((at, cpu)) = self.dma.core.timer_request.take() {
            self.events.push(at, Event::DmaTimer { cpu: cpu as u32 });
        }
    }

    /// dma_map_page() on `cpu` at `now`: (DMA address pfn, release time), None if IOVA space is exhausted.
    pub fn dma_map(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        let r = self.dma.map(now, cpu, phys_pfn, pages);
        self.take_timer_request();
        r
    }

    /// FANDS' block mapping of an RX WQE's pages: (IOVA pfn of the block, release time).
    pub fn dma_map_block(&mut self, now: Time, cpu: usize, phys: &[u64]) -> Option<(u64, Time)> {
        self.dma.map_block(now, cpu, phys)
    }

    /// The driver ended a batch of unmaps (a NAPI poll, a TX completion batch): the release time.
    pub fn dma_batch_end(&mut self, now: Time, cpu: usize) -> Time {
        self.dma.batch_end(now, cpu)
    }

    /// dma_unmap_page() on `cpu` at `now`: the release time.
    pub fn dma_unmap(&mut self, now: Time, cpu: usize, dma_pfn: u64, pages: u64) -> Time {
        self.dma_unmap_desc(now, cpu, &[(dma_pfn, pages)])
    }

    /// Map a buffer of `bytes` at byte `offset` of page `phys` (dma_map_single): (dma pfn, pages, release
    /// time). What else shares its pages is logged as sub-page exposure.
    pub fn dma_map_buf(
        &mut self,
        now: Time,
        cpu: usize,
        phys: u64,
        offset: u64,
        bytes: u64,
    ) -> Option<(u64, u64, Time)> {
        let r = self.dma.map_buf(now, cpu, phys, offset, bytes);
        self.take_timer_request();
        r
    }

    /// Unmap the segments `(dma pfn, pages)` of one completed descriptor.
    pub fn dma_unmap_desc(&mut self, now: Time, cpu: usize, segs: &[(u64, u64)]) -> Time {
        let t = self.dma.unmap_desc(now, cpu, segs);
        self.take_timer_request();
        t
    }

    /// Run a DMA-layer timer on its CPU; returns the release time.
    /// Device side of one DMA page: the latency its translation adds to the write (the PCIe base; with
    /// ATS, nothing more on an ATC hit and a translation-request round trip on a miss; one memory read per
    /// page-walk level the walk caches did not cover) and whether it faulted.
    pub fn dma_page(&mut self, now: Time, iova_pfn: u64) -> (u64, bool) {
        let pcie = &self.platform.pcie;
        let base = pcie.dma_base_ns;
        match self.dma.translate(now, iova_pfn) {
            None => (base, false),
            Some(tr) => {
                let ats = if tr.ats_request {
                    pcie.ats_request_ns
                } else {
                    0
                };
                let walk = tr.walk_reads as u64 * self.platform.memory.walk_read_ns;
                (base + ats + walk, tr.fault())
            }
        }
    }

    /// Device side of a descriptor or completion-entry access: only what its translation adds (ATS round
    /// trip, page-walk reads), not the per-packet DMA base; and whether it faulted.
    pub fn dma_translation(&mut self, now: Time, iova_pfn: u64) -> (u64, bool) {
        let (lat, fault) = self.dma_page(now, iova_pfn);
        (lat - self.platform.pcie.dma_base_ns, fault)
    }

    pub fn run_dma_timer(&mut self, now: Time, cpu: usize) {
        if !self.cpu_acquire(cpu, now, Event::DmaTimer { cpu: cpu as u32 }, Ctx::Softirq) {
            return;
        }
        let end = self.dma.timer(now, cpu);
        self.cpus[cpu].account(now, end);
        self.take_timer_request();
    }
}
