//! A cyclic RX ring whose pages page_pool keeps mapped, for small frames (ACKs, requests) landing one per
//! page in turn: the device fetches the next descriptor, writes the frame and a completion entry. Frames
//! free no DMA state when the stack consumes them (the page is recycled mapped).

use super::desc_ring::DescRing;
use super::sq::{CQE_BYTES, DS_BYTES};
use super::Device;
use crate::host::Host;
use crate::sim::{Path, Time};
use std::collections::VecDeque;

pub struct KeptRxRing<T> {
    pages: Vec<u64>,
    next: usize,
    desc: DescRing,
    cq: DescRing,
    /// Frames written, in order: when each completion entry is visible, and what the frame carries.
    pub pending: VecDeque<(Time, u64, T)>,
}

impl<T> KeptRxRing<T> {
    /// `n` pages allocated and mapped on `cpu` from `t`, and the rings. None when memory or IOVA space ran
    /// out.
    pub fn alloc(host: &mut Host, cpu: usize, n: u64, mut t: Time) -> Option<(Self, Time)> {
        let mut pages = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let phys = host.pages.alloc()?;
            let (dma, t2) = host.dma_map_rx_page(t, cpu, phys)?;
            t = t2;
            pages.push(dma);
        }
        let (desc, t) = DescRing::alloc(host, cpu, n, DS_BYTES, t)?;
        let (cq, t) = DescRing::alloc(host, cpu, n, CQE_BYTES, t)?;
        let ring = KeptRxRing {
            pages,
            next: 0,
            desc,
            cq,
            pending: VecDeque::new(),
        };
        Some((ring, t))
    }

    /// A frame of `bytes` carrying `what` arrives at `now`: when its completion entry is visible.
    pub fn receive(
        &mut self,
        dev: &mut Device,
        host: &mut Host,
        now: Time,
        bytes: u64,
        what: T,
    ) -> Time {
        let page = self.pages[self.next];
        self.next = (self.next + 1) % self.pages.len();
        dev.ring_access(host, Path::Receive, now, &mut self.desc);
        let written = dev.access(host, Path::Receive, now, page, bytes);
        let done = written.max(dev.ring_access(host, Path::Receive, now, &mut self.cq));
        self.pending.push_back((done, bytes, what));
        done
    }

    /// When each pending completion is visible, oldest first.
    pub fn pending_times(&self) -> impl Iterator<Item = Time> + '_ {
        self.pending.iter().map(|p| p.0)
    }

    /// The oldest frame, if its completion is visible by `t`, and when the CPU has synced it for reading
    /// (dma_sync_single_for_cpu: a bounced page's copy back).
    pub fn pop_ready(&mut self, host: &mut Host, t: Time) -> Option<(T, Time)> {
        match self.pending.front() {
            Some(&(at, _, _)) if at <= t => {
                let (_, bytes, w) = self.pending.pop_front().expect("front checked");
                Some((w, host.dma_sync_for_cpu(t, bytes)))
            }
            _ => None,
        }
    }
}
