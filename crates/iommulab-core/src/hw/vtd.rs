//! Intel VT-d: second-level page table, IOTLB and paging-structure caches (shared [`Translator`]), and queued
//! invalidation as drivers/iommu/intel/cache.c and dmar.c drive it: PSI with address mask, DSI, global and
//! device-TLB descriptors gathered into batches of up to 16 (qi_batch) and submitted with a wait descriptor
//! through one hardware queue, all under the domain's cache_lock; caching mode and RWBF after maps.

use super::cache::{PsiMatch, QemuIotlb};
use super::driver::{Column, Driver, Emulation, KernelDriver, Switch};
use super::emul::{hash_scan_ns, ExitCause, ExitStats, Shadow, Trap, BQL};
use super::translator::{CacheInval, Translator};
use super::{DomainId, DomainLocks, InvClass, InvKind, Iommu, IotlbGather};
use super::{HypervisorProfile, IommuProfile, Platform, PtFormat, Vendor};
use crate::kernel::{Arch, KernelVersion};
use crate::sim::{
    Coherence, FifoServer, LockStats, PerCpu, SpinLock, Time, QSPINLOCK_HANDOFF_TRANSFERS,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// VT-d's invalidation descriptors (spec §6.5.2), as the driver names them.
pub const PSI: InvKind = InvKind::new(0, "psi", InvClass::Range);
pub const DSI: InvKind = InvKind::new(1, "dsi", InvClass::Domain);
pub const GLOBAL: InvKind = InvKind::new(2, "global", InvClass::Global);
pub const DEVTLB: InvKind = InvKind::new(3, "devtlb", InvClass::DevTlb);
pub const CONTEXT_CACHE: InvKind = InvKind::new(4, "context_cache", InvClass::Config);
pub const WBF: InvKind = InvKind::new(5, "wbf", InvClass::WriteBuffer);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VtdProfile {
    /// Hardware time to process one IOTLB invalidation descriptor.
    pub inv_desc_ns: u64,
    /// Hardware time to process a wait descriptor (status write back).
    pub inv_wait_ns: u64,
    /// CPU time to write one descriptor into the queue under the queue lock.
    pub submit_desc_ns: u64,
    /// Largest PSI address mask (CAP.MAMV); larger ranges fall back to DSI.
    pub mamv: u32,
    /// CAP.CM: caching mode (virtual IOMMUs): maps need an invalidation too.
    pub caching_mode: bool,
    /// CAP.RWBF: the write buffer must be flushed after a map when no invalidation is required.
    pub rwbf: bool,
    /// Hardware time of one write-buffer flush (GCMD.WBF until GSTS.WBFS clears).
    pub wbf_ns: u64,
    /// CPU time per cache tag when a flush walks the domain's tags under its cache_lock (6.10+).
    pub cache_tag_ns: u64,
    /// What a page-selective invalidation with IH=0 drops from the paging-structure caches.
    #[serde(default)]
    pub psi_nonleaf: PsiNonLeaf,
    /// The DMA domains use first-stage tables: scalable mode with ECAP.FLTS (QEMU's
    /// `x-scalable-mode=on,x-flts=on`), which the kernel then picks for DMA domains from 5.6
    /// (first_level_by_default), as it does for a nested domain's guest stage (intel/nested.c). Caching mode
    /// covers only second-stage updates (VT-d spec §6.1), so a map invalidates nothing.
    #[serde(default)]
    pub first_stage: bool,
}

/// The paging-structure-cache entries a PSI with IH=0 invalidates (VT-d spec §6.5.2.3, IOTLB Invalidate
/// Descriptor, IH; an implementation may invalidate at a coarser granularity than requested).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PsiNonLeaf {
    /// Only the non-leaf entries used to translate the ADDR/AM range (what the spec requires).
    #[default]
    Range,
    /// Every non-leaf entry of the domain, the leaf entries of the range only (Intel server IIO).
    Domain,
}

/// intel/iommu.h QI_MAX_BATCHED_DESC_COUNT: descriptors gathered before a qi_submit_sync().
pub const QI_MAX_BATCHED_DESC_COUNT: usize = 16;

/// One invalidation descriptor (VT-d spec §6.5.2: IOTLB invalidate G/DID/ADDR/AM/IH; device-TLB invalidate;
/// context-cache invalidate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvDesc {
    /// Page-selective-within-domain: 2^am pages at `addr_pfn` (aligned); `ih` keeps paging-structure caches.
    Psi {
        dom: DomainId,
        addr_pfn: u64,
        am: u32,
        ih: bool,
    },
    /// Domain-selective.
    Dsi {
        dom: DomainId,
    },
    Global,
    /// Device-TLB (ATS) invalidation of 2^am pages at `addr_pfn`, or the whole ATC (`am` None).
    DevTlb {
        dom: DomainId,
        addr_pfn: u64,
        am: Option<u32>,
    },
    /// Device-selective context-cache invalidation.
    ContextCache,
}

/// drivers/iommu/intel/cache.c calculate_psi_aligned_address(): the smallest naturally aligned power-of-two
/// block holding [start, start + pages). Returns (aligned base pfn, address mask AM).
pub fn psi_aligned(start_pfn: u64, pages: u64) -> (u64, u32) {
    let aligned = pages.max(1).next_power_of_two();
    let bitmask = aligned - 1;
    let mut mask = aligned.trailing_zeros();
    if bitmask & start_pfn != 0 {
        let end_pfn = start_pfn + pages - 1;
        let shared = !(start_pfn ^ end_pfn) & !bitmask;
        mask = if shared != 0 {
            shared.trailing_zeros()
        } else {
            64
        };
    }
    let base = if mask >= 64 {
        0
    } else {
        start_pfn & !((1u64 << mask) - 1)
    };
    (base, mask)
}

pub struct Vtd {
    cfg: VtdProfile,
    tr: Translator,
    kernel: KernelVersion,
    /// The device's ATS invalidation completion time (device-TLB descriptors wait for it).
    ats_inv_ns: u64,
    /// dmar_domain->cache_lock per domain: held across a flush's submissions and their waits.
    cache_lock: DomainLocks,
    /// qi->q_lock (one line with the queue's indices): descriptors are written one CPU at a time, and
    /// every CPU waiting for its wait descriptor polls its status with the lock held, dropping it only
    /// around cpu_relax() (dmar.c qi_submit_sync).
    q_lock: SpinLock,
    /// Per CPU, its last wait-descriptor poll: (from, until its status is written). A CPU polls one at a
    /// time (interrupts off).
    pollers: PerCpu<(Time, Time)>,
    coh: Coherence,
    /// The uncontended lock cost (the pollers' turn on q_lock).
    lock_ns: u64,
    /// The invalidation hardware: it processes the queue's descriptors in the order they were written.
    hw: FifoServer,
    /// qi_flush_iotlb() takes IH from bit 6 of the address (the F&S / FANDS dmar.c change), whatever the
    /// kernel version.
    psi_ih_patched: bool,
    /// In a guest: the tail write exits to the VMM, whose handler is the "hardware" (`hw`: its work under
    /// the BQL, at the profile's per-descriptor costs).
    trap: Option<Trap>,
    /// A VFIO device in that guest: QEMU shadows the guest's mappings into the host IOMMU.
    shadow: Option<Shadow>,
}

impl Vtd {
    /// The DMA domain uses first-stage tables (the profile's `first_stage`, on a kernel that uses them).
    fn first_stage(&self) -> bool {
        self.cfg.first_stage && self.kernel.vtd_first_stage_dma()
    }

    pub fn new(
        p: &IommuProfile,
        tr: Translator,
        ats_inv_ns: u64,
        kernel: KernelVersion,
        coh: Coherence,
        lock_ns: u64,
    ) -> Self {
        Vtd {
            cfg: p
                .vtd
                .clone()
                .expect("validated: vendor vtd has [iommu.vtd]"),
            tr,
            kernel,
            ats_inv_ns,
            cache_lock: DomainLocks::new(coh),
            q_lock: SpinLock::new(coh),
            pollers: PerCpu::default(),
            coh,
            lock_ns,
            hw: FifoServer::default(),
            psi_ih_patched: false,
            trap: None,
            shadow: None,
        }
    }

    /// The same IOMMU emulated by a hypervisor (QEMU's intel_iommu), when `trap` is given; `shadow` when a
    /// VFIO device sits behind it.
    pub fn emulated(mut self, trap: Option<Trap>, shadow: Option<Shadow>) -> Self {
        self.trap = trap;
        self.shadow = shadow.filter(|_| self.trap.is_some());
        self
    }

    /// QEMU's shadow sync for the descriptors a handler processes (vtd_iotlb_page_invalidate_notify): the
    /// emulator's ns.
    fn shadow_ns(&mut self, descs: &[InvDesc]) -> u64 {
        let (Some(sh), Some(trap)) = (self.shadow.as_mut(), self.trap.as_mut()) else {
            return 0;
        };
        descs
            .iter()
            .map(|d| match *d {
                InvDesc::Psi {
                    dom, addr_pfn, am, ..
                } => sh.sync(&mut trap.stats, &self.tr, dom, addr_pfn, 1u64 << am.min(63)),
                InvDesc::Dsi { dom } => sh.sync_all(&mut trap.stats, &self.tr, dom),
                _ => 0,
            })
            .sum()
    }

    /// Hardware time to process one descriptor.
    fn desc_ns(&self, d: &InvDesc) -> u64 {
        match d {
            // The device must answer the ATS invalidation before the wait descriptor can complete.
            InvDesc::DevTlb { .. } => self.cfg.inv_desc_ns + self.ats_inv_ns,
            // QEMU drops IOTLB entries by walking its whole hash (vtd_iotlb_page_invalidate,
            // vtd_iotlb_domain_invalidate: g_hash_table_foreach_remove), so a flush costs more the fuller it is.
            InvDesc::Psi { .. } | InvDesc::Dsi { .. } => {
                self.cfg.inv_desc_ns + hash_scan_ns(self.trap.as_ref(), &self.tr)
            }
            _ => self.cfg.inv_desc_ns,
        }
    }

    /// Count a descriptor and hand its effect on the translation caches over for `at`, when the hardware
    /// processes it.
    fn apply(&mut self, at: Time, d: InvDesc) {
        let inv = match d {
            InvDesc::Psi {
                dom,
                addr_pfn,
                am,
                ih,
            } => {
                self.tr.c.count(PSI, 1);
                // IH=0 on an IIO that drops the domain's non-leaf entries: the range's leaves, then every
                // walk-cache entry of the domain.
                let domain_wide = !ih && self.cfg.psi_nonleaf == PsiNonLeaf::Domain;
                let range = CacheInval::Range {
                    dom,
                    pfn: addr_pfn,
                    n: 1u64 << am.min(63),
                    leaf_only: ih || domain_wide,
                };
                self.tr.invalidate(at, range);
                if !domain_wide {
                    return;
                }
                CacheInval::WalkCaches { dom }
            }
            InvDesc::Dsi { dom } => {
                self.tr.c.count(DSI, 1);
                CacheInval::Domain { dom }
            }
            InvDesc::Global => {
                self.tr.c.count(GLOBAL, 1);
                CacheInval::All
            }
            InvDesc::DevTlb { dom, addr_pfn, am } => {
                self.tr.c.count(DEVTLB, 1);
                let range = am.map(|am| (addr_pfn, 1u64 << am.min(63)));
                CacheInval::Atc { dom, range }
            }
            InvDesc::ContextCache => {
                self.tr.c.count(CONTEXT_CACHE, 1);
                return;
            }
        };
        self.tr.invalidate(at, inv);
    }

    /// dmar.c qi_submit_sync() on `cpu`: write the descriptors and a wait descriptor under q_lock, ring
    /// the tail, then poll the wait descriptor's status with q_lock held, dropping it around cpu_relax().
    /// A submitter queues on q_lock behind one turn of every CPU still polling (qspinlock is FIFO and a
    /// poller re-queues after each release); the poller that sees QI_DONE frees its slots under the lock.
    /// Returns the release time.
    pub fn qi_submit_sync(&mut self, now: Time, cpu: u32, descs: &[InvDesc]) -> Time {
        let n = descs.len() as u64 + 1;
        let ahead = self
            .pollers
            .iter()
            .enumerate()
            .filter(|&(c, &(from, done))| from <= now && now < done && c as u32 != cpu)
            .count() as u64;
        let mut t = now;
        if ahead > 0 {
            // The pollers' turns ahead of this CPU: each a queued hand-off of the lock word (taken between
            // cores of the socket) and a status check.
            let turn = self.lock_ns + QSPINLOCK_HANDOFF_TRANSFERS * self.coh.socket_ns;
            t = self.q_lock.acquire(t, ahead * turn).1;
        }
        let (_, written) = self.q_lock.lock_on(t, cpu, n * self.cfg.submit_desc_ns);
        // The hardware drains the queue in order, one descriptor after another.
        let work: u64 = descs.iter().map(|d| self.desc_ns(d)).sum::<u64>()
            + self.cfg.inv_wait_ns
            + self.shadow_ns(descs)
            + self.trap.as_ref().map_or(0, Trap::handler_ns);
        // In a guest the tail write exits, with q_lock held, to QEMU's vtd_handle_iqt_write(), which
        // processes every descriptor and the wait's status write before the vCPU re-enters.
        let arrive = self.trap.as_ref().map_or(written, |tr| tr.exit(written));
        let (_, done) = self.hw.serve(arrive, work);
        let done = match self.trap.as_mut() {
            Some(tr) => {
                let back = tr.resume(ExitCause::QiTail, written, done, work, n);
                self.q_lock.extend(written, back);
                back
            }
            None => done,
        };
        // The hardware reaches each descriptor in turn; the wait descriptor completes after the last.
        let mut at = done - work;
        for &d in descs {
            at += self.desc_ns(&d);
            self.apply(at, d);
        }
        // A trapped vCPU holds q_lock through its exit (extended above) and finds QI_DONE on return.
        if cpu != crate::sim::NO_CPU && self.trap.is_none() {
            *self.pollers.get_mut(cpu as usize) = (written, done);
        }
        self.tr.c.syncs += 1;
        self.tr.c.submissions += 1;
        // The poll that sees QI_DONE holds q_lock; reclaim_free_desc() and the unlock follow.
        self.q_lock.lock_on(done, cpu, self.lock_ns).1
    }

    /// iommu.c iommu_flush_write_buffer(): GCMD.WBF and wait, on hardware with CAP.RWBF; a no-op elsewhere.
    fn flush_write_buffer(&mut self, now: Time) -> Time {
        if !self.cfg.rwbf {
            return now;
        }
        self.tr.c.count(WBF, 1);
        let (_, done) = self.hw.serve(now, self.cfg.wbf_ns);
        self.tr.c.inv_wait_ns += done - now;
        done
    }

    /// A domain flush. 6.12+ (cache.c with qi_batch): under the domain's cache_lock, the descriptors in batches
    /// of QI_MAX_BATCHED_DESC_COUNT, each batch submitted and waited for. 6.10–6.11: under the cache_lock, one
    /// submission per descriptor. Before 6.10 (iommu_flush_iotlb_psi + iommu_flush_dev_iotlb): one submission
    /// per descriptor and no domain lock.
    fn flush_descs(&mut self, now: Time, cpu: u32, dom: DomainId, descs: &[InvDesc]) -> Time {
        if descs.is_empty() {
            return now;
        }
        let per_submit = if self.kernel.vtd_qi_batch() {
            QI_MAX_BATCHED_DESC_COUNT
        } else {
            1
        };
        let locked = self.kernel.vtd_cache_tags();
        let start = if locked {
            self.cache_lock.get(dom).lock_on(now, cpu, 0).0
        } else {
            now
        };
        let mut t = start;
        for batch in descs.chunks(per_submit) {
            t = self.qi_submit_sync(t, cpu, batch);
        }
        if locked {
            self.cache_lock.get(dom).extend(start, t);
        }
        self.tr.c.inv_wait_ns += t - now;
        t
    }

    /// cache_tag_flush_range(): the IOTLB tag's PSI for the aligned block (DSI when the mask exceeds MAMV),
    /// then the device-TLB tag's descriptor for the same block.
    /// `range`: (first pfn, pages).
    fn flush_range(
        &mut self,
        now: Time,
        cpu: u32,
        dom: DomainId,
        range: (u64, u64),
        ih: bool,
        devtlb: bool,
    ) -> Time {
        let (start_pfn, pages) = range;
        let (base, am) = psi_aligned(start_pfn, pages);
        let mut descs = Vec::with_capacity(2);
        descs.push(if am > self.cfg.mamv {
            InvDesc::Dsi { dom }
        } else {
            InvDesc::Psi {
                dom,
                addr_pfn: base,
                am,
                ih,
            }
        });
        if devtlb && self.tr.has_atc() {
            descs.push(InvDesc::DevTlb {
                dom,
                addr_pfn: base,
                am: (am < 64).then_some(am),
            });
        }
        self.flush_descs(now, cpu, dom, &descs)
    }
}

impl Iommu for Vtd {
    fn name(&self) -> &'static str {
        "vtd"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        &[PSI, DSI, GLOBAL, DEVTLB, CONTEXT_CACHE, WBF]
    }

    fn translator(&self) -> &Translator {
        &self.tr
    }

    fn translator_mut(&mut self) -> &mut Translator {
        &mut self.tr
    }

    /// q_lock, every domain's cache_lock, and the invalidation queue.
    fn exit_stats(&self) -> Option<ExitStats> {
        self.trap.as_ref().map(|t| t.stats)
    }

    fn bql(&mut self) -> Option<&mut FifoServer> {
        // QEMU's vtd_handle_iqt_write runs in the trapping vCPU's thread under the BQL: the queue is it.
        self.trap.is_some().then_some(&mut self.hw)
    }

    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        vec![
            ("vt-d qi q_lock", self.q_lock.stats.clone()),
            ("vt-d domain cache_lock", self.cache_lock.stats(&self.tr)),
            (
                if self.trap.is_some() {
                    BQL
                } else {
                    "vt-d invalidation queue"
                },
                self.hw.stats.clone(),
            ),
        ]
    }

    fn unmap_pages(
        &mut self,
        now: Time,
        _cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> (u64, Time) {
        // Freed table pages wait for the sync (IH=0 then), unlike io-pgtable-arm's immediate flush_walk.
        (self.tr.unmap(dom, iova_pfn, n, gather), now)
    }

    fn iotlb_sync_map(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
    ) -> Time {
        // intel_iommu_iotlb_sync_map → cache_tag_flush_range_np(): a PSI (no device-TLB) in caching mode
        // for a second-stage domain (__mapping_notify_one before 6.10), else iommu_flush_write_buffer(), a
        // no-op unless CAP.RWBF. 6.10–6.16 walk the domain's cache tags under its cache_lock even then (one
        // IOTLB tag, and a device-TLB tag with ATS).
        let cm_flush = self.cfg.caching_mode && !self.first_stage();
        if !cm_flush && !self.cfg.rwbf && self.kernel.vtd_sync_map_walk() {
            let tags = 1 + self.tr.has_atc() as u64;
            let hold = self.cfg.cache_tag_ns * tags;
            return self.cache_lock.get(dom).lock_on(now, cpu as u32, hold).1;
        }
        if cm_flush {
            self.flush_range(now, cpu as u32, dom, (iova_pfn, n), false, false)
        } else {
            self.flush_write_buffer(now)
        }
    }

    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        // intel_iommu_tlb_sync(): IH only when no page-table pages were freed, and before 6.18 the hint never
        // reached the descriptor (qi_desc_iotlb() built it with IH = 0).
        let ih = g.freed_tables == 0 && (self.kernel.vtd_psi_ih() || self.psi_ih_patched);
        self.flush_range(now, cpu as u32, dom, (g.start, g.pages()), ih, true)
    }

    fn honour_psi_ih(&mut self) {
        self.psi_ih_patched = true;
    }

    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // cache_tag_flush_all(): DSI, and the whole device TLB. Before 6.10 intel_flush_iotlb_all() skipped
        // the device TLB under caching mode.
        let mut descs = vec![InvDesc::Dsi { dom }];
        if self.tr.has_atc() && (self.kernel.vtd_cache_tags() || !self.cfg.caching_mode) {
            descs.push(InvDesc::DevTlb {
                dom,
                addr_pfn: 0,
                am: None,
            });
        }
        self.flush_descs(now, cpu as u32, dom, &descs)
    }

    fn attach_dev(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // domain_context_mapping_one(): with caching mode the context entry change is invalidated
        // (device-selective context cache, then DSI); otherwise only the write buffer may need a flush.
        if self.cfg.caching_mode {
            let t = self.qi_submit_sync(now, cpu as u32, &[InvDesc::ContextCache]);
            self.qi_submit_sync(t, cpu as u32, &[InvDesc::Dsi { dom }])
        } else {
            self.flush_write_buffer(now)
        }
    }
}

/// The VT-d driver (drivers/iommu/intel/) and its hardware.
pub struct VtdDriver;

impl KernelDriver for VtdDriver {
    fn name(&self) -> &'static str {
        "vtd"
    }
    fn title(&self) -> &'static str {
        "Intel VT-d"
    }
    fn archs(&self) -> &'static [Arch] {
        &[Arch::X86_64]
    }
    fn arch_expected(&self) -> &'static str {
        "expected x86_64: the platform's IOMMU is Intel VT-d"
    }
    fn param(&self) -> Option<&'static str> {
        Some("intel_iommu")
    }
    // intel/iommu.c intel_iommu_setup(): "strict" is deprecated but still sets strict; "off".
    fn switch(&self, opt: &str, _k: KernelVersion) -> Option<Switch> {
        match opt {
            "strict" => Some(Switch::Strict(
                "DMAR: intel_iommu=strict deprecated; use iommu.strict=1",
            )),
            "off" => Some(Switch::Off(Some("DMAR: IOMMU disabled"))),
            _ => None,
        }
    }
    fn caching_mode_cap(&self) -> Option<&'static str> {
        Some("CAP.CM")
    }
    // intel_iommu_init(): a caching-mode IOMMU makes every DMA domain strict.
    fn strict_under_caching_mode(&self, _k: KernelVersion) -> Option<(&'static str, &'static str)> {
        Some((
            "DMAR: IOMMU batching disallowed due to virtualization",
            "caching mode (a virtual VT-d): IOMMU batching disallowed due to virtualization",
        ))
    }
}

impl Driver for VtdDriver {
    fn vendor(&self) -> Vendor {
        Vendor::Vtd
    }
    fn pt_format(&self, p: &IommuProfile) -> Result<PtFormat, (&'static str, String)> {
        if p.granule_kb != 4 {
            return Err(("granule_kb", "expected 4: VT-d pages are 4 KiB".into()));
        }
        PtFormat::vtd(p.ias_bits, p.large_pages).map_err(|m| ("ias_bits", m))
    }
    fn check(&self, p: &IommuProfile, _guest: bool) -> Result<(), (&'static str, String)> {
        let Some(v) = &p.vtd else {
            return Err((
                "vtd",
                "expected an [iommu.vtd] section for vendor \"vtd\"".into(),
            ));
        };
        if v.mamv > 63 {
            return Err((
                "vtd.mamv",
                "expected an address-mask limit of 0..=63".into(),
            ));
        }
        Ok(())
    }
    fn caching_mode(&self, p: &IommuProfile) -> bool {
        p.vtd.as_ref().is_some_and(|v| v.caching_mode)
    }
    fn caching_mode_key(&self) -> Option<&'static str> {
        Some("vtd.caching_mode")
    }
    // QEMU before 9.1 matched a PSI against its IOTLB hash by the low byte of the address mask.
    fn qemu_iotlb(&self, h: &HypervisorProfile, entries: u32) -> QemuIotlb<(u64, u64)> {
        let fixed = h.qemu_version().is_some_and(|v| v >= (9, 1));
        let m = if fixed {
            PsiMatch::Range
        } else {
            PsiMatch::LowByte
        };
        QemuIotlb::new(entries as usize, m)
    }
    fn build(
        &self,
        p: &Platform,
        _cpus: usize,
        kernel: KernelVersion,
        tr: Translator,
        emu: Emulation,
    ) -> Box<dyn Iommu> {
        let mut v = Vtd::new(
            &p.iommu,
            tr,
            p.pcie.ats_inv_ns,
            kernel,
            p.cpu.coherence(),
            p.cpu.lock_ns,
        );
        // A nested vIOMMU's guest stage is the first stage (intel/nested.c: use_first_level).
        v.cfg.first_stage |= p.hypervisor.as_ref().is_some_and(|h| h.nested);
        Box::new(v.emulated(emu.trap, emu.shadow))
    }
    fn replay_profile(&self) -> (&'static str, Arch) {
        ("vtd-server", Arch::X86_64)
    }
    // QEMU's vtd_inv_desc_iotlb_pages / _domain / _global, vtd_inv_desc_wait, vtd_inv_desc_dev_tlb.
    fn replay_columns(&self) -> &'static [(&'static str, Column)] {
        &[
            ("iotlb_psi", Column::Class(InvClass::Range)),
            ("iotlb_dsi", Column::Class(InvClass::Domain)),
            ("iotlb_global", Column::Class(InvClass::Global)),
            ("wait", Column::Syncs),
            ("devtlb", Column::Class(InvClass::DevTlb)),
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::hw::LATER;

    /// A small VT-d configuration for unit tests across the crate.
    pub(crate) fn cfg() -> IommuProfile {
        IommuProfile {
            iotlb_entries: 64,
            iotlb_ways: 4,
            pwc_entries: vec![16, 16, 16],
            pwc_ways: 0,
            ias_bits: 48,
            granule_kb: 4,
            large_pages: true,
            shadow_on_flush: false,
            vtd: Some(VtdProfile {
                inv_desc_ns: 400,
                inv_wait_ns: 200,
                submit_desc_ns: 40,
                mamv: 9,
                caching_mode: false,
                rwbf: false,
                wbf_ns: 300,
                cache_tag_ns: 30,
                psi_nonleaf: PsiNonLeaf::Range,
                first_stage: false,
            }),
            smmuv3: None,
            virtio: None,
            amdvi: None,
            riscv: None,
        }
    }

    /// A VT-d with the profile's format, and an ATC of `atc` entries when given.
    pub(crate) fn vtd_with(p: &IommuProfile, atc: Option<u32>) -> Vtd {
        let fmt = crate::hw::Vendor::Vtd.driver().pt_format(p).unwrap();
        let tr = Translator::new(p, fmt, atc.map(|n| (n, n)));
        Vtd::new(p, tr, 1000, KernelVersion(6, 12), Coherence::default(), 10)
    }

    pub(crate) fn vtd(p: &IommuProfile) -> Vtd {
        vtd_with(p, None)
    }

    #[test]
    fn psi_mask_for_unaligned_three_pages() {
        // pfn 0x1005..0x1007: 3 pages → 4 aligned would be 0x1004..0x1007, which holds it: AM 2.
        assert_eq!(psi_aligned(0x1005, 3), (0x1004, 2));
        // pfn 0x1007..0x1009 crosses an 8-page boundary: AM grows to 4 (0x1000..0x100f).
        assert_eq!(psi_aligned(0x1007, 3), (0x1000, 4));
        assert_eq!(psi_aligned(0x2000, 1), (0x2000, 0));
    }

    #[test]
    fn mask_above_mamv_falls_back_to_dsi() {
        let mut v = vtd(&cfg());
        let mut g = IotlbGather::new();
        v.map_pages(1, 0, 100, 1024);
        v.unmap_pages(0, 0, 1, 0, 1024, &mut g); // 1024 pages: AM 10 > MAMV 9
        v.iotlb_sync(0, 0, 1, &g);
        assert_eq!((v.tr.c.get(PSI), v.tr.c.get(DSI), v.tr.c.syncs), (0, 1, 1));
    }

    #[test]
    fn psi_up_to_mamv_512_pages_dsi_from_513() {
        // cache_tag_flush_range(): DSI when mask > cap_max_amask_val(cap): with MAMV 9, 512 pages from pfn 0
        // are AM ilog2(512) = 9, a PSI; 513 round up to 1024, AM 10 > 9, a DSI.
        for (pages, psi, dsi) in [(512, 1, 0), (513, 0, 1)] {
            let mut v = vtd(&cfg());
            let mut g = IotlbGather::new();
            v.map_pages(1, 0, 100, pages);
            v.unmap_pages(0, 0, 1, 0, pages, &mut g);
            v.iotlb_sync(0, 0, 1, &g);
            assert_eq!(
                (v.tr.c.get(PSI), v.tr.c.get(DSI), v.tr.c.syncs),
                (psi, dsi, 1),
                "{pages} pages"
            );
        }
    }

    #[test]
    fn walk_caches_cut_reads_and_psi_without_ih_drops_them() {
        let mut v = vtd(&cfg());
        v.map_pages(1, 0x40000, 7, 4);
        let t = v.translate(LATER, 1, 0x40000);
        assert_eq!((t.iotlb_hit, t.walk_reads), (false, 4));
        assert!(v.translate(LATER, 1, 0x40000).iotlb_hit);
        let t = v.translate(LATER, 1, 0x40001); // same leaf table: PDE cached
        assert_eq!(
            (t.walk_reads, t.walk_levels),
            (1, 0b10),
            "only the leaf PTE is read"
        );
        // IH=1 keeps the walk caches, IH=0 drops them.
        v.qi_submit_sync(
            0,
            0,
            &[InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x40002,
                am: 0,
                ih: true,
            }],
        );
        assert_eq!(v.translate(LATER, 1, 0x40002).walk_reads, 1);
        v.qi_submit_sync(
            0,
            0,
            &[InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x40003,
                am: 0,
                ih: false,
            }],
        );
        assert_eq!(v.translate(LATER, 1, 0x40003).walk_reads, 4);
    }

    /// A descriptor acts on the caches when the hardware reaches it, not when the CPU writes it: a device
    /// access in between still hits, and two PSIs sent back to back each drop the walk caches the device
    /// refilled between them.
    #[test]
    fn invalidations_act_when_the_hardware_processes_them() {
        let psi = |pfn| InvDesc::Psi {
            dom: 1,
            addr_pfn: pfn,
            am: 0,
            ih: false,
        };
        let mut v = vtd(&cfg());
        v.map_pages(1, 0x40000, 7, 8);
        v.translate(0, 1, 0x40000);
        let done = v.qi_submit_sync(1_000, 0, &[psi(0x40000)]);
        let desc_ns = cfg().vtd.unwrap().inv_desc_ns;
        // The poll that sees the status takes q_lock (lock_ns 10) before it returns.
        let processed = done - 10 - cfg().vtd.unwrap().inv_wait_ns;
        assert!(processed >= 1_000 + desc_ns);
        assert!(v.translate(processed - 1, 1, 0x40000).iotlb_hit);
        assert!(!v.translate(processed, 1, 0x40000).iotlb_hit);
        // Back to back: the device walks between the two, so each PSI costs it a full walk.
        let first = v.qi_submit_sync(done, 0, &[psi(0x40004)]);
        let second = v.qi_submit_sync(first, 0, &[psi(0x40005)]);
        assert_eq!(v.translate(first, 1, 0x40001).walk_reads, 4);
        assert_eq!(v.translate(first + 1, 1, 0x40002).walk_reads, 1);
        assert_eq!(v.translate(second, 1, 0x40003).walk_reads, 4);
    }

    #[test]
    fn psi_without_ih_drops_other_ranges_walk_entries_only_on_a_domain_level_iio() {
        // Two leaf tables (2 MiB apart), both PDEs cached; a PSI with IH=0 on the first.
        let after_psi = |scope: PsiNonLeaf| {
            let mut p = cfg();
            p.vtd.as_mut().unwrap().psi_nonleaf = scope;
            let mut v = vtd(&p);
            v.map_pages(1, 0x40000, 7, 1024);
            v.translate(LATER, 1, 0x40000);
            v.translate(LATER, 1, 0x40200);
            let psi = InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x40000,
                am: 0,
                ih: false,
            };
            v.qi_submit_sync(0, 0, &[psi]);
            (
                v.translate(LATER, 1, 0x40201).walk_reads,
                v.translate(LATER, 1, 0x40200).iotlb_hit,
            )
        };
        // The spec's minimum keeps the other table's PDE: one read for its leaf PTE.
        assert_eq!(after_psi(PsiNonLeaf::Range), (1, true));
        // The IIO drops every non-leaf entry of the domain: a full walk, but other leaves stay cached.
        assert_eq!(after_psi(PsiNonLeaf::Domain), (4, true));
    }

    #[test]
    fn stale_iotlb_entry_hits_until_invalidated() {
        let mut v = vtd(&cfg());
        v.map_pages(1, 10, 99, 1);
        v.translate(LATER, 1, 10);
        let mut g = IotlbGather::new();
        v.unmap_pages(0, 0, 1, 10, 1, &mut g);
        let t = v.translate(LATER, 1, 10);
        assert!(
            t.iotlb_hit && t.stale && t.phys == Some(99),
            "unmapped, not invalidated: stale hit"
        );
        assert_eq!(v.tr.c.stale_hits, 1);
        v.iotlb_sync(0, 0, 1, &g);
        let t = v.translate(LATER, 1, 10);
        assert!(!t.iotlb_hit && t.fault());
    }

    #[test]
    fn shared_queue_serialises_cpus() {
        // Different domains: no common cache_lock, but one queue and one invalidation engine.
        let mut v = vtd(&cfg());
        let a = v.flush_iotlb_all(0, 0, 1);
        let b = v.flush_iotlb_all(0, 1, 2);
        // Each CPU takes q_lock once more (lock_ns 10) when its poll sees the status.
        assert_eq!(a, 80 + 400 + 200 + 10);
        assert_eq!(
            b,
            a + 600,
            "descriptors written while the first batch runs; processed after it"
        );
    }

    #[test]
    fn in_a_guest_each_tail_write_traps_once_and_holds_q_lock_through_the_exit() {
        let trap = || {
            Some(Trap::new(
                &crate::scenario::tests::hypervisor(),
                &crate::scenario::tests::kvm(),
            ))
        };
        let mut v = vtd(&cfg()).emulated(trap(), None);
        // One submission of 17 descriptors' worth: two batches (16 + 1), each with its wait: two exits.
        let descs: Vec<InvDesc> = (0..17)
            .map(|i| InvDesc::Psi {
                dom: 1,
                addr_pfn: i,
                am: 0,
                ih: false,
            })
            .collect();
        v.flush_descs(0, 0, 1, &descs);
        let st = v.exit_stats().unwrap();
        assert_eq!(st.count, [2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(st.work.inv_processed, 17 + 2);
        // The emulator consumed every descriptor and both waits.
        assert_eq!(st.emulator_ns, 17 * 400 + 2 * 200);
        assert_eq!(v.tr.c.get(PSI), 17);
        // A second CPU's submission waits for q_lock until the first vCPU is back from its exit.
        let mut v = vtd(&cfg()).emulated(trap(), None);
        let a = v.flush_iotlb_all(0, 0, 1);
        let b = v.flush_iotlb_all(0, 1, 2);
        // Write 2 descriptors (80), exit and re-entry (5000), DSI and wait (600), the lock's last turn (10).
        assert_eq!(a, 80 + 5000 + 600 + 10);
        assert!(
            b >= a + 5000 + 600,
            "the second exit starts after the first vCPU released q_lock"
        );
        // Bare metal: no exits.
        assert!(vtd(&cfg()).exit_stats().is_none());
    }

    #[test]
    fn an_emulated_psi_costs_more_the_fuller_qemus_iotlb_is() {
        use crate::hw::cache::{PsiMatch, QemuIotlb};
        // QEMU's PSI walks its whole IOTLB hash: the same descriptor after 500 translations were cached costs
        // 500 entry scans more than on an empty hash.
        let (h, k) = (
            crate::scenario::tests::hypervisor(),
            crate::scenario::tests::kvm(),
        );
        let psi_done = |cached: u64| {
            let p = IommuProfile {
                large_pages: false,
                ..cfg()
            };
            let fmt = crate::hw::Vendor::Vtd.driver().pt_format(&p).unwrap();
            let tr = Translator::new(&p, fmt, None)
                .emulated_iotlb(QemuIotlb::new(1024, PsiMatch::LowByte));
            let mut v = Vtd::new(&p, tr, 1000, KernelVersion(6, 12), Coherence::default(), 10)
                .emulated(Some(Trap::new(&h, &k)), None);
            v.map_pages(1, 0x1000, 0x1000, 1000);
            for i in 0..cached {
                v.translate(0, 1, 0x1000 + i);
            }
            assert_eq!(v.tr.qemu_iotlb().unwrap().len() as u64, cached);
            let psi = InvDesc::Psi {
                dom: 1,
                addr_pfn: 0x1000,
                am: 0,
                ih: false,
            };
            v.flush_descs(0, 0, 1, &[psi])
        };
        assert_eq!(psi_done(500) - psi_done(0), 500 * k.qemu_iotlb_scan_ns);
    }

    #[test]
    fn caching_mode_invalidates_on_map() {
        let mut c = cfg();
        c.vtd.as_mut().unwrap().caching_mode = true;
        let mut v = vtd(&c);
        v.map_pages(1, 5, 5, 1);
        v.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(v.tr.c.get(PSI), 1);
        let mut v = vtd(&cfg());
        v.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(v.tr.c.get(PSI), 0);
    }

    #[test]
    fn a_first_stage_domain_under_caching_mode_invalidates_nothing_on_map() {
        // Scalable mode with first-stage tables (a nested vIOMMU's guest stage): caching mode covers only
        // second-stage updates, and the kernel skips the map-time PSI from 5.6 (first-level DMA domains).
        let mut c = cfg();
        let v_cfg = c.vtd.as_mut().unwrap();
        v_cfg.caching_mode = true;
        v_cfg.first_stage = true;
        let mut v = vtd(&c);
        v.map_pages(1, 5, 5, 1);
        v.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(v.tr.c.get(PSI), 0);
        // The unmap still invalidates (a PASID-based IOTLB invalidation, counted as the range one).
        let mut g = IotlbGather::new();
        v.unmap_pages(0, 0, 1, 5, 1, &mut g);
        v.iotlb_sync(0, 0, 1, &g);
        assert_eq!(v.tr.c.get(PSI), 1);
        // A kernel before first-level DMA domains keeps them second-stage: the map is invalidated.
        let mut old = vtd(&c);
        old.kernel = KernelVersion(5, 4);
        old.map_pages(1, 5, 5, 1);
        old.iotlb_sync_map(0, 0, 1, 5, 1);
        assert_eq!(old.tr.c.get(PSI), 1);
    }

    #[test]
    fn descriptors_go_in_batches_of_16_each_with_a_wait() {
        let mut v = vtd(&cfg());
        let descs: Vec<InvDesc> = (0..20)
            .map(|i| InvDesc::Psi {
                dom: 1,
                addr_pfn: i,
                am: 0,
                ih: true,
            })
            .collect();
        v.flush_descs(0, 0, 1, &descs);
        assert_eq!((v.tr.c.submissions, v.tr.c.syncs), (2, 2));
        assert_eq!(v.tr.c.get(PSI), 20);
    }

    #[test]
    fn ats_device_gets_a_device_tlb_descriptor_in_the_same_batch() {
        let mut v = vtd_with(&cfg(), Some(16));
        v.map_pages(1, 0x40, 9, 1);
        v.translate(LATER, 1, 0x40);
        let mut g = IotlbGather::new();
        v.unmap_pages(0, 0, 1, 0x40, 1, &mut g);
        let t = v.iotlb_sync(0, 0, 1, &g);
        assert_eq!((v.tr.c.get(PSI), v.tr.c.get(DEVTLB)), (1, 1));
        assert_eq!(v.tr.c.syncs, 1, "PSI + device-TLB + one wait descriptor");
        assert_eq!(
            t,
            3 * 40 + 400 + (400 + 1000) + 200 + 10,
            "the wait completes after the device answers"
        );
        assert!(!v.translate(LATER, 1, 0x40).stale);
        // flush_iotlb_all clears the whole device TLB too.
        v.flush_iotlb_all(t, 0, 1);
        assert_eq!(v.tr.c.get(DEVTLB), 2);
    }

    #[test]
    fn rwbf_flushes_the_write_buffer_after_maps_and_caching_mode_invalidates_on_attach() {
        let mut c = cfg();
        c.vtd.as_mut().unwrap().rwbf = true;
        let mut v = vtd(&c);
        assert_eq!(v.iotlb_sync_map(0, 0, 1, 5, 1), 300);
        assert_eq!((v.tr.c.get(WBF), v.tr.c.invalidations()), (1, 0));
        let mut c = cfg();
        c.vtd.as_mut().unwrap().caching_mode = true;
        let mut v = vtd(&c);
        v.attach_dev(0, 0, 1);
        assert_eq!((v.tr.c.get(CONTEXT_CACHE), v.tr.c.get(DSI)), (1, 1));
        let mut v = vtd(&cfg());
        assert_eq!(
            v.attach_dev(0, 0, 1),
            0,
            "real hardware: nothing to invalidate"
        );
    }

    #[test]
    fn cache_lock_is_held_across_the_wait() {
        // Two CPUs flush the same domain at once: the second cannot even write its descriptor before the
        // first has its completion (cache.c holds domain->cache_lock around qi_submit_sync).
        let mut v = vtd(&cfg());
        let a = v.flush_iotlb_all(0, 0, 1);
        let b = v.flush_iotlb_all(0, 1, 1);
        assert_eq!(b, a + 80 + 400 + 200 + 10);
    }

    fn vtd_kernel(atc: Option<u32>, k: KernelVersion) -> Vtd {
        let p = cfg();
        let fmt = crate::hw::Vendor::Vtd.driver().pt_format(&p).unwrap();
        Vtd::new(
            &p,
            Translator::new(&p, fmt, atc.map(|n| (n, n))),
            1000,
            k,
            Coherence::default(),
            10,
        )
    }

    #[test]
    fn kernel_versions_change_submissions_locks_and_map_cost() {
        // ATS strict unmap: 6.12 batches PSI + device-TLB under one wait; 6.1 submits each with its own.
        for (k, waits) in [
            (KernelVersion(6, 12), 1),
            (KernelVersion(6, 11), 2),
            (KernelVersion(6, 1), 2),
        ] {
            let mut v = vtd_kernel(Some(8), k);
            v.map_pages(1, 0x40, 1, 1);
            let mut g = IotlbGather::new();
            v.unmap_pages(0, 0, 1, 0x40, 1, &mut g);
            v.iotlb_sync(0, 0, 1, &g);
            assert_eq!((v.tr.c.syncs, v.tr.c.get(DEVTLB)), (waits, 1), "{k:?}");
        }
        // A strict unmap's PSI: the hint reaches the descriptor from 6.18 only, so before it the next walk
        // near the unmapped page reads every level again.
        for (k, reads) in [(KernelVersion(6, 12), 4), (KernelVersion(6, 18), 1)] {
            let mut v = vtd_kernel(None, k);
            v.map_pages(1, 0x40000, 7, 4);
            v.translate(LATER, 1, 0x40000);
            let mut g = IotlbGather::new();
            v.unmap_pages(0, 0, 1, 0x40000, 1, &mut g);
            v.iotlb_sync(0, 0, 1, &g);
            assert_eq!(v.translate(LATER, 1, 0x40001).walk_reads, reads, "{k:?}");
        }
        // flush_iotlb_all under caching mode: 6.10+ flush the device TLB too, 6.1 skipped it.
        for (k, devtlb) in [(KernelVersion(6, 12), 1), (KernelVersion(6, 1), 0)] {
            let mut p = cfg();
            p.vtd.as_mut().unwrap().caching_mode = true;
            let fmt = crate::hw::Vendor::Vtd.driver().pt_format(&p).unwrap();
            let mut v = Vtd::new(
                &p,
                Translator::new(&p, fmt, Some((8, 8))),
                0,
                k,
                Coherence::default(),
                10,
            );
            v.flush_iotlb_all(0, 0, 1);
            assert_eq!(v.tr.c.get(DEVTLB), devtlb, "{k:?}");
        }
        // Two CPUs flushing one domain: 6.10+ hold its cache_lock across the wait, 6.1 only the queue lock.
        let pair = |k| {
            let mut v = vtd_kernel(None, k);
            let a = v.flush_iotlb_all(0, 0, 1);
            (a, v.flush_iotlb_all(0, 1, 1))
        };
        assert_eq!(pair(KernelVersion(6, 12)), (690, 690 + 690));
        assert_eq!(pair(KernelVersion(6, 1)), (690, 690 + 600));
        // iotlb_sync_map without caching mode: 6.10–6.16 walk the tags under the lock, 6.17 skips it.
        assert_eq!(
            vtd_kernel(None, KernelVersion(6, 12)).iotlb_sync_map(100, 0, 1, 5, 1),
            130
        );
        assert_eq!(
            vtd_kernel(None, KernelVersion(6, 17)).iotlb_sync_map(100, 0, 1, 5, 1),
            100
        );
        assert_eq!(
            vtd_kernel(None, KernelVersion(6, 6)).iotlb_sync_map(100, 0, 1, 5, 1),
            100
        );
    }
}
