//! What every IOMMU shares on the translation side: per-domain radix page tables, a set-associative IOTLB
//! tagged by domain (VT-d domain id, SMMU ASID/VMID), and one paging-structure (walk) cache per non-leaf
//! level. Vendors put their invalidation interfaces and costs on top.

use super::cache::TagCache;
use super::pgtable::RadixPgtable;
use super::{DomainId, IommuCounters, IotlbGather, Translation};
use crate::scenario::IommuProfile;

/// Cache tags carry the domain in their top bits.
const DOM_SHIFT: u32 = 52;
const KEY_MASK: u64 = (1 << DOM_SHIFT) - 1;

#[inline]
fn tag(dom: DomainId, key: u64) -> u64 {
    ((dom as u64) << DOM_SHIFT) | key
}

#[inline]
fn tag_dom(t: u64) -> u64 {
    t >> DOM_SHIFT
}

pub struct Translator {
    levels: u32,
    domains: Vec<Option<RadixPgtable>>,
    iotlb: TagCache,
    /// pwc[0] caches top-level entries (F&S PTcache-L1); pwc[levels-2] the entries pointing at leaf tables.
    pwc: Vec<TagCache>,
    pub c: IommuCounters,
}

impl Translator {
    pub fn new(p: &IommuProfile) -> Self {
        Translator {
            levels: p.pt_levels,
            domains: Vec::new(),
            iotlb: TagCache::new(p.iotlb_entries as usize, p.iotlb_ways as usize),
            pwc: p
                .pwc_entries
                .iter()
                .map(|&n| TagCache::new(n.max(1) as usize, n.max(1) as usize))
                .collect(),
            c: IommuCounters::default(),
        }
    }

    fn pt(&mut self, dom: DomainId) -> &mut RadixPgtable {
        let i = dom as usize;
        if self.domains.len() <= i {
            self.domains.resize_with(i + 1, || None);
        }
        let levels = self.levels;
        self.domains[i].get_or_insert_with(|| RadixPgtable::new(levels))
    }

    /// Walk-cache index (0 = top) → shift of the IOVA pfn its entries are tagged by.
    fn pwc_shift(&self, i: usize) -> u32 {
        9 * (self.levels - 1 - i as u32)
    }

    /// Install `n` leaf PTEs; returns PTEs written.
    pub fn map(&mut self, dom: DomainId, iova_pfn: u64, phys_pfn: u64, n: u64) -> u64 {
        let pt = self.pt(dom);
        let before = pt.tables_allocated;
        let w = pt.map(iova_pfn, phys_pfn, n);
        let grown = pt.tables_allocated - before;
        self.c.table_pages_allocated += grown;
        w
    }

    /// Clear `n` leaf PTEs (freeing tables the range covers) into `gather`. Returns pages unmapped.
    pub fn unmap(&mut self, dom: DomainId, iova_pfn: u64, n: u64, gather: &mut IotlbGather) -> u64 {
        let (un, freed) = self.pt(dom).unmap(iova_pfn, n);
        self.c.table_pages_freed += freed as u64;
        gather.add_range(iova_pfn, n);
        gather.freed_tables += freed;
        un
    }

    pub fn lookup(&self, dom: DomainId, iova_pfn: u64) -> Option<u64> {
        self.domains
            .get(dom as usize)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.lookup(iova_pfn))
    }

    /// Device side: IOTLB, then the walk caches lowest level first; each level missed costs one more read.
    pub fn translate(&mut self, dom: DomainId, iova_pfn: u64) -> Translation {
        self.c.translations += 1;
        let t = tag(dom, iova_pfn);
        let current = self.lookup(dom, iova_pfn);
        if let Some(cached) = self.iotlb.lookup(t, iova_pfn) {
            let stale = current != Some(cached);
            self.c.stale_hits += stale as u64;
            return Translation {
                iotlb_hit: true,
                walk_reads: 0,
                phys: Some(cached),
                stale,
            };
        }
        self.c.iotlb_misses += 1;
        let mut reads = 1; // the leaf PTE
        let levels = self.pwc.len();
        let mut i = levels;
        while i > 0 {
            let s = self.pwc_shift(i - 1);
            if self.pwc[i - 1]
                .lookup(tag(dom, iova_pfn >> s), iova_pfn >> s)
                .is_some()
            {
                break;
            }
            self.c.pwc_misses[i - 1] += 1;
            reads += 1;
            i -= 1;
        }
        self.c.walk_reads += reads;
        let Some(phys) = current else {
            self.c.faults += 1;
            return Translation {
                iotlb_hit: false,
                walk_reads: reads as u32,
                phys: None,
                stale: false,
            };
        };
        for j in i..levels {
            let s = self.pwc_shift(j);
            self.pwc[j].insert(tag(dom, iova_pfn >> s), iova_pfn >> s, 0);
        }
        self.iotlb.insert(t, iova_pfn, phys);
        Translation {
            iotlb_hit: false,
            walk_reads: reads as u32,
            phys: Some(phys),
            stale: false,
        }
    }

    /// Drop IOTLB entries of `dom` for [pfn, pfn + n); walk-cache entries for the range too unless `leaf_only`
    /// (VT-d IH=1, SMMUv3 TLBI with Leaf=1).
    pub fn invalidate_range(&mut self, dom: DomainId, pfn: u64, n: u64, leaf_only: bool) {
        let end = pfn.saturating_add(n);
        if n <= self.iotlb.entries() as u64 {
            for p in pfn..end {
                self.iotlb.invalidate(tag(dom, p), p);
            }
        } else {
            self.iotlb.invalidate_where(|t| {
                tag_dom(t) == dom as u64 && (pfn..end).contains(&(t & KEY_MASK))
            });
        }
        if !leaf_only {
            for i in 0..self.pwc.len() {
                let s = self.pwc_shift(i);
                let (lo, hi) = (pfn >> s, (end - 1) >> s);
                self.pwc[i].invalidate_where(|t| {
                    tag_dom(t) == dom as u64 && (lo..=hi).contains(&(t & KEY_MASK))
                });
            }
        }
    }

    /// Drop every IOTLB and walk-cache entry of `dom`.
    pub fn invalidate_domain(&mut self, dom: DomainId) {
        self.iotlb.invalidate_where(|t| tag_dom(t) == dom as u64);
        for p in &mut self.pwc {
            p.invalidate_where(|t| tag_dom(t) == dom as u64);
        }
    }

    pub fn invalidate_all(&mut self) {
        self.iotlb.invalidate_where(|_| true);
        for p in &mut self.pwc {
            p.invalidate_where(|_| true);
        }
    }
}
