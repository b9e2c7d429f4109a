//! Fuzzing on stable Rust, as property tests: whatever a trace or a scenario holds, replay and the simulator
//! answer with a result or an error, never a panic, and in bounded time. `cargo test --release --test fuzz`
//! runs a short campaign (CI); a long one sets the case count:
//!
//!     PROPTEST_CASES=1000000 cargo test --release --test fuzz trace
//!     PROPTEST_CASES=100000 cargo test --release --test fuzz scenario
//!
//! Every input that ever broke something is kept in `proptest-regressions/` and replayed first.

use iommulab_core::replay::{ReplayOptions, ReplaySession};
use iommulab_core::run::Simulation;
use iommulab_core::scenario::{load, PolicyName, Source, Vendor};
use proptest::prelude::*;
use std::time::{Duration, Instant};

/// Lines of a real kernel's trace (the testbed's 6.12 VT-d capture, first lines; a capture's notes, labels,
/// DMA API events and timer lines, with 7.3's names too), as seeds to mutate.
const REAL: &str = "  kworker/0:1-10      [000] b..1.     3.579441: map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096
  kworker/0:1-10      [000] ..s2.     3.580036: unmap: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 size=4096 unmapped_size=4096
            init-1       [000] .....     4.491812: tracing_mark_write: TB_BEGIN net
      dd-212 [001] ..... 5.000100: map: IOMMU: iova=0x00000000fffe0000 - 0x00000000ffff0000 paddr=0x0000000004000000 size=65536
      dd-212 [001] ..s1. 5.000200: unmap: IOMMU: iova=0x00000000fffe0000 - 0x00000000ffff0000 size=65536 unmapped_size=65536
            init-1       [000] .....     6.491812: tracing_mark_write: TB_END net
# iommulab capture: flush queue timer's domain recorded (kprobe tb_flush_all)
# iommulab capture: iommu group 3: 0000:00:03.0 0000:00:03.1
      dd-212 [001] d.... 5.000090: tb_map: (__iommu_map+0x0/0x290) dom=0xffff359486672640 iova=0xfffe0000 size=65536
      dd-212 [001] d.... 5.000101: dma_map_page: 0000:00:03.0 dir=FROM_DEVICE dma_addr=fffe0000 size=65536 phys_addr=4000000 attrs=
      dd-212 [001] ..... 5.000102: dma_map_sg: 0000:00:03.1 dir=FROM_DEVICE nents=2/2 ents=1/1 dma_addrs={0xfffa0000} sizes={0x20000} phys_addrs={0x1,0x2} attrs=NO_WARN
      dd-212 [001] d.h.. 5.000103: dma_unmap_sg: 0000:00:03.1 dir=FROM_DEVICE phys_addrs={0x1,0x2} attrs=
      dd-212 [001] ..s1. 5.000201: dma_unmap_page: 0000:00:03.0 dir=FROM_DEVICE dma_addr=fffe0000 size=65536 attrs=
 ksoftirqd/1-20      [001] d.s.. 5.010000: fq_flush_timeout: (fq_flush_timeout+0x0/0xd8) fq_domain=0xffff359486672640
 ksoftirqd/1-20      [001] d.s.. 5.010001: tb_flush_all: (intel_flush_iotlb_all+0x0/0x30) dom=0xffff359486672640
 ksoftirqd/1-20      [001] d.s.. 5.010002: tb_flush_all_viommu: (viommu_flush_iotlb_all+0x0/0x30) dom=0xffff359486672640
      dd-212 [001] d.... 5.000091: tb_map: (iommu_map_nosync+0x0/0x290) dom=0xffff359486672640 iova=0xfffe0000 size=65536
      dd-212 [001] d.... 5.000104: dma_map_phys: 0000:00:03.0 dir=FROM_DEVICE dma_addr=fffe0000 size=65536 phys_addr=4000000 attrs=
      dd-212 [001] ..s1. 5.000202: dma_unmap_phys: 0000:00:03.0 dir=FROM_DEVICE dma_addr=fffe0000 size=65536 attrs=
";

/// A trace line: a well-formed event with extreme numbers, a marker, a mutated real line, or bytes.
fn line() -> impl Strategy<Value = String> {
    let num = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(0xffff_ffff_ffff_f000),
        Just(1u64 << 48),
        0u64..0x1_0000_0000,
        any::<u64>(),
    ];
    let size = prop_oneof![
        Just(0u64),
        Just(4096u64),
        Just(u64::MAX),
        1u64..(1 << 30),
        any::<u64>()
    ];
    let ts = (0u64..100_000, 0u64..1_000_000).prop_map(|(s, us)| format!("{s}.{us:06}"));
    let map = (ts.clone(), num.clone(), num.clone(), size.clone()).prop_map(|(t, i, p, s)| {
        format!(
            "  dd-1 [000] ..... {t}: map: IOMMU: iova=0x{i:016x} - 0x{:016x} paddr=0x{p:016x} size={s}",
            i.wrapping_add(s)
        )
    });
    let unmap = (ts.clone(), num, size.clone(), size).prop_map(|(t, i, s, u)| {
        format!(
            "  dd-1 [001] ..s1. {t}: unmap: IOMMU: iova=0x{i:016x} - 0x{:016x} size={s} unmapped_size={u}",
            i.wrapping_add(s)
        )
    });
    let marker = (
        ts,
        prop::sample::select(vec!["TB_BEGIN", "TB_END", "TB_X"]),
        "[a-z]{0,4}",
    )
        .prop_map(|(t, k, n)| format!("  init-1 [000] ..... {t}: tracing_mark_write: {k} {n}"));
    let real_lines: Vec<String> = REAL.lines().map(String::from).collect();
    let mutated = (
        prop::sample::select(real_lines),
        any::<usize>(),
        any::<u8>(),
        any::<bool>(),
    )
        .prop_map(|(l, at, b, cut)| {
            let mut v = l.into_bytes();
            let i = at % v.len().max(1);
            if cut {
                v.truncate(i);
            } else if !v.is_empty() {
                v[i] = b;
            }
            String::from_utf8_lossy(&v).into_owned()
        });
    let bytes = prop::collection::vec(any::<u8>(), 0..120)
        .prop_map(|v| String::from_utf8_lossy(&v).into_owned());
    prop_oneof![3 => map, 3 => unmap, 1 => marker, 3 => mutated, 1 => bytes]
}

fn options() -> impl Strategy<Value = ReplayOptions> {
    (
        prop::sample::select(
            iommulab_core::hw::drivers()
                .iter()
                .map(|d| d.vendor())
                .collect::<Vec<Vendor>>(),
        ),
        any::<bool>(),
        prop::sample::select(vec![
            None,
            Some(PolicyName::Strict),
            Some(PolicyName::Lazy),
            Some(PolicyName::Passthrough),
        ]),
        prop::sample::select(vec!["5.15", "6.1", "6.8", "6.12", "6.18"]),
        prop::option::of(0u64..10_000_000),
    )
        .prop_map(
            |(vendor, ats, mode, kernel, jiffy_phase_ns)| ReplayOptions {
                vendor,
                caching_mode: vendor.driver().caching_mode_cap().is_some() && ats,
                ats,
                // A kernel the driver exists in (the RISC-V IOMMU's first is 6.13).
                kernel: {
                    let (a, b) = kernel.split_once('.').unwrap();
                    let k = iommulab_core::kernel::KernelVersion(
                        a.parse().unwrap(),
                        b.parse().unwrap(),
                    );
                    let (_, arch) = vendor.driver().replay_profile();
                    if vendor.driver().check_kernel(k, arch).is_ok() {
                        kernel
                    } else {
                        "6.18"
                    }
                    .into()
                },
                mode,
                jiffy_phase_ns,
                ..ReplayOptions::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any trace text replays to a result or an error, and in bounded time.
    #[test]
    fn trace_replays_or_errs_without_panic(opts in options(), lines in prop::collection::vec(line(), 0..40),
                                          chunk in 1usize..64) {
        let t0 = Instant::now();
        let text = lines.join("\n");
        let mut s = ReplaySession::new("fuzz", &opts).expect("valid options");
        let fed = text.as_bytes().chunks(chunk).try_for_each(|c| s.feed(c));
        if fed.is_ok() {
            let _ = s.finish();
        }
        prop_assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    }
}

/// A scenario key and a value to set it to.
fn setting() -> impl Strategy<Value = (String, String)> {
    let keys = vec![
        "run.duration_ms",
        "run.warmup_ms",
        "os.policy",
        "os.kernel",
        "os.hz",
        "workload.nic_rx.line_rate_gbps",
        "workload.nic_rx.queues",
        "workload.nic_rx.flows",
        "workload.nic_rx.mtu",
        "workload.nic_rx.ring_size",
        "workload.nic_rx.napi_budget",
        "workload.nic_rx.page_pool",
        "workload.nic_rx.pool_size",
        "platform.memory.pages",
        "platform.pcie.translation_slots",
        "platform.pcie.link_gbps",
        "platform.pcie.ats",
        "platform.cpu.cores",
        "platform.cpu.cluster_cores",
        "platform.cpu.socket_cores",
        "platform.cpu.line_remote_ns",
        "platform.iommu.iotlb_entries",
        "platform.iommu.vtd.inv_desc_ns",
        "platform.iommu.vtd.mamv",
        "attack.replay_per_sec",
    ];
    let value = prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1".to_string()),
        Just("3".to_string()),
        Just("1e300".to_string()),
        Just("1e-12".to_string()),
        Just("nan".to_string()),
        Just("true".to_string()),
        Just("\"strict\"".to_string()),
        Just("\"lazy\"".to_string()),
        Just("\"9.9\"".to_string()),
        Just("[]".to_string()),
        (1u64..100_000).prop_map(|n| n.to_string()),
        (0.0f64..1.0).prop_map(|x| format!("{x}")),
    ];
    (prop::sample::select(keys), value).prop_map(|(k, v)| (k.to_string(), v))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    /// Any settings on a built-in scenario load to a one-line error or run (a short window of it) to a result.
    #[test]
    fn scenario_loads_or_errs_and_runs_without_panic(
        name in prop::sample::select(vec!["default", "c1", "nvme", "tx", "rr", "iotlb-sync-map"]),
        mut sets in prop::collection::vec(setting(), 0..4),
    ) {
        // Keep each case short: the window is what is fuzzed, not its length.
        sets.push(("run.duration_ms".into(), "0.2".into()));
        sets.push(("run.warmup_ms".into(), "0.1".into()));
        let t0 = Instant::now();
        if let Ok(vs) = load(Source::Builtin(name), &sets) {
            for v in vs.iter().take(2) {
                if let Ok(mut s) = Simulation::try_new(v) {
                    s.run_to_end();
                    let _ = s.result();
                }
            }
        }
        prop_assert!(t0.elapsed() < Duration::from_secs(10), "{sets:?} took {:?}", t0.elapsed());
    }
}
