//! Arm SMMUv3: LPAE page table (4K granule), TLB and walk caches (shared [`Translator`]) and the command
//! queue as drivers/iommu/arm/arm-smmu-v3/arm-smmu-v3.c drives it: TLBI_NH_VA / TLBI_S2_IPA per granule, or
//! range commands (TG/SCALE/NUM/TTL) with RIL; TLBI_NH_ASID / TLBI_S12_VMALL for a whole domain; batches of
//! CMDQ_BATCH_ENTRIES issued without sync and a CMD_SYNC at the end; one queue shared by all CPUs (the
//! lock-free insertion still serialises on the producer index) or per-CPU ECMDQs.

use super::translator::Translator;
use super::{DomainId, InvKind, Iommu, IotlbGather, PAGE_SHIFT};
use crate::scenario::{IommuProfile, Smmuv3Profile};
use crate::sim::{SpinLock, Time};

/// arm-smmu-v3.h CMDQ_BATCH_ENTRIES (BITS_PER_LONG): commands per batch before an unsynchronised issue.
pub const CMDQ_BATCH_ENTRIES: usize = 64;
/// arm-smmu-v3.h CMDQ_TLBI_RANGE_NUM_MAX: the 5-bit NUM field.
pub const CMDQ_TLBI_RANGE_NUM_MAX: u64 = 31;
/// log2 of the leaf granule (4 KiB).
const TG_SHIFT: u32 = 12;

/// One TLBI command by address, with the fields __arm_smmu_tlb_inv_range() fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TlbiRange {
    /// First 4 KiB page the command covers.
    pub addr_pfn: u64,
    /// Pages it covers.
    pub pages: u64,
    /// Range fields (0 without RIL): TG = (tg-10)/2, SCALE, NUM (encoded as num-1), TTL (0 = any level).
    pub tg: u32,
    pub scale: u32,
    pub num: u32,
    pub ttl: u32,
    pub leaf: bool,
}

/// __arm_smmu_tlb_inv_range(): the TLBI commands for [iova_pfn, iova_pfn + pages) of 4 KiB leaves. With RIL,
/// one command per 5-bit chunk of the page count; without, one command per granule.
pub fn tlbi_range_cmds(iova_pfn: u64, pages: u64, leaf: bool, ril: bool) -> Vec<TlbiRange> {
    let mut out = Vec::new();
    if pages == 0 {
        return out;
    }
    if !ril {
        return (0..pages)
            .map(|i| TlbiRange {
                addr_pfn: iova_pfn + i,
                pages: 1,
                tg: 0,
                scale: 0,
                num: 0,
                ttl: 0,
                leaf,
            })
            .collect();
    }
    let tg = (TG_SHIFT - 10) / 2;
    // Leaf: TTL from the granule's level (4 - (ilog2(granule) - 3) / (tg - 3)); non-leaf keeps TTL 0 and avoids
    // a lone NUM of 1 by rounding up.
    // The gather's page size: only 4 KiB leaves are mapped in this model.
    let granule_shift = PAGE_SHIFT;
    let ttl = if leaf {
        4 - (granule_shift - 3) / (TG_SHIFT - 3)
    } else {
        0
    };
    let mut num_pages = pages;
    if !leaf && (num_pages & CMDQ_TLBI_RANGE_NUM_MAX) == 1 {
        num_pages += 1;
    }
    let end = iova_pfn + pages;
    let mut addr = iova_pfn;
    while addr < end && num_pages > 0 {
        let scale = num_pages.trailing_zeros();
        let num = (num_pages >> scale) & CMDQ_TLBI_RANGE_NUM_MAX;
        let span = num << scale;
        out.push(TlbiRange {
            addr_pfn: addr,
            pages: span,
            tg,
            scale,
            num: num as u32 - 1,
            ttl,
            leaf,
        });
        num_pages -= span;
        addr += span;
    }
    out
}

pub struct Smmuv3 {
    cfg: Smmuv3Profile,
    tr: Translator,
    /// The shared command queue's producer index (cmpxchg-reserved slots): one writer at a time.
    cmdq_prod: SpinLock,
    /// Per-CPU ECMDQs: each CPU inserts into its own queue.
    ecmdq_prod: Vec<SpinLock>,
    /// The SMMU consuming commands, one after another.
    hw: SpinLock,
}

impl Smmuv3 {
    pub fn new(p: &IommuProfile, cpus: usize) -> Self {
        Smmuv3 {
            cfg: p
                .smmuv3
                .clone()
                .expect("validated: vendor smmuv3 has [iommu.smmuv3]"),
            tr: Translator::new(p),
            cmdq_prod: SpinLock::default(),
            ecmdq_prod: vec![SpinLock::default(); cpus.max(1)],
            hw: SpinLock::default(),
        }
    }

    fn by_va(&self) -> InvKind {
        if self.cfg.stage == 2 {
            InvKind::TlbiS2Ipa
        } else {
            InvKind::TlbiNhVa
        }
    }

    /// arm_smmu_cmdq_issue_cmdlist() for `n` commands, with a CMD_SYNC appended when `sync`. Returns the time
    /// the CPU is released: after insertion, or after the SMMU has consumed up to its CMD_SYNC.
    fn issue(&mut self, now: Time, cpu: usize, n: usize, sync: bool) -> Time {
        let cmds = n as u64 + sync as u64;
        let nq = self.ecmdq_prod.len();
        let prod = if self.cfg.ecmdq {
            &mut self.ecmdq_prod[cpu % nq]
        } else {
            &mut self.cmdq_prod
        };
        let (_, written) = prod.acquire(now, cmds * self.cfg.submit_cmd_ns);
        let work = n as u64 * self.cfg.cmd_ns + if sync { self.cfg.sync_ns } else { 0 };
        let (_, done) = self.hw.acquire(written, work);
        self.tr.c.submissions += 1;
        if !sync {
            return written;
        }
        self.tr.c.syncs += 1;
        self.tr.c.inv_wait_ns += done - now;
        done
    }

    /// arm_smmu_tlb_inv_range_domain(): the range commands in batches, then CMD_SYNC.
    fn inv_range(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        pfn: u64,
        pages: u64,
        leaf: bool,
    ) -> Time {
        let cmds = tlbi_range_cmds(pfn, pages, leaf, self.cfg.ril);
        let kind = self.by_va();
        let mut t = now;
        for (i, chunk) in cmds.chunks(CMDQ_BATCH_ENTRIES).enumerate() {
            let last = (i + 1) * CMDQ_BATCH_ENTRIES >= cmds.len();
            for c in chunk {
                // Leaf=1 may keep walk-cache entries; a non-leaf TLBI removes them for the range.
                self.tr.invalidate_range(dom, c.addr_pfn, c.pages, c.leaf);
            }
            self.tr.c.count(kind, chunk.len() as u64);
            t = self.issue(t, cpu, chunk.len(), last);
        }
        t
    }
}

impl Iommu for Smmuv3 {
    fn name(&self) -> &'static str {
        "smmuv3"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        if self.cfg.stage == 2 {
            &[InvKind::TlbiS2Ipa, InvKind::TlbiS12Vmall, InvKind::AtcInv]
        } else {
            &[InvKind::TlbiNhVa, InvKind::TlbiNhAsid, InvKind::AtcInv]
        }
    }

    fn translator(&self) -> &Translator {
        &self.tr
    }

    fn translator_mut(&mut self) -> &mut Translator {
        &mut self.tr
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
        let before = gather.freed_tables;
        let un = self.tr.unmap(dom, iova_pfn, n, gather);
        // io-pgtable-arm: a freed table is flushed at once (tlb_flush_walk → non-leaf range invalidation), even
        // when the unmap itself is queued for a lazy flush. Simplification: one walk flush over the unmapped
        // range, which covers every freed table's span.
        if gather.freed_tables > before {
            let t = self.inv_range(now, cpu, dom, iova_pfn, n, false);
            return (un, t);
        }
        (un, now)
    }

    fn iotlb_sync_map(
        &mut self,
        now: Time,
        _cpu: usize,
        _dom: DomainId,
        _iova_pfn: u64,
        _n: u64,
    ) -> Time {
        // arm-smmu-v3 has no iotlb_sync_map.
        now
    }

    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        // arm_smmu_iotlb_sync() → arm_smmu_tlb_inv_range_domain(leaf = true).
        self.inv_range(now, cpu, dom, g.start, g.pages(), true)
    }

    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // arm_smmu_tlb_inv_context(): TLBI_NH_ASID (stage 1) or TLBI_S12_VMALL (stage 2), with sync.
        let kind = if self.cfg.stage == 2 {
            InvKind::TlbiS12Vmall
        } else {
            InvKind::TlbiNhAsid
        };
        self.tr.c.count(kind, 1);
        self.tr.invalidate_domain(dom);
        self.issue(now, cpu, 1, true)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn cfg(ril: bool, ecmdq: bool) -> IommuProfile {
        IommuProfile {
            iotlb_entries: 2048,
            iotlb_ways: 4,
            pwc_entries: vec![4, 28, 348],
            pt_levels: 4,
            vtd: None,
            smmuv3: Some(Smmuv3Profile {
                submit_cmd_ns: 10,
                cmd_ns: 50,
                sync_ns: 500,
                ril,
                ecmdq,
                stage: 1,
            }),
        }
    }

    fn fields(c: &[TlbiRange]) -> Vec<(u32, u32, u64)> {
        c.iter().map(|c| (c.scale, c.num, c.pages)).collect()
    }

    #[test]
    fn ril_encodings_for_1_31_32_513_pages() {
        // (SCALE, NUM field = num-1, pages covered)
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 1, true, true)),
            vec![(0, 0, 1)]
        );
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 31, true, true)),
            vec![(0, 30, 31)]
        );
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 32, true, true)),
            vec![(5, 0, 32)]
        );
        let c = tlbi_range_cmds(0x100, 513, true, true);
        assert_eq!(fields(&c), vec![(0, 0, 1), (9, 0, 512)]);
        assert_eq!(
            (c[1].addr_pfn, c[0].tg, c[0].ttl),
            (0x101, 1, 3),
            "4K granule: TG=1, leaf TTL=3"
        );
        // Without RIL: one command per granule.
        assert_eq!(tlbi_range_cmds(0x100, 513, true, false).len(), 513);
        // Non-leaf with a lone NUM of 1 rounds up, TTL 0.
        let c = tlbi_range_cmds(0x200, 1, false, true);
        assert_eq!((fields(&c), c[0].ttl), (vec![(1, 0, 2)], 0));
    }

    #[test]
    fn batches_of_64_with_one_sync() {
        let mut s = Smmuv3::new(&cfg(false, false), 2);
        s.map_pages(1, 0, 0, 1);
        let mut g = IotlbGather::new();
        g.add_range(0x1000, 130);
        let t = s.iotlb_sync(0, 0, 1, &g);
        assert_eq!(s.tr.c.get(InvKind::TlbiNhVa), 130);
        assert_eq!(
            (s.tr.c.submissions, s.tr.c.syncs),
            (3, 1),
            "64 + 64 unsynced, 2 + CMD_SYNC"
        );
        // The SMMU starts on the first batch as soon as it is inserted; later insertions overlap with it.
        assert_eq!(t, 64 * 10 + 130 * 50 + 500);
    }

    #[test]
    fn flush_all_is_one_asid_command_and_drops_walk_caches() {
        let mut s = Smmuv3::new(&cfg(true, false), 1);
        s.map_pages(1, 0x40000, 7, 2);
        s.translate(1, 0x40000);
        assert_eq!(s.translate(1, 0x40001).walk_reads, 1);
        s.flush_iotlb_all(0, 0, 1);
        assert_eq!(s.tr.c.get(InvKind::TlbiNhAsid), 1);
        assert_eq!(s.translate(1, 0x40001).walk_reads, 4);
    }

    #[test]
    fn freeing_a_table_issues_a_non_leaf_invalidation_at_once() {
        let mut s = Smmuv3::new(&cfg(true, false), 1);
        s.map_pages(1, 512, 9000, 512); // exactly one leaf table
        s.translate(1, 512);
        let mut g = IotlbGather::new();
        let (un, t) = s.unmap_pages(100, 0, 1, 512, 512, &mut g);
        assert_eq!((un, g.freed_tables), (512, 1));
        assert!(t > 100, "the walk flush is synchronous");
        assert_eq!(
            s.tr.c.get(InvKind::TlbiNhVa),
            1,
            "512 pages: one range command (SCALE 9)"
        );
        assert_eq!(s.tr.c.syncs, 1);
        // Leaf-only unmap frees nothing and issues nothing until the sync.
        s.map_pages(1, 0x5000, 1, 4);
        let mut g = IotlbGather::new();
        let (_, t) = s.unmap_pages(200, 0, 1, 0x5000, 1, &mut g);
        assert_eq!(t, 200);
    }

    #[test]
    fn ecmdq_removes_insertion_contention_between_cpus() {
        let mut shared = Smmuv3::new(&cfg(true, false), 2);
        let mut per_cpu = Smmuv3::new(&cfg(true, true), 2);
        for s in [&mut shared, &mut per_cpu] {
            s.flush_iotlb_all(0, 0, 1);
            s.flush_iotlb_all(0, 1, 1);
        }
        assert!(
            shared.cmdq_prod.contended == 1 && per_cpu.ecmdq_prod.iter().all(|l| l.contended == 0)
        );
    }
}
