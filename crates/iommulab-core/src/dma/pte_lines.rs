//! The cache lines of a domain's leaf page tables, and which core wrote each last. A map writes its PTEs
//! and an unmap clears them with plain stores (`__arm_lpae_init_pte`, `dma_pte_clear_range`), 8 bytes an
//! entry, so a 64-byte line holds 8 neighbouring IOVAs' entries. IOVAs handed to different CPUs sit next to
//! each other (the rbtree allocates top-down, each CPU's rcache then hands its own back), and a range the
//! rbtree serves (above the rcache's 32 pages) goes to whichever CPU asks next once freed. So CPUs mapping
//! and unmapping at once write each other's lines: a store to a line another core wrote last waits for the
//! line to come over (`sim/coherence.rs`), up to `LINE_FILLS` such lines at once. Simplifications: only
//! leaf entries are tracked (a block mapping's entry and the upper levels, read by every walk and written on
//! a table's first use, are not); the IOMMU's own reads of an entry (a coherent walker snooping it) do not
//! move the line.

use crate::sim::{Coherence, LockStats, NO_CPU};
use std::collections::HashMap;

/// Bytes of one page-table entry: VT-d, AMD-Vi, LPAE (SMMUv3) and RISC-V Sv39/48/57 entries are all 64-bit.
const PTE_BYTES: u64 = 8;
/// Bytes of a cache line.
const LINE_BYTES: u64 = 64;
/// log2 of the entries one line holds.
const LINE_SHIFT: u32 = (LINE_BYTES / PTE_BYTES).trailing_zeros();
/// Line misses a core has in flight at once: Intel's cores from Nehalem to Skylake have 10 L1D fill buffers
/// (Intel 64 and IA-32 Architectures Optimization Reference Manual). Estimate for the other profiles'
/// cores, whose counts are not published: as many. A range's stores to consecutive lines overlap their
/// transfers this many at a time.
const LINE_FILLS: u64 = 10;

#[derive(Debug, Clone, Default)]
pub struct PteLines {
    coh: Coherence,
    /// Line (leaf entry index >> LINE_SHIFT) → the core that wrote it last.
    last: HashMap<u64, u32>,
    /// Lines written (`acquisitions`), those taken from another core (`transfers`) and their stall, per CPU.
    pub stats: LockStats,
}

impl PteLines {
    pub fn new(coh: Coherence) -> Self {
        PteLines {
            coh,
            ..Default::default()
        }
    }

    /// `cpu` writes (or clears) the leaf entries `first..first + n`: returns its stall, a transfer for the
    /// lines another core wrote last, `LINE_FILLS` of them overlapping (each group costs its longest).
    pub fn write(&mut self, cpu: usize, first: u64, n: u64) -> u64 {
        if n == 0 || self.coh.is_free() {
            return 0;
        }
        let cpu = cpu as u32;
        let (mut stall, mut group, mut in_group) = (0, 0, 0);
        for line in first >> LINE_SHIFT..=(first + n - 1) >> LINE_SHIFT {
            let prev = self.last.insert(line, cpu).unwrap_or(NO_CPU);
            let xfer = self.coh.transfer_ns(prev, cpu);
            self.stats.acquisitions += 1;
            if xfer > 0 {
                self.stats.transfers += 1;
                group = group.max(xfer);
                in_group += 1;
                if in_group == LINE_FILLS {
                    stall += std::mem::take(&mut group);
                    in_group = 0;
                }
            }
        }
        stall += group;
        self.stats.transfer_ns += stall;
        self.stats.stall(cpu, stall);
        stall
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines() -> PteLines {
        PteLines::new(Coherence {
            cluster_cores: 4,
            socket_cores: 8,
            cluster_ns: 40,
            socket_ns: 60,
            remote_ns: 180,
        })
    }

    #[test]
    fn neighbours_on_two_cores_share_a_line_and_pay_for_it() {
        let mut l = lines();
        // Entries 8..16 are one line: the first write takes it from nobody, the same core again pays nothing.
        assert_eq!(l.write(0, 9, 1), 0);
        assert_eq!(l.write(0, 9, 1), 0);
        // Another core's neighbouring entry is in that line: it comes over from core 0's cluster.
        assert_eq!(l.write(1, 10, 1), 40);
        // And back, from the other socket's point of view a remote transfer.
        assert_eq!(l.write(9, 15, 1), 180);
        // Entry 16 starts the next line: no one wrote it.
        assert_eq!(l.write(1, 16, 1), 0);
        assert_eq!((l.stats.transfers, l.stats.transfer_ns), (2, 220));
    }

    #[test]
    fn a_range_takes_its_lines_ten_at_a_time() {
        let mut l = lines();
        // 256 entries from 0 are 32 whole lines, all core 0's; core 4 (another cluster) takes all of them,
        // 10 at once: four rounds.
        l.write(0, 0, 256);
        assert_eq!(l.write(4, 0, 256), 4 * 60);
        assert_eq!(l.stats.transfers, 32);
        // A range straddling two lines takes both at once.
        assert_eq!(l.write(0, 7, 2), 60);
        // A round costs its farthest line: one of the 10 from the other socket makes it a remote transfer.
        l.write(9, 512, 8);
        l.write(1, 520, 72);
        assert_eq!(l.write(2, 512, 80), 180);
    }

    proptest::proptest! {
        /// Whatever the writes: one core alone never pays; a write's stall is at most one transfer per line
        /// it takes and at least one transfer per round of LINE_FILLS lines; every line taken was written.
        #[test]
        fn stalls_are_bounded_by_the_lines_taken(
            writes in proptest::collection::vec((0usize..12, 0u64..600, 1u64..300), 1..60),
        ) {
            let mut l = lines();
            let mut alone = lines();
            for &(cpu, first, n) in &writes {
                let before = l.stats.transfers;
                let stall = l.write(cpu, first, n);
                let taken = l.stats.transfers - before;
                proptest::prop_assert!(stall <= taken * 180);
                proptest::prop_assert!(stall >= taken.div_ceil(LINE_FILLS) * 40);
                proptest::prop_assert_eq!(alone.write(3, first, n), 0);
            }
            proptest::prop_assert!(l.stats.transfers <= l.stats.acquisitions);
            let total: u64 = l.stats.spin_by_cpu.iter().sum();
            proptest::prop_assert_eq!(total, l.stats.transfer_ns);
        }
    }

    #[test]
    fn a_free_topology_keeps_no_books() {
        let mut l = PteLines::new(Coherence::default());
        assert_eq!(l.write(0, 0, 8) + l.write(1, 0, 8), 0);
        assert!(l.last.is_empty());
    }
}
