//! A split virtqueue as QEMU's device side reads and writes it (hw/virtio/virtio.c, QEMU 7.2), with
//! VIRTIO_RING_F_EVENT_IDX negotiated as Linux's virtio drivers do. Behind a vIOMMU every access to the
//! ring goes through the IOMMU: the ring's MemoryRegionCache maps no host pointer for an IOMMU region, so
//! each load or store (address_space_translate_cached) asks the vIOMMU to translate the page it falls in.
//! This module says which ring page each step touches; the device translates them.
//!
//! Layout (vring_create_virtqueue_split, SMP_CACHE_BYTES alignment for virtio-pci modern): the descriptor
//! table (16 bytes each), the avail ring right after it (flags, idx, `ring[num]`, used_event), the used
//! ring at the next 64-byte boundary (flags, idx, `ring[num]` of 8 bytes, avail_event).

use crate::hw::PAGE_SIZE;

/// struct vring_desc (in the ring and in an indirect table).
pub const DESC_BYTES: u64 = 16;
/// struct vring_used_elem.
const USED_ELEM_BYTES: u64 = 8;
/// The used ring's alignment for virtio-pci modern (SMP_CACHE_BYTES on x86-64 and arm64).
const USED_ALIGN: u64 = 64;

/// One split virtqueue's device-side state (VirtQueue's last_avail_idx, shadow_avail_idx, notification).
#[derive(Debug, Clone)]
pub struct Vring {
    num: u64,
    avail: u64,
    used: u64,
    /// Buffers the driver has made available (the avail ring's idx).
    pub posted: u64,
    /// The next the device takes (last_avail_idx) and the avail idx it last read (shadow_avail_idx).
    last_avail: u64,
    shadow_avail: u64,
    /// The device wants notifications (virtio_queue_set_notification).
    notification: bool,
    /// Used entries written and not yet published by a flush.
    pending_used: u64,
    used_idx: u64,
    /// Pages (from the ring's start) of the accesses made since the last `take`.
    touched: Vec<u64>,
}

impl Vring {
    pub fn new(num: u32) -> Self {
        let num = num as u64;
        let avail = num * DESC_BYTES;
        let used = (avail + 4 + 2 * num + 2).next_multiple_of(USED_ALIGN);
        Vring {
            num,
            avail,
            used,
            posted: 0,
            last_avail: 0,
            shadow_avail: 0,
            notification: true,
            pending_used: 0,
            used_idx: 0,
            touched: Vec::new(),
        }
    }

    /// Pages the ring spans (what dma_alloc_coherent maps for it).
    pub fn pages(&self) -> u64 {
        (self.used + 4 + USED_ELEM_BYTES * self.num + 2).div_ceil(PAGE_SIZE)
    }

    /// The ring pages touched since the last call, in order.
    pub fn take(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.touched)
    }

    fn touch(&mut self, offset: u64) {
        self.touched.push(offset / PAGE_SIZE);
    }

    /// vring_avail_idx(): the driver's avail idx, kept as the shadow.
    fn avail_idx(&mut self) -> u64 {
        self.touch(self.avail + 2);
        self.shadow_avail = self.posted;
        self.posted
    }

    /// vring_avail_ring(): the head posted at `i`.
    fn avail_ring(&mut self, i: u64) {
        self.touch(self.avail + 4 + 2 * (i % self.num));
    }

    /// vring_split_desc_read() of descriptor `head` (the device takes heads in order here).
    fn desc(&mut self, head: u64) {
        self.touch((head % self.num) * DESC_BYTES);
    }

    /// vring_set_avail_event(): only while notifications are on.
    fn set_avail_event(&mut self) {
        if self.notification {
            self.touch(self.used + 4 + USED_ELEM_BYTES * self.num);
        }
    }

    /// virtio_queue_empty(): no read while the shadow shows buffers.
    pub fn empty(&mut self) -> bool {
        if self.shadow_avail != self.last_avail {
            return false;
        }
        self.avail_idx() == self.last_avail
    }

    /// virtqueue_get_avail_bytes() until `bufs` buffers of one descriptor each are found: per head the avail
    /// idx, the head and its descriptor. Whether they were there.
    pub fn avail_bufs(&mut self, bufs: u64) -> bool {
        let mut idx = self.last_avail;
        while self.avail_idx() > idx {
            self.avail_ring(idx);
            self.desc(idx);
            idx += 1;
            if idx - self.last_avail >= bufs {
                return true;
            }
        }
        false
    }

    /// virtio_queue_set_notification(): the avail idx read, and with notifications on the avail event
    /// written.
    pub fn set_notification(&mut self, on: bool) {
        self.notification = on;
        self.avail_idx();
        self.set_avail_event();
    }

    /// virtqueue_pop(): the empty check, the head, the avail event and the head's descriptor. An indirect
    /// table's entries are the caller's to translate (the table is a mapping of its own). Returns whether a
    /// buffer was there.
    pub fn pop(&mut self) -> bool {
        if self.empty() {
            return false;
        }
        let head = self.last_avail;
        self.avail_ring(head);
        self.last_avail += 1;
        self.set_avail_event();
        self.desc(head);
        true
    }

    /// virtqueue_fill(): one used element written.
    pub fn fill(&mut self) {
        self.touch(
            self.used + 4 + USED_ELEM_BYTES * ((self.used_idx + self.pending_used) % self.num),
        );
        self.pending_used += 1;
    }

    /// virtqueue_flush(): the used idx published.
    pub fn flush(&mut self) {
        self.touch(self.used + 2);
        self.used_idx += std::mem::take(&mut self.pending_used);
    }

    /// virtio_notify() → virtio_split_should_notify(): the driver's used_event read.
    pub fn notify(&mut self) {
        self.touch(self.avail + 4 + 2 * self.num);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_256_entry_ring_puts_its_descriptors_on_one_page_and_both_rings_on_the_next() {
        let mut v = Vring::new(256);
        assert_eq!(v.pages(), 2);
        v.posted = 10;
        // The first look reads the avail idx; from then on the shadow shows buffers.
        assert!(!v.empty());
        assert_eq!(v.take(), vec![1]);
        // virtio_net_receive_rcu for one buffer: has_buffers (avail bytes), notifications off, pop, fill,
        // flush, notify.
        assert!(!v.empty());
        assert!(v.avail_bufs(1));
        v.set_notification(false);
        assert!(v.pop());
        v.fill();
        v.flush();
        v.notify();
        let t = v.take();
        assert_eq!(t.iter().filter(|&&p| p == 0).count(), 2, "{t:?}");
        assert_eq!(t.iter().filter(|&&p| p == 1).count(), 7, "{t:?}");
    }

    #[test]
    fn an_empty_check_reads_only_when_the_shadow_shows_nothing() {
        let mut v = Vring::new(256);
        v.posted = 1;
        assert!(!v.empty());
        assert_eq!(v.take().len(), 1);
        assert!(!v.empty(), "the shadow still shows a buffer");
        assert!(v.take().is_empty());
        assert!(v.pop());
        v.take();
        assert!(v.empty());
        assert_eq!(v.take().len(), 1);
    }
}
