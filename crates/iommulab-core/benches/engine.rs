//! Speed figures: translations per second on the IOTLB-hit and full-walk paths of each vendor (and of a VT-d
//! device with ATS, whose hits come from its ATC), and simulated seconds per
//! wall-clock second for 200 Gbps strict RX (criterion's "elem/s" there is simulated ns per wall second:
//! 1 Gelem/s = 1 simulated second per second).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use iommulab_core::hw;
use iommulab_core::run::Simulation;
use iommulab_core::scenario::{load, Platform, Source};

/// The platform of the default scenario on `profile`, optionally with an ATS device.
fn platform(profile: &str, ats: bool) -> Platform {
    let arch = if profile.starts_with("smmuv3") {
        "arm64"
    } else {
        "x86_64"
    };
    let ov = vec![
        ("platform.profile".to_string(), profile.to_string()),
        ("platform.pcie.ats".to_string(), ats.to_string()),
        ("os.arch".to_string(), arch.to_string()),
    ];
    let v = load(Source::Builtin("default"), &ov).expect("default loads");
    v[0].scenario.platform.clone()
}

fn translations(c: &mut Criterion) {
    const N: u64 = 4096;
    for (name, profile, ats) in [
        ("vtd", "vtd-server", false),
        ("smmuv3", "smmuv3-server", false),
        ("vtd_ats", "vtd-server", true),
    ] {
        let p = platform(profile, ats);
        let mut g = c.benchmark_group(format!("translate/{name}"));
        g.throughput(Throughput::Elements(N));
        // Cache hits (IOTLB, or the device ATC with ATS): 16 pages, all resident.
        let mut v = hw::build(&p, 1, (6, 12), false);
        v.map_pages(1, 0x1000, 0x9000, 16);
        g.bench_function("iotlb_hit", |b| {
            b.iter(|| {
                for i in 0..N {
                    black_box(v.translate(0, 1, 0x1000 + (i & 15)));
                }
            })
        });
        // Full walks: pages 1 GiB apart miss the IOTLB and (nearly) every walk cache.
        let mut v = hw::build(&p, 1, (6, 12), false);
        for i in 0..N {
            v.map_pages(1, i << 18, i, 1);
        }
        g.bench_function("full_walk", |b| {
            b.iter(|| {
                for i in 0..N {
                    black_box(v.translate(0, 1, i << 18));
                }
            })
        });
        g.finish();
    }
}

fn simulation(c: &mut Criterion) {
    let ov: Vec<(String, String)> = [
        ("os.policy", "strict"),
        ("workload.nic_rx.line_rate_gbps", "200"),
        ("workload.nic_rx.queues", "16"),
        ("workload.nic_rx.flows", "16"),
        ("workload.nic_rx.page_pool", "false"),
        ("run.warmup_ms", "0"),
        ("run.duration_ms", "10"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    let v = load(Source::Builtin("default"), &ov).expect("loads");
    let mut g = c.benchmark_group("simulate");
    g.sample_size(10);
    g.throughput(Throughput::Elements(10_000_000)); // simulated ns per iteration
    g.bench_function("strict_rx_200g_no_page_pool", |b| {
        b.iter(|| {
            let mut s = Simulation::new(&v[0]);
            s.run_to_end();
            black_box(s.result())
        })
    });
    g.finish();
}

criterion_group!(benches, translations, simulation);
criterion_main!(benches);
