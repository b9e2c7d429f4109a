//! A sequence kept as two deques split where it was last changed, so that inserts and removals near one
//! another move only the entries between them (a gap buffer over `VecDeque`s). A lock's calendar is appended
//! to at its back and, when a request comes in behind the latest (a replay books a map's `iotlb_sync_map`
//! only at its unmap), changed at a point some way back that creeps forward: a flat deque moved everything
//! after that point on every insert.

use std::collections::VecDeque;

/// The first index at which `pred` (true on a prefix, false after it) is false, over the concatenation of
/// `parts`, as `partition_point`, but galloping from the back: the entries asked about are mostly the latest,
/// whose lines are still in cache, while a binary search from the middle of a long calendar misses on
/// every step.
pub fn partition_from_back<T>(parts: &[&[T]], pred: impl Fn(&T) -> bool) -> usize {
    let mut end: usize = parts.iter().map(|p| p.len()).sum();
    for part in parts.iter().rev() {
        end -= part.len();
        if part.first().is_some_and(&pred) {
            return end + gallop_from_back(part, pred);
        }
    }
    0
}

/// `partition_from_back` over one slice whose first entry satisfies `pred`.
fn gallop_from_back<T>(part: &[T], pred: impl Fn(&T) -> bool) -> usize {
    let (mut lo, mut hi) = (0, part.len());
    let mut step = 1;
    while hi > 0 {
        let probe = hi.saturating_sub(step);
        if pred(&part[probe]) {
            lo = probe + 1;
            break;
        }
        hi = probe;
        step *= 2;
    }
    // pred holds before lo and fails from hi on.
    lo + part[lo..hi].partition_point(pred)
}

#[derive(Debug, Clone)]
pub struct SplitDeque<T> {
    /// The entries before the split, then those from it on.
    head: VecDeque<T>,
    tail: VecDeque<T>,
}

impl<T> Default for SplitDeque<T> {
    fn default() -> Self {
        SplitDeque {
            head: VecDeque::new(),
            tail: VecDeque::new(),
        }
    }
}

impl<T: Copy> SplitDeque<T> {
    pub fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    pub fn get(&self, i: usize) -> T {
        match i.checked_sub(self.head.len()) {
            None => self.head[i],
            Some(j) => self.tail[j],
        }
    }

    pub fn get_mut(&mut self, i: usize) -> &mut T {
        match i.checked_sub(self.head.len()) {
            None => &mut self.head[i],
            Some(j) => &mut self.tail[j],
        }
    }

    pub fn front(&self) -> Option<T> {
        self.head.front().or(self.tail.front()).copied()
    }

    pub fn back(&self) -> Option<T> {
        self.tail.back().or(self.head.back()).copied()
    }

    pub fn back_mut(&mut self) -> Option<&mut T> {
        match self.tail.back_mut() {
            Some(b) => Some(b),
            None => self.head.back_mut(),
        }
    }

    pub fn pop_front(&mut self) -> Option<T> {
        if self.head.is_empty() && !self.tail.is_empty() {
            // Popped up to the split: the tail is the whole sequence, and one buffer is enough for it (an empty
            // deque keeps the buffer it has).
            self.head = std::mem::take(&mut self.tail);
        }
        self.head.pop_front()
    }

    pub fn push_back(&mut self, x: T) {
        if self.tail.is_empty() {
            self.head.push_back(x);
        } else {
            self.tail.push_back(x);
        }
    }

    /// The first index at which `pred` (true on a prefix, false after it) is false, searched from the back.
    pub fn partition_from_back(&self, pred: impl Fn(&T) -> bool) -> usize {
        let (h0, h1) = self.head.as_slices();
        let (t0, t1) = self.tail.as_slices();
        partition_from_back(&[h0, h1, t0, t1], pred)
    }

    /// Move the split to just before entry `i` (moving the entries between the old split and `i`).
    fn split_at(&mut self, i: usize) {
        while self.head.len() > i {
            let x = self.head.pop_back().expect("head longer than i");
            self.tail.push_front(x);
        }
        while self.head.len() < i {
            let x = self.tail.pop_front().expect("i within the sequence");
            self.head.push_back(x);
        }
    }

    /// Insert `x` before entry `i`.
    pub fn insert(&mut self, i: usize, x: T) {
        self.split_at(i);
        self.head.push_back(x);
    }

    /// Remove entry `i`.
    pub fn remove(&mut self, i: usize) -> T {
        self.split_at(i + 1);
        self.head.pop_back().expect("i within the sequence")
    }

    /// Replace entries [lo, hi) by `f` folded over them from `init` (which is inserted at `lo` if the range
    /// is empty). A range past the split is merged where it is, without moving the split (a lock extended
    /// at its back between inserts further back).
    pub fn merge(&mut self, lo: usize, hi: usize, init: T, f: impl FnMut(T, T) -> T) {
        match lo.checked_sub(self.head.len()) {
            Some(j) => {
                let k = hi - self.head.len();
                let m = self.tail.drain(j..k).fold(init, f);
                self.tail.insert(j, m);
            }
            None => {
                self.split_at(lo);
                let m = self.tail.drain(..hi - lo).fold(init, f);
                self.head.push_back(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Insert(usize, u32),
        Remove(usize),
        Merge(usize, usize, u32),
        PushBack(u32),
        PopFront,
        SetBack(u32),
        Set(usize, u32),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (any::<usize>(), any::<u32>()).prop_map(|(i, x)| Step::Insert(i, x)),
            any::<usize>().prop_map(Step::Remove),
            (any::<usize>(), 0usize..5, any::<u32>()).prop_map(|(i, n, x)| Step::Merge(i, n, x)),
            any::<u32>().prop_map(Step::PushBack),
            Just(Step::PopFront),
            any::<u32>().prop_map(Step::SetBack),
            (any::<usize>(), any::<u32>()).prop_map(|(i, x)| Step::Set(i, x)),
        ]
    }

    proptest! {
        #[test]
        fn galloping_from_the_back_finds_what_partition_point_finds(
            xs in proptest::collection::btree_set(0u64..10_000, 0..300),
            cuts in proptest::collection::vec(0usize..300, 0..4),
            at in 0u64..10_100,
        ) {
            let flat: Vec<u64> = xs.into_iter().collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(flat.len())).collect();
            cuts.sort_unstable();
            let mut parts = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([flat.len()]) {
                parts.push(&flat[from..c]);
                from = c;
            }
            prop_assert_eq!(
                partition_from_back(&parts, |&x| x <= at),
                flat.partition_point(|&x| x <= at)
            );
        }

        /// Whatever is done to it, it reads as a flat deque given the same steps.
        #[test]
        fn reads_as_a_flat_deque(steps in proptest::collection::vec(step(), 0..200)) {
            let mut s = SplitDeque::default();
            let mut flat = VecDeque::new();
            for st in steps {
                let n = flat.len();
                match st {
                    Step::Insert(i, x) => {
                        let i = i % (n + 1);
                        s.insert(i, x);
                        flat.insert(i, x);
                    }
                    Step::Remove(i) if n > 0 => {
                        let i = i % n;
                        prop_assert_eq!(s.remove(i), flat.remove(i).unwrap());
                    }
                    Step::Merge(i, k, x) => {
                        let lo = i % (n + 1);
                        let hi = (lo + k).min(n);
                        s.merge(lo, hi, x, u32::wrapping_add);
                        let m = flat.drain(lo..hi).fold(x, u32::wrapping_add);
                        flat.insert(lo, m);
                    }
                    Step::PushBack(x) => {
                        s.push_back(x);
                        flat.push_back(x);
                    }
                    Step::PopFront => prop_assert_eq!(s.pop_front(), flat.pop_front()),
                    Step::SetBack(x) => {
                        if let (Some(a), Some(b)) = (s.back_mut(), flat.back_mut()) {
                            *a = x;
                            *b = x;
                        }
                    }
                    Step::Set(i, x) if n > 0 => {
                        *s.get_mut(i % n) = x;
                        flat[i % n] = x;
                    }
                    _ => {}
                }
                prop_assert_eq!(s.len(), flat.len());
                prop_assert_eq!(s.front(), flat.front().copied());
                prop_assert_eq!(s.back(), flat.back().copied());
                let all: Vec<u32> = (0..s.len()).map(|i| s.get(i)).collect();
                prop_assert_eq!(&all, &flat.iter().copied().collect::<Vec<_>>());
                // Sorted, the split's four slices are searched as one.
                let mut sorted = SplitDeque::default();
                let mut v = all.clone();
                v.sort_unstable();
                for (i, &x) in v.iter().enumerate() {
                    sorted.insert(i, x);
                }
                if !v.is_empty() {
                    sorted.insert(v.len() / 2, v[v.len() / 2]);
                    v.insert(v.len() / 2, v[v.len() / 2]);
                }
                let at = v.get(v.len() / 3).copied().unwrap_or(0);
                prop_assert_eq!(sorted.partition_from_back(|&x| x <= at), v.partition_point(|&x| x <= at));
            }
        }
    }
}
