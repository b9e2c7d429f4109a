//! The RISC-V IOMMU (RISC-V IOMMU Architecture Specification v1.0; Linux drivers/iommu/riscv/, from 6.13): an
//! Sv39/Sv48/Sv57 first-stage table (4 KiB radix, 2 MiB and 1 GiB leaves), the IOATC (shared [`Translator`]),
//! and the command queue as the 6.13 driver drives it. An unmap's range below 2 MiB is one IOTINVAL.VMA (AV = 1,
//! PSCV = 1) per 4 KiB page, a larger one a single IOTINVAL.VMA for the whole PSCID (AV = 0); then an IOFENCE.C
//! (PR = PW = 1), whose completion the CPU sees by polling the queue's head register (CQH). Every command is
//! written with its own tail-register (CQT) write. Later kernels (the generic page table, 7.1 or so) choose
//! ranges from the levels an unmap touched: not modelled.
//!
//! Linux on RISC-V has no IOMMU_DMA (`Arch::iommu_dma`): its DMA API never maps through this IOMMU, whose
//! domains are identity unless an IOMMU-API user (iommufd, a patched kernel) makes a paging one.

use super::cache::{PsiMatch, QemuIotlb};
use super::driver::{Column, Driver, Emulation, KernelDriver};
use super::emul::{hash_scan_ns, ring, ExitCause, ExitStats, Shadow, Trap, BQL};
use super::translator::{CacheInval, Translator};
use super::{DomainId, InvClass, InvKind, Iommu, IotlbGather};
use super::{HypervisorProfile, IommuProfile, Platform, PtFormat, Vendor};
use crate::kernel::{Arch, KernelVersion};
use crate::sim::{FifoServer, LockStats, SpinLock, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The RISC-V IOMMU's commands (spec §3.1), as iommu-bits.h names them.
pub const IOTINVAL_VMA: InvKind = InvKind::new(0, "iotinval_vma", InvClass::Range);
/// IOTINVAL.VMA without an address (AV = 0, PSCV = 1): every entry of the PSCID.
pub const IOTINVAL_VMA_PSCID: InvKind = InvKind::new(1, "iotinval_vma_pscid", InvClass::Domain);
pub const IODIR_INVAL_DDT: InvKind = InvKind::new(2, "iodir_inval_ddt", InvClass::Config);

/// iommu.c RISCV_IOMMU_IOTLB_INVAL_LIMIT (6.13): from 2 MiB up, one invalidation for the whole PSCID.
const IOTLB_INVAL_LIMIT_PAGES: u64 = (2 << 20) >> 12;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RiscvProfile {
    /// CPU time to copy one 16-byte command into the queue and write CQT.
    pub submit_cmd_ns: u64,
    /// IOMMU time to process one IOTINVAL.VMA.
    pub cmd_ns: u64,
    /// IOMMU time to process an IOFENCE.C once the commands before it are done.
    pub iofence_ns: u64,
    /// One read of the queue's head register (CQH) by the polling CPU: riscv_iommu_queue_wait() reads it
    /// back to back until the fence is consumed.
    pub cqh_read_ns: u64,
}

/// One command as the driver writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    /// IOTINVAL.VMA for one 4 KiB page of the PSCID, or (None) for all of it.
    Vma { dom: DomainId, pfn: Option<u64> },
    /// IODIR.INVAL_DDT for a device's context.
    Ddt,
    /// IOFENCE.C: the commands before it are done.
    Fence,
}

pub struct RiscvIommu {
    cfg: RiscvProfile,
    tr: Translator,
    /// The command queue's producer side: 6.13 reserves slots with atomic_inc_return and publishes in order
    /// (later kernels take queue->lock); one CPU writes at a time.
    queue: SpinLock,
    /// The command processor: it consumes the queue in order.
    hw: FifoServer,
    /// In a guest: every CQT write exits to QEMU (riscv_iommu_process_cq_tail), every CQH read too.
    trap: Option<Trap>,
    shadow: Option<Shadow>,
}

impl RiscvIommu {
    pub fn new(p: &IommuProfile, tr: Translator, coh: crate::sim::Coherence) -> Self {
        RiscvIommu {
            cfg: p
                .riscv
                .clone()
                .expect("validated: vendor riscv has [iommu.riscv]"),
            tr,
            queue: SpinLock::new(coh),
            hw: FifoServer::default(),
            trap: None,
            shadow: None,
        }
    }

    /// The same IOMMU emulated by QEMU (riscv-iommu-pci), when `trap` is given.
    pub fn emulated(mut self, trap: Option<Trap>, shadow: Option<Shadow>) -> Self {
        self.trap = trap;
        self.shadow = shadow.filter(|_| self.trap.is_some());
        self
    }

    fn cmd_ns(&mut self, c: &Cmd) -> u64 {
        match *c {
            Cmd::Fence => self.cfg.iofence_ns,
            Cmd::Ddt => self.cfg.cmd_ns,
            // QEMU walks its whole IOATC hash for each IOTINVAL (riscv_iommu_iot_inval: g_hash_table_foreach).
            Cmd::Vma { dom, pfn } => {
                let scan = hash_scan_ns(self.trap.as_ref(), &self.tr);
                let shadow = match (self.shadow.as_mut(), self.trap.as_mut(), pfn) {
                    (Some(sh), Some(t), Some(pfn)) => sh.sync(&mut t.stats, &self.tr, dom, pfn, 1),
                    (Some(sh), Some(t), None) => sh.sync_all(&mut t.stats, &self.tr, dom),
                    _ => 0,
                };
                self.cfg.cmd_ns + scan + shadow
            }
        }
    }

    fn apply(&mut self, at: Time, c: Cmd) {
        match c {
            Cmd::Vma {
                dom,
                pfn: Some(pfn),
            } => {
                self.tr.c.count(IOTINVAL_VMA, 1);
                let range = CacheInval::Range {
                    dom,
                    pfn,
                    n: 1,
                    leaf_only: false,
                };
                self.tr.invalidate(at, range);
            }
            Cmd::Vma { dom, pfn: None } => {
                self.tr.c.count(IOTINVAL_VMA_PSCID, 1);
                self.tr.invalidate(at, CacheInval::Domain { dom });
            }
            Cmd::Ddt => self.tr.c.count(IODIR_INVAL_DDT, 1),
            Cmd::Fence => {}
        }
    }

    /// riscv_iommu_queue_send(): the command and its CQT write. In a guest the write exits to QEMU, which
    /// processes the queue up to the tail before the vCPU re-enters. Returns when the CPU goes on, and when
    /// the IOMMU is done with the command.
    fn send(&mut self, now: Time, cpu: u32, c: Cmd) -> (Time, Time) {
        let work = self.cmd_ns(&c);
        let (submit, cause) = (self.cfg.submit_cmd_ns, ExitCause::Cqt);
        let (back, done) = ring(
            &mut self.queue,
            &mut self.hw,
            self.trap.as_mut(),
            cause,
            now,
            cpu,
            submit,
            work,
        );
        self.apply(done, c);
        self.tr.c.submissions += 1;
        (back, done)
    }

    /// riscv_iommu_cmd_sync(): an IOFENCE.C, then CQH read back to back until the fence is consumed (in a
    /// guest each read exits; QEMU processed the fence in the CQT write, so the first read sees it).
    fn sync(&mut self, now: Time, cpu: u32) -> Time {
        let (back, done) = self.send(now, cpu, Cmd::Fence);
        self.tr.c.syncs += 1;
        match self.trap.as_mut() {
            Some(t) => t.read(ExitCause::Cqh, back, done),
            None => {
                let r = self.cfg.cqh_read_ns.max(1);
                back + (done.saturating_sub(back)).div_ceil(r).max(1) * r
            }
        }
    }

    /// riscv_iommu_iotlb_inval() (6.13): per page below 2 MiB, else the whole PSCID; then the fence.
    fn inval(&mut self, now: Time, cpu: u32, dom: DomainId, range: Option<(u64, u64)>) -> Time {
        let mut t = now;
        match range {
            Some((pfn, n)) if n < IOTLB_INVAL_LIMIT_PAGES => {
                for p in pfn..pfn + n {
                    t = self.send(t, cpu, Cmd::Vma { dom, pfn: Some(p) }).0;
                }
            }
            _ => t = self.send(t, cpu, Cmd::Vma { dom, pfn: None }).0,
        }
        let t = self.sync(t, cpu);
        self.tr.c.inv_wait_ns += t - now;
        t
    }
}

impl Iommu for RiscvIommu {
    fn name(&self) -> &'static str {
        "riscv"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        &[IOTINVAL_VMA, IOTINVAL_VMA_PSCID, IODIR_INVAL_DDT]
    }

    fn translator(&self) -> &Translator {
        &self.tr
    }

    fn translator_mut(&mut self) -> &mut Translator {
        &mut self.tr
    }

    fn exit_stats(&self) -> Option<ExitStats> {
        self.trap.as_ref().map(|t| t.stats)
    }

    fn bql(&mut self) -> Option<&mut FifoServer> {
        self.trap.is_some().then_some(&mut self.hw)
    }

    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        let hw = if self.trap.is_some() {
            BQL
        } else {
            "riscv command queue"
        };
        vec![
            ("riscv cq producer", self.queue.stats.clone()),
            (hw, self.hw.stats.clone()),
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
        (self.tr.unmap(dom, iova_pfn, n, gather), now)
    }

    // No iotlb_sync_map: the IOATC caches no invalid entries.
    fn iotlb_sync_map(
        &mut self,
        now: Time,
        _cpu: usize,
        _dom: DomainId,
        _iova_pfn: u64,
        _n: u64,
    ) -> Time {
        now
    }

    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        self.inval(now, cpu as u32, dom, Some((g.start, g.pages())))
    }

    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // iotlb_inval(0, ULONG_MAX): the length wraps to 0, so the whole PSCID.
        self.inval(now, cpu as u32, dom, None)
    }

    fn attach_dev(&mut self, now: Time, cpu: usize, _dom: DomainId) -> Time {
        // riscv_iommu_iodir_update(): IODIR.INVAL_DDT for the device's context, then the fence.
        let t = self.send(now, cpu as u32, Cmd::Ddt).0;
        self.sync(t, cpu as u32)
    }
}

/// The RISC-V IOMMU driver (drivers/iommu/riscv/) and its hardware.
pub struct RiscvDriver;

impl KernelDriver for RiscvDriver {
    fn name(&self) -> &'static str {
        "riscv"
    }
    fn title(&self) -> &'static str {
        "RISC-V IOMMU"
    }
    fn archs(&self) -> &'static [Arch] {
        &[Arch::Riscv64]
    }
    fn arch_expected(&self) -> &'static str {
        "expected riscv64: the platform's IOMMU is a RISC-V IOMMU"
    }
    // No .capable op in 6.13: without IOMMU_CAP_DEFERRED_FLUSH a DMA-FQ domain would be strict.
    fn deferred_flush(&self, _k: KernelVersion) -> Result<(), &'static str> {
        Err("the RISC-V IOMMU driver has no IOMMU_CAP_DEFERRED_FLUSH: a DMA-FQ domain falls back to DMA (strict)")
    }
    fn check_kernel(&self, k: KernelVersion, _arch: Arch) -> Result<(), &'static str> {
        if k.riscv_iommu() {
            Ok(())
        } else {
            Err("expected 6.13 or later for the RISC-V IOMMU (its driver's first kernel)")
        }
    }
}

impl Driver for RiscvDriver {
    fn vendor(&self) -> Vendor {
        Vendor::Riscv
    }
    // riscv_iommu_alloc_paging_domain(): Sv57, Sv48 or Sv39, the largest the IOMMU has.
    fn pt_format(&self, p: &IommuProfile) -> Result<PtFormat, (&'static str, String)> {
        if p.granule_kb != 4 {
            return Err(("granule_kb", "expected 4: RISC-V pages are 4 KiB".into()));
        }
        // Sv39/48/57 are radix tables of 512 entries a level over 4 KiB pages.
        PtFormat::vtd(p.ias_bits, p.large_pages).map_err(|_| {
            (
                "ias_bits",
                "expected 39, 48 or 57 (Sv39, Sv48, Sv57)".to_string(),
            )
        })
    }
    // The driver never sets DC.tc.EN_ATS (drivers/iommu/riscv/iommu.c has no ATS code, sends no ATS.INVAL):
    // a device behind it does not cache translations.
    fn enables_ats(&self, _p: &IommuProfile, _k: KernelVersion) -> bool {
        false
    }
    fn check(&self, p: &IommuProfile, _guest: bool) -> Result<(), (&'static str, String)> {
        if p.riscv.is_none() {
            return Err((
                "riscv",
                "expected an [iommu.riscv] section for vendor \"riscv\"".into(),
            ));
        }
        Ok(())
    }
    // QEMU's IOATC: per 4 KiB page, an IOTINVAL.VMA with AV drops that page of the PSCID.
    fn qemu_iotlb(&self, _h: &HypervisorProfile, entries: u32) -> QemuIotlb<(u64, u64)> {
        QemuIotlb::new(entries as usize, PsiMatch::Range)
    }
    fn build(
        &self,
        p: &Platform,
        _cpus: usize,
        _kernel: KernelVersion,
        tr: Translator,
        emu: Emulation,
    ) -> Box<dyn Iommu> {
        let r = RiscvIommu::new(&p.iommu, tr, p.cpu.coherence());
        Box::new(r.emulated(emu.trap, emu.shadow))
    }
    fn replay_profile(&self) -> (&'static str, Arch) {
        ("riscv-server", Arch::Riscv64)
    }
    // QEMU traces every command as riscv_iommu_cmd (opcode in dword0).
    fn replay_columns(&self) -> &'static [(&'static str, Column)] {
        &[
            (
                "iotinval_vma",
                Column::Classes(&[InvClass::Range, InvClass::Domain]),
            ),
            ("iofence", Column::Syncs),
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::hw::LATER;

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
            vtd: None,
            smmuv3: None,
            virtio: None,
            amdvi: None,
            riscv: Some(RiscvProfile {
                submit_cmd_ns: 40,
                cmd_ns: 300,
                iofence_ns: 200,
                cqh_read_ns: 300,
            }),
        }
    }

    pub(crate) fn riscv_with(p: &IommuProfile, atc: Option<u32>) -> RiscvIommu {
        let fmt = RiscvDriver.pt_format(p).unwrap();
        let tr = Translator::new(p, fmt, atc.map(|n| (n, n)));
        RiscvIommu::new(p, tr, crate::sim::Coherence::default())
    }

    fn unmap_sync(r: &mut RiscvIommu, now: Time, pfn: u64, n: u64) -> Time {
        let mut g = IotlbGather::new();
        r.unmap_pages(now, 0, 1, pfn, n, &mut g);
        r.iotlb_sync(now, 0, 1, &g)
    }

    #[test]
    fn below_2_mib_one_iotinval_per_page_then_one_iofence() {
        let mut r = riscv_with(&cfg(), None);
        r.map_pages(1, 16, 1000, 4);
        r.translate(LATER, 1, 17);
        unmap_sync(&mut r, 0, 16, 4);
        let c = r.counters();
        assert_eq!((c.get(IOTINVAL_VMA), c.syncs, c.submissions), (4, 1, 5));
        assert!(r.translate(LATER, 1, 17).fault());
        // 2 MiB or more: one invalidation of the whole PSCID.
        r.map_pages(1, 1024, 5000, 512);
        unmap_sync(&mut r, 0, 1024, 512);
        assert_eq!(r.counters().get(IOTINVAL_VMA_PSCID), 1);
    }

    #[test]
    fn the_per_page_limit_is_2_mib_511_pages_per_page_512_the_whole_pscid() {
        // riscv_iommu_iotlb_inval(): per page while len < RISCV_IOMMU_IOTLB_INVAL_LIMIT (2 << 20): 511 pages
        // are 511 × 4096 = 2093056 B < 2097152, per page; 512 pages are 2097152 B, not below it: the PSCID.
        for (pages, per_page, whole) in [(511, 511, 0), (512, 0, 1)] {
            let mut r = riscv_with(&cfg(), None);
            r.map_pages(1, 1024, 5000, pages);
            unmap_sync(&mut r, 0, 1024, pages);
            let c = r.counters();
            assert_eq!(
                (c.get(IOTINVAL_VMA), c.get(IOTINVAL_VMA_PSCID), c.syncs),
                (per_page, whole, 1),
                "{pages} pages"
            );
        }
    }

    #[test]
    fn an_iofence_orders_the_invalidations_before_it() {
        // The CPU goes on only once the fence is consumed: every IOTINVAL before it has acted by then.
        let mut r = riscv_with(&cfg(), None);
        r.map_pages(1, 8, 1000, 3);
        for p in 8..11 {
            r.translate(LATER, 1, p);
        }
        let t = unmap_sync(&mut r, 0, 8, 3);
        assert!(t >= 3 * 300 + 200, "{t}");
        for p in 8..11 {
            let tr = r.translate(t, 1, p);
            assert!(!tr.stale && tr.fault(), "{p}: {tr:?}");
        }
    }

    #[test]
    fn no_iotlb_sync_map_and_no_deferred_flush() {
        let mut r = riscv_with(&cfg(), None);
        r.map_pages(1, 3, 1000, 1);
        assert_eq!(r.iotlb_sync_map(7, 0, 1, 3, 1), 7);
        assert!(RiscvDriver.deferred_flush(KernelVersion(6, 13)).is_err());
    }
}
