//! The kernel's DMA map benchmark (kernel/dma/map_benchmark.c): `threads` kernel threads, each with one
//! buffer of `granule` pages (alloc_pages_exact, once), looping in map_benchmark_thread(): fill the buffer
//! unless the direction is DMA_FROM_DEVICE, time dma_map_single(), busy-wait `dma_trans_ns` (ndelay), time
//! dma_unmap_single(), add both times in whole 100 ns units to shared sums and sums of squares. The device
//! never touches the buffer: the benchmark measures the DMA layer and the IOMMU driver alone.

use super::{event, Workload, WorkloadStats};
use crate::host::Host;
use crate::hw::PAGE_SIZE;
use crate::scenario::{MapBenchmark, MapDir};
use crate::sim::{Ctx, Time};
use serde::Serialize;

const EV_MAP: u16 = 0;
const EV_UNMAP: u16 = 1;

/// map_benchmark_thread()'s accumulators (struct map_benchmark_data: sum_map_100ns, sum_sq_map, ...):
/// cumulative, a window is the difference of two ([`MapBenchSums::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MapBenchSums {
    pub loops: u64,
    pub sum_map_100ns: u64,
    pub sum_sq_map: u64,
    pub sum_unmap_100ns: u64,
    pub sum_sq_unmap: u64,
    /// dma_map_single() calls that failed (the kernel's thread then ends with -ENOMEM).
    pub map_failures: u64,
    /// The same times in ns before the kernel's division by 100 (to compare with a host's own measurement).
    pub sum_map_ns: u64,
    pub sum_unmap_ns: u64,
}

impl MapBenchSums {
    /// One loop's map and unmap times, in ns: div64_ul(delta, 100), then the sums (map_benchmark_thread).
    fn add(&mut self, map_ns: u64, unmap_ns: u64) {
        let (m, u) = (map_ns / 100, unmap_ns / 100);
        self.loops += 1;
        self.sum_map_100ns += m;
        self.sum_sq_map += m * m;
        self.sum_unmap_100ns += u;
        self.sum_sq_unmap += u * u;
        self.sum_map_ns += map_ns;
        self.sum_unmap_ns += unmap_ns;
    }

    pub fn since(&self, a: &MapBenchSums) -> MapBenchSums {
        MapBenchSums {
            loops: self.loops - a.loops,
            sum_map_100ns: self.sum_map_100ns - a.sum_map_100ns,
            sum_sq_map: self.sum_sq_map - a.sum_sq_map,
            sum_unmap_100ns: self.sum_unmap_100ns - a.sum_unmap_100ns,
            sum_sq_unmap: self.sum_sq_unmap - a.sum_sq_unmap,
            // Over the whole run: any failed map fails the kernel's ioctl, warm-up or not.
            map_failures: self.map_failures,
            sum_map_ns: self.sum_map_ns - a.sum_map_ns,
            sum_unmap_ns: self.sum_unmap_ns - a.sum_unmap_ns,
        }
    }

    /// do_map_benchmark(): the average and standard deviation in 100 ns units, as the kernel computes them
    /// in integers: avg = sum / loops, stddev = int_sqrt64(sum_sq / loops - avg²).
    pub fn map_100ns(&self) -> (u64, u64) {
        avg_stddev(self.sum_map_100ns, self.sum_sq_map, self.loops)
    }

    pub fn unmap_100ns(&self) -> (u64, u64) {
        avg_stddev(self.sum_unmap_100ns, self.sum_sq_unmap, self.loops)
    }
}

fn avg_stddev(sum: u64, sum_sq: u64, loops: u64) -> (u64, u64) {
    if loops == 0 {
        return (0, 0);
    }
    let avg = sum / loops;
    let var = (sum_sq / loops).saturating_sub(avg * avg);
    (avg, var.isqrt())
}

/// One kernel thread (on CPU `cpus[i]`): its buffer, and the loop's map in progress (its DMA pfn and how long
/// the map took). A thread whose map failed schedules nothing more: it has ended.
struct Thread {
    phys: u64,
    mapped: Option<(u64, Time)>,
}

pub struct MapBenchmarkWorkload {
    cfg: MapBenchmark,
    cpus: Vec<usize>,
    threads: Vec<Thread>,
    /// CPU time to fill the buffer before each map (memset 0x66), ns.
    fill_ns: u64,
    sums: MapBenchSums,
    stats: WorkloadStats,
}

impl MapBenchmarkWorkload {
    /// `memset_ns_per_byte`: the platform's store rate for the buffer fill.
    pub fn new(cfg: &MapBenchmark, socket_cores: u32, memset_ns_per_byte: f64) -> Self {
        let bytes = cfg.granule as u64 * PAGE_SIZE;
        let fill_ns = if cfg.dma_dir == MapDir::FromDevice {
            0
        } else {
            (bytes as f64 * memset_ns_per_byte).round() as u64
        };
        MapBenchmarkWorkload {
            cfg: cfg.clone(),
            cpus: cfg.cpus(socket_cores).collect(),
            threads: Vec::new(),
            fill_ns,
            sums: MapBenchSums::default(),
            stats: WorkloadStats::default(),
        }
    }

    fn pages(&self) -> u64 {
        self.cfg.granule as u64
    }

    /// The top of the loop: the fill, then the timed dma_map_single().
    fn map(&mut self, host: &mut Host, now: Time, i: usize) {
        let (cpu, phys) = (self.cpus[i], self.threads[i].phys);
        if !host.cpu_acquire(cpu, now, event(EV_MAP, i), Ctx::Task) {
            return;
        }
        let start = now + self.fill_ns;
        let bytes = self.pages() * PAGE_SIZE;
        let mapped = host.dma_map_dir(start, cpu, phys, 0, bytes, self.cfg.dma_dir);
        let Some((dma, _, t)) = mapped else {
            self.sums.map_failures += 1;
            host.cpus[cpu].account(now, start);
            return;
        };
        self.threads[i].mapped = Some((dma, t - start));
        // ndelay(): the CPU spins through the pretended transfer.
        let unmap_at = t + self.cfg.dma_trans_ns;
        host.cpus[cpu].account(now, unmap_at);
        host.schedule(unmap_at, event(EV_UNMAP, i));
    }

    /// The timed dma_unmap_single(), the sums, and the next loop.
    fn unmap(&mut self, host: &mut Host, now: Time, i: usize) {
        let cpu = self.cpus[i];
        if !host.cpu_acquire(cpu, now, event(EV_UNMAP, i), Ctx::Task) {
            return;
        }
        let (dma, map_ns) = self.threads[i]
            .mapped
            .take()
            .expect("an unmap follows its map");
        let t = host.dma_unmap(now, cpu, dma, self.pages());
        let t = host.dma_batch_end(t, cpu);
        self.sums.add(map_ns, t - now);
        self.stats.packets_delivered += 1;
        self.stats.bytes_delivered += self.pages() * PAGE_SIZE;
        host.cpus[cpu].account(now, t);
        host.schedule(t, event(EV_MAP, i));
    }
}

impl Workload for MapBenchmarkWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        for i in 0..self.cpus.len() {
            // alloc_pages_exact(): physically contiguous, once per thread.
            let Some(phys) = host.pages.alloc_contiguous(self.cfg.granule as u64) else {
                return now;
            };
            self.threads.push(Thread { phys, mapped: None });
            host.schedule(now, event(EV_MAP, i));
        }
        now
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        match kind {
            EV_MAP => self.map(host, now, id as usize),
            EV_UNMAP => self.unmap(host, now, id as usize),
            _ => unreachable!("map benchmark event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        WorkloadStats {
            map_bench: Some(self.sums),
            ..self.stats.clone()
        }
    }

    fn cpus(&self) -> Vec<usize> {
        self.cpus.clone()
    }

    /// No device moves data: nothing bounds the loop but the CPUs and the IOMMU.
    fn line_rate_gbps(&self) -> f64 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_and_statistics_follow_the_kernels_integer_arithmetic() {
        let mut s = MapBenchSums::default();
        // 199 ns counts as one 100 ns unit, 99 ns as none (div64_ul).
        s.add(199, 99);
        s.add(450, 1000);
        s.add(1010, 1000);
        assert_eq!((s.sum_map_100ns, s.sum_sq_map), (1 + 4 + 10, 1 + 16 + 100));
        // avg = 15 / 3 = 5; variance = 117 / 3 - 25 = 14; int_sqrt = 3.
        assert_eq!(s.map_100ns(), (5, 3));
        // unmap: 0, 10, 10: avg 20/3 = 6, variance 200/3 - 36 = 30, sqrt 5.
        assert_eq!(s.unmap_100ns(), (6, 5));
        let later = {
            let mut l = s;
            l.add(300, 300);
            l
        };
        assert_eq!(later.since(&s).map_100ns(), (3, 0));
        let failed = MapBenchSums {
            map_failures: 1,
            ..later
        };
        assert_eq!(
            failed.since(&s).map_failures,
            1,
            "failures count over the run"
        );
        assert_eq!(MapBenchSums::default().map_100ns(), (0, 0));
    }

    /// One 1 MiB thread of the built-in map-benchmark scenario (Kunpeng 920, strict) with `ov` set: its counts,
    /// and its SMMU's cmd_ns.
    fn one_thread_1m(ov: &[(&str, &str)]) -> (crate::metrics::MapBenchmarkCounts, u64) {
        let mut all = vec![
            ("workload.dma_map_benchmark.threads", "1"),
            ("workload.dma_map_benchmark.granule", "256"),
        ];
        all.extend_from_slice(ov);
        let v = crate::run::builtin_with("map-benchmark", &all)
            .into_iter()
            .find(|v| {
                let mb = v.scenario.workload.dma_map_benchmark.as_ref();
                mb.is_some_and(|m| m.threads == 1 && m.granule == 256)
            })
            .expect("the scenario compares 1 thread and 256 pages");
        let cmd_ns = v
            .scenario
            .platform
            .iommu
            .smmuv3
            .as_ref()
            .expect("an SMMUv3")
            .cmd_ns;
        let r = crate::run::run_variant(&v);
        (r.map_benchmark.expect("a map benchmark run"), cmd_ns)
    }

    #[test]
    fn the_timed_spans_are_the_map_and_unmap_calls_alone() {
        // map_benchmark_thread(): memset(buf, 0x66, size) before map_stime = ktime_get(); map_etime right
        // after dma_map_single(); ndelay(dma_trans_ns) before unmap_stime; unmap_etime right after
        // dma_unmap_single(). The fill and the delay take the loop's time, never a timed call's.
        let (fill, cmd_ns) = one_thread_1m(&[]);
        let (nofill, _) = one_thread_1m(&[("workload.dma_map_benchmark.dma_dir", "from_device")]);
        let (delayed, _) = one_thread_1m(&[
            ("workload.dma_map_benchmark.dma_dir", "from_device"),
            ("workload.dma_map_benchmark.dma_trans_ns", "100000"),
        ]);
        let rate = |c: &crate::metrics::MapBenchmarkCounts| c.loops_per_sec_per_thread;
        assert!(rate(&fill) < rate(&nofill) / 1.5, "{fill:?} {nofill:?}");
        assert!(
            rate(&delayed) < rate(&nofill) * 0.3,
            "{delayed:?} {nofill:?}"
        );
        for c in [&fill, &delayed] {
            assert_eq!(
                (c.map_ns_mean, c.unmap_ns_mean),
                (nofill.map_ns_mean, nofill.unmap_ns_mean),
                "{c:?}"
            );
        }
        // The unmap's span holds the whole strict dma_unmap_single(): its CMD_SYNC completes once the SMMU
        // has consumed the 256 TLBI_NH_VA before it, 256 × cmd_ns.
        assert!(nofill.unmap_ns_mean >= (256 * cmd_ns) as f64, "{nofill:?}");
        assert!(nofill.map_ns_mean > 0.0, "{nofill:?}");
    }

    #[test]
    fn each_timed_span_is_its_calls_own_time_to_the_nanosecond() {
        // The same calls, made by hand on a twin host, give each span's exact length: the map's from after
        // the fill (map_stime) to dma_map_single()'s return (map_etime); the unmap's from after ndelay()
        // (unmap_stime) to dma_unmap_single()'s return (unmap_etime).
        let cfg = MapBenchmark {
            threads: 1,
            seconds: None,
            granule: 16,
            dma_dir: MapDir::Bidirectional,
            node: -1,
            dma_bits: 32,
            dma_trans_ns: 50_000,
        };
        let (mut host, mut twin) = (
            crate::run::test_host("strict"),
            crate::run::test_host("strict"),
        );
        let mut w = MapBenchmarkWorkload::new(&cfg, 8, 0.25);
        w.start(&mut host, 0);
        MapBenchmarkWorkload::new(&cfg, 8, 0.25).start(&mut twin, 0);
        let (cpu, phys, pages, fill) = (w.cpus[0], w.threads[0].phys, w.pages(), w.fill_ns);
        assert!(fill > 0, "a bidirectional map fills its buffer first");
        w.handle(&mut host, 0, EV_MAP, 0);
        assert!(twin.cpu_acquire(cpu, 0, event(EV_MAP, 0), Ctx::Task));
        let (dma, mapped) = twin.dma_map(fill, cpu, phys, pages).expect("maps");
        assert_eq!(w.threads[0].mapped, Some((dma, mapped - fill)));
        let at = mapped + cfg.dma_trans_ns;
        twin.cpus[cpu].account(0, at);
        w.handle(&mut host, at, EV_UNMAP, 0);
        assert!(twin.cpu_acquire(cpu, at, event(EV_UNMAP, 0), Ctx::Task));
        let t = twin.dma_unmap(at, cpu, dma, pages);
        let t = twin.dma_batch_end(t, cpu);
        assert!(mapped > fill && t > at);
        assert_eq!(
            (w.sums.loops, w.sums.sum_map_ns, w.sums.sum_unmap_ns),
            (1, mapped - fill, t - at)
        );
    }
}
