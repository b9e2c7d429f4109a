//! What moving a cache line between cores costs: the CPU topology (cores per cluster sharing an LLC or a
//! mesh cluster, cores per socket) and the line-transfer latency at each distance. A lock word, a queue's
//! producer index or a bitmap word written by one core and then by another moves once; the second core
//! stalls for the transfer. Simplification: a line has one owner (the last writer); read-sharing by
//! pollers is folded into the next writer's transfer, as qspinlock's MCS queue keeps at most one spinner
//! on the lock word (kernel/locking/qspinlock.c).

/// CPU `i` sits in cluster `i / cluster_cores` of socket `i / socket_cores` (Linux numbers a socket's
/// cores together on the profiled hosts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coherence {
    pub cluster_cores: u32,
    pub socket_cores: u32,
    /// Transfer from another core of the same cluster.
    pub cluster_ns: u64,
    /// Transfer from a core of another cluster of the same socket.
    pub socket_ns: u64,
    /// Transfer from a core of another socket.
    pub remote_ns: u64,
}

/// No CPU owns the line yet (or the caller is not a CPU: the model's own bookkeeping).
pub const NO_CPU: u32 = u32::MAX;

impl Coherence {
    /// Stall of `to` taking a line last written by `from`.
    #[inline]
    pub fn transfer_ns(&self, from: u32, to: u32) -> u64 {
        if from == to || from == NO_CPU || to == NO_CPU {
            return 0;
        }
        let (c, s) = (self.cluster_cores.max(1), self.socket_cores.max(1));
        if from / s != to / s {
            self.remote_ns
        } else if from / c != to / c {
            self.socket_ns
        } else {
            self.cluster_ns
        }
    }
    /// Whether any transfer costs anything (a free model skips the bookkeeping).
    pub fn is_free(&self) -> bool {
        self.cluster_ns == 0 && self.socket_ns == 0 && self.remote_ns == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn transfer_grows_with_distance() {
        let c = Coherence {
            cluster_cores: 4,
            socket_cores: 16,
            cluster_ns: 30,
            socket_ns: 70,
            remote_ns: 150,
        };
        assert_eq!(c.transfer_ns(3, 3), 0);
        assert_eq!(c.transfer_ns(0, 3), 30);
        assert_eq!(c.transfer_ns(0, 4), 70);
        assert_eq!(c.transfer_ns(15, 16), 150);
        assert_eq!(c.transfer_ns(NO_CPU, 5), 0);
    }
}
