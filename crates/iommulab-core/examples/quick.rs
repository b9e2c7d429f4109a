//! Developer tool: run the built-in default scenario with `key=value` overrides and print one line per run;
//! with `--timeline`, print the first variant millisecond by millisecond instead.
//!
//!     cargo run --release --example quick -- os.policy=strict workload.nic_rx.queues=4
//!     cargo run --release --example quick -- --timeline run.warmup_ms=0 run.duration_ms=20
//!     cargo run --release --example quick -- --scenario=c3 os.policy=strict
use iommulab_core::{metrics::RunResult, run, scenario};

fn line(r: &RunResult) -> String {
    format!(
        "{:<34} {:>7.2} Gbps busy={:.3} invwait={:.3} unmapped/s={:>9.0} inv={:>7} inv/pg={:.4} miss/pg={:.3} pwc/pg={:.3?} walk/pg={:.3} tx={} drops r/d={}/{} win={:.3} fq={}/{} exp={:.3}/{:?}us stale={} reuse={}/{}/{} n={}+{} beyond={:.3} dma_reuse={}/{}/{} cache={:?}",
        r.label, r.throughput_gbps, r.cpu_busy, r.cpu_inv_wait_share, r.iova_pages_unmapped as f64 / r.sim_seconds,
        r.invalidations.total, r.inv_per_page, r.iotlb_misses_per_page, r.pwc_misses_per_page, r.walk_reads_per_page, r.tx_packets,
        r.drops.ring, r.drops.device, r.window_limited_share, r.flush_queue_flushes.full, r.flush_queue_flushes.timer,
        r.safety.exposed_share, r.safety.window.as_ref().map(|w| (w.p50_us, w.max_us)), r.stale_translations,
        r.iova_locality.walk.reuse_distance_p50, r.iova_locality.walk.reuse_distance_p99, r.iova_locality.walk.reuse_distance_max,
        r.iova_locality.allocations, r.iova_locality.walk.first_use, r.iova_locality.walk.beyond_walk_cache_share,
        r.dma_locality.walk.reuse_distance_p50, r.dma_locality.walk.reuse_distance_p99, r.dma_locality.walk.reuse_distance_max, r.rx_page_cache,
    )
}

fn main() {
    let mut timeline = false;
    let mut name = "default".to_string();
    let mut ov = Vec::new();
    for a in std::env::args().skip(1) {
        if let Some(n) = a.strip_prefix("--scenario=") {
            name = n.to_string();
            continue;
        }
        if a == "--timeline" {
            timeline = true;
            continue;
        }
        let (k, v) = a
            .split_once('=')
            .expect("arguments are key=value or --timeline");
        ov.push((k.to_string(), v.to_string()));
    }
    let vs =
        scenario::load(scenario::Source::Builtin(&name), &ov).unwrap_or_else(|e| panic!("{e}"));
    if !timeline {
        for v in &vs {
            let t0 = std::time::Instant::now();
            let r = run::run_variant(v);
            println!("{} ({:.2}s wall)", line(&r), t0.elapsed().as_secs_f64());
        }
        return;
    }
    let mut s = run::Simulation::new(&vs[0]);
    let mut t = 0;
    while !s.done() {
        t += 1_000_000;
        s.advance_to(t);
        println!("{:>5}ms cumulative: {}", t / 1_000_000, line(&s.result()));
    }
}
