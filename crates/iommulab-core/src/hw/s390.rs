//! s390's zPCI IOMMU (drivers/iommu/s390-iommu.c): `explain` knows its default-domain rules; iommulab does
//! not model its hardware.

use super::driver::{KernelDriver, Switch};
use crate::kernel::{Arch, KernelVersion};

pub struct S390Driver;

impl KernelDriver for S390Driver {
    fn name(&self) -> &'static str {
        "s390"
    }
    fn title(&self) -> &'static str {
        "s390 zPCI"
    }
    fn archs(&self) -> &'static [Arch] {
        &[Arch::S390]
    }
    fn arch_expected(&self) -> &'static str {
        "expected s390: the platform's IOMMU is s390's zPCI"
    }
    fn param(&self) -> Option<&'static str> {
        Some("s390_iommu")
    }
    // s390-iommu.c s390_iommu_setup().
    fn switch(&self, opt: &str, _k: KernelVersion) -> Option<Switch> {
        (opt == "strict").then_some(Switch::Strict(
            "s390_iommu=strict deprecated; use iommu.strict=1 instead",
        ))
    }
    // s390_iommu_probe_device(): a zPCI function that needs TLB refreshes (z/VM, KVM) sets shadow_on_flush.
    fn shadow_on_flush(&self) -> Option<&'static str> {
        Some("zPCI (tlb_refresh)")
    }
}
