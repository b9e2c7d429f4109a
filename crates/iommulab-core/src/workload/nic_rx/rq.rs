//! RX queue layouts: where the device writes each frame.
//!
//! - Cyclic: one page per descriptor; a frame takes whole descriptors (mlx5 legacy RQ, most NICs).
//! - Striding (mlx5 MPWQE, en/params.c): a WQE of `pages` pages cut into `stride`-byte strides; frames land
//!   back to back, each starting on a stride boundary, so consecutive frames share pages. A frame that does
//!   not fit in the WQE's remaining strides closes it (a filler CQE) and starts the next.

use super::pages::{PageId, WqePages};
use crate::hw::PAGE_SIZE as PAGE;
use crate::sim::Time;
use std::collections::VecDeque;

/// en.h MLX5_MPWRQ_LOG_WQE_SZ: a multi-packet WQE spans 2^18 bytes (64 pages of 4 KiB).
const MLX5_MPWRQ_LOG_WQE_SZ: u32 = 18;
/// en/params.c mlx5e_mpwqe_get_log_rq_size(): never fewer than 2^2 WQEs (MLX5E_PARAMS_MINIMUM_LOG_RQ_SIZE_MPW).
const MLX5E_PARAMS_MINIMUM_LOG_RQ_SIZE_MPW: u32 = 2;
/// en.h MLX5E_ETH_HARD_MTU: ETH_HLEN + VLAN_HLEN + ETH_FCS_LEN added to the MTU (MLX5E_SW2HW_MTU).
const MLX5E_ETH_HARD_MTU: u32 = 14 + 4 + 4;
/// en.h MLX5_RX_HEADROOM = NET_SKB_PAD (64 on x86, whose NET_IP_ALIGN is 0).
const MLX5_RX_HEADROOM: u32 = 64;
/// sizeof(struct skb_shared_info) on x86_64, SKB_DATA_ALIGNed (include/linux/skbuff.h MLX5_SKB_FRAG_SZ).
const SKB_SHARED_INFO: u32 = 320;
const SMP_CACHE_BYTES: u32 = 64;

/// en.h MLX5E_RX_MAX_HEAD: non-linear striding RQs use strides of 2^order_base_2(256) bytes
/// (MLX5_MPWRQ_DEF_LOG_STRIDE_SZ; the hardware minimum of 64 is below it).
const MLX5E_RX_MAX_HEAD: u32 = 256;

fn order_base_2(x: u32) -> u32 {
    x.max(1).next_power_of_two().trailing_zeros()
}

/// A linear striding RQ's fragment per frame: headroom, the largest frame and skb_shared_info, cache
/// aligned (en/params.c mlx5e_rx_get_linear_frag_sz, MLX5_SKB_FRAG_SZ).
fn mlx5_linear_frag(mtu: u32) -> u32 {
    let align = |x: u32| x.div_ceil(SMP_CACHE_BYTES) * SMP_CACHE_BYTES;
    align(MLX5_RX_HEADROOM + mtu + MLX5E_ETH_HARD_MTU) + SKB_SHARED_INFO
}

/// The striding RQ mlx5 builds for an `ethtool -G rx <ring_frames>` setting and an MTU: the layout and the
/// number of WQEs (en/params.c mlx5e_rx_get_linear_frag_sz, mlx5e_rx_is_linear_skb,
/// mlx5e_mpwqe_get_log_stride_size, mlx5e_mpwqe_log_pkts_per_wqe, mlx5e_mpwqe_get_log_rq_size).
pub fn mlx5_striding(ring_frames: u32, mtu: u32) -> (Layout, u32) {
    let frag = mlx5_linear_frag(mtu);
    let linear = frag as u64 <= PAGE;
    let log_stride = if linear {
        order_base_2(frag)
    } else {
        order_base_2(MLX5E_RX_MAX_HEAD)
    };
    let log_pkts = MLX5_MPWRQ_LOG_WQE_SZ.saturating_sub(order_base_2(frag));
    let log_frames = 31 - ring_frames.max(1).leading_zeros();
    let log_wqes = if log_frames < log_pkts + MLX5E_PARAMS_MINIMUM_LOG_RQ_SIZE_MPW {
        MLX5E_PARAMS_MINIMUM_LOG_RQ_SIZE_MPW
    } else {
        log_frames - log_pkts
    };
    let layout = Layout::Striding {
        pages: (1u64 << MLX5_MPWRQ_LOG_WQE_SZ).div_ceil(PAGE) as u32,
        stride: 1 << log_stride,
    };
    (layout, 1 << log_wqes)
}

/// The truesize a full-sized frame of `frame_bytes` adds to the socket's receive memory once GRO has merged it
/// into a flow's skb (skb_gro_receive adds each merged segment's fragment truesize; the merged skb's one head
/// is left out, under 2 % of a 64 KiB skb):
/// - cyclic: the whole pages it took (build_skb on a page, as ENA's ena_rx_skb and mlx5's legacy RQ do);
/// - striding, linear: its fragment (mlx5e_skb_from_cqe_mpwrq_linear builds the skb on it);
/// - striding, non-linear: what follows the MLX5E_RX_MAX_HEAD bytes copied into the skb head, stride-aligned
///   (mlx5e_skb_from_cqe_mpwrq_nonlinear: ALIGN(pg_consumed_bytes, BIT(log_stride_sz)); a frame that
///   crosses a page adds under one stride more, left out).
pub fn frame_truesize(layout: Layout, mtu: u32, frame_bytes: u64) -> u64 {
    match layout {
        Layout::Cyclic => frame_bytes.div_ceil(PAGE) * PAGE,
        Layout::Striding { stride, .. } => {
            let frag = mlx5_linear_frag(mtu) as u64;
            if frag <= PAGE {
                frag
            } else {
                let rest = frame_bytes.saturating_sub(MLX5E_RX_MAX_HEAD as u64);
                rest.div_ceil(stride as u64) * stride as u64
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Cyclic,
    Striding { pages: u32, stride: u32 },
}

struct Wqe {
    visible: Time,
    pages: WqePages,
    used_strides: u32,
}

/// What placing one frame did besides writing its pieces.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// Descriptors the device started (each fetched once).
    pub started: u32,
    /// Descriptors the device finished (released by NAPI when it reaches this frame's completion).
    pub finished: u32,
}

pub struct Rq {
    layout: Layout,
    strides_per_wqe: u32,
    capacity: usize,
    posted: VecDeque<Wqe>,
    /// Descriptors finished by the device, in order, awaiting their release by NAPI.
    finished: VecDeque<WqePages>,
}

impl Rq {
    /// `capacity`: descriptors (pages for cyclic, WQEs for striding).
    pub fn new(layout: Layout, capacity: u32) -> Self {
        let strides_per_wqe = match layout {
            Layout::Cyclic => 1,
            Layout::Striding { pages, stride } => (pages as u64 * PAGE / stride as u64) as u32,
        };
        Rq {
            layout,
            strides_per_wqe,
            capacity: capacity as usize,
            posted: VecDeque::with_capacity(capacity as usize),
            finished: VecDeque::new(),
        }
    }

    pub fn pages_per_wqe(&self) -> usize {
        match self.layout {
            Layout::Cyclic => 1,
            Layout::Striding { pages, .. } => pages as usize,
        }
    }

    /// Completion-queue entries the ring needs: one per descriptor, or per stride when striding
    /// (en/params.c mlx5e_build_rx_cq_param: log_cq_size = log_rq_size + log_num_strides).
    pub fn cqes(&self) -> u64 {
        self.capacity as u64 * self.strides_per_wqe as u64
    }

    pub fn descriptors(&self) -> u64 {
        self.capacity as u64
    }

    pub fn wants_refill(&self) -> bool {
        self.posted.len() < self.capacity
    }

    pub fn post(&mut self, visible: Time, pages: WqePages) {
        debug_assert_eq!(pages.len(), self.pages_per_wqe());
        self.posted.push_back(Wqe {
            visible,
            pages,
            used_strides: 0,
        });
    }

    pub fn pop_finished(&mut self) -> Option<WqePages> {
        self.finished.pop_front()
    }

    /// Place a frame of `frame` bytes arriving at `t`: appends (page, bytes written) per page touched to
    /// `out`. None, with nothing changed, when no posted descriptor can take it (the frame is dropped).
    pub fn place(
        &mut self,
        t: Time,
        frame: u64,
        out: &mut Vec<(PageId, u64)>,
    ) -> Option<Placement> {
        match self.layout {
            Layout::Cyclic => {
                let k = frame.div_ceil(PAGE) as usize;
                if self.posted.len() < k || self.posted[k - 1].visible > t {
                    return None;
                }
                let mut left = frame;
                for _ in 0..k {
                    let w = self.posted.pop_front().expect("checked above");
                    out.push((w.pages[0], left.min(PAGE)));
                    left = left.saturating_sub(PAGE);
                    self.finished.push_back(w.pages);
                }
                Some(Placement {
                    started: k as u32,
                    finished: k as u32,
                })
            }
            Layout::Striding { stride, .. } => {
                let stride = stride as u64;
                let need = frame.div_ceil(stride) as u32;
                let mut p = Placement::default();
                let fits = |w: &Wqe| w.used_strides + need <= self.strides_per_wqe;
                match self.posted.front() {
                    Some(w) if w.visible <= t && fits(w) => {}
                    Some(w) if w.visible <= t && w.used_strides > 0 => {
                        // The frame needs the next WQE; without one the current WQE stays open.
                        match self.posted.get(1) {
                            Some(n) if n.visible <= t => {}
                            _ => return None,
                        }
                        let w = self.posted.pop_front().expect("front exists");
                        self.finished.push_back(w.pages);
                        p.finished += 1;
                    }
                    _ => return None,
                }
                let w = self.posted.front_mut().expect("checked above");
                if w.used_strides == 0 {
                    p.started += 1;
                }
                let off = w.used_strides as u64 * stride;
                let (first, last) = (off / PAGE, (off + frame - 1) / PAGE);
                for pg in first..=last {
                    let lo = off.max(pg * PAGE);
                    let hi = (off + frame).min((pg + 1) * PAGE);
                    out.push((w.pages[pg as usize], hi - lo));
                }
                w.used_strides += need;
                if w.used_strides == self.strides_per_wqe {
                    let w = self.posted.pop_front().expect("front exists");
                    self.finished.push_back(w.pages);
                    p.finished += 1;
                }
                Some(p)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_adds_the_buffer_it_took_to_the_sockets_memory() {
        // MTU 4000 (C3): non-linear, 256 bytes copied to the head, the other 3758 in 15 strides of 256.
        let (c3, _) = mlx5_striding(256, 4000);
        assert_eq!(frame_truesize(c3, 4000, 4014), 3840);
        // MTU 1500 (C2): linear, the frame's 1920-byte fragment (headroom, frame, skb_shared_info).
        let (c2, _) = mlx5_striding(1024, 1500);
        assert_eq!(frame_truesize(c2, 1500, 1514), 1920);
        // One page per descriptor: whole pages, three for a 9001-byte MTU (C1).
        assert_eq!(frame_truesize(Layout::Cyclic, 1500, 1514), 4096);
        assert_eq!(frame_truesize(Layout::Cyclic, 9001, 9015), 3 * 4096);
    }

    #[test]
    fn mlx5_ring_sizes() {
        let nonlinear = Layout::Striding {
            pages: 64,
            stride: 256,
        };
        // ethtool -G rx 256 with MTU 4000 or 4096: fragments over a page (non-linear, 256-byte strides),
        // counted as 32 frames per 256 KiB WQE: 8 WQEs.
        assert_eq!(mlx5_striding(256, 4000), (nonlinear, 8));
        assert_eq!(mlx5_striding(256, 4096), (nonlinear, 8));
        // The default 1024 frames at MTU 1500: linear 2 KiB strides, 128 frames per WQE, 8 WQEs.
        let linear = Layout::Striding {
            pages: 64,
            stride: 2048,
        };
        assert_eq!(mlx5_striding(1024, 1500), (linear, 8));
        // Never fewer than 4.
        assert_eq!(mlx5_striding(64, 9000), (nonlinear, 4));
    }

    fn striding(wqes: u32) -> Rq {
        let mut rq = Rq::new(
            Layout::Striding {
                pages: 64,
                stride: 256,
            },
            wqes,
        );
        for w in 0..wqes {
            rq.post(0, (w * 64..(w + 1) * 64).collect());
        }
        rq
    }

    #[test]
    fn striding_packs_frames_back_to_back_on_stride_boundaries() {
        let mut rq = striding(2);
        let mut out = vec![];
        // 4110 bytes: 17 strides (4352 bytes); the second frame starts at 4352, inside page 1.
        let p = rq.place(0, 4110, &mut out).unwrap();
        assert_eq!(
            p,
            Placement {
                started: 1,
                finished: 0
            }
        );
        assert_eq!(out, vec![(0, 4096), (1, 14)]);
        out.clear();
        rq.place(0, 4110, &mut out).unwrap();
        assert_eq!(out, vec![(1, 4096 - 256), (2, 4110 - 3840)]);
        // 1024 strides / 17 = 60 frames per WQE; the 61st closes it (filler) and starts WQE 1.
        for _ in 2..60 {
            rq.place(0, 4110, &mut out).unwrap();
        }
        out.clear();
        let p = rq.place(0, 4110, &mut out).unwrap();
        assert_eq!(
            p,
            Placement {
                started: 1,
                finished: 1
            }
        );
        assert_eq!(out[0].0, 64);
        assert_eq!(
            rq.pop_finished().unwrap().to_vec(),
            (0..64).collect::<Vec<_>>()
        );
    }

    #[test]
    fn striding_exact_fit_finishes_and_a_full_ring_drops() {
        let mut rq = striding(1);
        let mut out = vec![];
        // 4014-byte frames (MTU 4000) take 16 strides: exactly one page each, 64 per WQE.
        for i in 0..64 {
            out.clear();
            let p = rq.place(0, 4014, &mut out).unwrap();
            assert_eq!(out, vec![(i, 4014)]);
            assert_eq!(p.finished, (i == 63) as u32);
        }
        assert!(rq.place(0, 4014, &mut out).is_none());
        assert!(rq.wants_refill());
    }

    #[test]
    fn cyclic_takes_whole_pages_and_waits_for_visibility() {
        let mut rq = Rq::new(Layout::Cyclic, 4);
        for i in 0..4 {
            rq.post(10, smallvec::smallvec![i]);
        }
        let mut out = vec![];
        assert!(rq.place(5, 5000, &mut out).is_none());
        let p = rq.place(10, 5000, &mut out).unwrap();
        assert_eq!(out, vec![(0, 4096), (1, 904)]);
        assert_eq!(
            p,
            Placement {
                started: 2,
                finished: 2
            }
        );
        assert_eq!(rq.cqes(), 4);
    }
}
