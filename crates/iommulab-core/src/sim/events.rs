use super::Time;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A time-ordered event queue; events at the same time pop in the order they were pushed.
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Time, u64, Slot<E>)>>,
    seq: u64,
}

/// Wrapper so the payload never takes part in ordering.
struct Slot<E>(E);
impl<E> PartialEq for Slot<E> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<E> Eq for Slot<E> {}
impl<E> PartialOrd for Slot<E> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Slot<E> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }
}

impl<E> EventQueue<E> {
    pub fn push(&mut self, at: Time, ev: E) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, Slot(ev))));
    }
    pub fn peek_time(&self) -> Option<Time> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }
    pub fn pop(&mut self) -> Option<(Time, E)> {
        self.heap.pop().map(|Reverse((t, _, Slot(e)))| (t, e))
    }
    pub fn len(&self) -> usize {
        self.heap.len()
    }
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn orders_by_time_then_insertion() {
        let mut q = EventQueue::default();
        q.push(5, 'a');
        q.push(1, 'b');
        q.push(5, 'c');
        q.push(1, 'd');
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(1, 'b'), (1, 'd'), (5, 'a'), (5, 'c')]);
    }
}
