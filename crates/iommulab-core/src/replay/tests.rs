//! The replay's unit and property tests.

use super::*;
use proptest::prelude::*;

proptest! {
    /// A map finds every queued range it meets, once, whether the ranges are disjoint (the run found
    /// from its end) or a trace has made them overlap (the full search).
    #[test]
    fn a_map_finds_the_queued_ranges_it_meets(ops in proptest::collection::vec((0u8..8, 0u64..200, 1u64..20), 1..200)) {
        let mut q = Queued::default();
        let mut model: BTreeMap<u64, u64> = BTreeMap::new();
        for (kind, first, n) in ops {
            match kind {
                0 => {
                    q.clear();
                    model.clear();
                }
                // Mostly unmaps of IOVA not queued, now and then one over a queued range.
                1..=4 => {
                    if kind == 4 || model.iter().all(|(&a, &e)| e <= first || a >= first + n) {
                        q.insert(first, first + n);
                        model.insert(first, first + n);
                    }
                }
                _ => {
                    let met: Vec<u64> = model.iter().filter(|(&a, &e)| a < first + n && e > first).map(|(&a, _)| a).collect();
                    prop_assert_eq!(q.take_overlapping(first, first + n), met.len() as u64);
                    for a in met {
                        model.remove(&a);
                    }
                }
            }
            prop_assert_eq!(&q.by_first, &model);
        }
    }
}

fn line(ts_us: u64, body: &str) -> String {
    format!(
        "  dd-212 [000] ..... {}.{:06}: {body}\n",
        ts_us / 1_000_000,
        ts_us % 1_000_000
    )
}
fn map(ts: u64, iova: u64, pa: u64, size: u64) -> String {
    line(
        ts,
        &format!(
            "map: IOMMU: iova=0x{iova:016x} - 0x{:016x} paddr=0x{pa:016x} size={size}",
            iova.wrapping_add(size)
        ),
    )
}
fn unmap(ts: u64, iova: u64, size: u64) -> String {
    line(
        ts,
        &format!(
            "unmap: IOMMU: iova=0x{iova:016x} - 0x{:016x} size={size} unmapped_size={size}",
            iova.wrapping_add(size)
        ),
    )
}
fn mark(ts: u64, t: &str) -> String {
    line(ts, &format!("tracing_mark_write: {t}"))
}
/// The flush queue's timer firing at `ts`, as a kprobe on fq_flush_timeout records it.
fn timer_fired(ts: u64) -> String {
    line(ts, "fq_flush_timeout: (fq_flush_timeout+0x0/0x160)")
}
/// `text` without its lines that contain `needle`.
fn without(text: &str, needle: &str) -> String {
    text.lines()
        .filter(|l| !l.contains(needle))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn run(text: &str, opts: &ReplayOptions) -> ReplayResult {
    replay(text.as_bytes(), "t", opts).unwrap()
}

#[test]
fn the_traced_iovas_walk_cache_locality_is_reported() {
    // Three maps in the 2 MiB at 0xfff00000, one in the 2 MiB below, then back: distances 0, 0, 1.
    let t = [
        map(10, 0xfff0_0000, 0x10_0000, 4096),
        map(11, 0xfff0_1000, 0x20_0000, 4096),
        map(12, 0xfff0_2000, 0x30_0000, 4096),
        map(13, 0xffd0_0000, 0x40_0000, 4096),
        map(14, 0xfff0_3000, 0x50_0000, 4096),
    ]
    .concat();
    let l = run(&t, &ReplayOptions::default()).iova_locality;
    assert_eq!((l.allocations, l.walk.first_use), (3, 2));
    assert_eq!(
        (l.walk.reuse_distance_max, l.walk.walk_cache_entries),
        (1, 16)
    );
    assert_eq!(l.walk.beyond_walk_cache_share, 0.0);
}

/// Invalidations wait in the IOMMU model until their processing time; with no device translating in a
/// replay they act as the trace's clock passes them, so a long trace keeps only the latest unmap's.
/// Ranges the page table cannot hold (wrapping past 2^64, beyond the input address space, empty) are
/// reported as unreadable lines, not replayed: they used to panic or spin.
#[test]
fn events_outside_the_iommus_address_space_are_bad_lines() {
    let ok = map(1_000, 0xfff0_0000, 0x10_0000, 4096);
    let t = [
        ok.clone(),
        map(2_000, 0xffff_ffff_ffff_f000, 0x10_0000, 4096),
        unmap(3_000, 0xffff_ffff_ffff_f000, 4096),
        map(4_000, 0xfff1_0000, 0x10_0000, 0),
        line(
            5,
            "unmap: IOMMU: iova=0x00000000fff00000 - 0x00000000fff01000 size=4096 unmapped_size=18446744073709551615",
        ),
        unmap(6_000, 0xfff0_0000, 4096),
    ]
    .concat();
    let r = run(&t, &ReplayOptions::default());
    assert_eq!(
        (r.lines.events, r.lines.bad),
        (2, 4),
        "{:?}",
        r.lines.bad_examples
    );
    assert!(r.lines.bad_examples[0].contains("beyond the IOMMU's input address space"));
}

/// Oddities a real host's trace can hold are replayed and counted: unaligned IOVAs, timestamps going
/// backwards, TB_END of a phase never begun, unmaps of ranges the trace never mapped.
#[test]
fn a_traces_oddities_are_counted() {
    let t = [
        mark(1_000, "TB_END net"),
        map(2_000, 0xfff0_0800, 0x10_0000, 4096),
        unmap(1_500, 0xfff0_0800, 4096),
        unmap(3_000, 0xfff8_0000, 8192),
    ]
    .concat();
    let a = run(&t, &ReplayOptions::default()).anomalies;
    assert_eq!(
        (
            a.unaligned,
            a.time_backwards,
            a.unmatched_markers,
            a.untraced_unmapped_pages
        ),
        (2, 1, 1, 2)
    );
    assert_eq!(a.maps_over_live, 0);
    // A map on IOVA still mapped: no domain does that, so the trace merged several (or lost an unmap).
    let t = [
        map(1_000, 0xffff_e000, 0x10_0000, 8192),
        map(2_000, 0xffff_f000, 0x20_0000, 4096),
        unmap(3_000, 0xffff_e000, 8192),
        map(4_000, 0xffff_f000, 0x30_0000, 4096),
    ]
    .concat();
    assert_eq!(
        run(&t, &ReplayOptions::default()).anomalies.maps_over_live,
        1
    );
    // --ats-phases naming a phase the trace does not have is an error, not a silent nothing.
    let opts = ReplayOptions {
        ats_phases: vec!["net".into()],
        ..Default::default()
    };
    let mut s = ReplaySession::new("t", &opts).unwrap();
    s.feed(t.as_bytes()).expect("short lines");
    let e = s.finish().unwrap_err().to_string();
    assert!(e.contains("--ats-phases net"), "{e}");
}

#[test]
fn a_long_strict_replay_keeps_no_backlog_of_invalidations() {
    let t: String = (0..1000u64)
        .flat_map(|i| {
            let ts = 1_000_000 + i * 10_000;
            [
                map(ts, 0xfff0_0000, 0x10_0000, 4096),
                unmap(ts + 5_000, 0xfff0_0000, 4096),
            ]
        })
        .collect();
    let strict = ReplayOptions {
        mode: Some(PolicyName::Strict),
        ..Default::default()
    };
    let mut s = ReplaySession::new("t", &strict).unwrap();
    s.feed(t.as_bytes()).expect("short lines");
    s.replay_batch(true);
    for r in s.model.finish().iter().flat_map(|(_, doms)| doms) {
        // The last unmap's PSI: its range and, with IH=0, the domain's walk caches.
        let n = r.dma.core.iommu.translator().pending();
        assert!(n <= 2, "{n} pending");
    }
}

#[test]
fn firings_naming_pointers_wait_until_the_pointer_is_tied_to_a_device() {
    // Issue 12: two devices named by the DMA API's events only, each unmapping every ms; the disk stops
    // at 300 ms. The firings name their domain's pointer (fq_domain), which nothing in the trace pairs with
    // a device: the network's pointer is tied when it fires with the disk quiet, the disk's then by
    // elimination. Every firing waited for its tie and flushed its own domain; the same on any number of
    // threads.
    let ms = |t: u64| 1_000_000 + t * 1000;
    let mut t = String::new();
    for i in 0..600u64 {
        for (dev, base, until) in [
            ("0000:00:02.0", 0xfff0_0000u64, 600),
            ("0000:00:03.0", 0xffe0_0000, 300),
        ] {
            if i >= until {
                continue;
            }
            let iova = base - (i % 200) * 0x1000;
            t += &map(ms(i), iova, 0x10_0000 + i * 0x1000, 4096);
            t += &line(ms(i) + 1, &format!("dma_map_page: {dev} dir=FROM_DEVICE dma_addr={iova:x} size=4096 phys_addr=0 attrs="));
            t += &unmap(ms(i) + 200, iova, 4096);
            t += &line(
                ms(i) + 201,
                &format!(
                    "dma_unmap_page: {dev} dir=FROM_DEVICE dma_addr={iova:x} size=4096 attrs="
                ),
            );
        }
        for (ptr, at, until) in [("0xaaa0", 5, 600), ("0xbbb0", 15, 310)] {
            if i % 20 == at && i < until {
                t += &line(
                    ms(i) + 300,
                    &format!("fq_flush_timeout: (fq_flush_timeout+0x0/0x160) fq_domain={ptr}"),
                );
            }
        }
    }
    let lazy = ReplayOptions {
        mode: Some(PolicyName::Lazy),
        jiffy_phase_ns: Some(0),
        ..Default::default()
    };
    let json = |cores: usize, chunk: usize| {
        let mut s = ReplaySession::on_cores("t", &lazy, cores).unwrap();
        for c in t.as_bytes().chunks(chunk) {
            s.feed(c).unwrap();
        }
        s.finish().unwrap()
    };
    let r = json(1, 1 << 20);
    let rt = r.recorded_timer.clone().unwrap();
    assert_eq!(
        (rt.firings, rt.ignored, rt.tied, rt.own_timer_domains),
        (30 + 15, 0, 2, 0)
    );
    assert_eq!(
        dsi_by_domain(&r, OUTSIDE),
        [("0000:00:02.0", 30), ("0000:00:03.0", 15)]
    );
    let one = serde_json::to_string(&r).unwrap();
    for (cores, chunk) in [(2, 97), (3, 4096)] {
        assert_eq!(
            serde_json::to_string(&json(cores, chunk)).unwrap(),
            one,
            "{cores} threads"
        );
    }
}

#[test]
fn the_replay_does_not_depend_on_how_many_threads_run_the_model() {
    // Two labelled domains, a map_sg group, lazy with its 16 tick phases: every thread count gives the
    // same JSON, chunks cut anywhere.
    let mut t = String::new();
    for i in 0..3000u64 {
        let ts = 1_000_000 + i * 7_000;
        let dom = ["0xaaa0", "0xbbb0"][(i % 2) as usize];
        let iova = 0xffff_0000 - (i % 64) * 0x2000;
        t += &format!("  t-1 [000] .... {}.{:06}: tb_map: (__iommu_map+0x0/0x280) dom={dom} iova={iova:#x} size=8192\n", ts / 1_000_000, ts % 1_000_000);
        t += &map(ts + 1, iova, 0x10_0000 + i * 0x2000, 4096);
        t += &map(ts + 2, iova + 0x1000, 0x20_0000 + i * 0x2000, 4096);
        if i >= 8 {
            let j = i - 8;
            let (dom, iova) = (
                ["0xaaa0", "0xbbb0"][(j % 2) as usize],
                0xffff_0000 - (j % 64) * 0x2000,
            );
            t += &format!("  t-1 [000] .... {}.{:06}: tb_unmap: (__iommu_unmap+0x0/0x1d0) dom={dom} iova={iova:#x} size=8192\n", (ts + 3) / 1_000_000, (ts + 3) % 1_000_000);
            t += &unmap(ts + 4, iova, 8192);
        }
    }
    let lazy = ReplayOptions {
        mode: Some(PolicyName::Lazy),
        ..Default::default()
    };
    let json = |cores: usize, chunk: usize| {
        let mut s = ReplaySession::on_cores("t", &lazy, cores).unwrap();
        for c in t.as_bytes().chunks(chunk) {
            s.feed(c).expect("short lines");
        }
        serde_json::to_string(&s.finish().unwrap()).unwrap()
    };
    let one = json(1, 1 << 20);
    assert!(one.contains("\"count\":2"), "{one}");
    for (cores, chunk) in [(2, 97), (3, 4096), (16, 1 << 20)] {
        assert_eq!(
            json(cores, chunk),
            one,
            "{cores} threads, chunks of {chunk}"
        );
    }
}

#[test]
fn labelled_domains_each_flush_their_own_queue() {
    // Two devices map the same IOVA at once (each domain allocates top-down from 4 GiB); the kprobe
    // lines name their domains. Lazy: each domain's flush queue and timer are its own, so two flushes.
    let line = |ts: u64, body: &str| {
        format!(
            "  t-1 [000] .... {}.{:06}: {body}\n",
            ts / 1_000_000,
            ts % 1_000_000
        )
    };
    let mut t = String::new();
    for (i, dom) in ["0xaaa0", "0xbbb0"].iter().enumerate() {
        let ts = 1_000_000 + i as u64 * 10;
        t += &line(
            ts,
            &format!("tb_map: (__iommu_map+0x0/0x280) dom={dom} iova=0xfffff000 size=4096"),
        );
        t += &line(ts + 1, "map: IOMMU: iova=0x00000000fffff000 - 0x0000000100000000 paddr=0x0000000001000000 size=4096");
    }
    for (i, dom) in ["0xaaa0", "0xbbb0"].iter().enumerate() {
        let ts = 1_000_100 + i as u64 * 10;
        t += &line(
            ts,
            &format!("tb_unmap: (__iommu_unmap+0x0/0x1d0) dom={dom} iova=0xfffff000 size=4096"),
        );
        t += &line(ts + 1, "unmap: IOMMU: iova=0x00000000fffff000 - 0x0000000100000000 size=4096 unmapped_size=4096");
    }
    let lazy = ReplayOptions {
        mode: Some(PolicyName::Lazy),
        jiffy_phase_ns: Some(0),
        ..Default::default()
    };
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(t.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!((r.domains.count, r.domains.labelled_events), (2, 4));
    assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), 2);
    // Each domain's own counts, under the pointer its labels name (issue 17).
    assert_eq!(dsi_by_domain(&r, OUTSIDE), [("0xaaa0", 1), ("0xbbb0", 1)]);
    // A recorded firing of the flush timer does not say whose: with two domains it is passed over.
    let timed = t.clone() + &timer_fired(1_000_200);
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(timed.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), 2);
    assert_eq!(
        r.recorded_timer,
        Some(RecordedTimer {
            firings: 0,
            ignored: 1,
            by_domain: false,
            tied: 0,
            own_timer_domains: 2
        })
    );
    // A capture that names each firing's domain (its flush_iotlb_all, next on the CPU): that domain's
    // timer fired, and the recorded firings drive every domain's timer.
    let named =
        format!(
        "# iommulab capture: flush queue timer's domain recorded (kprobe tb_flush_all)\n{t}{}{}",
        timer_fired(1_000_200),
        line(1_000_201, "tb_flush_all: (intel_flush_iotlb_all+0x0/0x30) dom=0xbbb0")
    );
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(named.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!(
        r.recorded_timer,
        Some(RecordedTimer {
            firings: 1,
            ignored: 0,
            by_domain: true,
            tied: 0,
            own_timer_domains: 0
        })
    );
    assert_eq!(
        r.phases.get(OUTSIDE).unwrap().counts.domain(),
        1,
        "only 0xbbb0's timer fired"
    );
    // A capture whose flush probe sits on a driver not in use (an x86 kernel with VT-d built in, serving
    // its devices through virtio-iommu) records the firings and never their flushes: at a CPU's second
    // firing without one, the first is lost and the firings' own fq_domain names their domains.
    let blind = format!(
        "# iommulab capture: flush queue timer's domain recorded (kprobe tb_flush_all)\n{t}{}{}",
        line(
            1_000_150,
            "fq_flush_timeout: (fq_flush_timeout+0x0/0x160) fq_domain=0xaaa0"
        ),
        line(
            1_000_200,
            "fq_flush_timeout: (fq_flush_timeout+0x0/0x160) fq_domain=0xbbb0"
        )
    );
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(blind.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!(
        r.recorded_timer,
        Some(RecordedTimer {
            firings: 1,
            ignored: 1,
            by_domain: true,
            tied: 0,
            own_timer_domains: 0
        })
    );
    assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), 1);
    // Or the firing reads the cookie's fq_domain itself; one that names no domain the labels know (read at
    // the wrong offset) leaves every domain its own timer.
    for (dom, firings, dsi) in [("0xaaa0", 1, 1), ("0x1234", 0, 2)] {
        // (In both, an earlier firing of a domain the trace never labels decides nothing.)
        let fq = format!(
            "{t}{}{}",
            line(
                1_000_150,
                "fq_flush_timeout: (fq_flush_timeout+0x0/0x160) fq_domain=0x5678"
            ),
            line(
                1_000_200,
                &format!("fq_flush_timeout: (fq_flush_timeout+0x0/0x160) fq_domain={dom}")
            )
        );
        let mut s = ReplaySession::new("t", &lazy).unwrap();
        s.feed(fq.as_bytes()).expect("short lines");
        let r = s.finish().unwrap();
        let rt = r.recorded_timer.unwrap();
        assert_eq!(
            (rt.firings, rt.ignored, rt.by_domain),
            (firings, 2 - firings, firings == 1),
            "{dom}"
        );
        assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), dsi, "{dom}");
    }
    // Without the labels: one domain, one flush.
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(without(&t, "tb_").as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!(r.domains.count, 1);
    assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), 1);
    // The DMA API's events name the devices instead: dma_map_page after its map, dma_unmap_page after
    // its unmap (Linux 6.12), each on the map's CPU.
    let mut d = String::new();
    for (i, dev) in ["0000:00:02.0", "0000:00:03.0"].iter().enumerate() {
        let ts = 1_000_000 + i as u64 * 10;
        d += &line(ts + 1, "map: IOMMU: iova=0x00000000fffff000 - 0x0000000100000000 paddr=0x0000000001000000 size=4096");
        d += &line(ts + 2, &format!("dma_map_page: {dev} dir=FROM_DEVICE dma_addr=fffff000 size=4096 phys_addr=1000000 attrs="));
    }
    for (i, dev) in ["0000:00:02.0", "0000:00:03.0"].iter().enumerate() {
        let ts = 1_000_100 + i as u64 * 10;
        d += &line(ts + 1, "unmap: IOMMU: iova=0x00000000fffff000 - 0x0000000100000000 size=4096 unmapped_size=4096");
        d += &line(
            ts + 2,
            &format!("dma_unmap_page: {dev} dir=FROM_DEVICE dma_addr=fffff000 size=4096 attrs="),
        );
    }
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(d.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!((r.domains.count, r.domains.labelled_events), (2, 4));
    assert_eq!(r.anomalies.maps_over_live, 0);
    assert_eq!(r.phases.get(OUTSIDE).unwrap().counts.domain(), 2);
    assert_eq!(
        dsi_by_domain(&r, OUTSIDE),
        [("0000:00:02.0", 1), ("0000:00:03.0", 1)]
    );
    assert_eq!(
        r.domains.devices.get("0000:00:03.0"),
        Some(&vec!["0000:00:03.0".to_string()])
    );
    // Devices of one IOMMU group share its domain.
    let grouped = "# iommulab capture: iommu group 7: 0000:00:02.0 0000:00:03.0\n".to_string() + &d;
    let mut s = ReplaySession::new("t", &lazy).unwrap();
    s.feed(grouped.as_bytes()).expect("short lines");
    let r = s.finish().unwrap();
    assert_eq!(r.domains.count, 1);
    assert_eq!(r.anomalies.maps_over_live, 1);
    assert_eq!(dsi_by_domain(&r, OUTSIDE), [("iommu group 7", 1)]);
    assert_eq!(
        r.domains.devices.get("iommu group 7"),
        Some(&vec!["0000:00:02.0".to_string(), "0000:00:03.0".into()])
    );
    // Without labels: the one domain, unnamed.
    let r = run(&without(&d, "dma_"), &lazy);
    assert_eq!(dsi_by_domain(&r, OUTSIDE), [("_domain0", 1)]);
}

/// A phase's flushes per domain, by the domain's name.
fn dsi_by_domain<'a>(r: &'a ReplayResult, phase: &str) -> Vec<(&'a str, u64)> {
    let p = r.phases.get(phase).expect("phase");
    p.by_domain
        .0
        .iter()
        .map(|(n, c)| (&**n, c.domain()))
        .collect()
}

#[test]
fn strict_unmap_is_one_psi_and_wait_and_map_sg_is_one_sync_map() {
    // A map_sg of three contiguous segments, one separate map, both unmapped.
    let t = [
        mark(1_000_000, "TB_BEGIN io"),
        map(1_000_010, 0xfff0_0000, 0x10_0000, 4096),
        map(1_000_011, 0xfff0_1000, 0x20_0000, 8192),
        map(1_000_012, 0xfff0_3000, 0x30_0000, 4096),
        map(1_000_020, 0xffe0_0000, 0x40_0000, 4096),
        unmap(1_000_030, 0xfff0_0000, 16384),
        unmap(1_000_040, 0xffe0_0000, 4096),
        mark(1_000_050, "TB_END io"),
    ]
    .concat();
    let strict = ReplayOptions {
        mode: Some(PolicyName::Strict),
        ..Default::default()
    };
    let r = run(&t, &strict);
    let c = &r.phases.get("io").unwrap().counts;
    assert_eq!((c.map_events, c.unmap_events, c.map_syncs), (4, 2, 2));
    assert_eq!((c.range(), c.domain(), c.syncs), (2, 0, 2));
    // Caching mode: the two map groups are invalidated too.
    let cm = ReplayOptions {
        caching_mode: true,
        ..strict.clone()
    };
    let c = run(&t, &cm).phases.get("io").unwrap().counts.clone();
    assert_eq!((c.range(), c.syncs), (4, 4));
    // Unmaps of ranges mapped before tracing still invalidate.
    let c = run(&unmap(5, 0x1000, 4096), &strict)
        .phases
        .get(OUTSIDE)
        .unwrap()
        .counts
        .clone();
    assert_eq!(c.range(), 1);
}

#[test]
fn another_domains_map_over_live_iova_does_not_merge_groups() {
    // Phase "net": a device maps two buffers with separate dma_map_page() calls at adjacent IOVAs and
    // never unmaps them (still posted). Phase "blk": another device's domain maps 8K over the same IOVAs
    // and unmaps it. Without the collision rule that unmap would settle the net buffers as one group.
    let t = [
        mark(1_000_000, "TB_BEGIN net"),
        map(1_000_010, 0xfff0_0000, 0x10_0000, 4096),
        map(1_000_011, 0xfff0_1000, 0x20_0000, 4096),
        mark(1_000_020, "TB_END net"),
        mark(1_000_030, "TB_BEGIN blk"),
        map(1_000_040, 0xfff0_0000, 0x50_0000, 8192),
        unmap(1_000_050, 0xfff0_0000, 8192),
        mark(1_000_060, "TB_END blk"),
    ]
    .concat();
    let cm = ReplayOptions {
        caching_mode: true,
        mode: Some(PolicyName::Strict),
        ..Default::default()
    };
    let r = run(&t, &cm);
    let net = &r.phases.get("net").unwrap().counts;
    let blk = &r.phases.get("blk").unwrap().counts;
    // net saw no multi-segment group, so its unsettled maps are one call each.
    assert_eq!((net.map_syncs, net.range()), (2, 2));
    assert_eq!((blk.map_syncs, blk.range()), (1, 2));
    // Where the phase did show a map_sg, an unsettled candidate stays one call.
    let t2 = [
        mark(1_000_000, "TB_BEGIN io"),
        map(1_000_010, 0xfff0_0000, 0x10_0000, 4096),
        map(1_000_011, 0xfff0_1000, 0x20_0000, 4096),
        unmap(1_000_012, 0xfff0_0000, 8192),
        map(1_000_020, 0xffe0_0000, 0x30_0000, 4096),
        map(1_000_021, 0xffe0_1000, 0x40_0000, 4096),
        mark(1_000_030, "TB_END io"),
    ]
    .concat();
    let io = run(&t2, &cm).phases.get("io").unwrap().counts.clone();
    assert_eq!(io.map_syncs, 2);
}

#[test]
fn an_iova_api_unlink_invalidates_at_once_in_a_lazy_domain() {
    // dma_iova_unlink() (the capture's kprobe line, then its unmap) syncs the IOTLB at once; a plain lazy
    // unmap waits for the flush queue's timer.
    let t = map(10, 0xffff_f000, 0x1000, 4096)
        + &line(20, "tb_iova_unlink: (dma_iova_unlink+0x0/0x30)")
        + &unmap(21, 0xffff_f000, 4096)
        + &map(30, 0xffff_e000, 0x2000, 4096)
        + &unmap(31, 0xffff_e000, 4096);
    let lazy = ReplayOptions {
        mode: Some(PolicyName::Lazy),
        jiffy_phase_ns: Some(0),
        ..Default::default()
    };
    let c = run(&t, &lazy).phases.get(OUTSIDE).unwrap().counts.clone();
    assert_eq!((c.range(), c.domain()), (1, 1));
    let c = run(&without(&t, "tb_iova_unlink"), &lazy)
        .phases
        .get(OUTSIDE)
        .unwrap()
        .counts
        .clone();
    assert_eq!((c.range(), c.domain()), (0, 1));
}

#[test]
fn lazy_flushes_on_a_full_ring_and_on_the_timer() {
    // 300 separate maps (top-down IOVAs, as the allocator hands them out), then 300 unmaps 10 us apart
    // and silence: one flush at the 256th unmap (255 queued), one by the timer.
    let mut t = mark(0, "TB_BEGIN net");
    let iova = |i: u64| 0x1000_0000 - i * 4096;
    for i in 0..300u64 {
        t += &map(1000 + i * 10, iova(i), i * 4096, 4096);
    }
    for i in 0..300u64 {
        t += &unmap(5000 + i * 10, iova(i), 4096);
    }
    t += &mark(1_000_000, "TB_END net");
    let lazy = ReplayOptions {
        cmdline: "iommu.strict=0".into(),
        ..Default::default()
    };
    let r = run(&t, &lazy);
    assert_eq!(r.policy, "lazy");
    let c = &r.phases.get("net").unwrap().counts;
    assert_eq!((c.range(), c.domain(), c.syncs), (0, 2, 2));
    // Caching mode forces strict whatever the command line says.
    let r = run(
        &t,
        &ReplayOptions {
            caching_mode: true,
            ..lazy
        },
    );
    assert_eq!(r.policy, "strict");
    assert_eq!(r.phases.get("net").unwrap().counts.range(), 300 + 300);
}

#[test]
fn a_recorded_flush_timer_replaces_the_models() {
    // Unmaps in three bursts 100 ms apart, each followed by the flush timer as the trace recorded it 30 ms
    // later (late: the model's own fires 12-16 ms after arming): one flush per recorded firing.
    let mut body = mark(0, "TB_BEGIN net");
    for b in 0..3u64 {
        let t0 = 10_000 + b * 100_000;
        for i in 0..10u64 {
            let iova = 0x1000_0000 - (b * 10 + i) * 4096;
            body += &map(t0 + i * 10, iova, iova, 4096);
            body += &unmap(t0 + 500 + i * 10, iova, 4096);
        }
        body += &timer_fired(t0 + 30_000);
    }
    body += &mark(1_000_000, "TB_END net");
    let lazy = ReplayOptions {
        cmdline: "iommu.strict=0".into(),
        ..Default::default()
    };
    // The model's timer runs until the first recorded firing; here it was due 12-16 ms after the first
    // unmap, but no event came before the recorded firing to run it, so it never did.
    let r = run(&body, &lazy);
    assert_eq!(r.phases.get("net").unwrap().counts.domain(), 3);
    assert_eq!(
        r.recorded_timer,
        Some(RecordedTimer {
            firings: 3,
            ignored: 0,
            by_domain: false,
            tied: 0,
            own_timer_domains: 0
        })
    );
    // The model's own timer, where the trace does not record it: one flush per burst too, but at its own
    // time; strict passes the firings over.
    let r = run(&without(&body, "fq_flush_timeout"), &lazy);
    assert_eq!(
        (
            r.phases.get("net").unwrap().counts.domain(),
            r.recorded_timer
        ),
        (3, None)
    );
    let strict = ReplayOptions {
        cmdline: "iommu.strict=1".into(),
        ..Default::default()
    };
    let r = run(&body, &strict);
    assert_eq!(
        (
            r.phases.get("net").unwrap().counts.range(),
            r.recorded_timer
        ),
        (30, None)
    );
}

#[test]
fn a_recorded_firing_flushes_what_the_models_late_timer_would_have_left_queued() {
    // A first unmap and its firing; then two unmaps 25 ms apart. The model's own timer (12-16 ms) flushes
    // each alone: three flushes. The recorded firing of the second pair comes 40 ms after its first unmap
    // (late) and finds both queued: two flushes.
    let mut body = mark(0, "TB_BEGIN net");
    let mut timed = body.clone();
    for (i, ts) in [(0u64, 1_000u64), (1, 100_000), (2, 125_000)] {
        let iova = 0x1000_0000 - i * 4096;
        for t in [&mut body, &mut timed] {
            *t += &map(ts - 100, iova, iova, 4096);
            *t += &unmap(ts, iova, 4096);
        }
        if i == 0 {
            timed += &timer_fired(3_000);
        }
    }
    timed += &timer_fired(140_000);
    let end = mark(1_000_000, "TB_END net");
    let lazy = ReplayOptions {
        cmdline: "iommu.strict=0".into(),
        ..Default::default()
    };
    let model = run(&(body + &end), &lazy);
    assert_eq!(model.phases.get("net").unwrap().counts.domain(), 3);
    let r = run(&(timed + &end), &lazy);
    assert_eq!(r.phases.get("net").unwrap().counts.domain(), 2);
}

/// Issue 4: a trace without newlines (/dev/zero, a binary file) was buffered whole, without bound.
#[test]
fn a_line_longer_than_the_bound_is_an_error_wherever_the_chunks_cut_it() {
    let first = map(10, 0x1000, 0x1000, 4096);
    let at_bound = format!("{}\n", "x".repeat(ftrace::MAX_LINE_BYTES));
    let over = "x".repeat(ftrace::MAX_LINE_BYTES + 1);
    for chunk in [1 << 16, 1 << 20, 3 << 20] {
        let mut s = ReplaySession::new("t.txt", &ReplayOptions::default()).unwrap();
        let fed = [first.as_str(), &at_bound]
            .concat()
            .as_bytes()
            .chunks(chunk)
            .try_for_each(|c| s.feed(c));
        assert!(fed.is_ok(), "a line of the bound itself is read");
        let e = over
            .as_bytes()
            .chunks(chunk)
            .try_for_each(|c| s.feed(c))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "t.txt:3: a line longer than 1048576 bytes; expected ftrace text"
        );
        assert!(s.partial.len() <= ftrace::MAX_LINE_BYTES);
    }
}

#[test]
fn chunks_cut_anywhere_and_crlf_give_the_same_result() {
    let t = [
        mark(1, "TB_BEGIN a"),
        map(10, 0x1000, 0x1000, 4096),
        unmap(20, 0x1000, 4096),
        mark(30, "TB_END a"),
    ]
    .concat()
    .replace('\n', "\r\n");
    let whole = run(&t, &ReplayOptions::default());
    for cut in [1, 7, 64] {
        let mut s = ReplaySession::new("t", &ReplayOptions::default()).unwrap();
        for chunk in t.as_bytes().chunks(cut) {
            s.feed(chunk).expect("short lines");
        }
        assert_eq!(s.finish().unwrap(), whole, "chunks of {cut}");
    }
    // x86 defaults to lazy: the unmap waits for the timer, which fires after the phase ended.
    assert_eq!(whole.policy, "lazy");
    assert_eq!(whole.phases.get("a").unwrap().counts.unmap_events, 1);
    assert_eq!(whole.phases.get(OUTSIDE).unwrap().counts.domain(), 1);
}

/// Phase `io`: a map_sg of 32 4K segments over an aligned 128K, then a 3-page buffer at a 16K-aligned IOVA,
/// both unmapped.
fn sg_then_buffer() -> String {
    let mut t = mark(0, "TB_BEGIN io");
    for i in 0..32u64 {
        t += &map(10 + i, 0xfffa_0000 + i * 4096, 0x10_0000 + i * 0x3000, 4096);
    }
    t += &map(100, 0xffe0_0000, 0x40_0000, 12288);
    t += &unmap(200, 0xfffa_0000, 131072);
    t += &unmap(210, 0xffe0_0000, 12288);
    t += &mark(300, "TB_END io");
    t
}

#[test]
fn virtio_sends_a_request_per_map_chunk_and_one_unmap_per_sg() {
    let t = sg_then_buffer();
    let v = ReplayOptions {
        vendor: Vendor::Virtio,
        mode: Some(PolicyName::Strict),
        ..Default::default()
    };
    let r = run(&t, &v);
    assert_eq!(r.iommu, "virtio");
    let c = &r.phases.get("io").unwrap().counts;
    assert_eq!((c.map_events, c.map_syncs), (33, 2));
    // 32 + 2 MAPs (8K then 4K), 1 + 2 UNMAPs; no wait descriptors, no IOTLB invalidations.
    assert_eq!((c.class(crate::hw::InvClass::Map), c.range()), (34, 3));
    assert_eq!(c.domain(), 0);
    // Reported in virtio-iommu's words only: no wait descriptor, no IOTLB invalidation.
    let j = serde_json::to_value(c).unwrap();
    let keys: Vec<&str> = j.as_object().unwrap().keys().map(|k| k.as_str()).collect(); // sorted
    assert_eq!(
        keys,
        [
            "map_events",
            "map_syncs",
            "unmap_events",
            "virtio_map",
            "virtio_unmap"
        ]
    );
    // Before 6.8 virtio-iommu cannot defer: lazy on the command line still gives strict.
    let r = run(
        &t,
        &ReplayOptions {
            mode: None,
            cmdline: "iommu.strict=0".into(),
            kernel: "6.6".into(),
            ..v
        },
    );
    assert_eq!(r.policy, "strict");
}

#[test]
fn noise_is_counted_and_an_empty_trace_is_an_error() {
    let t = [
        "# tracer: nop\r\n".to_string(),
        map(10, 0x1000, 0x1000, 4096),
        "  x-1 [000] ..... 1.0: map: IOMMU: iova=0x\n".into(),
        "garbage unmap: IOMMU\n".into(),
        unmap(20, 0x1000, 4096),
    ]
    .concat();
    let r = run(&t, &ReplayOptions::default());
    assert_eq!((r.lines.total, r.lines.events, r.lines.bad), (5, 2, 2));
    assert!(r.lines.bad_examples[0].starts_with("3: "));
    let e = replay(
        "# tracer: nop\nhello\n".as_bytes(),
        "x.txt",
        &ReplayOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("x.txt: no iommu:map"), "{e}");
}

#[test]
fn riscv_sends_an_iotinval_per_page_below_2_mib_and_amd_vi_one_per_aligned_block() {
    // A 128 KiB map_sg unmapped at once and a 3-page buffer: on the RISC-V IOMMU (6.13) 32 + 3 IOTINVAL.VMAs
    // and two IOFENCE.Cs; on AMD-Vi one INVALIDATE_IOMMU_PAGES each (the 3 pages as their aligned block of 4)
    // and two COMPLETION_WAITs.
    let t = sg_then_buffer();
    for (vendor, kernel, invs, syncs) in [
        (Vendor::Riscv, "6.13", 35, 2),
        (Vendor::Amdvi, "6.12", 2, 2),
    ] {
        let v = ReplayOptions {
            vendor,
            kernel: kernel.into(),
            mode: Some(PolicyName::Strict),
            ..Default::default()
        };
        let r = run(&t, &v);
        let c = &r.phases.get("io").unwrap().counts;
        assert_eq!((c.range(), c.syncs), (invs, syncs), "{vendor:?}");
        let j = serde_json::to_value(c).unwrap();
        let cols: Vec<&str> = vendor
            .driver()
            .replay_columns()
            .iter()
            .map(|(n, _)| *n)
            .collect();
        assert!(cols.iter().all(|k| j.get(*k).is_some()), "{vendor:?}: {j}");
    }
}

/// A bounced page map as a 6.12 guest traces it: `swiotlb_bounced`, then `dma_map_page` with the slot's
/// address (or DMA_MAPPING_ERROR).
fn bounce_map(ts: u64, dev: &str, addr: u64, size: u64, phys: u64) -> String {
    line(
        ts,
        &format!("swiotlb_bounced: dev_name: {dev} dma_mask=ffffffffffffffff dev_addr={phys:x} size={size} FORCE"),
    ) + &line(
        ts,
        &format!("dma_map_page: {dev} dir=FROM_DEVICE dma_addr={addr:x} size={size} phys_addr={phys:x} attrs="),
    )
}
fn bounce_unmap(ts: u64, dev: &str, addr: u64, size: u64) -> String {
    line(
        ts,
        &format!("dma_unmap_page: {dev} dir=FROM_DEVICE dma_addr={addr:x} size={size} attrs="),
    )
}

#[test]
fn a_forced_pool_fills_and_reuses_slots_as_the_kernels_did() {
    // swiotlb=128,force on one CPU: one area of 128 slots at 0x1000000. Sixty-four 4 KiB maps take two
    // page-aligned slots each and fill it; the 65th fails in the kernel and in the model. A freed pair is what
    // the next search finds.
    let start = 0x100_0000u64;
    let dev = "0000:00:03.0";
    let mut t = String::from(
        "# iommulab capture: swiotlb at start: nslabs=128 used=0 hiwater=0 possible=0 start=0x1000000\n",
    );
    t += &mark(1, "TB_BEGIN blk");
    for k in 0..64u64 {
        t += &bounce_map(10 + k, dev, start + k * 4096, 4096, 0x5000_0000 + k * 4096);
    }
    t += &bounce_map(100, dev, u64::MAX, 4096, 0x6000_0000);
    t += &bounce_unmap(110, dev, start + 10 * 4096, 4096);
    t += &bounce_map(120, dev, start + 10 * 4096, 4096, 0x6000_0000);
    t += &mark(130, "TB_END blk");
    t += "# iommulab capture: swiotlb at end: nslabs=128 used=128 hiwater=128 possible=0 start=0x1000000\n";
    let opts = ReplayOptions {
        cmdline: "iommu.passthrough=1 swiotlb=128,force".into(),
        ..ReplayOptions::default()
    };
    let r = run(&t, &opts);
    assert_eq!(r.policy, "passthrough");
    let s = r.swiotlb.as_ref().expect("the trace bounces");
    assert_eq!((s.pool_slots, s.areas, s.force), (128, 1, true));
    assert_eq!(s.kernel_pool_slots, Some(128));
    let b = r
        .phases
        .get("blk")
        .and_then(|p| p.swiotlb.as_ref())
        .expect("blk bounced");
    assert_eq!(b.guest.swiotlb_bounced, 66);
    assert_eq!(b.model.bounces, 66);
    assert_eq!((b.model.full_events, b.guest.map_errors), (1, 1));
    assert_eq!((b.slots_compared, b.slots_same), (65, 65));
    assert_eq!(
        (b.model_full_kernel_mapped, b.model_mapped_kernel_full),
        (0, 0)
    );
    assert_eq!(b.model.used_slots, Some(128));
    assert_eq!(b.model.high_water_slots, Some(128));
    assert_eq!(b.guest.high_water_slots, Some(128));
}

#[test]
fn a_kernel_whose_slots_differ_from_the_models_is_counted_not_hidden() {
    // The kernel put the second map two slots further than the model's search would: compared, not the same.
    let start = 0x100_0000u64;
    let dev = "0000:00:02.0";
    let mut t = String::from("# iommulab capture: swiotlb at start: nslabs=256 used=0 hiwater=0 possible=0-1 start=0x1000000\n");
    t += &mark(1, "TB_BEGIN net");
    t += &bounce_map(10, dev, start, 1536, 0x5000_0000);
    t += &bounce_map(11, dev, start + 2 * 2048, 1536, 0x5000_1000);
    // The model follows the kernel's slot, and its next search starts after it, as the kernel's does.
    t += &bounce_map(12, dev, start + 3 * 2048, 1536, 0x5000_2000);
    // The first mapping's unmap was lost: the kernel hands its slot out again, and the model drops it.
    t += &line(13, "swiotlb_bounced: dev_name: 0000:00:02.0 dma_mask=ffffffffffffffff dev_addr=0 size=64 FORCE");
    t += &line(
        13,
        &format!(
            "dma_map_page: {dev} dir=TO_DEVICE dma_addr={start:x} size=64 phys_addr=5000 attrs="
        ),
    );
    t += &mark(20, "TB_END net");
    let opts = ReplayOptions {
        cmdline: "iommu.passthrough=1 swiotlb=256,force".into(),
        ..ReplayOptions::default()
    };
    let r = run(&t, &opts);
    // Two possible CPUs: two areas of 128.
    assert_eq!(r.swiotlb.as_ref().map(|s| s.areas), Some(2));
    let b = r
        .phases
        .get("net")
        .and_then(|p| p.swiotlb.as_ref())
        .unwrap();
    assert_eq!((b.slots_compared, b.slots_same), (4, 2));
    assert_eq!((b.followed, b.untraced_frees), (2, 1));
}

#[test]
fn swiotlbs_command_line_parameter_reads_as_the_kernel_reads_it() {
    let p = |c: &str| SwiotlbParam::parse(c);
    assert_eq!(p("quiet"), None);
    assert_eq!(
        p("swiotlb=1024,force"),
        Some(SwiotlbParam {
            slabs: Some(1024),
            areas: None,
            force: true
        })
    );
    assert_eq!(
        p("swiotlb=65536,4,force x"),
        Some(SwiotlbParam {
            slabs: Some(65536),
            areas: Some(4),
            force: true
        })
    );
    assert_eq!(
        p("swiotlb=force"),
        Some(SwiotlbParam {
            slabs: None,
            areas: None,
            force: true
        })
    );
    assert_eq!(
        p("swiotlb=0x800"),
        Some(SwiotlbParam {
            slabs: Some(2048),
            areas: None,
            force: false
        })
    );
    assert_eq!(p("swiotlb=noforce").map(|s| s.force), Some(false));
}
