//! FANDS (seed 002 §3.1, Linux 6.0.3 + fands.patch): an RX multi-packet WQE gets one contiguous IOVA block
//! (mlx5e_alloc_rx_mpwqe: iommu_dma_alloc_iova of 64 pages); each page is mapped into it
//! (dma_map_page_attrs_iova), the first one issuing iotlb_sync_map for the whole block; at WQE teardown
//! the last page unmaps the whole block with one iotlb_sync and frees the IOVA (__iommu_dma_unmap_iova).
//! The pages are not recycled while the device is behind an IOMMU (mlx5e_free_rx_mpwqe calls
//! mlx5e_page_release with recycle = false): every WQE takes fresh pages. Every other mapping (TX, ACKs,
//! rings) is strict. The patch's dmar.c change makes qi_flush_iotlb() take IH from the address, so every
//! PSI whose unmap freed no table keeps the walk caches. The driver side lives in the NIC RX workload; this
//! file is the DMA side.

use super::strict::Strict;
use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::Time;

pub struct Fands;

impl DmaPolicy for Fands {
    fn name(&self) -> PolicyName {
        PolicyName::Fands
    }
    fn rx_wqe_iova_blocks(&self) -> bool {
        true
    }
    fn psi_ih(&self) -> bool {
        true
    }
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time {
        Strict.unmap(core, now, cpu, iova_pfn, pages)
    }
}
