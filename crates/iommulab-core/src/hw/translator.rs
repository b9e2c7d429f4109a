//! What every IOMMU shares on the translation side: per-domain page tables in the vendor's format, an IOTLB
//! tagged by domain (VT-d domain id, SMMU ASID/VMID) and page size, one paging-structure (walk) cache per
//! non-leaf level, and optionally the device's ATS translation cache. Vendors put their invalidation
//! interfaces and costs on top. Addresses in this interface are 4 KiB pfns; the tables work in granules.
//!
//! An invalidation acts on the caches when the IOMMU processes it, not when the CPU writes it: vendors hand
//! each one over with that time ([`Translator::invalidate`]) and a translation first applies those due by
//! its own time ([`Translator::settle`]). A device access between the request and its processing still
//! finds the entries, as on hardware; two invalidations a CPU sends back to back each cost the device's
//! next walk its cached entries.

use super::cache::{PsiMatch, QemuIotlb, TagCache};
use super::pgtable::{PtFormat, RadixPgtable};
use super::IommuProfile;
use super::{DomainId, IommuCounters, IotlbGather, Translation};
use crate::sim::Time;
use std::collections::VecDeque;

/// Cache tags: domain in the top bits, then the level of the cached entry, then the index.
const DOM_SHIFT: u32 = 52;
const LEVEL_SHIFT: u32 = 48;
const INDEX_MASK: u64 = (1 << LEVEL_SHIFT) - 1;

#[inline]
fn tag(dom: DomainId, level: u32, index: u64) -> u64 {
    ((dom as u64) << DOM_SHIFT) | ((level as u64) << LEVEL_SHIFT) | (index & INDEX_MASK)
}

#[inline]
fn tag_dom(t: u64) -> u64 {
    t >> DOM_SHIFT
}

#[inline]
fn tag_level(t: u64) -> u32 {
    ((t >> LEVEL_SHIFT) & 0xf) as u32
}

/// Drop the entries of `c` tagged (`dom`, `level`, index in [a, b]): a few looked up in their sets, a wide
/// range by one scan of the cache.
fn invalidate_indices<V: Copy + Default>(
    c: &mut TagCache<V>,
    dom: DomainId,
    level: u32,
    a: u64,
    b: u64,
) {
    if b - a < c.entries() as u64 {
        for i in a..=b {
            c.invalidate(tag(dom, level, i), i);
        }
    } else {
        c.invalidate_where(|t| {
            tag_dom(t) == dom as u64 && tag_level(t) == level && (a..=b).contains(&(t & INDEX_MASK))
        });
    }
}

/// Where a TLB keeps its entries: hardware's set-associative cache with LRU replacement, or an emulated
/// IOMMU's software hash (QEMU's).
enum Store {
    Sets(TagCache<(u64, u64)>),
    Hash(QemuIotlb<(u64, u64)>),
}

/// A TLB of leaf translations of any page size (the IOTLB, or a device's ATC): one entry per page or
/// block, tagged by its size so an invalidation by address finds the block holding that address.
pub struct Tlb {
    /// Value: (physical granule pfn of the page, the translator's unmap epoch when it was filled).
    c: Store,
    /// Bit L: entries of level L have been filled (only those sizes are probed).
    sizes: u32,
}

impl Tlb {
    pub fn new(entries: usize, ways: usize) -> Self {
        Tlb {
            c: Store::Sets(TagCache::new(entries, ways)),
            sizes: 0,
        }
    }

    /// The emulated hash, if this is one.
    pub fn qemu(&self) -> Option<&QemuIotlb<(u64, u64)>> {
        match &self.c {
            Store::Hash(h) => Some(h),
            Store::Sets(_) => None,
        }
    }

    /// Entries it holds.
    pub fn len(&self) -> usize {
        match &self.c {
            Store::Sets(c) => c.len(),
            Store::Hash(h) => h.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it can hold an entry at all.
    fn holds_any(&self) -> bool {
        match &self.c {
            Store::Sets(c) => c.entries() > 0,
            Store::Hash(h) => h.entries() > 0,
        }
    }

    fn get(&mut self, t: u64, index: u64) -> Option<(u64, u64)> {
        match &mut self.c {
            Store::Sets(c) => c.lookup(t, index),
            Store::Hash(h) => h.lookup(t),
        }
    }

    /// The cached leaf holding `gpfn`: (its level, the physical granule pfn of `gpfn` through it, the
    /// epoch it was filled at).
    fn lookup(&mut self, f: &PtFormat, dom: DomainId, gpfn: u64) -> Option<(u32, u64, u64)> {
        let mut sizes = self.sizes;
        while sizes != 0 {
            let level = sizes.trailing_zeros();
            sizes &= sizes - 1;
            let s = f.span_shift(level);
            if let Some((base, epoch)) = self.get(tag(dom, level, gpfn >> s), gpfn >> s) {
                return Some((level, base + (gpfn & ((1 << s) - 1)), epoch));
            }
        }
        None
    }

    fn insert(
        &mut self,
        f: &PtFormat,
        dom: DomainId,
        level: u32,
        gpfn: u64,
        phys: u64,
        epoch: u64,
    ) {
        let s = f.span_shift(level);
        let mask = (1u64 << s) - 1;
        self.sizes |= 1 << level;
        let (t, i) = (tag(dom, level, gpfn >> s), gpfn >> s);
        match &mut self.c {
            Store::Sets(c) => c.insert(t, i, (phys & !mask, epoch)),
            Store::Hash(h) => h.insert(t, i, (phys & !mask, epoch)),
        }
    }

    /// Drop entries of `dom` overlapping granules [lo, hi].
    fn invalidate_range(&mut self, f: &PtFormat, dom: DomainId, lo: u64, hi: u64) {
        let h = match &mut self.c {
            Store::Hash(h) => h,
            Store::Sets(c) => {
                let mut sizes = self.sizes;
                while sizes != 0 {
                    let level = sizes.trailing_zeros();
                    sizes &= sizes - 1;
                    let s = f.span_shift(level);
                    invalidate_indices(c, dom, level, lo >> s, hi >> s);
                }
                return;
            }
        };
        // QEMU before 9.1 compares page numbers under the PSI's mask cut to 8 bits (vtd_hash_remove_by_page):
        // the range as the descriptor gives it, 2^am pages aligned.
        let am = 64 - (hi - lo).leading_zeros();
        let low_byte = (!((1u64 << am.min(63)) - 1) & 0xff, lo);
        let psi = h.psi;
        let f = *f;
        h.invalidate_where(|t, i| {
            if tag_dom(t) != dom as u64 {
                return false;
            }
            let s = f.span_shift(tag_level(t));
            let (first, last) = (i << s, ((i + 1) << s) - 1);
            let overlaps = first <= hi && last >= lo;
            match psi {
                PsiMatch::Range => overlaps,
                PsiMatch::LowByte => {
                    let (m8, base) = low_byte;
                    overlaps || (first & m8) == (base & m8)
                }
                PsiMatch::Domain => true,
            }
        });
    }

    fn invalidate_domain(&mut self, dom: DomainId) {
        match &mut self.c {
            Store::Sets(c) => c.invalidate_where(|t| tag_dom(t) == dom as u64),
            Store::Hash(h) => h.invalidate_where(|t, _| tag_dom(t) == dom as u64),
        }
    }

    fn invalidate_all(&mut self) {
        match &mut self.c {
            Store::Sets(c) => c.invalidate_where(|_| true),
            Store::Hash(h) => h.invalidate_where(|_, _| true),
        }
    }
}

/// What an invalidation does to the translation caches once the IOMMU (or, for the ATC, the device) has
/// processed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheInval {
    /// IOTLB entries of `dom` over [pfn, pfn + n) of 4 KiB pages; walk-cache entries for the range too
    /// unless `leaf_only` (VT-d IH=1, SMMUv3 TLBI with Leaf=1).
    Range {
        dom: DomainId,
        pfn: u64,
        n: u64,
        leaf_only: bool,
    },
    /// Every walk-cache (non-leaf) entry of `dom`, leaving the IOTLB.
    WalkCaches {
        dom: DomainId,
    },
    /// Every IOTLB and walk-cache entry of `dom`.
    Domain {
        dom: DomainId,
    },
    All,
    /// The device's cached translations of `dom` over (pfn, n), or all of them.
    Atc {
        dom: DomainId,
        range: Option<(u64, u64)>,
    },
}

pub struct Translator {
    fmt: PtFormat,
    domains: Vec<Option<RadixPgtable>>,
    iotlb: Tlb,
    /// pwc[i] caches entries of level `levels - i`: pwc[0] the top level (F&S PTcache-L1), the last one the
    /// entries pointing at leaf tables.
    pwc: Vec<TagCache>,
    /// The device's address translation cache when it uses ATS (PCIe ATS; VT-d device-TLB).
    atc: Option<Tlb>,
    /// Whether the device being served has ATS enabled (a replay of several devices' traffic, only some of
    /// which use ATS, switches it per event).
    ats_active: bool,
    /// Bumped whenever a leaf is cleared or replaced: a TLB entry filled at the current epoch cannot be
    /// stale, so its hit needs no table walk to check (a simulator shortcut, not hardware).
    epoch: u64,
    /// Invalidations handed over but not yet processed, in the order (and at the time) they act.
    pending: VecDeque<(Time, CacheInval)>,
    pub c: IommuCounters,
}

impl Translator {
    /// `atc`: the device's ATS cache as (entries, ways), if it has one.
    pub fn new(p: &IommuProfile, fmt: PtFormat, atc: Option<(u32, u32)>) -> Self {
        Translator {
            fmt,
            domains: Vec::new(),
            iotlb: Tlb::new(p.iotlb_entries as usize, p.iotlb_ways as usize),
            // One walk cache per non-leaf level; a profile without them (virtio-iommu) has empty ones.
            pwc: (0..fmt.levels as usize - 1)
                .map(|l| {
                    let n = p.pwc_entries.get(l).copied().unwrap_or(0);
                    let ways = if p.pwc_ways == 0 { n } else { p.pwc_ways };
                    TagCache::new(n as usize, ways as usize)
                })
                .collect(),
            atc: atc.map(|(n, w)| Tlb::new(n as usize, w as usize)),
            ats_active: true,
            epoch: 0,
            pending: VecDeque::new(),
            c: IommuCounters::default(),
        }
    }

    /// The IOTLB as an emulator keeps it (QEMU's hash, `emul::iotlb_of`).
    pub fn emulated_iotlb(mut self, hash: QemuIotlb<(u64, u64)>) -> Self {
        self.iotlb = Tlb {
            c: Store::Hash(hash),
            sizes: 0,
        };
        self
    }

    /// An emulated IOTLB's hash (its occupancy, the times it was emptied because full).
    pub fn qemu_iotlb(&self) -> Option<&QemuIotlb<(u64, u64)>> {
        self.iotlb.qemu()
    }

    pub fn format(&self) -> &PtFormat {
        &self.fmt
    }

    /// Whether the device being served has an ATS cache in front of this IOMMU.
    pub fn has_atc(&self) -> bool {
        self.atc.is_some() && self.ats_active
    }

    /// Entries in the device's ATS cache (0 without one).
    pub fn atc_len(&self) -> usize {
        self.atc.as_ref().map_or(0, Tlb::len)
    }

    /// Serve a device with (true) or without ATS; a no-op without an ATS cache.
    pub fn set_ats_active(&mut self, on: bool) {
        self.ats_active = on;
    }

    #[inline]
    fn gshift(&self) -> u32 {
        self.fmt.granule_shift - 12
    }

    /// [pfn, pfn + n) of 4 KiB pages as the granules it touches: (first, last).
    fn granules(&self, pfn: u64, n: u64) -> (u64, u64) {
        let g = self.gshift();
        (pfn >> g, (pfn + n.max(1) - 1) >> g)
    }

    fn pt(&mut self, dom: DomainId) -> &mut RadixPgtable {
        let i = dom as usize;
        if self.domains.len() <= i {
            self.domains.resize_with(i + 1, || None);
        }
        let fmt = self.fmt;
        self.domains[i].get_or_insert_with(|| RadixPgtable::new(fmt))
    }

    /// Map [iova_pfn, iova_pfn + n) of 4 KiB pages to phys (both granule aligned), in the largest page sizes
    /// the format and alignment allow. Returns leaf entries written.
    pub fn map(&mut self, dom: DomainId, iova_pfn: u64, phys_pfn: u64, n: u64) -> u64 {
        let g = self.gshift();
        let (lo, hi) = self.granules(iova_pfn, n);
        let pt = self.pt(dom);
        let (before, replaced) = (pt.tables_allocated, pt.leaves_replaced);
        let w = pt.map(lo, phys_pfn >> g, hi - lo + 1);
        let grown = pt.tables_allocated - before;
        let replaced = pt.leaves_replaced - replaced;
        if replaced != 0 {
            self.epoch += 1;
            self.c.leaves_replaced += replaced;
        }
        self.c.table_pages_allocated += grown;
        w
    }

    /// Clear the leaves over [iova_pfn, iova_pfn + n) (freeing tables the range covers) into `gather`.
    /// Returns 4 KiB pages unmapped.
    pub fn unmap(&mut self, dom: DomainId, iova_pfn: u64, n: u64, gather: &mut IotlbGather) -> u64 {
        let g = self.gshift();
        let (lo, hi) = self.granules(iova_pfn, n);
        let u = self.pt(dom).unmap(lo, hi - lo + 1);
        self.c.table_pages_freed += u.tables_freed as u64;
        self.c.ptes_cleared += u.leaves;
        if u.granules > 0 {
            self.epoch += 1;
            gather.add_range(u.first << g, (u.last - u.first + 1) << g);
            let pgsize = self.fmt.granule_shift + self.fmt.span_shift(u.leaf_level);
            gather.pgsize_shift = gather.pgsize_shift.max(pgsize);
        }
        gather.freed_tables += u.tables_freed;
        u.granules << g
    }

    /// iova_to_phys(): the 4 KiB pfn mapped at `iova_pfn`.
    pub fn lookup(&self, dom: DomainId, iova_pfn: u64) -> Option<u64> {
        let g = self.gshift();
        let pt = self.domains.get(dom as usize)?.as_ref()?;
        pt.lookup(iova_pfn >> g)
            .map(|(p, _)| (p << g) | (iova_pfn & ((1 << g) - 1)))
    }

    /// Device side: the ATC (with ATS), the IOTLB, then the walk caches deepest level first; each level not
    /// cached costs one memory read. Translations served from an entry the table no longer holds are stale.
    /// Domain ids created so far (made at setup, before traffic).
    pub fn domain_slots(&self) -> usize {
        self.domains.len()
    }

    pub fn translate(&mut self, dom: DomainId, iova_pfn: u64) -> Translation {
        self.c.translations += 1;
        let g = self.gshift();
        let gpfn = iova_pfn >> g;
        let off = iova_pfn & ((1 << g) - 1);
        let fmt = self.fmt;
        let to4k = |p: u64| (p << g) | off;
        let current = || {
            self.domains
                .get(dom as usize)
                .and_then(|p| p.as_ref())
                .and_then(|p| p.lookup(gpfn))
                .map(|(p, _)| p)
        };
        let epoch = self.epoch;
        let mut atc_miss = false;
        if let Some(atc) = self.atc.as_mut().filter(|_| self.ats_active) {
            if let Some((_, phys, filled)) = atc.lookup(&fmt, dom, gpfn) {
                self.c.atc_hits += 1;
                let stale = filled != epoch && current() != Some(phys);
                self.c.stale_hits += stale as u64;
                return Translation {
                    atc_hit: true,
                    phys: Some(to4k(phys)),
                    stale,
                    ..Default::default()
                };
            }
            self.c.atc_misses += 1;
            atc_miss = true;
        }
        if let Some((level, phys, filled)) = self.iotlb.lookup(&fmt, dom, gpfn) {
            let stale = filled != epoch && current() != Some(phys);
            self.c.stale_hits += stale as u64;
            if atc_miss && !stale {
                self.atc_fill(dom, level, gpfn, phys);
            }
            return Translation {
                iotlb_hit: true,
                ats_request: atc_miss,
                phys: Some(to4k(phys)),
                stale,
                ..Default::default()
            };
        }
        // An emulator without an IOTLB (virtio-iommu's tree lookup) has nothing to miss.
        self.c.iotlb_misses += self.iotlb.holds_any() as u64;
        let levels = fmt.levels;
        let pt = self.domains.get(dom as usize).and_then(|p| p.as_ref());
        // The walk caches hold non-leaf entries; search deepest first. A hit resumes the walk at the table it
        // points to; an entry pointing at a table no longer in the tree is stale.
        let mut start = levels;
        let mut resumed = None;
        let mut stale_walk = false;
        for l in 2..=levels {
            let i = (levels - l) as usize;
            let s = fmt.span_shift(l);
            if let Some(handle) = self.pwc[i].lookup(tag(dom, l, gpfn >> s), gpfn >> s) {
                self.c.pwc_hits[i] += 1;
                resumed = pt.and_then(|pt| pt.walk_from(handle, l, gpfn));
                stale_walk = resumed.is_none();
                start = l - 1;
                break;
            }
            self.c.pwc_misses[i] += 1;
        }
        // A walk-cache entry pointing at a table no longer in the tree: the walk reads that old, cleared
        // table page (the drivers free it only after the flush): one read, no translation, but counted.
        if stale_walk {
            self.c.stale_hits += 1;
            self.c.walk_reads += 1;
            self.c.faults += 1;
            return Translation {
                walk_reads: 1,
                walk_levels: 1 << start,
                ats_request: atc_miss,
                stale: true,
                ..Default::default()
            };
        }
        let w = match (resumed, pt) {
            (Some(w), _) => w,
            (None, Some(pt)) => pt.walk(gpfn),
            (None, None) => super::pgtable::Walk {
                phys: None,
                level: levels,
                ptr: [0; 8],
            },
        };
        let reads = start - w.level + 1;
        // Levels start down to w.level, one entry each.
        let walk_levels = (((1u32 << (start + 1)) - 1) & !((1u32 << w.level) - 1)) as u8;
        self.c.walk_reads += reads as u64;
        for l in w.level + 1..=start {
            let s = fmt.span_shift(l);
            self.pwc[(levels - l) as usize].insert(
                tag(dom, l, gpfn >> s),
                gpfn >> s,
                w.ptr[l as usize],
            );
        }
        let Some(phys) = w.phys else {
            self.c.faults += 1;
            return Translation {
                walk_reads: reads,
                walk_levels,
                ats_request: atc_miss,
                ..Default::default()
            };
        };
        self.iotlb.insert(&fmt, dom, w.level, gpfn, phys, epoch);
        if atc_miss {
            self.atc_fill(dom, w.level, gpfn, phys);
        }
        Translation {
            walk_reads: reads,
            walk_levels,
            ats_request: atc_miss,
            phys: Some(to4k(phys)),
            ..Default::default()
        }
    }

    fn atc_fill(&mut self, dom: DomainId, level: u32, gpfn: u64, phys: u64) {
        let (fmt, epoch) = (self.fmt, self.epoch);
        if let Some(atc) = self.atc.as_mut() {
            atc.insert(&fmt, dom, level, gpfn, phys, epoch);
        }
    }

    /// The IOMMU processes `inv` at `at`: it acts on the caches from then on.
    pub fn invalidate(&mut self, at: Time, inv: CacheInval) {
        // One queue per IOMMU processes in order; a later-simulated CPU may still hand over an earlier one.
        let i = self.pending.partition_point(|&(t, _)| t <= at);
        self.pending.insert(i, (at, inv));
    }

    /// Invalidations handed over and not yet applied.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Apply the invalidations processed by `now`.
    pub fn settle(&mut self, now: Time) {
        while let Some(&(at, inv)) = self.pending.front() {
            if at > now {
                break;
            }
            self.pending.pop_front();
            self.apply(inv);
        }
    }

    fn apply(&mut self, inv: CacheInval) {
        match inv {
            CacheInval::Range {
                dom,
                pfn,
                n,
                leaf_only,
            } => self.invalidate_range(dom, pfn, n, leaf_only),
            CacheInval::WalkCaches { dom } => self.invalidate_walk_caches(dom),
            CacheInval::Domain { dom } => {
                self.iotlb.invalidate_domain(dom);
                self.invalidate_walk_caches(dom);
            }
            CacheInval::All => {
                self.iotlb.invalidate_all();
                for p in &mut self.pwc {
                    p.invalidate_where(|_| true);
                }
            }
            CacheInval::Atc { dom, range } => self.invalidate_atc(dom, range),
        }
    }

    fn invalidate_range(&mut self, dom: DomainId, pfn: u64, n: u64, leaf_only: bool) {
        let fmt = self.fmt;
        let (lo, hi) = self.granules(pfn, n);
        self.iotlb.invalidate_range(&fmt, dom, lo, hi);
        if !leaf_only {
            for i in 0..self.pwc.len() {
                let l = fmt.levels - i as u32;
                let s = fmt.span_shift(l);
                invalidate_indices(&mut self.pwc[i], dom, l, lo >> s, hi >> s);
            }
        }
    }

    fn invalidate_walk_caches(&mut self, dom: DomainId) {
        for p in &mut self.pwc {
            p.invalidate_where(|t| tag_dom(t) == dom as u64);
        }
    }

    fn invalidate_atc(&mut self, dom: DomainId, range: Option<(u64, u64)>) {
        let fmt = self.fmt;
        let span = range.map(|(pfn, n)| self.granules(pfn, n));
        if let Some(atc) = self.atc.as_mut() {
            match span {
                Some((lo, hi)) => atc.invalidate_range(&fmt, dom, lo, hi),
                None => atc.invalidate_domain(dom),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::vtd::tests::cfg;

    fn tr(fmt: PtFormat, atc: Option<(u32, u32)>) -> Translator {
        Translator::new(&cfg(), fmt, atc)
    }

    #[test]
    fn superpage_fills_one_iotlb_entry_tagged_by_size() {
        let mut t = tr(PtFormat::vtd(48, true).unwrap(), None);
        t.map(1, 512, 4096, 512); // one 2M page
        let a = t.translate(1, 512 + 3);
        assert_eq!(
            (a.iotlb_hit, a.walk_reads, a.phys),
            (false, 3, Some(4096 + 3))
        );
        // Any 4K page inside hits the same 2M entry.
        let b = t.translate(1, 512 + 400);
        assert_eq!((b.iotlb_hit, b.phys), (true, Some(4096 + 400)));
        assert_eq!(t.c.iotlb_misses, 1);
        // A 4K-page invalidation inside the block drops the 2M entry.
        t.invalidate_range(1, 512 + 100, 1, true);
        assert!(!t.translate(1, 512 + 5).iotlb_hit);
    }

    #[test]
    fn stale_walk_cache_entry_to_a_freed_table_is_detected() {
        let mut t = tr(PtFormat::vtd(48, false).unwrap(), None);
        t.map(1, 0, 100, 512); // one full leaf table
        t.translate(1, 0); // caches the entry pointing at that leaf table
        let mut g = IotlbGather::new();
        t.unmap(1, 0, 512, &mut g);
        assert_eq!(g.freed_tables, 1);
        t.map(1, 7, 900, 1); // a new leaf table for the same 2M region
        let x = t.translate(1, 7);
        assert!(
            x.stale && x.phys.is_none(),
            "walked through the freed table: {x:?}"
        );
        // A non-leaf invalidation of the range (IH=0) drops the walk-cache entry: the walk is right again.
        t.invalidate_range(1, g.start, g.pages(), false);
        let y = t.translate(1, 7);
        assert_eq!((y.stale, y.phys), (false, Some(900)));
        assert_eq!(t.c.stale_hits, 1);
    }

    #[test]
    fn atc_serves_the_device_until_invalidated() {
        let mut t = tr(PtFormat::vtd(48, true).unwrap(), Some((8, 8)));
        t.map(1, 10, 55, 1);
        let a = t.translate(1, 10);
        assert!(a.ats_request && !a.atc_hit && !a.iotlb_hit);
        let b = t.translate(1, 10);
        assert!(b.atc_hit && !b.ats_request);
        assert_eq!((t.c.atc_hits, t.c.atc_misses), (1, 1));
        let mut g = IotlbGather::new();
        t.unmap(1, 10, 1, &mut g);
        t.invalidate_range(1, 10, 1, true);
        // The IOTLB is clean but the device still holds the translation: stale until its ATC is invalidated.
        assert!(t.translate(1, 10).stale);
        t.invalidate_atc(1, Some((10, 1)));
        let c = t.translate(1, 10);
        assert!(!c.stale && c.fault());
    }

    #[test]
    fn walk_reads_per_format() {
        // 64K granule, 48-bit: 3 levels; 4K stage 2 with 40-bit IPA: 3 levels (concatenated start).
        for fmt in [
            PtFormat::lpae(64, 48, 1, true).unwrap(),
            PtFormat::lpae(4, 40, 2, true).unwrap(),
        ] {
            let mut t = Translator::new(
                &IommuProfile {
                    pwc_entries: vec![4, 4],
                    ..cfg()
                },
                fmt,
                None,
            );
            t.map(1, 0, 0, fmt.granule_pages());
            assert_eq!(t.translate(1, 0).walk_reads, 3, "{fmt:?}");
            assert_eq!(t.translate(1, 0).walk_reads, 0);
        }
    }
}
