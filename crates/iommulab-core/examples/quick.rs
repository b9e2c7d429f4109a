//! Run the built-in default scenario with `key=value` overrides and print one line per run.
use iommulab_core::{run, scenario};
fn main() {
    let ov: Vec<(String, String)> = std::env::args()
        .skip(1)
        .map(|a| {
            let (k, v) = a.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect();
    let vs =
        scenario::load(scenario::Source::Builtin("default"), &ov).unwrap_or_else(|e| panic!("{e}"));
    for v in &vs {
        let t0 = std::time::Instant::now();
        let r = run::run_variant(v);
        println!(
            "{:<12} {:>7.2} Gbps busy={:.3} invwait={:.3} unmapped/s={:>9.0} inv={:>7} inv/pg={:.4} miss/pg={:.3} walk/pg={:.3} drops r/d={}/{} win={:.3} fq={:?} ({:.2}s wall)",
            r.label, r.throughput_gbps, r.cpu_busy, r.cpu_inv_wait_share, r.iova_pages_unmapped as f64 / r.sim_seconds,
            r.invalidations.total, r.inv_per_page, r.iotlb_misses_per_page, r.walk_reads_per_page,
            r.drops.ring, r.drops.device, r.window_limited_share, (r.flush_queue_flushes.full, r.flush_queue_flushes.timer),
            t0.elapsed().as_secs_f64()
        );
    }
}
