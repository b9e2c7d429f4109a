//! A log-linear latency histogram (HdrHistogram-like): exact below 32 ns, then 32 buckets per power of two
//! (about 3 % resolution). Cumulative, so the window between two snapshots is their difference.

use serde::Serialize;

const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    counts: Vec<u64>,
}

fn index(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
    (SUB + (e - SUB_BITS) as u64 * SUB + sub) as usize
}

/// The smallest and largest value of bucket `i`.
fn bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < SUB {
        return (i, i);
    }
    let e = (i - SUB) / SUB + SUB_BITS as u64;
    let sub = (i - SUB) % SUB;
    let lo = (1 << e) | (sub << (e - SUB_BITS as u64));
    (lo, lo + (1 << (e - SUB_BITS as u64)) - 1)
}

/// Percentiles of a window, in µs.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Histogram {
    pub fn record(&mut self, ns: u64) {
        self.record_n(ns, 1);
    }

    /// `n` samples of the same value.
    pub fn record_n(&mut self, ns: u64, n: u64) {
        let i = index(ns);
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += n;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// What was recorded since `earlier` (a snapshot of this histogram).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        Histogram {
            counts: self
                .counts
                .iter()
                .enumerate()
                .map(|(i, &n)| n - earlier.counts.get(i).copied().unwrap_or(0))
                .collect(),
        }
    }

    /// Add another histogram's samples.
    pub fn add(&mut self, o: &Histogram) {
        if self.counts.len() < o.counts.len() {
            self.counts.resize(o.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
    }

    /// The value at quantile `q` (0..=1): the middle of the bucket holding that rank.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, hi) = bounds(i);
                return lo + (hi - lo) / 2;
            }
        }
        unreachable!("rank <= count")
    }

    /// Samples of `v` or more, to the bucket resolution (exact below 32): `v`'s whole bucket counts.
    pub fn count_at_least(&self, v: u64) -> u64 {
        self.counts.iter().skip(index(v)).sum()
    }

    /// The largest recorded value, to the bucket's upper bound.
    pub fn max(&self) -> u64 {
        self.counts
            .iter()
            .rposition(|&c| c > 0)
            .map_or(0, |i| bounds(i).1)
    }

    pub fn latency(&self, round: impl Fn(f64) -> f64) -> Option<Latency> {
        let count = self.count();
        (count > 0).then(|| Latency {
            count,
            p50_us: round(self.quantile(0.5) as f64 / 1000.0),
            p99_us: round(self.quantile(0.99) as f64 / 1000.0),
            p999_us: round(self.quantile(0.999) as f64 / 1000.0),
            max_us: round(self.max() as f64 / 1000.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_value_falls_in_its_bucket_within_3_percent(v in 0u64..1 << 50) {
            let (lo, hi) = bounds(index(v));
            prop_assert!(lo <= v && v <= hi);
            prop_assert!((hi - lo) as f64 <= v as f64 / 32.0 + 1.0);
        }
    }

    #[test]
    fn quantiles_of_a_window() {
        let mut h = Histogram::default();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let early = h.clone();
        for _ in 0..1000 {
            h.record(5_000_000);
        }
        let w = h.since(&early);
        assert_eq!(w.count(), 1000);
        let q = w.quantile(0.5) as f64;
        assert!((q - 5e6).abs() / 5e6 < 0.03, "{q}");
        let all = h.quantile(0.25) as f64;
        assert!((all - 500_000.0).abs() / 5e5 < 0.03, "{all}");
        assert!(h.max() >= 5_000_000);
        assert_eq!(Histogram::default().latency(|x| x), None);
    }
}
