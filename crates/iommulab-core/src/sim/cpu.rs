use super::Time;

/// A simulated CPU: runs one piece of work at a time; accounts busy time, and the part of it spent spinning.
#[derive(Debug, Clone, Default)]
pub struct Cpu {
    /// The CPU is busy until this time.
    pub busy_until: Time,
    pub busy_ns: u64,
    /// Busy time spent spinning on locks or on invalidation completion.
    pub spin_ns: u64,
}

impl Cpu {
    /// Account work that ran on this CPU from `start` to `end` (callers advance their own cursor).
    pub fn account(&mut self, start: Time, end: Time) {
        debug_assert!(end >= start);
        self.busy_ns += end - start;
        self.busy_until = self.busy_until.max(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn accounts_busy_time_and_horizon() {
        let mut c = Cpu::default();
        c.account(10, 30);
        assert_eq!(c.busy_until, 30);
        c.account(25, 40); // overlapping accounting extends, never shrinks, busy_until
        assert_eq!(c.busy_until, 40);
        assert_eq!(c.busy_ns, 35);
    }
}
