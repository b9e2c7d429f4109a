//! An IOMMU emulated by the hypervisor (QEMU's hw/i386/intel_iommu.c and hw/arm/smmuv3.c under KVM): the
//! guest's driver runs unchanged on a vCPU and writes its commands into guest memory; its doorbell write
//! (VT-d's invalidation-queue tail, DMAR_IQT_REG; SMMUv3's CMDQ_PROD) is an MMIO access KVM cannot handle,
//! so the vCPU exits to the VMM. The VMM's MMIO handler runs in that vCPU's thread under QEMU's big lock
//! (BQL): it consumes every command queued up to the new tail (vtd_fetch_inv_desc, smmuv3_cmdq_consume),
//! completes the wait descriptor or CMD_SYNC, and returns; the vCPU re-enters the guest. The vendor model
//! keeps the guest driver's side (descriptors, batching, locks) and its queue of work, which the emulator
//! serves in place of hardware; this module adds the exit and re-entry and counts them.

use super::DomainId;
use super::{HypervisorProfile, KvmProfile};
use crate::sim::{FifoServer, SpinLock, Time};
use serde::Serialize;

/// What an emulated IOMMU's command queue is, in its lock statistics: QEMU's big lock, under which its
/// handlers run (and QEMU's own device models with them).
pub const BQL: &str = "qemu bql";

/// Why a vCPU left the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCause {
    /// VT-d: the driver advanced the invalidation queue tail (qi_submit_sync's writel to DMAR_IQT_REG).
    QiTail,
    /// SMMUv3: the command-queue owner advanced CMDQ_PROD (arm_smmu_cmdq_issue_cmdlist).
    CmdqProd,
    /// SMMUv3: a CPU waiting for its CMD_SYNC read CMDQ_CONS (__arm_smmu_cmdq_poll_until_consumed). QEMU's
    /// SMMU sets neither IDR0.MSI nor IDR0.SEV, so the driver polls the register, and every read traps.
    CmdqCons,
    /// A virtqueue notification (virtio-net's, virtio-iommu's request queue): an ioeventfd exit KVM
    /// completes in the kernel.
    Kick,
    /// A device's interrupt (irqfd) reaching a running vCPU on a host without posted interrupts: KVM kicks
    /// the vCPU out to load it (arm64's vgic: kvm_vgic_inject_irq → kvm_vcpu_kick).
    Irq,
    /// AMD-Vi: the driver advanced the command buffer's tail (copy_cmd_to_buffer's writel to
    /// MMIO_CMD_TAIL_OFFSET), once per command.
    CmdTail,
    /// RISC-V IOMMU: the driver advanced the command queue's tail (riscv_iommu_queue_send's CQT write), once
    /// per command.
    Cqt,
    /// RISC-V IOMMU: a CPU waiting for its IOFENCE.C read the queue's head (riscv_iommu_queue_wait's CQH).
    Cqh,
}

pub const EXIT_CAUSES: usize = 8;

impl ExitCause {
    pub const ALL: [ExitCause; EXIT_CAUSES] = [
        ExitCause::QiTail,
        ExitCause::CmdqProd,
        ExitCause::CmdqCons,
        ExitCause::Kick,
        ExitCause::Irq,
        ExitCause::CmdTail,
        ExitCause::Cqt,
        ExitCause::Cqh,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ExitCause::QiTail => "qi_tail",
            ExitCause::CmdqProd => "cmdq_prod",
            ExitCause::CmdTail => "cmd_tail",
            ExitCause::Cqt => "cqt",
            ExitCause::Cqh => "cqh",
            ExitCause::CmdqCons => "cmdq_cons",
            ExitCause::Kick => "kick",
            ExitCause::Irq => "irq",
        }
    }
    /// An access to the IOMMU's registers (not a virtqueue's).
    pub fn is_mmio(self) -> bool {
        !matches!(self, ExitCause::Kick | ExitCause::Irq)
    }
}

/// Exits by cause and the vCPU time each cost (from the doorbell write to re-entry, the emulator's work
/// and any wait for the BQL included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ExitStats {
    pub count: [u64; EXIT_CAUSES],
    pub vcpu_ns: [u64; EXIT_CAUSES],
    /// Time the emulator spent consuming commands (under the BQL).
    pub emulator_ns: u64,
    /// Time a software device's thread (QEMU's virtio-net, vhost's worker) was busy.
    pub device_ns: u64,
    /// Of it, QEMU's device work under the BQL (virtio-net in QEMU's main loop), which the emulated
    /// IOMMU's handlers also take.
    pub bql_ns: u64,
    /// Time the software device waited for the BQL (held by a vCPU's IOMMU handler): QEMU's before its
    /// work, vhost's for QEMU's answer to an IOTLB miss.
    pub bql_wait_ns: u64,
    /// A VFIO device's shadow mappings: VFIO_IOMMU_MAP_DMA / UNMAP_DMA calls and the pages they pinned
    /// and unpinned.
    pub vfio_maps: u64,
    pub vfio_unmaps: u64,
    pub pins: u64,
    pub unpins: u64,
    /// What the emulator did, as QEMU's trace counts it.
    pub work: EmulatorWork,
}

/// The emulator's own work, as QEMU's trace events count it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EmulatorWork {
    /// The emulator's translations of the software device's DMA (QEMU's vtd_iommu_translate,
    /// smmuv3_translate, virtio_iommu_translate): served from its IOTLB or walked on a miss.
    pub translations: u64,
    pub iotlb_hits: u64,
    pub iotlb_misses: u64,
    /// Walks of the guest's page table (one per miss; virtio-iommu looks its tree up instead).
    pub walks: u64,
    /// Times QEMU emptied its full IOTLB hash.
    pub iotlb_resets: u64,
    /// Invalidation descriptors (VT-d, wait descriptors included), commands (SMMUv3, CMD_SYNCs included)
    /// or requests (virtio-iommu) the emulator processed.
    pub inv_processed: u64,
}

impl EmulatorWork {
    /// One translation by the emulator (vtd_iommu_translate, smmuv3_translate, virtio_iommu_translate); with
    /// an IOTLB of its own (`iotlb`), its hit, or its miss and the walk behind it.
    pub fn translated(&mut self, iotlb: bool, hit: bool) {
        self.translations += 1;
        if iotlb {
            self.iotlb_hits += hit as u64;
            self.iotlb_misses += !hit as u64;
            self.walks += !hit as u64;
        }
    }

    fn combine(&mut self, o: &EmulatorWork, f: impl Fn(u64, u64) -> u64) {
        for (a, b) in [
            (&mut self.translations, o.translations),
            (&mut self.iotlb_hits, o.iotlb_hits),
            (&mut self.iotlb_misses, o.iotlb_misses),
            (&mut self.walks, o.walks),
            (&mut self.iotlb_resets, o.iotlb_resets),
            (&mut self.inv_processed, o.inv_processed),
        ] {
            *a = f(*a, b);
        }
    }
}

impl ExitStats {
    /// `n` exits of `cause` that cost the vCPUs `vcpu_ns` in all.
    pub fn record(&mut self, cause: ExitCause, n: u64, vcpu_ns: u64) {
        self.count[cause as usize] += n;
        self.vcpu_ns[cause as usize] += vcpu_ns;
    }

    pub fn since(&self, e: &ExitStats) -> ExitStats {
        let mut d = *self;
        for i in 0..EXIT_CAUSES {
            d.count[i] -= e.count[i];
            d.vcpu_ns[i] -= e.vcpu_ns[i];
        }
        d.emulator_ns -= e.emulator_ns;
        d.device_ns -= e.device_ns;
        d.bql_ns -= e.bql_ns;
        d.bql_wait_ns -= e.bql_wait_ns;
        d.vfio_maps -= e.vfio_maps;
        d.vfio_unmaps -= e.vfio_unmaps;
        d.pins -= e.pins;
        d.unpins -= e.unpins;
        d.work.combine(&e.work, |a, b| a - b);
        d
    }
    pub fn total(&self) -> u64 {
        self.count.iter().sum()
    }
    pub fn add(&mut self, o: &ExitStats) {
        for i in 0..EXIT_CAUSES {
            self.count[i] += o.count[i];
            self.vcpu_ns[i] += o.vcpu_ns[i];
        }
        self.emulator_ns += o.emulator_ns;
        self.device_ns += o.device_ns;
        self.bql_ns += o.bql_ns;
        self.bql_wait_ns += o.bql_wait_ns;
        self.vfio_maps += o.vfio_maps;
        self.vfio_unmaps += o.vfio_unmaps;
        self.pins += o.pins;
        self.unpins += o.unpins;
        self.work.combine(&o.work, |a, b| a + b);
    }
    /// Exits on the IOMMU's registers.
    pub fn mmio_exits(&self) -> u64 {
        ExitCause::ALL
            .iter()
            .filter(|c| c.is_mmio())
            .map(|&c| self.count[c as usize])
            .sum()
    }
}

/// The trap around an emulated IOMMU's doorbell.
#[derive(Debug, Clone)]
pub struct Trap {
    /// VM exit to the VMM's MMIO handler in user space.
    exit_ns: u64,
    /// From the handler's return to the vCPU running guest code again.
    entry_ns: u64,
    /// Nested: the handler's forwarding of the batch to the host (iommufd), on top of the commands' work.
    forward_ns: u64,
    /// QEMU's scan of one IOTLB hash entry by an invalidation.
    pub scan_ns: u64,
    pub stats: ExitStats,
}

impl Trap {
    pub fn new(h: &HypervisorProfile, k: &KvmProfile) -> Self {
        // The profile gives the round trip; KVM's exit and its re-entry are each about half of it.
        let exit_ns = k.mmio_exit_ns / 2;
        Trap {
            exit_ns,
            entry_ns: k.mmio_exit_ns - exit_ns,
            forward_ns: if h.nested { k.nested_inv_ns } else { 0 },
            scan_ns: k.qemu_iotlb_scan_ns,
            stats: ExitStats::default(),
        }
    }

    /// The vCPU writes the doorbell at `at`: when the emulator's handler starts (before any wait for the
    /// BQL).
    pub fn exit(&self, at: Time) -> Time {
        at + self.exit_ns
    }

    /// What the handler adds to the commands' own work: the forwarding ioctl when nested.
    pub fn handler_ns(&self) -> u64 {
        self.forward_ns
    }

    /// The handler that the doorbell written at `at` started returned at `done`, having consumed `cmds`
    /// commands in `work` ns: when the vCPU runs guest code again.
    pub fn resume(&mut self, cause: ExitCause, at: Time, done: Time, work: u64, cmds: u64) -> Time {
        let back = done + self.entry_ns;
        self.stats.record(cause, 1, back - at);
        self.consumed(work, cmds);
        back
    }

    /// The emulator consumed `cmds` commands in `work` ns (for a doorbell counted elsewhere).
    pub fn consumed(&mut self, work: u64, cmds: u64) {
        self.stats.emulator_ns += work;
        self.stats.work.inv_processed += cmds;
    }

    /// A trapped read of a register (CMDQ_CONS) at `at`, its handler able to answer once the emulator's
    /// work ends at `ready` (the BQL held by another vCPU's doorbell until then): when the vCPU runs
    /// guest code again.
    pub fn read(&mut self, cause: ExitCause, at: Time, ready: Time) -> Time {
        let back = (at + self.exit_ns).max(ready) + self.entry_ns;
        self.stats.record(cause, 1, back - at);
        back
    }
}

/// QEMU's walk of its whole IOTLB hash for one invalidation (g_hash_table_foreach_remove, in each emulated
/// IOMMU): `scan_ns` per entry it holds; nothing on bare metal.
pub fn hash_scan_ns(trap: Option<&Trap>, tr: &super::translator::Translator) -> u64 {
    trap.map_or(0, |t| {
        t.scan_ns * tr.qemu_iotlb().map_or(0, |h| h.len()) as u64
    })
}

/// One command written with its own doorbell (AMD-Vi's tail write, the RISC-V IOMMU's CQT write) by `cpu` at
/// `now` under the queue's `lock`, `submit_ns` to write it, `work` ns for the IOMMU. In a guest the doorbell
/// exits, lock held, to QEMU, whose handler processes the command before the vCPU re-enters. Returns when the
/// CPU goes on and when the IOMMU is done with the command.
#[allow(clippy::too_many_arguments)]
pub fn ring(
    lock: &mut SpinLock,
    hw: &mut FifoServer,
    trap: Option<&mut Trap>,
    cause: ExitCause,
    now: Time,
    cpu: u32,
    submit_ns: u64,
    work: u64,
) -> (Time, Time) {
    let (_, written) = lock.lock_on(now, cpu, submit_ns);
    let work = work + trap.as_ref().map_or(0, |t| t.handler_ns());
    let arrive = trap.as_ref().map_or(written, |t| t.exit(written));
    let (_, done) = hw.serve(arrive, work);
    let back = match trap {
        Some(t) => {
            let back = t.resume(cause, written, done, work, 1);
            lock.extend(written, back);
            back
        }
        None => written,
    };
    (back, done)
}

/// Above this many pages a range is synced by walking the whole address space, as QEMU does for a
/// domain-wide invalidation. A modelling bound.
const SHADOW_RANGE_MAX: u64 = 4096;

/// QEMU's shadow of a VFIO device's mappings (vtd_sync_shadow_page_table_range, vfio_iommu_map_notify):
/// on each invalidation the guest's table is walked over the range, every new leaf entry mapped into the
/// host IOMMU with its own VFIO_IOMMU_MAP_DMA (pinning the page), every range gone unmapped with one
/// VFIO_IOMMU_UNMAP_DMA (the host's invalidation and wait, then the unpin). The translator's table stands
/// for both the guest's table and the host's shadow of it: the host side adds cost, not state.
#[derive(Debug, Clone)]
pub struct Shadow {
    mapped: std::collections::BTreeSet<(DomainId, u64)>,
    map_ns: u64,
    map_page_ns: u64,
    unmap_ns: u64,
    unmap_page_ns: u64,
    /// QEMU's walk of the guest table, per page looked at.
    walk_ns: u64,
}

impl Shadow {
    pub fn new(k: &KvmProfile) -> Self {
        Shadow {
            mapped: Default::default(),
            map_ns: k.vfio_map_ns,
            map_page_ns: k.vfio_map_page_ns,
            unmap_ns: k.vfio_unmap_ns,
            unmap_page_ns: k.vfio_unmap_page_ns,
            walk_ns: k.qemu_translate_ns,
        }
    }

    /// A MAP request of `pages` (virtio-iommu: the request names the range; no walk). Returns the ns.
    pub fn map(&mut self, stats: &mut ExitStats, pages: u64) -> u64 {
        stats.vfio_maps += 1;
        stats.pins += pages;
        self.map_ns + pages * self.map_page_ns
    }

    /// An UNMAP of `pages` (virtio-iommu). Returns the ns.
    pub fn unmap(&mut self, stats: &mut ExitStats, pages: u64) -> u64 {
        stats.vfio_unmaps += 1;
        stats.unpins += pages;
        self.unmap_ns + pages * self.unmap_page_ns
    }

    /// Bring the host's mappings of [pfn, pfn + n) of `dom` in line with the guest's table `tr`. Returns
    /// the emulator's ns.
    pub fn sync(
        &mut self,
        stats: &mut ExitStats,
        tr: &super::translator::Translator,
        dom: DomainId,
        pfn: u64,
        n: u64,
    ) -> u64 {
        if n > SHADOW_RANGE_MAX {
            return self.sync_all(stats, tr, dom);
        }
        let mut ns = n * self.walk_ns;
        let mut gone_run = 0;
        for p in pfn..pfn + n {
            let present = tr.lookup(dom, p).is_some();
            let shadowed = self.mapped.contains(&(dom, p));
            if present && !shadowed {
                self.mapped.insert((dom, p));
                ns += self.map(stats, 1);
            } else if !present && shadowed {
                self.mapped.remove(&(dom, p));
                gone_run += 1;
                continue;
            }
            if gone_run > 0 {
                ns += self.unmap(stats, std::mem::take(&mut gone_run));
            }
        }
        if gone_run > 0 {
            ns += self.unmap(stats, gone_run);
        }
        ns
    }

    /// A domain-wide invalidation: QEMU walks the whole address space and unmaps every range gone.
    pub fn sync_all(
        &mut self,
        stats: &mut ExitStats,
        tr: &super::translator::Translator,
        dom: DomainId,
    ) -> u64 {
        let shadowed: Vec<u64> = self
            .mapped
            .range((dom, 0)..=(dom, u64::MAX))
            .map(|&(_, p)| p)
            .collect();
        let mut ns = shadowed.len() as u64 * self.walk_ns;
        let (mut run, mut last) = (0, None);
        for p in shadowed {
            if tr.lookup(dom, p).is_some() {
                continue;
            }
            self.mapped.remove(&(dom, p));
            if run > 0 && last != Some(p - 1) {
                ns += self.unmap(stats, std::mem::take(&mut run));
            }
            run += 1;
            last = Some(p);
        }
        if run > 0 {
            ns += self.unmap(stats, run);
        }
        ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trap_costs_the_round_trip_plus_the_handler_and_counts_once() {
        let mut t = Trap::new(
            &crate::scenario::tests::hypervisor(),
            &crate::scenario::tests::kvm(),
        );
        let start = t.exit(1000);
        assert_eq!(start, 3500);
        let back = t.resume(ExitCause::QiTail, 1000, start + 700, 700, 2);
        assert_eq!(back, 1000 + 5000 + 700);
        assert_eq!(t.stats.count, [1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(t.stats.work.inv_processed, 2);
        assert_eq!(t.handler_ns(), 0);
        assert_eq!(t.stats.vcpu_ns[0], 5700);
        assert_eq!(t.stats.emulator_ns, 700);
    }
}
