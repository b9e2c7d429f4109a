//! The OS DMA-mapping layer: the IOVA allocator, iommu-dma map/unmap, and the domain's invalidation policy.
//!
//! [`DmaCore`] holds what every policy shares (the IOMMU, the IOVA domain, the costs) and implements the
//! common iommu-dma paths; a [`DmaPolicy`] decides what happens around them — one file per policy.

pub mod default_domain;
pub mod flush_queue;
pub mod iova;
pub mod passthrough;
pub mod strict;

use crate::hw::{DomainId, Iommu, IotlbGather, Translation};
use crate::scenario::{CpuProfile, PolicyName};
use crate::sim::Time;
use iova::{IovaCosts, IovaDomain};

/// Counters of the DMA API as the kernel would see them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DmaStats {
    pub maps: u64,
    pub unmaps: u64,
    pub pages_mapped: u64,
    /// IOVA pages whose PTEs were cleared (intel_iommu_unmap's count: size >> VTD_PAGE_SHIFT).
    pub iova_pages_unmapped: u64,
    pub map_failures: u64,
    /// Flush-queue flushes from a full per-CPU ring (synchronous in queue_iova) and from the timer.
    pub fq_flush_full: u64,
    pub fq_flush_timer: u64,
}

/// What all policies share.
pub struct DmaCore {
    pub iommu: Box<dyn Iommu>,
    pub iovad: IovaDomain,
    pub dom: DomainId,
    pub costs: CpuProfile,
    pub stats: DmaStats,
    /// Device DMA mask in pfns (64-bit capable device, limited by the page table's input size).
    dma_limit_pfn: u64,
    /// dev->iommu->pci_32bit_workaround: try below 4 GiB first until that fails once.
    pci_32bit_workaround: bool,
    /// A timer the policy armed, for the engine to schedule: (expiry, CPU that armed it).
    pub timer_request: Option<(Time, usize)>,
}

impl DmaCore {
    pub fn new(iommu: Box<dyn Iommu>, cpus: usize, costs: &CpuProfile, pt_levels: u32) -> Self {
        let ic = IovaCosts {
            rcache_ns: costs.iova_rcache_ns,
            rbtree_ns: costs.iova_rbtree_ns,
            lock_ns: costs.lock_ns,
        };
        DmaCore {
            iommu,
            iovad: IovaDomain::new(1, cpus, ic),
            dom: 1,
            costs: costs.clone(),
            stats: DmaStats::default(),
            dma_limit_pfn: (1u64 << (9 * pt_levels)) - 1,
            pci_32bit_workaround: true,
            timer_request: None,
        }
    }

    /// iommu_dma_alloc_iova(): PCI devices first try below 4 GiB without flushing the rcaches.
    fn alloc_iova(&mut self, now: Time, cpu: usize, pages: u64) -> (Option<u64>, Time) {
        let mut t = now;
        if self.pci_32bit_workaround && self.dma_limit_pfn > (1 << 20) - 1 {
            let (p, t2) = self.iovad.alloc_fast(t, cpu, pages, (1 << 20) - 1, false);
            if p.is_some() {
                return (p, t2);
            }
            t = t2;
            self.pci_32bit_workaround = false;
        }
        self.iovad
            .alloc_fast(t, cpu, pages, self.dma_limit_pfn, true)
    }

    /// __iommu_dma_map(): allocate IOVA, write the PTEs, iotlb_sync_map. Returns (iova pfn, release time).
    pub fn iommu_map(
        &mut self,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        let t = now + self.costs.dma_iommu_op_ns;
        let (iova, t) = self.alloc_iova(t, cpu, pages);
        let Some(iova) = iova else {
            self.stats.map_failures += 1;
            return None;
        };
        let written = self.iommu.map_pages(self.dom, iova, phys_pfn, pages);
        let t = t + written * self.costs.pte_ns;
        let t = self.iommu.iotlb_sync_map(t, cpu, self.dom, iova, pages);
        self.stats.maps += 1;
        self.stats.pages_mapped += pages;
        Some((iova, t))
    }

    /// iommu_unmap_fast(): clear the PTEs into a gather. Returns the gather and the time.
    pub fn unmap_ptes(
        &mut self,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> (IotlbGather, Time) {
        let mut g = IotlbGather::new();
        let t = now + self.costs.dma_iommu_op_ns;
        let (un, t) = self
            .iommu
            .unmap_pages(t, cpu, self.dom, iova_pfn, pages, &mut g);
        self.stats.unmaps += 1;
        self.stats.iova_pages_unmapped += un;
        (g, t + un * self.costs.pte_ns)
    }
}

/// A DMA-mapping policy: what dma_map/dma_unmap do around the shared iommu-dma paths.
pub trait DmaPolicy: Send + Sync {
    fn name(&self) -> PolicyName;
    /// Whether the device's DMA goes through IOMMU translation (false for an identity domain).
    fn translated(&self) -> bool {
        true
    }
    /// dma_map_page(): the DMA address (pfn) and the time the CPU is released.
    fn map(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        phys_pfn: u64,
        pages: u64,
    ) -> Option<(u64, Time)> {
        core.iommu_map(now, cpu, phys_pfn, pages)
    }
    /// dma_unmap_page(): returns the time the CPU is released.
    fn unmap(
        &mut self,
        core: &mut DmaCore,
        now: Time,
        cpu: usize,
        iova_pfn: u64,
        pages: u64,
    ) -> Time;
    /// A timer this policy armed (through `core.timer_request`) fired on `cpu`. Returns the release time.
    fn timer(&mut self, _core: &mut DmaCore, now: Time, _cpu: usize) -> Time {
        now
    }
}

/// The DMA layer of one device: shared state plus its domain's policy.
pub struct DmaLayer {
    pub core: DmaCore,
    pub policy: Box<dyn DmaPolicy>,
}

impl DmaLayer {
    pub fn new(core: DmaCore, policy: PolicyName, cpus: usize, hz: u32) -> Self {
        let policy: Box<dyn DmaPolicy> = match policy {
            PolicyName::Passthrough => Box::new(passthrough::Passthrough),
            PolicyName::Strict => Box::new(strict::Strict),
            PolicyName::Lazy => Box::new(flush_queue::FlushQueue::new(cpus, hz)),
            PolicyName::Auto => unreachable!("resolved before the host is built"),
        };
        DmaLayer { core, policy }
    }
    pub fn map(&mut self, now: Time, cpu: usize, phys_pfn: u64, pages: u64) -> Option<(u64, Time)> {
        self.policy.map(&mut self.core, now, cpu, phys_pfn, pages)
    }
    pub fn unmap(&mut self, now: Time, cpu: usize, iova_pfn: u64, pages: u64) -> Time {
        self.policy.unmap(&mut self.core, now, cpu, iova_pfn, pages)
    }
    pub fn timer(&mut self, now: Time, cpu: usize) -> Time {
        self.policy.timer(&mut self.core, now, cpu)
    }
    /// Device side: translate one page, or None when the domain is identity (no translation).
    pub fn translate(&mut self, iova_pfn: u64) -> Option<Translation> {
        if self.policy.translated() {
            Some(self.core.iommu.translate(self.core.dom, iova_pfn))
        } else {
            None
        }
    }
}
