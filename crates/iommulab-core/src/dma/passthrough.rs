//! Identity domain (passthrough): dma-direct; DMA addresses are physical and nothing is translated.

use super::{DmaCore, DmaPolicy};
use crate::scenario::PolicyName;
use crate::sim::Time;

pub struct Passthrough;

impl DmaPolicy for Passthrough {
    fn name(&self) -> PolicyName {
        PolicyName::Passthrough
    }
    fn translated(&self) -> bool {
        false
    }
    fn map(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        _cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        core.stats.maps += 1;
        core.stats.pages_mapped += pages;
        Some((phys_pfn, now + core.costs.dma_direct_op_ns))
    }
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        _cpu: usize,
        _iova_pfn: u64,
        _pages: u64,
    ) -> Time {
        core.stats.unmaps += 1;
        now + core.costs.dma_direct_op_ns
    }
}
