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
    /// Earliest time new work can start on this CPU if it becomes ready at `at`.
    pub fn start_at(&self, at: Time) -> Time {
        at.max(self.busy_until)
    }
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
    fn work_queues_behind_busy_cpu() {
        let mut c = Cpu::default();
        c.account(10, 30);
        assert_eq!(c.start_at(20), 30);
        assert_eq!(c.start_at(40), 40);
        assert_eq!(c.busy_ns, 20);
    }
}
