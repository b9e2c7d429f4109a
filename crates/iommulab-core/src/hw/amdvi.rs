//! AMD-Vi (AMD I/O Virtualization Technology spec, rev 3.x; drivers/iommu/amd/): a DMA domain's v1 table
//! (AMD's own 4 KiB radix, 3 levels for IOVAs below 512 GiB) or v2 (x86-64, 4 or 5 levels), the IOTLB and
//! page-directory cache (shared [`Translator`]), and the command buffer as iommu.c drives it. A flush is one
//! INVALIDATE_IOMMU_PAGES covering the naturally aligned power of two around the range (build_inv_address:
//! S = 1, PDE = 1), an INVALIDATE_IOTLB_PAGES for an ATS device, and a COMPLETION_WAIT whose store the CPU
//! polls (wait_on_sem, udelay(1) between reads), all under the domain's lock; each command is written with
//! its own tail-register write under iommu->lock. With NpCache (a virtual AMD IOMMU, QEMU's) the driver runs
//! strict, flushes after every map and splits a range into naturally aligned pieces.

use super::cache::{PsiMatch, QemuIotlb};
use super::driver::{Column, Driver, Emulation, KernelDriver, Switch};
use super::emul::{hash_scan_ns, ring, ExitCause, ExitStats, Shadow, Trap, BQL};
use super::translator::{CacheInval, Translator};
use super::{DomainId, DomainLocks, InvClass, InvKind, Iommu, IotlbGather};
use super::{HypervisorProfile, IommuProfile, Platform, PtFormat, Vendor};
use crate::kernel::{Arch, KernelVersion};
use crate::sim::{Coherence, FifoServer, LockStats, SpinLock, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// AMD-Vi's commands (spec §2.4), as iommu.c builds them.
pub const INV_IOMMU_PAGES: InvKind = InvKind::new(0, "inv_iommu_pages", InvClass::Range);
/// INVALIDATE_IOMMU_PAGES with the all-pages address (CMD_INV_IOMMU_ALL_PAGES_ADDRESS): the whole domain.
pub const INV_IOMMU_PAGES_ALL: InvKind = InvKind::new(1, "inv_iommu_pages_all", InvClass::Domain);
pub const INV_IOTLB_PAGES: InvKind = InvKind::new(2, "inv_iotlb_pages", InvClass::DevTlb);
pub const INV_IOMMU_ALL: InvKind = InvKind::new(3, "inv_iommu_all", InvClass::Global);
pub const INV_DEVTAB_ENTRY: InvKind = InvKind::new(4, "inv_devtab_entry", InvClass::Config);

/// wait_on_sem(): the CPU reads the semaphore, then udelay(1) before the next read.
const WAIT_ON_SEM_POLL_NS: u64 = 1000;
/// Bits 63:52 of an address are sign extension: a range whose start and end differ above bit 51 is
/// flushed whole (build_inv_address), in 4 KiB pages.
const INV_ADDRESS_TOP_PFN_BIT: u32 = 51 - 12;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AmdViProfile {
    /// CPU time to copy one 16-byte command into the buffer and write the tail register (under iommu->lock).
    pub submit_cmd_ns: u64,
    /// IOMMU time to process one invalidation command.
    pub cmd_ns: u64,
    /// IOMMU time to process a COMPLETION_WAIT once the commands before it are done: its store to memory.
    pub completion_wait_ns: u64,
    /// The capability header's NpCache (IOMMU_CAP_NPCACHE): the IOMMU may cache non-present entries. Linux
    /// then runs strict, flushes after every map and splits flushes into naturally aligned ranges; only
    /// virtual AMD IOMMUs (QEMU's) set it.
    #[serde(default)]
    pub np_cache: bool,
    /// The DMA domains' page table: "v1" (AMD's own format, Linux's default) or "v2" (the x86-64 format,
    /// `amd_iommu=pgtbl_v2`).
    #[serde(default)]
    pub pgtable: AmdPgtable,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AmdPgtable {
    #[default]
    V1,
    V2,
}

/// One command as the driver writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    /// INVALIDATE_IOMMU_PAGES: `span` pages from `pfn` (naturally aligned), or the whole domain (None).
    Pages {
        dom: DomainId,
        range: Option<(u64, u64)>,
    },
    /// INVALIDATE_IOTLB_PAGES: the device's ATS cache over the same encoding.
    Iotlb {
        dom: DomainId,
        range: Option<(u64, u64)>,
    },
    /// INVALIDATE_DEVTAB_ENTRY: a device's DTE changed (attach).
    Dte,
    /// COMPLETION_WAIT with the store bit: the IOMMU writes the semaphore once every command before it is done.
    CompletionWait,
}

/// build_inv_address(): the naturally aligned block of 4 KiB pages one command covers for the `bytes` at
/// `addr`: (first pfn, pages), or None for the all-pages address.
fn inv_address(addr: u64, bytes: u64) -> Option<(u64, u64)> {
    let first = addr >> 12;
    let last = (addr + bytes.max(1) - 1) >> 12;
    if first == last {
        return Some((first, 1));
    }
    // The most significant bit that differs between start and end: the block is twice its weight.
    let msb = 63 - (first ^ last).leading_zeros();
    if msb > INV_ADDRESS_TOP_PFN_BIT {
        return None;
    }
    let span = 1u64 << (msb + 1);
    Some((first & !(span - 1), span))
}

/// amd_iommu_domain_flush_pages() under NpCache: the naturally aligned pieces of [addr, addr + bytes), each
/// the smaller of the address's alignment and the largest power of two that fits.
fn natural_pieces(mut addr: u64, mut bytes: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    while bytes != 0 {
        let size_align = 63 - bytes.leading_zeros();
        let align = if addr != 0 {
            addr.trailing_zeros().min(size_align)
        } else {
            size_align
        };
        let piece = 1u64 << align;
        v.push((addr, piece));
        addr = addr.wrapping_add(piece);
        bytes -= piece;
    }
    v
}

/// CMD_INV_IOMMU_ALL_PAGES_ADDRESS, the size amd_iommu_domain_flush_all() passes.
const ALL_PAGES_ADDRESS: u64 = 0x7fff_ffff_ffff_ffff;

pub struct AmdVi {
    cfg: AmdViProfile,
    tr: Translator,
    kernel: KernelVersion,
    /// The device's ATS invalidation completion time (INVALIDATE_IOTLB_PAGES waits for it).
    ats_inv_ns: u64,
    /// protection_domain->lock per domain: held across a flush's commands and its completion wait.
    dom_lock: DomainLocks,
    /// iommu->lock: one command written at a time; held through wait_on_sem until "move wait_on_sem() out
    /// of spinlock".
    lock: SpinLock,
    /// The command processor: it consumes the buffer's commands in the order they were written.
    hw: FifoServer,
    /// In a guest: every tail write exits to the VMM, whose handler (amdvi_mmio_write → amdvi_cmdbuf_run)
    /// processes the command under the BQL.
    trap: Option<Trap>,
    /// A VFIO device in that guest: QEMU shadows the guest's mappings into the host IOMMU.
    shadow: Option<Shadow>,
}

impl AmdVi {
    pub fn new(
        p: &IommuProfile,
        tr: Translator,
        ats_inv_ns: u64,
        kernel: KernelVersion,
        coh: Coherence,
    ) -> Self {
        AmdVi {
            cfg: p
                .amdvi
                .clone()
                .expect("validated: vendor amdvi has [iommu.amdvi]"),
            tr,
            kernel,
            ats_inv_ns,
            dom_lock: DomainLocks::new(coh),
            lock: SpinLock::new(coh),
            hw: FifoServer::default(),
            trap: None,
            shadow: None,
        }
    }

    /// The same IOMMU emulated by a hypervisor (QEMU's amd-iommu), when `trap` is given; `shadow` when a
    /// VFIO device sits behind it.
    pub fn emulated(mut self, trap: Option<Trap>, shadow: Option<Shadow>) -> Self {
        self.trap = trap;
        self.shadow = shadow.filter(|_| self.trap.is_some());
        self
    }

    /// IOMMU time of one command; in a guest, QEMU's handler's (and its shadow sync's).
    fn cmd_ns(&mut self, c: &Cmd) -> u64 {
        let own = match c {
            // The device answers the ATS invalidation before a later COMPLETION_WAIT can complete.
            Cmd::Iotlb { .. } => self.cfg.cmd_ns + self.ats_inv_ns,
            Cmd::CompletionWait => self.cfg.completion_wait_ns,
            // QEMU drops IOTLB entries by walking its whole hash (amdvi_inval_pages:
            // g_hash_table_foreach_remove): the fuller, the costlier.
            Cmd::Pages { .. } => self.cfg.cmd_ns + hash_scan_ns(self.trap.as_ref(), &self.tr),
            Cmd::Dte => self.cfg.cmd_ns,
        };
        own + self.shadow_ns(c)
    }

    /// QEMU's shadow sync of a VFIO device's mappings for an invalidation (its IOMMU notifier).
    fn shadow_ns(&mut self, c: &Cmd) -> u64 {
        let (Some(sh), Some(trap)) = (self.shadow.as_mut(), self.trap.as_mut()) else {
            return 0;
        };
        match *c {
            Cmd::Pages {
                dom,
                range: Some((pfn, n)),
            } => sh.sync(&mut trap.stats, &self.tr, dom, pfn, n),
            Cmd::Pages { dom, range: None } => sh.sync_all(&mut trap.stats, &self.tr, dom),
            _ => 0,
        }
    }

    /// Count a command and hand its effect on the caches over for `at`, when the IOMMU processes it.
    fn apply(&mut self, at: Time, c: Cmd) {
        let inv = match c {
            // PDE = 1: the range's page-directory entries go with its PTEs.
            Cmd::Pages {
                dom,
                range: Some((pfn, n)),
            } => {
                self.tr.c.count(INV_IOMMU_PAGES, 1);
                CacheInval::Range {
                    dom,
                    pfn,
                    n,
                    leaf_only: false,
                }
            }
            Cmd::Pages { dom, range: None } => {
                self.tr.c.count(INV_IOMMU_PAGES_ALL, 1);
                CacheInval::Domain { dom }
            }
            Cmd::Iotlb { dom, range } => {
                self.tr.c.count(INV_IOTLB_PAGES, 1);
                CacheInval::Atc { dom, range }
            }
            Cmd::Dte => {
                self.tr.c.count(INV_DEVTAB_ENTRY, 1);
                return;
            }
            Cmd::CompletionWait => return,
        };
        self.tr.invalidate(at, inv);
    }

    /// iommu_queue_command() on `cpu` at `now`: write the command and the tail register under iommu->lock.
    /// In a guest the tail write exits, with the lock held, to QEMU, which processes the command before
    /// the vCPU re-enters. Returns when the CPU goes on, and when the IOMMU is done with the command.
    fn queue(&mut self, now: Time, cpu: u32, c: Cmd) -> (Time, Time) {
        let work = self.cmd_ns(&c);
        let (submit, cause) = (self.cfg.submit_cmd_ns, ExitCause::CmdTail);
        let (back, done) = ring(
            &mut self.lock,
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

    /// iommu_completion_wait(): a COMPLETION_WAIT, then wait_on_sem() reading the semaphore every
    /// udelay(1) until the IOMMU has stored it; before "move wait_on_sem() out of spinlock" the CPU polls
    /// with iommu->lock held. Returns when the CPU sees the store.
    fn completion_wait(&mut self, now: Time, cpu: u32) -> Time {
        let (back, done) = self.queue(now, cpu, Cmd::CompletionWait);
        let seen = if done <= back {
            back
        } else {
            back + (done - back).div_ceil(WAIT_ON_SEM_POLL_NS) * WAIT_ON_SEM_POLL_NS
        };
        if !self.kernel.amd_wait_outside_lock() {
            self.lock.extend(back, seen);
        }
        self.tr.c.syncs += 1;
        seen
    }

    /// amd_iommu_domain_flush_pages() under the domain's lock: the commands for [pfn, pfn + n) pages (each
    /// naturally aligned piece under NpCache, from the kernel that split them), the device's IOTLB with
    /// ATS, then domain_flush_complete().
    fn flush_pages(&mut self, now: Time, cpu: u32, dom: DomainId, addr: u64, bytes: u64) -> Time {
        // Before 5.13 a flush of more than a page was the whole domain's.
        let (addr, bytes) = if bytes > 4096 && !self.kernel.amd_page_selective() {
            (0, ALL_PAGES_ADDRESS)
        } else {
            (addr, bytes)
        };
        let whole = bytes >= 1 << 52 && self.kernel.amd_flush_all_whole();
        let pieces = if self.cfg.np_cache && self.kernel.amd_np_cache_strict() && !whole {
            natural_pieces(addr, bytes)
        } else {
            vec![(addr, bytes)]
        };
        let start = self.dom_lock.get(dom).lock_on(now, cpu, 0).0;
        let mut t = start;
        for (a, b) in pieces {
            let range = inv_address(a, b);
            t = self.queue(t, cpu, Cmd::Pages { dom, range }).0;
            if self.tr.has_atc() {
                t = self.queue(t, cpu, Cmd::Iotlb { dom, range }).0;
            }
        }
        t = self.completion_wait(t, cpu);
        self.dom_lock.get(dom).extend(start, t);
        self.tr.c.inv_wait_ns += t - now;
        t
    }
}

impl Iommu for AmdVi {
    fn name(&self) -> &'static str {
        "amdvi"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        &[
            INV_IOMMU_PAGES,
            INV_IOMMU_PAGES_ALL,
            INV_IOTLB_PAGES,
            INV_IOMMU_ALL,
            INV_DEVTAB_ENTRY,
        ]
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
        // QEMU's amdvi_cmdbuf_run runs in the trapping vCPU's thread under the BQL: the buffer is it.
        self.trap.is_some().then_some(&mut self.hw)
    }

    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        vec![
            ("amd-vi iommu->lock", self.lock.stats.clone()),
            ("amd-vi domain lock", self.dom_lock.stats(&self.tr)),
            (
                if self.trap.is_some() {
                    BQL
                } else {
                    "amd-vi command buffer"
                },
                self.hw.stats.clone(),
            ),
        ]
    }

    fn unmap_pages(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> (u64, Time) {
        // amd_iommu_iotlb_gather_add_page(): under NpCache a range disjoint from the gathered one is synced
        // first rather than widening one flush over pages nobody unmapped.
        let mut t = now;
        let mut one = IotlbGather::new();
        let pages = self.tr.unmap(dom, iova_pfn, n, &mut one);
        if self.cfg.np_cache && gather.is_disjoint(&one) {
            t = self.iotlb_sync(t, cpu, dom, gather);
            *gather = IotlbGather::new();
        }
        gather.merge(&one);
        (pages, t)
    }

    fn iotlb_sync_map(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
    ) -> Time {
        // amd_iommu_iotlb_sync_map → domain_flush_np_cache(): only an IOMMU that caches non-present entries.
        if !self.cfg.np_cache {
            return now;
        }
        self.flush_pages(now, cpu as u32, dom, iova_pfn << 12, n << 12)
    }

    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        self.flush_pages(now, cpu as u32, dom, g.start << 12, g.pages() << 12)
    }

    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // amd_iommu_domain_flush_all(): the pages of the whole address space, the all-pages address.
        self.flush_pages(now, cpu as u32, dom, 0, ALL_PAGES_ADDRESS)
    }

    fn attach_dev(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // amd_iommu_attach_device → set_dte_entry and device_flush_dte(): INVALIDATE_DEVTAB_ENTRY, then the
        // old domain's translations (the new one's are empty) and a completion wait.
        let t = self.queue(now, cpu as u32, Cmd::Dte).0;
        let t = self.queue(t, cpu as u32, Cmd::Pages { dom, range: None }).0;
        self.completion_wait(t, cpu as u32)
    }
}

/// The AMD IOMMU driver (drivers/iommu/amd/) and its hardware.
pub struct AmdViDriver;

impl KernelDriver for AmdViDriver {
    fn name(&self) -> &'static str {
        "amdvi"
    }
    fn title(&self) -> &'static str {
        "AMD-Vi"
    }
    fn archs(&self) -> &'static [Arch] {
        &[Arch::X86_64]
    }
    fn arch_expected(&self) -> &'static str {
        "expected x86_64: the platform's IOMMU is AMD-Vi"
    }
    fn param(&self) -> Option<&'static str> {
        Some("amd_iommu")
    }
    // amd/init.c parse_amd_iommu_options().
    fn switch(&self, opt: &str, _k: KernelVersion) -> Option<Switch> {
        match opt {
            "fullflush" => Some(Switch::Strict(
                "AMD-Vi: amd_iommu=fullflush deprecated; use iommu.strict=1 instead",
            )),
            // iommu_go_to_state(): IOMMU_CMDLINE_DISABLED, silently.
            "off" => Some(Switch::Off(None)),
            _ => None,
        }
    }
    fn caching_mode_cap(&self) -> Option<&'static str> {
        Some("NpCache")
    }
    // init.c iommu_init_pci(): an IOMMU with NpCache makes every DMA domain strict.
    fn strict_under_caching_mode(&self, k: KernelVersion) -> Option<(&'static str, &'static str)> {
        k.amd_np_cache_strict().then_some((
            "AMD-Vi: Using strict mode due to virtualization",
            "NpCache (a virtual AMD IOMMU): Using strict mode due to virtualization",
        ))
    }
}

impl Driver for AmdViDriver {
    fn vendor(&self) -> Vendor {
        Vendor::Amdvi
    }
    fn pt_format(&self, p: &IommuProfile) -> Result<PtFormat, (&'static str, String)> {
        if p.granule_kb != 4 {
            return Err(("granule_kb", "expected 4: AMD-Vi pages are 4 KiB".into()));
        }
        let v2 = p
            .amdvi
            .as_ref()
            .is_some_and(|a| a.pgtable == AmdPgtable::V2);
        if v2 && p.ias_bits == 39 {
            return Err((
                "ias_bits",
                "expected 48 or 57 with the v2 table (x86-64's 4 or 5 levels)".into(),
            ));
        }
        // Both formats are radix tables of 512 entries a level over 4 KiB pages, with 2 MiB and 1 GiB leaves.
        PtFormat::vtd(p.ias_bits, p.large_pages).map_err(|m| ("ias_bits", m))
    }
    // attach_device() → pdev_enable_caps() only for an SVA-capable domain from 6.9.
    fn enables_ats(&self, p: &IommuProfile, k: KernelVersion) -> bool {
        let v1 = p.amdvi.as_ref().is_none_or(|a| a.pgtable == AmdPgtable::V1);
        !(v1 && k.amd_ats_sva_domains_only())
    }
    fn check(&self, p: &IommuProfile, _guest: bool) -> Result<(), (&'static str, String)> {
        if p.amdvi.is_none() {
            return Err((
                "amdvi",
                "expected an [iommu.amdvi] section for vendor \"amdvi\"".into(),
            ));
        }
        Ok(())
    }
    fn caching_mode(&self, p: &IommuProfile) -> bool {
        p.amdvi.as_ref().is_some_and(|a| a.np_cache)
    }
    fn caching_mode_key(&self) -> Option<&'static str> {
        Some("amdvi.np_cache")
    }
    // QEMU's amd_iommu.c before 10.1 (no dma-remap): amdvi_iommu_notify_flag_changed() refuses a MAP
    // notifier, and amdvi_inval_pages() notifies no one.
    fn emulation_refuses(
        &self,
        qemu: (u32, u32),
        vfio: bool,
        vhost: bool,
    ) -> Result<(), (&'static str, &'static str)> {
        if qemu >= (10, 1) {
            return Ok(());
        }
        if vfio {
            return Err((
                "platform.hypervisor.qemu",
                "expected QEMU 10.1 or later for a VFIO device behind QEMU's AMD IOMMU: before, it refuses the \
                 MAP notifier VFIO needs (\"requires iommu notifier which is not currently supported\")",
            ));
        }
        if vhost {
            return Err((
                "platform.hypervisor.qemu",
                "expected QEMU 10.1 or later for vhost behind QEMU's AMD IOMMU: before, its invalidations \
                 (amdvi_inval_pages) notify no device IOTLB, which iommulab does not model",
            ));
        }
        Ok(())
    }
    // QEMU's amdvi_inval_pages drops every entry of the domain, whatever the address.
    fn qemu_iotlb(&self, _h: &HypervisorProfile, entries: u32) -> QemuIotlb<(u64, u64)> {
        QemuIotlb::new(entries as usize, PsiMatch::Domain)
    }
    fn build(
        &self,
        p: &Platform,
        _cpus: usize,
        kernel: KernelVersion,
        tr: Translator,
        emu: Emulation,
    ) -> Box<dyn Iommu> {
        let a = AmdVi::new(&p.iommu, tr, p.pcie.ats_inv_ns, kernel, p.cpu.coherence());
        Box::new(a.emulated(emu.trap, emu.shadow))
    }
    fn replay_profile(&self) -> (&'static str, Arch) {
        ("amdvi-server", Arch::X86_64)
    }
    // QEMU's amdvi_pages_inval / amdvi_iotlb_inval / amdvi_all_inval / amdvi_completion_wait.
    fn replay_columns(&self) -> &'static [(&'static str, Column)] {
        &[
            (
                "inv_iommu_pages",
                Column::Classes(&[InvClass::Range, InvClass::Domain]),
            ),
            ("inv_iotlb_pages", Column::Class(InvClass::DevTlb)),
            ("inv_iommu_all", Column::Class(InvClass::Global)),
            ("completion_wait", Column::Syncs),
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::hw::LATER;

    /// A small AMD-Vi configuration for unit tests across the crate.
    pub(crate) fn cfg(np_cache: bool) -> IommuProfile {
        IommuProfile {
            iotlb_entries: 64,
            iotlb_ways: 4,
            pwc_entries: vec![16, 16],
            pwc_ways: 0,
            ias_bits: 39,
            granule_kb: 4,
            large_pages: true,
            shadow_on_flush: false,
            vtd: None,
            smmuv3: None,
            virtio: None,
            amdvi: Some(AmdViProfile {
                submit_cmd_ns: 40,
                cmd_ns: 400,
                completion_wait_ns: 200,
                np_cache,
                pgtable: AmdPgtable::V1,
            }),
            riscv: None,
        }
    }

    /// An AMD-Vi with the profile's format, and an ATC of `atc` entries when given.
    pub(crate) fn amd_with(p: &IommuProfile, atc: Option<u32>, kernel: KernelVersion) -> AmdVi {
        let fmt = AmdViDriver.pt_format(p).unwrap();
        let tr = Translator::new(p, fmt, atc.map(|n| (n, n)));
        AmdVi::new(p, tr, 1000, kernel, Coherence::default())
    }

    fn amd(np_cache: bool) -> AmdVi {
        amd_with(&cfg(np_cache), None, KernelVersion(6, 12))
    }

    /// Unmap [pfn, pfn + n) and sync it, as iommu-dma's strict unmap does; the CPU's release time.
    fn unmap_sync(a: &mut AmdVi, now: Time, pfn: u64, n: u64) -> Time {
        let mut g = IotlbGather::new();
        let (_, t) = a.unmap_pages(now, 0, 1, pfn, n, &mut g);
        a.iotlb_sync(t, 0, 1, &g)
    }

    #[test]
    fn a_strict_unmap_is_one_inv_iommu_pages_over_the_aligned_block_and_one_completion_wait() {
        let mut a = amd(false);
        a.map_pages(1, 5, 1000, 2);
        a.translate(LATER, 1, 5);
        unmap_sync(&mut a, 0, 5, 2);
        let c = a.counters();
        assert_eq!((c.get(INV_IOMMU_PAGES), c.syncs, c.submissions), (1, 1, 2));
        // Pages 5..=6 flush as the block 4..=7 (build_inv_address).
        assert!(a.translate(LATER, 1, 5).fault());
    }

    #[test]
    fn np_cache_splits_a_flush_into_natural_pieces_and_flushes_after_maps() {
        let mut a = amd(true);
        // A map is flushed (domain_flush_np_cache): pages 1..=6 as 1 + 2 + 2 + 1.
        a.map_pages(1, 1, 1000, 6);
        a.iotlb_sync_map(0, 0, 1, 1, 6);
        assert_eq!(
            (a.counters().get(INV_IOMMU_PAGES), a.counters().syncs),
            (4, 1)
        );
        unmap_sync(&mut a, 0, 1, 6);
        assert_eq!(
            (a.counters().get(INV_IOMMU_PAGES), a.counters().syncs),
            (8, 2)
        );
        // Without NpCache a map sends nothing.
        let mut b = amd(false);
        b.map_pages(1, 1, 1000, 6);
        b.iotlb_sync_map(0, 0, 1, 1, 6);
        assert_eq!(b.counters().submissions, 0);
    }

    #[test]
    fn a_whole_domain_flush_under_np_cache_was_63_commands_until_it_stayed_whole() {
        for (k, cmds) in [(KernelVersion(6, 12), 63), (KernelVersion(7, 0), 1)] {
            let mut a = amd_with(&cfg(true), None, k);
            a.flush_iotlb_all(0, 0, 1);
            let c = a.counters();
            assert_eq!(
                c.get(INV_IOMMU_PAGES) + c.get(INV_IOMMU_PAGES_ALL),
                cmds,
                "{k:?}"
            );
            assert_eq!(c.syncs, 1);
        }
    }

    #[test]
    fn an_ats_device_gets_inv_iotlb_pages_and_the_completion_wait_waits_for_its_answer() {
        // 6.1 enables ATS on a v1 DMA domain's device; from 6.9 only on an SVA-capable (v2) domain's.
        let p = cfg(false);
        assert!(AmdViDriver.enables_ats(&p, KernelVersion(6, 1)));
        assert!(!AmdViDriver.enables_ats(&p, KernelVersion(6, 12)));
        let mut v2 = p.clone();
        v2.ias_bits = 48;
        v2.amdvi.as_mut().unwrap().pgtable = AmdPgtable::V2;
        assert!(AmdViDriver.enables_ats(&v2, KernelVersion(6, 12)));
        let mut a = amd_with(&p, Some(16), KernelVersion(6, 1));
        a.map_pages(1, 8, 1000, 1);
        a.translate(LATER, 1, 8);
        let t = unmap_sync(&mut a, 0, 8, 1);
        assert_eq!(a.counters().get(INV_IOTLB_PAGES), 1);
        // The COMPLETION_WAIT orders everything queued before it: the CPU goes on only after the device
        // answered (ats_inv_ns), and nothing stale survives at that instant.
        assert!(t >= 1000 + p.amdvi.as_ref().unwrap().cmd_ns, "{t}");
        let tr = a.translate(t, 1, 8);
        assert!(!tr.stale && tr.fault(), "{tr:?}");
    }

    #[test]
    fn before_5_13_a_multi_page_flush_was_the_whole_domains() {
        let mut a = amd_with(&cfg(false), None, KernelVersion(5, 10));
        a.map_pages(1, 4, 1000, 2);
        unmap_sync(&mut a, 0, 4, 2);
        let c = a.counters();
        assert_eq!((c.get(INV_IOMMU_PAGES), c.get(INV_IOMMU_PAGES_ALL)), (0, 1));
    }

    #[test]
    fn before_5_13_one_page_was_flushed_alone_and_two_were_the_whole_domain() {
        // build_inv_iommu_pages() (5.10): pages = iommu_num_pages(address, size, PAGE_SIZE); pages > 1 takes
        // CMD_INV_IOMMU_ALL_PAGES_ADDRESS. One page is the last flushed by itself, two the first flushed whole.
        for (pages, selective, whole) in [(1, 1, 0), (2, 0, 1)] {
            let mut a = amd_with(&cfg(false), None, KernelVersion(5, 10));
            a.map_pages(1, 4, 1000, pages);
            unmap_sync(&mut a, 0, 4, pages);
            let c = a.counters();
            assert_eq!(
                (c.get(INV_IOMMU_PAGES), c.get(INV_IOMMU_PAGES_ALL)),
                (selective, whole),
                "{pages} pages"
            );
        }
    }

    #[test]
    fn wait_on_sem_sees_the_store_at_a_whole_poll() {
        // cmd_ns + completion_wait_ns = 600 ns: the first read (right after the tail write) misses it, the
        // second, after udelay(1), sees it.
        let mut a = amd(false);
        a.map_pages(1, 3, 1000, 1);
        let t = unmap_sync(&mut a, 0, 3, 1);
        assert_eq!(t, 40 + 40 + WAIT_ON_SEM_POLL_NS);
    }

    #[test]
    fn before_the_wait_left_the_lock_a_second_cpu_queues_behind_the_poll() {
        // CPU 0 syncs domain 1; CPU 1, on domain 2 (no domain lock in common), queues its command 10 ns later.
        let lock_wait = |k: KernelVersion| {
            let mut a = amd_with(&cfg(false), None, k);
            a.map_pages(1, 3, 1000, 1);
            a.map_pages(2, 9, 2000, 1);
            let t0 = unmap_sync(&mut a, 0, 3, 1);
            let mut g = IotlbGather::new();
            a.unmap_pages(10, 1, 2, 9, 1, &mut g);
            a.iotlb_sync(10, 1, 2, &g);
            let l = &a.lock_stats()[0].1;
            (t0, l.wait_ns)
        };
        let (t0, old) = lock_wait(KernelVersion(6, 12));
        let (_, new) = lock_wait(KernelVersion(6, 19));
        // Before: CPU 1 spins on iommu->lock until CPU 0 has seen its store; after: only behind the writes.
        assert!(
            old + 10 >= t0 && new < 100,
            "old {old} new {new} first {t0}"
        );
    }

    #[test]
    fn build_inv_address_covers_the_aligned_power_of_two_around_the_range() {
        // One page: that page.
        assert_eq!(inv_address(0x5000, 4096), Some((5, 1)));
        // Pages 5..=6 differ in bit 1 (0b101 ^ 0b110 = 0b011): the aligned block of 4 from page 4.
        assert_eq!(inv_address(0x5000, 2 * 4096), Some((4, 4)));
        // Pages 7..=8 cross a 16-page boundary: 16 pages from 0.
        assert_eq!(inv_address(0x7000, 2 * 4096), Some((0, 16)));
        // Start and end differing above bit 51: everything.
        assert_eq!(inv_address(0, ALL_PAGES_ADDRESS), None);
    }

    #[test]
    fn build_inv_address_stays_selective_through_bit_51_and_goes_whole_past_it() {
        // build_inv_address(): msb_diff = fls64(end ^ address) - 1, everything when msb_diff > 51. From 0,
        // 2^52 bytes end at 2^52 - 1: msb_diff 51, the aligned block of 2^40 pages; one page more ends at
        // 2^52 + 4095: msb_diff 52, the all-pages address.
        assert_eq!(inv_address(0, 1 << 52), Some((0, 1 << 40)));
        assert_eq!(inv_address(0, (1 << 52) + 4096), None);
    }

    #[test]
    fn np_cache_pieces_are_naturally_aligned() {
        // Pages 1..=6: 1 page at 1, 2 at 2, 2 at 4, 1 at 6.
        let p = natural_pieces(0x1000, 6 * 4096);
        assert_eq!(
            p,
            vec![
                (0x1000, 4096),
                (0x2000, 8192),
                (0x4000, 8192),
                (0x6000, 4096)
            ]
        );
        // The all-pages size from 0 splits into 63 powers of two (as before "Don't split flush for
        // amd_iommu_domain_flush_all()").
        assert_eq!(natural_pieces(0, ALL_PAGES_ADDRESS).len(), 63);
    }
}
