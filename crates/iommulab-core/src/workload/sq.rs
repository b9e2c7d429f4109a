//! A NIC send queue as mlx5e drives it. The driver maps an skb's DMA segments (mlx5e_txwqe_build_dsegs:
//! the linear part unless inlined, then each page frag) and posts a WQE; the device fetches the WQE's
//! building blocks, reads every page the segments cover and writes a completion entry; NAPI reaps
//! completions (mlx5e_poll_tx_cq) and unmaps each segment (mlx5e_tx_dma_unmap).

use super::desc_ring::DescRing;
use super::Device;
use crate::host::Host;
use crate::hw::PAGE_SIZE as PAGE;
use crate::scenario::MapDir;
use crate::sim::{Path, Time};
use std::collections::VecDeque;

/// en.h MLX5E_PARAMS_DEFAULT_LOG_SQ_SIZE: 1024 send WQE building blocks per TX queue, one CQE each.
pub const TX_RING_ENTRIES: u64 = 1024;
/// mlx5 send-WQE building block (MLX5_SEND_WQE_BB) and CQE (struct mlx5_cqe64) sizes.
pub const SEND_WQEBB_BYTES: u64 = 64;
pub const CQE_BYTES: u64 = 64;
/// en/txrx.h MLX5E_TX_CQ_POLL_BUDGET: TX completions reaped per NAPI poll.
pub const TX_CQ_POLL_BUDGET: usize = 128;

/// One 16-byte WQE data segment (struct mlx5_wqe_data_seg): a cyclic RQ's descriptor, and the unit send
/// WQEs are built of.
pub const DS_BYTES: u64 = 16;
/// A sender whose mapping found no IOVA space retries this much later (a modelling choice: the driver drops
/// the skb and TCP sends it again; no built-in scenario runs out).
pub const MAP_RETRY_NS: u64 = 10_000;
/// mlx5 WQE layout (en/tx.c mlx5e_sq_xmit_wqe): data segments, four per 64-byte building block; a
/// control and an Ethernet segment, the inlined headers beyond the Ethernet segment's first 2 bytes
/// (MLX5E_INLINE_HDR_START_SZ), then one segment per mapped buffer.
const WQEBB_DS: u64 = 4;
const INLINE_HDR_START: u64 = 2;

/// Building blocks of a WQE that inlines `inline_bytes` of headers (TSO: all of them; 0 when the NIC needs
/// none inlined and the head is mapped) and maps `segs` buffers.
pub fn wqebbs(inline_bytes: u64, segs: usize) -> u64 {
    let inline = inline_bytes
        .saturating_sub(INLINE_HDR_START)
        .div_ceil(DS_BYTES);
    (2 + inline + segs as u64).div_ceil(WQEBB_DS)
}

/// One mapped DMA segment: its first DMA page, the pages it spans, the byte offset in the first page and
/// its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub dma: u64,
    pub pages: u64,
    pub offset: u64,
    pub bytes: u64,
}

impl Seg {
    /// Bytes of the segment in each page it spans, in order.
    pub fn page_bytes(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut left = self.bytes;
        let mut off = self.offset;
        (0..self.pages).map(move |i| {
            let n = left.min(PAGE - off);
            left -= n;
            off = 0;
            (self.dma + i, n)
        })
    }
}

pub use crate::hw::pages_spanned;

/// skb heads come from kmalloc-512 (alloc_skb(MAX_TCP_HEADER) for ACKs and small sends): 8 per slab page. The
/// number of slab pages a queue's heads cycle over is a modelling choice: it only decides which physical page
/// a head lands in, never a cost.
const HEADS_PER_PAGE: u64 = 8;
const HEAD_SLAB_PAGES: u64 = 4;

/// The slab pages a queue's skb heads come from, used in turn.
pub struct HeadSlab {
    base: u64,
    used: u64,
}

impl HeadSlab {
    pub fn alloc(host: &mut Host) -> Option<Self> {
        let base = host.pages.alloc_contiguous(HEAD_SLAB_PAGES)?;
        Some(HeadSlab { base, used: 0 })
    }

    /// Map the next head, holding `bytes` of headers, on `cpu` from `t` (dma_map_single of the linear
    /// part): its segment and the CPU's release time. None if IOVA space ran out (the head stays free).
    pub fn map(&mut self, host: &mut Host, cpu: usize, t: Time, bytes: u64) -> Option<(Seg, Time)> {
        let phys = self.base + (self.used / HEADS_PER_PAGE) % HEAD_SLAB_PAGES;
        let offset = (self.used % HEADS_PER_PAGE) * (PAGE / HEADS_PER_PAGE);
        let (dma, pages, t) = host.dma_map_dir(t, cpu, phys, offset, bytes, MapDir::ToDevice)?;
        self.used += 1;
        let seg = Seg {
            dma,
            pages,
            offset,
            bytes,
        };
        Some((seg, t))
    }
}

pub use crate::net::SKB_FRAG_PAGE_BYTES;

/// A socket's page-frag chunks (sk_page_frag: physically contiguous chunks that tcp_sendmsg() copies data
/// into), used in turn; the owner sizes them so data in flight is never overwritten.
pub struct FragStream {
    chunks: Vec<u64>,
    chunk_bytes: u64,
    pos: u64,
}

impl FragStream {
    /// `n` chunks of `chunk_bytes` (a multiple of the page size). None when memory ran out.
    pub fn alloc(host: &mut Host, chunk_bytes: u64, n: u64) -> Option<Self> {
        let chunks = (0..n.max(1))
            .map(|_| host.pages.alloc_contiguous(chunk_bytes / PAGE))
            .collect::<Option<Vec<_>>>()?;
        Some(FragStream {
            chunks,
            chunk_bytes,
            pos: 0,
        })
    }

    /// Bytes the stream holds before it wraps, and its write position.
    pub fn len_bytes(&self) -> u64 {
        self.chunks.len() as u64 * self.chunk_bytes
    }
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Map the next `bytes` of the stream on `cpu` from `t` (skb_frag_dma_map): one segment per chunk piece,
    /// since a frag never crosses a chunk, appended to `segs`. False if IOVA space ran out: what was mapped
    /// is unmapped again and the stream does not advance.
    pub fn map(
        &mut self,
        host: &mut Host,
        cpu: usize,
        mut t: Time,
        bytes: u64,
        segs: &mut Vec<Seg>,
    ) -> (bool, Time) {
        let first = segs.len();
        let (mut pos, mut left) = (self.pos, bytes);
        while left > 0 {
            let in_chunk = pos % self.chunk_bytes;
            let n = left.min(self.chunk_bytes - in_chunk);
            let chunk = self.chunks[(pos / self.chunk_bytes) as usize];
            let offset = in_chunk % PAGE;
            let Some((dma, pages, t2)) =
                host.dma_map_dir(t, cpu, chunk + in_chunk / PAGE, offset, n, MapDir::ToDevice)
            else {
                for s in segs.drain(first..) {
                    t = host.dma_unmap(t, cpu, s.dma, s.pages);
                }
                return (false, t);
            };
            t = t2;
            segs.push(Seg {
                dma,
                pages,
                offset,
                bytes: n,
            });
            pos = (pos + n) % self.len_bytes();
            left -= n;
        }
        self.pos = pos;
        (true, t)
    }
}

struct Posted {
    /// When the completion entry is visible.
    done: Time,
    segs: u32,
    tag: u32,
}

pub struct SendQueue {
    sq: DescRing,
    cq: DescRing,
    posted: VecDeque<Posted>,
    /// The segments of posted WQEs, in order.
    segs: VecDeque<Seg>,
    /// The (dma pfn, pages) of the WQE being reaped (kept to reuse its allocation).
    reaping: Vec<(u64, u64)>,
}

impl SendQueue {
    /// The send and completion rings, allocated and mapped on `cpu` at `t` (mlx5e_open_txqsq). None when
    /// memory or IOVA space ran out.
    pub fn alloc(host: &mut Host, cpu: usize, t: Time) -> Option<(Self, Time)> {
        let (sq, t) = DescRing::alloc(host, cpu, TX_RING_ENTRIES, SEND_WQEBB_BYTES, t)?;
        let (cq, t) = DescRing::alloc(host, cpu, TX_RING_ENTRIES, CQE_BYTES, t)?;
        Some((
            SendQueue {
                sq,
                cq,
                posted: VecDeque::new(),
                segs: VecDeque::new(),
                reaping: Vec::new(),
            },
            t,
        ))
    }

    /// The device fetches `wqebbs` building blocks posted at `t`, then reads every page of `segs`: when the
    /// last byte has been read.
    pub fn fetch_and_read(
        &mut self,
        dev: &mut Device,
        host: &mut Host,
        t: Time,
        wqebbs: u64,
        segs: &[Seg],
    ) -> Time {
        let mut fetched = t;
        for _ in 0..wqebbs.max(1) {
            fetched = fetched.max(dev.ring_access(host, Path::SendRead, t, &mut self.sq));
        }
        let mut read = fetched;
        for s in segs {
            for (page, bytes) in s.page_bytes() {
                read = read.max(dev.access(host, Path::SendRead, fetched, page, bytes));
            }
        }
        read
    }

    /// The device writes the WQE's completion entry after `at`: the time it is visible. `tag` comes back
    /// from `reap`.
    pub fn complete(
        &mut self,
        dev: &mut Device,
        host: &mut Host,
        at: Time,
        segs: &[Seg],
        tag: u32,
    ) -> Time {
        let done = dev.ring_access(host, Path::SendWrite, at, &mut self.cq);
        self.segs.extend(segs.iter().copied());
        self.posted.push_back(Posted {
            done,
            segs: segs.len() as u32,
            tag,
        });
        done
    }

    /// mlx5e_poll_tx_cq() on `cpu` at `now`, its CPU busy from `t`: unmap the segments of up to
    /// TX_CQ_POLL_BUDGET WQEs the device completed by `now`, handing each tag to `done`. The CPU's release
    /// time.
    pub fn reap(
        &mut self,
        host: &mut Host,
        cpu: usize,
        now: Time,
        mut t: Time,
        mut done: impl FnMut(u32),
    ) -> Time {
        for _ in 0..TX_CQ_POLL_BUDGET {
            match self.posted.front() {
                Some(p) if p.done <= now => {}
                _ => break,
            }
            let p = self.posted.pop_front().expect("front checked");
            self.reaping.clear();
            self.reaping
                .extend(self.segs.drain(..p.segs as usize).map(|s| (s.dma, s.pages)));
            t = host.dma_unmap_desc(t, cpu, &self.reaping);
            done(p.tag);
        }
        // xSMMU: one sync per TX completion batch.
        host.dma_batch_end(t, cpu)
    }

    /// WQEs posted and not reaped.
    pub fn pending(&self) -> usize {
        self.posted.len()
    }

    /// When the `i`-th pending completion is visible.
    pub fn pending_done(&self, i: usize) -> Time {
        self.posted[i].done
    }

    /// When each pending completion is visible, oldest first.
    pub fn pending_times(&self) -> impl Iterator<Item = Time> + '_ {
        self.posted.iter().map(|p| p.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_splits_at_page_boundaries() {
        let s = Seg {
            dma: 10,
            pages: pages_spanned(4000, 5000),
            offset: 4000,
            bytes: 5000,
        };
        assert_eq!(s.pages, 3);
        let v: Vec<_> = s.page_bytes().collect();
        assert_eq!(v, vec![(10, 96), (11, 4096), (12, 808)]);
        assert_eq!(pages_spanned(0, 4096), 1);
        assert_eq!(pages_spanned(0, 4097), 2);
    }

    #[test]
    fn reaping_unmaps_every_segment_of_completed_wqes_in_order() {
        let mut host = crate::run::test_host("strict");
        let (mut q, t) = SendQueue::alloc(&mut host, 0, 0).unwrap();
        let mut dev = Device::new(8, 128.0);
        let mut tags = Vec::new();
        let mut last = 0;
        for tag in 0..3u32 {
            let phys = host.pages.alloc_contiguous(2).unwrap();
            let (dma, _) = host.dma_map(t, 0, phys, 2).unwrap();
            let segs = [Seg {
                dma,
                pages: 2,
                offset: 0,
                bytes: 8192,
            }];
            let read = q.fetch_and_read(&mut dev, &mut host, t, 2, &segs);
            last = q.complete(&mut dev, &mut host, read, &segs, tag);
        }
        assert_eq!(q.pending(), 3);
        let before = host.dma.core.stats.iova_pages_unmapped;
        q.reap(&mut host, 0, q.pending_done(0), t, |g| tags.push(g));
        assert_eq!(tags, vec![0], "only what the device completed");
        q.reap(&mut host, 0, last, t, |g| tags.push(g));
        assert_eq!(tags, vec![0, 1, 2]);
        assert_eq!(host.dma.core.stats.iova_pages_unmapped - before, 6);
        assert_eq!(dev.faults, 0);
    }
}
