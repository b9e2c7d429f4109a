//! Strict (IOMMU_DOMAIN_DMA): __iommu_dma_unmap() syncs the IOTLB before the IOVA is freed.

use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::Time;

pub struct Strict;

impl DmaPolicy for Strict {
    fn name(&self) -> PolicyName {
        PolicyName::Strict
    }
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        let (g, t, _) = core.unmap_ptes(now, cpu, iova_pfn, pages);
        // iommu_iotlb_sync(): invalidate and wait, then iommu_dma_free_iova() → free_iova_fast().
        let t = core.iotlb_sync(t, cpu, &g);
        core.free_iova(t, cpu, iova_pfn, pages)
    }
}
