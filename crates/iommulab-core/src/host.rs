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
    /// A timer the DMA policy of domain `dom` armed (flush-queue timeout), run in softirq on `cpu`.
    DmaTimer {
        cpu: u32,
        dom: u16,
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
    /// An allocation found no free page.
    pub exhausted: bool,
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
            exhausted: false,
        }
    }
    pub fn alloc(&mut self) -> Option<u64> {
        let p = match self.free.pop() {
            Some(p) => p,
            None if self.next_fresh < self.limit => {
                self.next_fresh += 1;
                self.next_fresh - 1
            }
            None => {
                self.exhausted = true;
                return None;
            }
        };
        self.allocated += 1;
        Some(p)
    }
    /// `n` physically contiguous pages (a higher-order allocation), taken from never-used memory.
    pub fn alloc_contiguous(&mut self, n: u64) -> Option<u64> {
        if self.next_fresh + n > self.limit {
            self.exhausted = true;
            return None;
        }
        self.next_fresh += n;
        self.allocated += n;
        Some(self.next_fresh - n)
    }
    /// `n` contiguous pages starting at a multiple of `align` pages (hugepages), taken from never-used
    /// memory; the pages skipped to align them stay unused.
    pub fn alloc_aligned(&mut self, n: u64, align: u64) -> Option<u64> {
        let skip = self.next_fresh.next_multiple_of(align) - self.next_fresh;
        if self.next_fresh + skip + n > self.limit {
            self.exhausted = true;
            return None;
        }
        self.next_fresh += skip;
        self.alloc_contiguous(n)
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
    /// The DMA layer of the first device's domain.
    pub dma: DmaLayer,
    /// The DMA layers of further domains (devices in IOMMU groups of their own): each its own IOVA
    /// space, policy, flush queue and timer, all driving the one IOMMU. The IOMMU is lent to the domain
    /// that uses it (`lend`); the others hold a stand-in that is never called.
    others: Vec<DmaLayer>,
    /// Which domain holds the IOMMU: 0 is `dma`, d is `others[d - 1]`.
    iommu_at: usize,
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
            others: Vec::new(),
            iommu_at: 0,
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

    /// `cpu` was just handed to the work being dispatched (the work cpu_free() chose, delivered again).
    pub fn cpu_granted(&self, cpu: usize) -> bool {
        self.granted[cpu]
    }

    /// The work cpu_free() handed `cpu` to has run (or given it up): the grant ends.
    pub fn cpu_ungrant(&mut self, cpu: usize) {
        self.granted[cpu] = false;
    }

    pub fn schedule(&mut self, at: Time, ev: Event) {
        self.events.push(at, ev);
    }

    /// Add the DMA layer of another domain (its IOMMU a stand-in until lent). Returns its index.
    pub fn add_domain(&mut self, layer: DmaLayer) -> usize {
        self.others.push(layer);
        self.others.len()
    }

    /// DMA domains on this host.
    pub fn domains(&self) -> usize {
        1 + self.others.len()
    }

    fn layer(&mut self, d: usize) -> &mut DmaLayer {
        if d == 0 {
            &mut self.dma
        } else {
            &mut self.others[d - 1]
        }
    }

    /// Hand the IOMMU to domain `d`'s layer (the layer that had it takes `d`'s stand-in) and return it.
    pub fn lend(&mut self, d: usize) -> &mut DmaLayer {
        let from = self.iommu_at;
        if from != d {
            let (a, b) = (from.min(d), from.max(d));
            let (lo, hi) = if a == 0 {
                (&mut self.dma, &mut self.others[b - 1])
            } else {
                let (x, y) = self.others.split_at_mut(b - 1);
                (&mut x[a - 1], &mut y[0])
            };
            std::mem::swap(&mut lo.core.iommu, &mut hi.core.iommu);
            self.iommu_at = d;
        }
        self.layer(d)
    }

    /// Every domain's layer, the first one first (it holds the IOMMU once `lend(0)` ran).
    pub fn layers(&self) -> impl Iterator<Item = &DmaLayer> {
        std::iter::once(&self.dma).chain(self.others.iter())
    }

    /// Every domain's layer, mutably.
    pub fn layers_mut(&mut self) -> impl Iterator<Item = &mut DmaLayer> {
        std::iter::once(&mut self.dma).chain(self.others.iter_mut())
    }

    fn take_timer_request(&mut self) {
        let d = self.iommu_at;
        if let Some((at, cpu)) = self.layer(d).core.timer_request.take() {
            self.events.push(
                at,
                Event::DmaTimer {
                    cpu: cpu as u32,
                    dom: d as u16,
                },
            );
        }
    }

    /// dma_map_page() for a device of domain `d`.
    pub fn dma_map_in(
        &mut self,
        d: usize,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        let r = self.lend(d).map(now, cpu, phys_pfn, pages);
        self.take_timer_request();
        r
    }

    /// A page_pool page (DMA_FROM_DEVICE, DMA_ATTR_SKIP_CPU_SYNC: page_pool_dma_map) of the first domain's
    /// device: (DMA pfn, release time). The driver syncs each frame it reads (`dma_sync_for_cpu`).
    pub fn dma_map_rx_page(&mut self, now: Time, cpu: usize, phys_pfn: u64) -> Option<(u64, Time)> {
        let dir = crate::scenario::MapDir::FromDevice;
        let r = self.dma_map_attrs_in(0, now, cpu, phys_pfn, 0, crate::hw::PAGE_SIZE, dir, true);
        r.map(|(dma, _, t)| (dma, t))
    }

    /// dma_map_page_attrs() of `bytes` at byte `offset` of page `phys_pfn`, direction `dir`, for a device of
    /// domain `d`: (DMA pfn, pages, release time); where dma-direct bounces (swiotlb), a copy in its pool.
    /// `skip_cpu_sync`: DMA_ATTR_SKIP_CPU_SYNC.
    #[allow(clippy::too_many_arguments)]
    pub fn dma_map_attrs_in(
        &mut self,
        d: usize,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        offset: u64,
        bytes: u64,
        dir: crate::scenario::MapDir,
        skip_cpu_sync: bool,
    ) -> Option<(u64, u64, Time)> {
        let r = self
            .lend(d)
            .map_attrs(now, cpu, phys_pfn, offset, bytes, dir, skip_cpu_sync);
        self.take_timer_request();
        r
    }

    /// dma_sync_single_range_for_cpu() of `bytes` a device of the first domain wrote (a received frame):
    /// the release time (a bounced page's copy back; nothing otherwise).
    pub fn dma_sync_for_cpu(&mut self, now: Time, bytes: u64) -> Time {
        // No IOMMU work: the layer need not hold the IOMMU (bouncing has one domain, validated).
        self.dma.sync_for_cpu(now, bytes)
    }

    /// dma_map_page() for the first domain's device ([`Host::dma_map_attrs_in`] without attributes).
    pub fn dma_map_dir(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        offset: u64,
        bytes: u64,
        dir: crate::scenario::MapDir,
    ) -> Option<(u64, u64, Time)> {
        self.dma_map_attrs_in(0, now, cpu, phys_pfn, offset, bytes, dir, false)
    }

    /// dma_alloc_coherent()'s mapping of `pages` at `phys_pfn` (a ring, a descriptor table): (DMA pfn,
    /// release time). Never bounced; a confidential guest converts the pages to shared.
    pub fn dma_alloc_coherent(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        let r = self.lend(0).alloc_coherent(now, cpu, phys_pfn, pages);
        self.take_timer_request();
        r
    }

    /// dma_unmap_page() for a device of domain `d`.
    pub fn dma_unmap_in(
        &mut self,
        d: usize,
        now: Time,
        cpu: usize,
        dma_pfn: u64,
        pages: u64,
    ) -> Time {
        let t = self.lend(d).unmap_desc(now, cpu, &[(dma_pfn, pages)]);
        self.take_timer_request();
        t
    }

    /// The driver of a device of domain `d` ended a batch of unmaps.
    pub fn dma_batch_end_in(&mut self, d: usize, now: Time, cpu: usize) -> Time {
        self.lend(d).batch_end(now, cpu)
    }

    /// A device of domain `d` reads or writes the data page at `iova_pfn`: (latency, fault), as
    /// [`Host::dma_page`].
    pub fn dma_access_in(&mut self, d: usize, now: Time, iova_pfn: u64) -> (u64, bool) {
        self.lend(d).data_access(iova_pfn);
        self.dma_page(now, iova_pfn)
    }

    /// dma_map_page() on `cpu` at `now`: (DMA address pfn, release time), None if IOVA space is exhausted.
    pub fn dma_map(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        self.dma_map_in(0, now, cpu, phys_pfn, pages)
    }

    /// FANDS' block mapping of an RX WQE's pages: (IOVA pfn of the block, release time).
    pub fn dma_map_block(&mut self, now: Time, cpu: usize, phys: &[u64]) -> Option<(u64, Time)> {
        self.lend(0).map_block(now, cpu, phys)
    }

    /// The driver ended a batch of unmaps (a NAPI poll, a TX completion batch): the release time.
    pub fn dma_batch_end(&mut self, now: Time, cpu: usize) -> Time {
        self.lend(0).batch_end(now, cpu)
    }

    /// dma_unmap_page() on `cpu` at `now`: the release time.
    pub fn dma_unmap(&mut self, now: Time, cpu: usize, dma_pfn: u64, pages: u64) -> Time {
        self.dma_unmap_desc(now, cpu, &[(dma_pfn, pages)])
    }

    /// Unmap the segments `(dma pfn, pages)` of one completed descriptor.
    pub fn dma_unmap_desc(&mut self, now: Time, cpu: usize, segs: &[(u64, u64)]) -> Time {
        let t = self.lend(0).unmap_desc(now, cpu, segs);
        self.take_timer_request();
        t
    }

    /// Device side of one DMA page: the latency its translation adds to the write (the PCIe base; with
    /// ATS, nothing more on an ATC hit and a translation-request round trip on a miss; one memory read per
    /// page-walk level the walk caches did not cover) and whether it faulted.
    pub fn dma_page(&mut self, now: Time, iova_pfn: u64) -> (u64, bool) {
        // Through the domain that holds the IOMMU: the one the device's last DMA-layer call lent it to.
        let tr = self.layer(self.iommu_at).translate(now, iova_pfn);
        let pcie = &self.platform.pcie;
        let base = pcie.dma_base_ns;
        match tr {
            None => (base, false),
            Some(tr) => {
                let ats = if tr.ats_request {
                    pcie.ats_request_ns
                } else {
                    0
                };
                let mut reads = tr.walk_reads as u64;
                // Nested: every stage-1 table access, and the output address, is a stage-2 lookup.
                if let Some(h) = self.platform.hypervisor.as_ref().filter(|h| h.nested) {
                    if reads > 0 {
                        reads += (reads + 1) * h.nested_s2_reads as u64;
                    }
                }
                let walk = reads * self.platform.memory.walk_read_ns;
                (base + ats + walk, tr.fault())
            }
        }
    }

    /// A software device (the VMM's or vhost's thread) reads or writes the guest page at `iova_pfn`: the
    /// translation its IOMMU lookup made (None: no translation, the device uses guest-physical addresses).
    pub fn sw_translate(&mut self, now: Time, iova_pfn: u64) -> Option<crate::hw::Translation> {
        self.lend(0).data_access(iova_pfn);
        self.layer(self.iommu_at).translate(now, iova_pfn)
    }

    /// The emulator's software walk of the guest's page table behind translation `tr`: its reads (none for
    /// virtio-iommu, whose device looks its mappings up in a tree: virtio_iommu_translate's g_tree_lookup).
    pub fn emulator_walk_ns(&self, tr: &crate::hw::Translation) -> u64 {
        if self.platform.vendor.driver().walks_tables() {
            tr.walk_reads as u64 * self.platform.memory.walk_read_ns
        } else {
            0
        }
    }

    /// A vhost or vhost-user device-IOTLB miss sent at `asked` for translation `tr`: QEMU reads the message
    /// in its main loop and translates under the BQL (vhost_device_iotlb_miss →
    /// address_space_get_iotlb_entry), behind any vCPU's trapped IOMMU handler, and sends the update back.
    /// Returns when the update is back, and how long the request waited for the BQL.
    pub fn vhost_iotlb_miss(&mut self, asked: Time, tr: &crate::hw::Translation) -> (Time, u64) {
        let walk = self.emulator_walk_ns(tr);
        let h = self.platform.host_kvm();
        let (miss, qemu) = (h.vhost_iotlb_miss_ns, h.qemu_translate_ns + walk);
        let wait = self
            .bql_serve(asked, qemu)
            .map_or(0, |(start, _)| start - asked);
        (asked + wait + miss + walk, wait)
    }

    /// Entries in the software device's IOTLB (vhost's, vhost-user's: the platform's ATC).
    pub fn sw_iotlb_len(&mut self) -> usize {
        self.layer(self.iommu_at).core.iommu.translator().atc_len()
    }

    /// The emulated IOMMU caches translations in an IOTLB of its own (QEMU's hash; virtio-iommu has none).
    pub fn emulator_iotlb(&mut self) -> bool {
        let tr = self.lend(0).core.iommu.translator();
        tr.qemu_iotlb().is_some_and(|h| h.entries() > 0)
    }

    /// When work reaching QEMU's big lock at `at` can start (None: no emulated IOMMU shares it).
    pub fn bql_free(&mut self, at: Time) -> Option<Time> {
        self.lend(0).core.iommu.bql().map(|b| b.start_for(at))
    }

    /// Hold QEMU's big lock from `at` for `work` ns (QEMU's device models in its main loop): (start, end).
    pub fn bql_serve(&mut self, at: Time, work: u64) -> Option<(Time, Time)> {
        self.lend(0).core.iommu.bql().map(|b| b.serve(at, work))
    }

    /// The device's MSI writes are translated by the IOMMU.
    pub fn msi_translated(&mut self) -> bool {
        self.lend(0).core.iommu.translates_msi()
    }

    /// Device side of a descriptor or completion-entry access: only what its translation adds (ATS round
    /// trip, page-walk reads), not the per-packet DMA base; and whether it faulted.
    pub fn dma_translation(&mut self, now: Time, iova_pfn: u64) -> (u64, bool) {
        let (lat, fault) = self.dma_page(now, iova_pfn);
        (lat - self.platform.pcie.dma_base_ns, fault)
    }

    /// Run domain `dom`'s DMA-layer timer on its CPU.
    pub fn run_dma_timer(&mut self, now: Time, cpu: usize, dom: usize) {
        let ev = Event::DmaTimer {
            cpu: cpu as u32,
            dom: dom as u16,
        };
        if !self.cpu_acquire(cpu, now, ev, Ctx::Softirq) {
            return;
        }
        let end = self.lend(dom).timer(now, cpu);
        self.cpus[cpu].account(now, end);
        self.take_timer_request();
    }
}
