//! Per-CPU state (a DMA policy's flush-queue rings, IOVA chunks and held unmaps; a lock's readers; VT-d's
//! pollers), grown on demand for CPUs beyond those it was built for: a replayed trace names its own CPUs.

#[derive(Debug, Clone)]
pub struct PerCpu<T>(Vec<T>);

/// No CPU has state yet.
impl<T> Default for PerCpu<T> {
    fn default() -> Self {
        PerCpu(Vec::new())
    }
}

impl<T: Default> PerCpu<T> {
    pub fn new(cpus: usize) -> Self {
        PerCpu((0..cpus.max(1)).map(|_| T::default()).collect())
    }

    /// CPUs with state.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `cpu`'s state, created if this CPU was not seen yet.
    pub fn get_mut(&mut self, cpu: usize) -> &mut T {
        if cpu >= self.0.len() {
            self.0.resize_with(cpu + 1, T::default);
        }
        &mut self.0[cpu]
    }
}

impl<T> PerCpu<T> {
    /// `cpu`'s state, if it was ever created.
    pub fn get(&self, cpu: usize) -> Option<&T> {
        self.0.get(cpu)
    }

    /// How many CPUs have state (the highest seen plus one).
    pub fn cpus(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.0.iter_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_for_an_unseen_cpu_and_keeps_what_it_had() {
        let mut p: PerCpu<Vec<u32>> = PerCpu::new(1);
        p.get_mut(0).push(7);
        assert!(p.get(3).is_none());
        p.get_mut(3).push(9);
        assert_eq!(
            (p.cpus(), p.get(0), p.get(3)),
            (4, Some(&vec![7]), Some(&vec![9]))
        );
    }
}
