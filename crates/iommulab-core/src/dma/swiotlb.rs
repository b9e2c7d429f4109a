//! swiotlb: bounce buffering through a pool of shared slots (kernel/dma/swiotlb.c). A device that may not
//! reach a buffer (a confidential guest's private memory, `swiotlb=force`, a DMA mask below it) is handed a
//! copy in the pool instead: swiotlb_tbl_map_single() finds free slots under its area's lock and copies the
//! buffer in; swiotlb_tbl_unmap_single() copies it back for a device-written buffer and frees the slots.
//! A freed slot keeps its data, readable by the host and the device, until a later mapping overwrites it.
//!
//! Slots are `IO_TLB_SIZE` (2 KiB) in segments of `IO_TLB_SEGSIZE` (128); `list[i]` is the number of free
//! slots from `i` to the end of its segment, as the kernel's `io_tlb_slot.list`. A bounced mapping's DMA
//! address is its first slot: page number `SWIOTLB_DMA_BASE + slot` (the model's DMA addresses are page
//! numbers, and two 2 KiB slots share a page).

use crate::kernel::KernelVersion;
use crate::scenario::MapDir;
use crate::sim::{Coherence, LockStats, SpinLock, Time};
use std::collections::HashMap;

/// IO_TLB_SHIFT (include/linux/swiotlb.h): a slot is 2 KiB.
pub const IO_TLB_SHIFT: u32 = 11;
pub const IO_TLB_SIZE: u64 = 1 << IO_TLB_SHIFT;
/// IO_TLB_SEGSIZE: 128 slots, the largest single mapping (256 KiB).
pub const IO_TLB_SEGSIZE: u64 = 128;
/// IO_TLB_DEFAULT_SIZE: the pool's 64 MiB unless `swiotlb=` or the architecture says otherwise.
pub const IO_TLB_DEFAULT_SIZE: u64 = 64 << 20;
/// IO_TLB_MIN_SLABS (kernel/dma/swiotlb.c): 1 MiB of slots, the smallest pool a dynamic allocation makes.
const IO_TLB_MIN_SLABS: u64 = (1 << 20) >> IO_TLB_SHIFT;
const PAGE_SIZE: u64 = crate::hw::PAGE_SIZE;
/// Where bounce slots sit among the model's DMA page numbers: slot `i` is `SWIOTLB_DMA_BASE + i`, above
/// any physical page a profile has.
pub const SWIOTLB_DMA_BASE: u64 = 1 << 44;

/// The pool as the kernel sets it up (swiotlb_init_remap, swiotlb_adjust_size, swiotlb_adjust_nareas).
#[derive(Debug, Clone, PartialEq)]
pub struct SwiotlbConfig {
    /// Slots of the default pool (nslabs).
    pub slots: u64,
    /// Areas, each with its own lock (1 before 6.0).
    pub areas: u32,
    /// CONFIG_SWIOTLB_DYNAMIC: grow instead of failing when full (6.6+).
    pub dynamic: bool,
    /// The device's dma_get_min_align_mask(): low address bits a bounce slot keeps from the original
    /// (NVMe: NVME_CTRL_PAGE_SIZE - 1).
    pub min_align_mask: u64,
    /// The most slots dynamic growth may reach (the memory it allocates from).
    pub max_slots: u64,
    /// CONFIG_DEBUG_FS: every map adds to one global `total_used` and may raise `used_hiwater`
    /// (inc_used_and_hiwater), atomics on a line every CPU writes.
    pub debugfs: bool,
    pub costs: SwiotlbCosts,
}

/// What a bounce costs the CPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwiotlbCosts {
    /// swiotlb_map() and swiotlb_tbl_map_single() beyond the slot search and the copy: the checks, the
    /// area lock taken and released, the slots' bookkeeping; the same again for the release.
    pub op_ns: u64,
    /// One slot looked at by the search (swiotlb_search_pool_area's loop) or written by the allocation or
    /// the release (`list`, `orig_addr`, `alloc_size`).
    pub slot_ns: u64,
    /// swiotlb_bounce()'s memcpy, per byte, between the buffer and the shared slots.
    pub copy_ns_per_byte: f64,
    /// The uncontended lock.
    pub lock_ns: u64,
    pub coh: Coherence,
}

impl SwiotlbConfig {
    /// The default pool for `cpus` CPUs and `memory_bytes` of RAM: `size_bytes` if `swiotlb=` gave one,
    /// else 64 MiB, or in a confidential x86 guest 6 % of memory clamped to [64 MiB, 1 GiB]
    /// (mem_encrypt_setup_arch, arch/x86/mm/mem_encrypt.c). `areas` 0: one per possible CPU.
    pub fn pool(
        kernel: KernelVersion,
        size_bytes: Option<u64>,
        areas: u32,
        cpus: u32,
        coco_sizing: bool,
        memory_bytes: u64,
    ) -> (u64, u32) {
        let mut nslabs = match size_bytes {
            // setup_io_tlb_npages: ALIGN(slabs, IO_TLB_SEGSIZE).
            Some(b) => (b >> IO_TLB_SHIFT).div_ceil(IO_TLB_SEGSIZE) * IO_TLB_SEGSIZE,
            None if coco_sizing => {
                // swiotlb_adjust_size: ALIGN(size >> IO_TLB_SHIFT, IO_TLB_SEGSIZE).
                let size = (memory_bytes * 6 / 100).clamp(IO_TLB_DEFAULT_SIZE, 1 << 30);
                (size.div_ceil(IO_TLB_SIZE)).div_ceil(IO_TLB_SEGSIZE) * IO_TLB_SEGSIZE
            }
            None => IO_TLB_DEFAULT_SIZE >> IO_TLB_SHIFT,
        };
        nslabs = nslabs.max(IO_TLB_SEGSIZE);
        if !kernel.swiotlb_areas() {
            return (nslabs, 1);
        }
        // swiotlb_adjust_nareas(num_possible_cpus()): a power of two, and round_up_default_nslabs: at
        // least a segment per area, and a power of two.
        let nareas = (if areas == 0 { cpus } else { areas })
            .max(1)
            .next_power_of_two();
        if nslabs < IO_TLB_SEGSIZE * nareas as u64 {
            nslabs = IO_TLB_SEGSIZE * nareas as u64;
        }
        nslabs = nslabs.next_power_of_two();
        // limit_nareas: no area smaller than a segment.
        let nareas = if nslabs < nareas as u64 * IO_TLB_SEGSIZE {
            (nslabs / IO_TLB_SEGSIZE) as u32
        } else {
            nareas
        };
        (nslabs, nareas)
    }
}

/// Counts (cumulative; diffed between snapshots).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SwiotlbStats {
    /// swiotlb_map() calls: the `swiotlb_bounced` tracepoint, which fires before the slots are looked for.
    pub bounces: u64,
    /// Bytes swiotlb_bounce() copied, in and back.
    pub bounced_bytes: u64,
    /// Copies made (swiotlb_bounce calls that moved data).
    pub copies: u64,
    /// Maps that found no slots: "swiotlb buffer is full" (or a mapping larger than a segment).
    pub full_events: u64,
    /// Maps refused for being larger than a segment (swiotlb_find_slots: alloc_size > IO_TLB_SEGSIZE slots).
    pub too_large: u64,
    /// Slots in use now, and the most in use at once (debugfs io_tlb_used, io_tlb_used_hiwater).
    pub used_slots: u64,
    pub high_water_slots: u64,
    /// Slots of every pool (the default pool's, and those added by dynamic growth).
    pub pool_slots: u64,
    /// Transient pools made for one mapping each (CONFIG_SWIOTLB_DYNAMIC), and pools added by the
    /// background worker (swiotlb_dyn_alloc).
    pub transient_pools: u64,
    pub pools_added: u64,
    /// Slots the searches looked at.
    pub slots_searched: u64,
}

/// One area: its lock and where its next search starts (struct io_tlb_area).
#[derive(Debug)]
struct Area {
    used: u64,
    index: u64,
    lock: SpinLock,
}

/// One pool (struct io_tlb_pool): slots [base, base + nslabs) of the model's slot numbers.
#[derive(Debug)]
struct Pool {
    base: u64,
    list: Vec<u16>,
    area_nslabs: u64,
    areas: Vec<Area>,
}

impl Pool {
    fn new(base: u64, nslabs: u64, nareas: u32, coh: Coherence) -> Self {
        // swiotlb_init_io_tlb_pool: list[i] = IO_TLB_SEGSIZE - io_tlb_offset(i).
        let list = (0..nslabs)
            .map(|i| (IO_TLB_SEGSIZE - i % IO_TLB_SEGSIZE) as u16)
            .collect();
        let nareas = nareas.max(1) as u64;
        Pool {
            base,
            list,
            area_nslabs: nslabs / nareas,
            areas: (0..nareas)
                .map(|_| Area {
                    used: 0,
                    index: 0,
                    lock: SpinLock::new(coh),
                })
                .collect(),
        }
    }
}

/// A live mapping: its pool (None: a transient pool of its own), its slots, the bytes mapped and the
/// direction.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    pool: Option<usize>,
    nslots: u64,
    bytes: u64,
    dir: MapDir,
    /// Mapped with DMA_ATTR_SKIP_CPU_SYNC: its unmap copies nothing back (the driver synced what it read).
    skip_cpu_sync: bool,
}

/// The swiotlb of one device's DMA layer (its `io_tlb_mem`).
#[derive(Debug)]
pub struct Swiotlb {
    cfg: SwiotlbConfig,
    pools: Vec<Pool>,
    next_base: u64,
    maps: HashMap<u64, Mapping>,
    /// `total_used` / `used_hiwater` (CONFIG_DEBUG_FS): one line every map and unmap writes.
    used_line: SpinLock,
    /// A background pool addition pending (mem->dyn_alloc scheduled), ready at this time.
    growing: Option<Time>,
    pub stats: SwiotlbStats,
}

/// Why a bounce failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// No free run of slots fits ("swiotlb buffer is full").
    Full,
    /// Larger than a segment: no pool can ever hold it.
    TooLarge,
}

/// The background worker's allocation of a new pool (swiotlb_dyn_alloc: alloc_pages, set_memory_decrypted
/// in a confidential guest): when the pool is ready after it is asked for. Estimate, 0.1-10 ms: a workqueue
/// wake-up and a contiguous allocation of up to 4 MiB (its page-state change too in a confidential guest);
/// no figure is published. Only when the pool grows does it matter (the transient pool serves meanwhile).
const DYN_ALLOC_NS: u64 = 1_000_000;
/// The largest pool swiotlb_dyn_alloc adds: SLABS_PER_PAGE << MAX_PAGE_ORDER, 4 MiB with x86's 4 KiB pages
/// (swiotlb_alloc_pool).
const DYN_POOL_MAX_SLABS: u64 = 2 << 10;

impl Swiotlb {
    pub fn new(cfg: SwiotlbConfig) -> Self {
        let coh = cfg.costs.coh;
        let pool = Pool::new(0, cfg.slots, cfg.areas, coh);
        let stats = SwiotlbStats {
            pool_slots: cfg.slots,
            ..Default::default()
        };
        Swiotlb {
            next_base: cfg.slots,
            pools: vec![pool],
            maps: HashMap::new(),
            used_line: SpinLock::new(coh),
            growing: None,
            stats,
            cfg,
        }
    }

    /// swiotlb_max_mapping_size(): the largest mapping that fits a segment, less the alignment padding.
    pub fn max_mapping_bytes(&self) -> u64 {
        let pad = if self.cfg.min_align_mask > 0 {
            (self.cfg.min_align_mask + 1).next_multiple_of(IO_TLB_SIZE)
        } else {
            0
        };
        IO_TLB_SEGSIZE * IO_TLB_SIZE - pad
    }

    /// swiotlb_map() of `bytes` at byte `offset` of a page, `dir`, by `cpu` at `now`: the DMA page number of
    /// the first bounce slot, the slots, and the release time; or why it failed and when the CPU gave up.
    /// Whatever the slots held before is overwritten by the copy in. `skip_cpu_sync`: mapped with
    /// DMA_ATTR_SKIP_CPU_SYNC, so the unmap copies nothing back (the map's copy is made regardless).
    pub fn map(
        &mut self,
        now: Time,
        cpu: usize,
        offset: u64,
        bytes: u64,
        dir: MapDir,
        skip_cpu_sync: bool,
    ) -> Result<(u64, u64, Time), (Full, Time)> {
        self.stats.bounces += 1;
        let c = self.cfg.costs;
        let mut t = now + c.op_ns;
        // swiotlb_align_offset(dev, 0, orig_addr): the original's low bits within a slot; a higher bit of
        // min_align_mask (NVMe's bit 11) is kept by the slot the search picks, not by padding.
        let pad = offset & self.cfg.min_align_mask & (IO_TLB_SIZE - 1);
        let alloc = bytes.max(1) + pad;
        if alloc > IO_TLB_SEGSIZE * IO_TLB_SIZE {
            self.stats.full_events += 1;
            self.stats.too_large += 1;
            return Err((Full::TooLarge, t));
        }
        self.add_ready_pool(t);
        let found = self.find_slots(t, cpu, offset, alloc);
        let (pool, slot, t2) = match found {
            Ok(x) => x,
            Err(t2) => match self.grow(t2, alloc) {
                Some(x) => x,
                None => {
                    self.stats.full_events += 1;
                    return Err((Full::Full, t2));
                }
            },
        };
        t = t2;
        let nslots = alloc.div_ceil(IO_TLB_SIZE);
        let first = pool.map_or(slot, |p| self.pools[p].base + slot);
        t = self.used(t, cpu, nslots as i64);
        // The copy in, whatever the direction ("Reinstate some of "swiotlb: rework "fix info leak with
        // DMA_FROM_DEVICE""", 901c7280ca0d, 5.18, in every stable series from 4.9.y on): a device that
        // writes part of a buffer leaves the rest as it was.
        t = self.copy(t, bytes);
        self.maps.insert(
            first,
            Mapping {
                pool,
                nslots,
                bytes,
                dir,
                skip_cpu_sync,
            },
        );
        Ok((SWIOTLB_DMA_BASE + first, nslots, t))
    }

    /// swiotlb_tbl_unmap_single() of the mapping at DMA page `dma_pfn`: the copy back for a device-written
    /// buffer, then swiotlb_release_slots() under the area's lock. Returns the release time and the slots,
    /// whose data stays in shared memory until a later mapping overwrites it; None for an address this
    /// pool did not hand out.
    pub fn unmap(&mut self, now: Time, cpu: usize, dma_pfn: u64) -> Option<(Time, u64)> {
        let first = dma_pfn.checked_sub(SWIOTLB_DMA_BASE)?;
        let m = self.maps.remove(&first)?;
        let c = self.cfg.costs;
        let mut t = now + c.op_ns;
        if m.dir.from_device() && !m.skip_cpu_sync {
            t = self.copy(t, m.bytes);
        }
        match m.pool {
            // swiotlb_del_transient: the pool goes with its one mapping.
            None => self.stats.pool_slots -= m.nslots,
            Some(pi) => {
                let p = &mut self.pools[pi];
                let local = first - p.base;
                let ai = (local / p.area_nslabs).min(p.areas.len() as u64 - 1) as usize;
                let merged = release_slots(&mut p.list, local, m.nslots);
                let hold = c.lock_ns + (m.nslots + merged) * c.slot_ns;
                let area = &mut p.areas[ai];
                t = area.lock.lock_on(t, cpu as u32, hold).1;
                area.used -= m.nslots;
            }
        }
        t = self.used(t, cpu, -(m.nslots as i64));
        Some((t, m.nslots))
    }

    /// swiotlb_sync_single_for_cpu() of `bytes` the device wrote (dma_sync_single_range_for_cpu of a received
    /// frame): copied back from the slots.
    pub fn sync_for_cpu(&mut self, now: Time, bytes: u64) -> Time {
        self.copy(now, bytes)
    }

    /// swiotlb_bounce(): a memcpy of `bytes`.
    fn copy(&mut self, t: Time, bytes: u64) -> Time {
        self.stats.copies += 1;
        self.stats.bounced_bytes += bytes;
        t + (bytes as f64 * self.cfg.costs.copy_ns_per_byte).round() as u64
    }

    /// inc_used_and_hiwater / dec_used: the pool's use, and with CONFIG_DEBUG_FS the atomics on its line.
    fn used(&mut self, t: Time, cpu: usize, delta: i64) -> Time {
        self.stats.used_slots = self.stats.used_slots.saturating_add_signed(delta);
        self.stats.high_water_slots = self.stats.high_water_slots.max(self.stats.used_slots);
        if self.cfg.debugfs {
            self.used_line.rmw_on(t, cpu as u32)
        } else {
            t
        }
    }

    /// swiotlb_find_slots(): this CPU's area first (raw_smp_processor_id() & (nareas - 1)), then the next
    /// ones in turn, in every pool. Ok((pool, slot in pool, time)); Err(time) when none fits.
    fn find_slots(
        &mut self,
        now: Time,
        cpu: usize,
        offset: u64,
        alloc: u64,
    ) -> Result<(Option<usize>, u64, Time), Time> {
        let mut t = now;
        let nareas = self.pools[0].areas.len();
        for i in 0..nareas {
            for pi in 0..self.pools.len() {
                let n = self.pools[pi].areas.len();
                if i >= n {
                    continue;
                }
                let (found, t2) = self.search_area(t, cpu, pi, (cpu + i) & (n - 1), offset, alloc);
                t = t2;
                if let Some(slot) = found {
                    return Ok((Some(pi), slot, t));
                }
            }
        }
        Err(t)
    }

    /// swiotlb_search_pool_area(): under the area's lock, from its `index`, the first slot aligned as the
    /// request needs whose free run (`list`) holds it. Returns (slot in pool, time).
    fn search_area(
        &mut self,
        now: Time,
        cpu: usize,
        pi: usize,
        ai: usize,
        offset: u64,
        alloc: u64,
    ) -> (Option<u64>, Time) {
        let c = self.cfg.costs;
        let min_align = self.cfg.min_align_mask;
        let p = &mut self.pools[pi];
        let nslots = alloc.div_ceil(IO_TLB_SIZE);
        // Streaming mappings of a page or more are page-aligned when nothing else asks (historic rule).
        let mut align = if min_align == 0 && alloc >= PAGE_SIZE {
            PAGE_SIZE - 1
        } else {
            0
        };
        align |= IO_TLB_SIZE - 1;
        let iotlb_align = min_align & !align;
        let stride = (align.max(iotlb_align) >> IO_TLB_SHIFT) + 1;
        let area_n = p.area_nslabs;
        let slot_base = ai as u64 * area_n;
        let area = &p.areas[ai];
        let (mut index, used) = (area.index, area.used);
        let mut checked = 0u64;
        let mut found = None;
        if nslots <= area_n - used {
            while checked < area_n {
                let slot = slot_base + index;
                let addr = (p.base + slot) << IO_TLB_SHIFT;
                if addr & align != 0 || (addr & iotlb_align) != (offset & iotlb_align) {
                    index = wrap(index + 1, area_n);
                    checked += 1;
                    continue;
                }
                if p.list[slot as usize] as u64 >= nslots {
                    found = Some(slot);
                    break;
                }
                index = wrap(index + stride, area_n);
                checked += stride;
            }
        }
        self.stats.slots_searched += checked + 1;
        let mut hold = c.lock_ns + (checked + 1) * c.slot_ns;
        if let Some(slot) = found {
            hold += allocate_slots(&mut p.list, slot, nslots) * c.slot_ns;
            let area = &mut p.areas[ai];
            area.index = wrap(index + nslots, area_n);
            area.used += nslots;
        }
        let t = p.areas[ai].lock.lock_on(now, cpu as u32, hold).1;
        (found, t)
    }

    /// The background pool asked for earlier, once ready (swiotlb_dyn_alloc → add_mem_pool).
    fn add_ready_pool(&mut self, now: Time) {
        if self.growing.is_some_and(|at| at <= now) {
            self.growing = None;
            let n = self.cfg.slots.clamp(IO_TLB_MIN_SLABS, DYN_POOL_MAX_SLABS);
            let base = self.next_base.next_multiple_of(IO_TLB_SEGSIZE);
            let pool = Pool::new(base, n, self.cfg.areas, self.cfg.costs.coh);
            self.next_base = base + n;
            self.stats.pool_slots += n;
            self.stats.pools_added += 1;
            self.pools.push(pool);
        }
    }

    /// CONFIG_SWIOTLB_DYNAMIC, when every area is full: schedule the background worker for a new pool (up
    /// to `max_slots` in all) and make a transient pool of just this mapping's slots (swiotlb_alloc_pool
    /// with GFP_NOWAIT). Returns (None, its first slot number, time).
    fn grow(&mut self, now: Time, alloc: u64) -> Option<(Option<usize>, u64, Time)> {
        let nslots = alloc.div_ceil(IO_TLB_SIZE);
        let room = self.cfg.max_slots.saturating_sub(self.stats.pool_slots);
        if !self.cfg.dynamic || room < nslots {
            return None;
        }
        if self.growing.is_none() && room >= DYN_POOL_MAX_SLABS + nslots {
            self.growing = Some(now + DYN_ALLOC_NS);
        }
        // A pool of its own, page-aligned.
        let first = self.next_base.next_multiple_of(IO_TLB_SEGSIZE);
        self.next_base = first + nslots;
        self.stats.transient_pools += 1;
        self.stats.pool_slots += nslots;
        Some((None, first, now + self.cfg.costs.op_ns))
    }

    /// Where the next search of `cpu`'s area in the default pool starts (its `index`).
    pub fn next_index(&self, cpu: usize) -> u64 {
        let p = &self.pools[0];
        p.areas[cpu & (p.areas.len() - 1)].index
    }

    /// Set where the next search of `cpu`'s area in the default pool starts.
    pub fn set_next_index(&mut self, cpu: usize, index: u64) {
        let p = &mut self.pools[0];
        let n = p.areas.len();
        p.areas[cpu & (n - 1)].index = index;
    }

    /// A replay's mapping as the kernel made it: `bytes` at slot `slot` of the default pool. Any mapping the
    /// model holds over those slots is released first (the kernel's shows them free: their unmaps were not
    /// traced), the slots are taken and their area's next search starts after them, as
    /// swiotlb_search_pool_area() leaves it. Returns the mapping's DMA page number and the DMA page numbers
    /// of the mappings released; None if the slots are not the default pool's or cross a segment.
    pub fn occupy(
        &mut self,
        now: Time,
        cpu: usize,
        slot: u64,
        bytes: u64,
        dir: MapDir,
        skip_cpu_sync: bool,
    ) -> Option<(u64, Vec<u64>)> {
        let nslots = bytes.max(1).div_ceil(IO_TLB_SIZE);
        let p = &self.pools[0];
        if slot + nslots > p.list.len() as u64
            || slot / IO_TLB_SEGSIZE != (slot + nslots - 1) / IO_TLB_SEGSIZE
        {
            return None;
        }
        let mut over: Vec<u64> = self
            .maps
            .iter()
            .filter(|(&f, m)| m.pool == Some(0) && f < slot + nslots && f + m.nslots > slot)
            .map(|(&f, _)| f)
            .collect();
        over.sort_unstable();
        for &f in &over {
            self.unmap(now, cpu, SWIOTLB_DMA_BASE + f);
        }
        let p = &mut self.pools[0];
        allocate_slots(&mut p.list, slot, nslots);
        let area_n = p.area_nslabs;
        let ai = ((slot / area_n) as usize).min(p.areas.len() - 1);
        let area = &mut p.areas[ai];
        area.index = wrap(slot % area_n + nslots, area_n);
        area.used += nslots;
        self.used(now, cpu, nslots as i64);
        self.maps.insert(
            slot,
            Mapping {
                pool: Some(0),
                nslots,
                bytes,
                dir,
                skip_cpu_sync,
            },
        );
        let released = over.into_iter().map(|f| SWIOTLB_DMA_BASE + f).collect();
        Some((SWIOTLB_DMA_BASE + slot, released))
    }

    /// The areas' locks, summed, and the used-count line.
    pub fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        let areas = self.pools.iter().flat_map(|p| p.areas.iter());
        let n = areas.clone().count();
        let mut v = vec![(
            "swiotlb area locks",
            LockStats::sum_of(areas.map(|a| &a.lock.stats), n),
        )];
        if self.cfg.debugfs {
            v.push(("swiotlb total_used", self.used_line.stats.clone()));
        }
        v
    }
}

fn wrap(index: u64, n: u64) -> u64 {
    if index >= n {
        0
    } else {
        index
    }
}

/// The allocation's bookkeeping in swiotlb_search_pool_area(): the run's slots become used and the free
/// slots before it in its segment count only up to it. Returns the slots written.
fn allocate_slots(list: &mut [u16], slot: u64, nslots: u64) -> u64 {
    let (s, n) = (slot as usize, nslots as usize);
    for l in &mut list[s..s + n] {
        *l = 0;
    }
    let mut count = 0u16;
    let mut i = s;
    while i > 0 && (i - 1) as u64 % IO_TLB_SEGSIZE != IO_TLB_SEGSIZE - 1 && list[i - 1] != 0 {
        count += 1;
        list[i - 1] = count;
        i -= 1;
    }
    nslots + count as u64
}

/// swiotlb_release_slots(): the slots become free, merged with the free run after them in the segment and
/// then with the one before. Returns the slots before it that were rewritten.
fn release_slots(list: &mut [u16], slot: u64, nslots: u64) -> u64 {
    let (s, n) = (slot as usize, nslots as usize);
    let end = s + n;
    let mut count = if !(end as u64).is_multiple_of(IO_TLB_SEGSIZE) && end < list.len() {
        list[end]
    } else {
        0
    };
    for i in (s..end).rev() {
        count += 1;
        list[i] = count;
    }
    let mut merged = 0;
    let mut i = s;
    while i > 0 && (i - 1) as u64 % IO_TLB_SEGSIZE != IO_TLB_SEGSIZE - 1 && list[i - 1] != 0 {
        count += 1;
        list[i - 1] = count;
        merged += 1;
        i -= 1;
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> SwiotlbCosts {
        SwiotlbCosts {
            op_ns: 50,
            slot_ns: 2,
            copy_ns_per_byte: 0.1,
            lock_ns: 10,
            coh: Coherence {
                cluster_cores: 4,
                socket_cores: 8,
                cluster_ns: 40,
                socket_ns: 60,
                remote_ns: 120,
            },
        }
    }

    fn tlb(slots: u64, areas: u32) -> Swiotlb {
        Swiotlb::new(SwiotlbConfig {
            slots,
            areas,
            dynamic: false,
            max_slots: 1 << 20,
            min_align_mask: 0,
            debugfs: true,
            costs: costs(),
        })
    }

    /// `list` as the kernel keeps it: each free slot counts the free run to its segment's end.
    fn check_list(p: &Pool) {
        for (i, &l) in p.list.iter().enumerate() {
            if l == 0 {
                continue;
            }
            let seg_end = (i as u64 / IO_TLB_SEGSIZE + 1) * IO_TLB_SEGSIZE;
            let run = (i as u64..seg_end)
                .take_while(|&j| p.list[j as usize] != 0)
                .count() as u16;
            assert_eq!(l, run, "slot {i}");
        }
    }

    #[test]
    fn a_mapping_larger_than_a_segment_fails_as_the_kernels_does() {
        let mut s = tlb(32768, 4);
        assert_eq!(s.max_mapping_bytes(), 256 << 10);
        assert!(s.map(0, 0, 0, 256 << 10, MapDir::ToDevice, false).is_ok());
        let e = s
            .map(0, 0, 0, (256 << 10) + 1, MapDir::ToDevice, false)
            .unwrap_err();
        assert_eq!(e.0, Full::TooLarge);
        assert_eq!(
            (s.stats.bounces, s.stats.full_events, s.stats.too_large),
            (2, 1, 1)
        );
        // NVMe's min_align_mask keeps the page offset: a full segment less its padding.
        let mut n = tlb(32768, 4);
        n.cfg.min_align_mask = 4095;
        assert_eq!(n.max_mapping_bytes(), (256 << 10) - 4096);
        // The padding is the offset within a slot (swiotlb_align_offset: & (IO_TLB_SIZE - 1)); the offset's
        // bit 11 is kept by an odd slot, so the largest mapping the kernel advertises fits at any offset.
        let (d, slots, _) = n
            .map(0, 0, 2560, (256 << 10) - 4096, MapDir::FromDevice, false)
            .unwrap();
        assert_eq!((d - SWIOTLB_DMA_BASE) % 2, 1);
        assert_eq!(slots, 127);
        let e = n
            .map(0, 0, 2560, (256 << 10) - 511, MapDir::FromDevice, false)
            .unwrap_err();
        assert_eq!(e.0, Full::TooLarge);
    }

    #[test]
    fn slots_are_used_and_freed_as_the_kernels_free_lists_say() {
        let mut s = tlb(1024, 2);
        let mut live = Vec::new();
        for (i, bytes) in [1500u64, 4096, 9000, 64 << 10, 100, 2048, 2049]
            .iter()
            .enumerate()
        {
            let (d, _, _) = s
                .map(i as u64 * 10, i % 2, 0, *bytes, MapDir::FromDevice, false)
                .unwrap();
            live.push(d);
            check_list(&s.pools[0]);
        }
        // A page or more starts on a page (two slots).
        for (d, bytes) in live.iter().zip([1500u64, 4096, 9000, 64 << 10]) {
            if bytes >= 4096 {
                assert_eq!((d - SWIOTLB_DMA_BASE) % 2, 0, "{bytes}");
            }
        }
        let used = s.stats.used_slots;
        assert_eq!(used, 1 + 2 + 5 + 32 + 1 + 1 + 2);
        for d in live {
            s.unmap(1000, 0, d).unwrap();
            check_list(&s.pools[0]);
        }
        assert_eq!(s.stats.used_slots, 0);
        assert_eq!(s.stats.high_water_slots, used);
        assert!(s.pools[0]
            .list
            .iter()
            .enumerate()
            .all(|(i, &l)| l as u64 == IO_TLB_SEGSIZE - i as u64 % IO_TLB_SEGSIZE));
        assert!(s.unmap(1000, 0, SWIOTLB_DMA_BASE + 5).is_none());
    }

    #[test]
    fn every_map_copies_in_and_a_device_written_buffer_copies_back() {
        let mut s = tlb(1024, 1);
        let (d, _, _) = s.map(0, 0, 0, 1500, MapDir::FromDevice, false).unwrap();
        s.unmap(10, 0, d).unwrap();
        let (d, _, _) = s.map(20, 0, 0, 1000, MapDir::ToDevice, false).unwrap();
        s.unmap(30, 0, d).unwrap();
        let (d, _, _) = s.map(40, 0, 0, 700, MapDir::Bidirectional, false).unwrap();
        s.unmap(50, 0, d).unwrap();
        assert_eq!(
            (s.stats.copies, s.stats.bounced_bytes),
            (5, 1500 * 2 + 1000 + 700 * 2)
        );
        // A page_pool page (DMA_ATTR_SKIP_CPU_SYNC): copied in at map, each frame synced for the CPU, nothing
        // copied back at unmap.
        let (d, _, _) = s.map(60, 0, 0, 4096, MapDir::FromDevice, true).unwrap();
        s.sync_for_cpu(70, 1514);
        s.unmap(80, 0, d).unwrap();
        assert_eq!(
            (s.stats.copies, s.stats.bounced_bytes),
            (7, 5400 + 4096 + 1514)
        );
    }

    #[test]
    fn a_filled_pool_fails_until_slots_come_back() {
        let mut s = tlb(256, 2);
        let mut live = Vec::new();
        while let Ok((d, _, _)) = s.map(0, 0, 0, 4096, MapDir::FromDevice, false) {
            live.push(d);
        }
        // The CPU's own area, then the next: the whole pool.
        assert_eq!(live.len(), 128);
        assert_eq!(s.stats.full_events, 1);
        s.unmap(10, 1, live[0]).unwrap();
        assert!(s.map(20, 1, 0, 4096, MapDir::FromDevice, false).is_ok());
    }

    #[test]
    fn dynamic_swiotlb_grows_where_the_kernel_has_it() {
        let mut s = tlb(256, 1);
        s.cfg.dynamic = true;
        for _ in 0..128 {
            s.map(0, 0, 0, 4096, MapDir::ToDevice, false).unwrap();
        }
        // Full: a transient pool for this one mapping, and a new pool asked for in the background.
        let (d, _, _) = s.map(10, 0, 0, 4096, MapDir::ToDevice, false).unwrap();
        assert_eq!((s.stats.transient_pools, s.stats.pools_added), (1, 0));
        assert_eq!(s.stats.pool_slots, 256 + 2);
        s.unmap(20, 0, d).unwrap();
        assert_eq!(s.stats.pool_slots, 256);
        // Once the worker's pool is in, maps land there.
        assert!(s
            .map(2 * DYN_ALLOC_NS, 0, 0, 4096, MapDir::ToDevice, false)
            .is_ok());
        assert_eq!((s.stats.transient_pools, s.stats.pools_added), (1, 1));
        assert_eq!(s.stats.pool_slots, 256 + IO_TLB_MIN_SLABS);
    }

    #[test]
    fn an_areas_lock_contends_as_cpus_grow() {
        // CPUs mapping at the same instants: with one area every CPU waits on one lock; with one area
        // per CPU (6.0+) none does.
        let spin = |areas: u32, cpus: usize| {
            let mut s = tlb(1 << 15, areas);
            for round in 0..50u64 {
                for cpu in 0..cpus {
                    let (d, _, _) = s
                        .map(round * 10_000, cpu, 0, 1500, MapDir::FromDevice, false)
                        .unwrap();
                    s.unmap(round * 10_000 + 5_000, cpu, d).unwrap();
                }
            }
            s.lock_stats()[0].1.wait_ns
        };
        let one = [1usize, 2, 4, 8].map(|n| spin(1, n));
        assert!(one.windows(2).all(|w| w[0] < w[1]), "{one:?}");
        assert_eq!(spin(8, 8), 0);
    }

    #[test]
    fn the_pool_is_sized_as_the_kernel_sizes_it() {
        let k = KernelVersion(6, 12);
        // 64 MiB and one area per CPU.
        assert_eq!(
            SwiotlbConfig::pool(k, None, 0, 4, false, 16 << 30),
            (32768, 4)
        );
        // A confidential guest of 16 GiB: 6 % is 983 MiB, rounded up to a power of two of slots (1 GiB).
        assert_eq!(
            SwiotlbConfig::pool(k, None, 0, 4, true, 16 << 30),
            (1 << 19, 4)
        );
        // Capped at 1 GiB, at least 64 MiB.
        assert_eq!(
            SwiotlbConfig::pool(k, None, 0, 4, true, 64 << 30).0,
            1 << 19
        );
        assert_eq!(SwiotlbConfig::pool(k, None, 0, 4, true, 512 << 20).0, 32768);
        // swiotlb=: 8 MiB, areas limited to a segment each; before 6.0 one lock.
        assert_eq!(
            SwiotlbConfig::pool(k, Some(256 << 10), 0, 8, false, 1 << 30),
            (1024, 8)
        );
        assert_eq!(
            SwiotlbConfig::pool(k, Some(128 << 10), 0, 8, false, 1 << 30),
            (1024, 8)
        );
        assert_eq!(
            SwiotlbConfig::pool(KernelVersion(5, 15), Some(128 << 10), 0, 8, false, 1 << 30),
            (128, 1)
        );
    }
}
