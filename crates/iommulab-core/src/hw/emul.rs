//! An IOMMU emulated by the hypervisor (QEMU's hw/i386/intel_iommu.c and hw/arm/smmuv3.c under KVM): the
//! guest's driver runs unchanged on a vCPU and writes its commands into guest memory; its doorbell write
//! (VT-d's invalidation-queue tail, DMAR_IQT_REG; SMMUv3's CMDQ_PROD) is an MMIO access KVM cannot handle,
//! so the vCPU exits to the VMM. The VMM's MMIO handler runs in that vCPU's thread under QEMU's big lock
//! (BQL): it consumes every command queued up to the new tail (vtd_fetch_inv_desc, smmuv3_cmdq_consume),
//! completes the wait descriptor or CMD_SYNC, and returns; the vCPU re-enters the guest. The vendor model
//! keeps the guest driver's side (descriptors, batching, locks) and its queue of work, which the emulator
//! serves in place of hardware; this module adds the exit and re-entry and counts them.

use crate::scenario::HypervisorProfile;
use crate::sim::Time;
use serde::Serialize;

/// Why a vCPU left the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCause {
    /// VT-d: the driver advanced the invalidation queue tail (qi_submit_sync's writel to DMAR_IQT_REG).
    QiTail,
    /// SMMUv3: the command-queue owner advanced CMDQ_PROD (arm_smmu_cmdq_issue_cmdlist).
    CmdqProd,
    /// A virtqueue notification (virtio-net's, virtio-iommu's request queue): an ioeventfd exit KVM
    /// completes in the kernel.
    Kick,
}

pub const EXIT_CAUSES: usize = 3;

impl ExitCause {
    pub const ALL: [ExitCause; EXIT_CAUSES] =
        [ExitCause::QiTail, ExitCause::CmdqProd, ExitCause::Kick];
    pub fn name(self) -> &'static str {
        match self {
            ExitCause::QiTail => "qi_tail",
            ExitCause::CmdqProd => "cmdq_prod",
            ExitCause::Kick => "kick",
        }
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
}

impl ExitStats {
    pub fn since(&self, e: &ExitStats) -> ExitStats {
        let mut d = *self;
        for i in 0..EXIT_CAUSES {
            d.count[i] -= e.count[i];
            d.vcpu_ns[i] -= e.vcpu_ns[i];
        }
        d.emulator_ns -= e.emulator_ns;
        d.device_ns -= e.device_ns;
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
    }
}

/// The trap around an emulated IOMMU's doorbell.
#[derive(Debug, Clone)]
pub struct Trap {
    /// VM exit to the VMM's MMIO handler in user space.
    exit_ns: u64,
    /// From the handler's return to the vCPU running guest code again.
    entry_ns: u64,
    pub stats: ExitStats,
}

impl Trap {
    pub fn new(h: &HypervisorProfile) -> Self {
        // The profile gives the round trip; KVM's exit and its re-entry are each about half of it.
        let exit_ns = h.mmio_exit_ns / 2;
        Trap {
            exit_ns,
            entry_ns: h.mmio_exit_ns - exit_ns,
            stats: ExitStats::default(),
        }
    }

    /// The vCPU writes the doorbell at `at`: when the emulator's handler starts (before any wait for the
    /// BQL).
    pub fn exit(&self, at: Time) -> Time {
        at + self.exit_ns
    }

    /// The handler that the doorbell written at `at` started returned at `done`, having consumed `work` ns
    /// of commands: when the vCPU runs guest code again.
    pub fn resume(&mut self, cause: ExitCause, at: Time, done: Time, work: u64) -> Time {
        let back = done + self.entry_ns;
        self.stats.count[cause as usize] += 1;
        self.stats.vcpu_ns[cause as usize] += back - at;
        self.stats.emulator_ns += work;
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trap_costs_the_round_trip_plus_the_handler_and_counts_once() {
        let h = HypervisorProfile {
            mmio_exit_ns: 5000,
            ..crate::scenario::tests::hypervisor()
        };
        let mut t = Trap::new(&h);
        let start = t.exit(1000);
        assert_eq!(start, 3500);
        let back = t.resume(ExitCause::QiTail, 1000, start + 700, 700);
        assert_eq!(back, 1000 + 5000 + 700);
        assert_eq!(t.stats.count, [1, 0, 0]);
        assert_eq!(t.stats.vcpu_ns[0], 5700);
        assert_eq!(t.stats.emulator_ns, 700);
    }
}
