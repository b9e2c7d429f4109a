//! Print a per-millisecond timeline of the default scenario with `key=value` overrides (first variant).
use iommulab_core::{run::Simulation, scenario};
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
    let mut s = Simulation::new(&vs[0]);
    let mut prev = s.result();
    let mut t = 0;
    while !s.done() {
        t += 1_000_000;
        s.advance_to(t);
        let r = s.result();
        println!(
            "{:>5}ms gbps={:>7.2} busy={:.3} unmapped={:>6} mapped={:>6} drops r/d={}/{} inv={}",
            t / 1_000_000,
            (r.throughput_gbps * r.sim_seconds - prev.throughput_gbps * prev.sim_seconds) / 0.001,
            r.cpu_busy,
            r.iova_pages_unmapped - prev.iova_pages_unmapped,
            r.iova_pages_mapped - prev.iova_pages_mapped,
            r.drops.ring - prev.drops.ring,
            r.drops.device - prev.drops.device,
            r.invalidations.total - prev.invalidations.total
        );
        prev = r;
    }
}
