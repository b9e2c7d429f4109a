"""Moving one knob moves the results the way the literature reports, with no recalibration. Each pair runs the
same target scenario (c1: SMMUv3 40G; c3: the F&S 5-flow VT-d baseline) with one key changed. Every direction is
asserted at several seeds: a direction that holds at one seed only is noise, not a prediction."""

import statistics

import iommulab
import pytest

SEEDS = range(1, 7)
seeds = pytest.mark.parametrize("seed", SEEDS)


def run(scenario, seed, **keys):
    return iommulab.run(scenario, **{"run.seed": seed}, **keys)


@seeds
def test_slower_page_walks_lower_translation_limited_throughput(seed):
    # F&S (SOSP'24): T = p / (l0 + M * lm); a larger memory latency lm lowers strict throughput on C3.
    fast = run("c3", seed, **{"os.policy": "strict", "platform.memory.walk_read_ns": 100})
    slow = run("c3", seed, **{"os.policy": "strict", "platform.memory.walk_read_ns": 300})
    assert slow.throughput_gbps < 0.8 * fast.throughput_gbps
    # ... while the CPU is far from saturated: the bottleneck is translation, not the CPU.
    assert slow.cpu_busy < 0.6


@seeds
def test_iommu_off_saturates_the_link_and_strict_does_not_on_c3(seed):
    off = run("c3", seed, **{"os.policy": "passthrough"})
    strict = run("c3", seed, **{"os.policy": "strict"})
    assert off.throughput_gbps > 0.95 * off.line_rate_gbps
    # F&S: 20-65 % lower with the IOMMU on (the least at 5 flows), the CPU far from saturated. The model
    # loses less at 5 flows (about 9 %: validate's C3.strict_throughput_share is a miss), so this asserts
    # the direction: strict falls short of the link although its CPUs have time to spare.
    assert strict.throughput_gbps < 0.95 * off.throughput_gbps and strict.cpu_busy < 0.7


# C1's strict is a known miss (docs/validation.md, "C1 without the fit"): with the CMD_SYNC times measured on
# Hi1620 the model's strict reaches the 40 Gbps line rate, so neither the MTU nor the line rate moves it.
C1_STRICT_MISS = pytest.mark.xfail(strict=True, reason="C1 strict reaches the line rate with Hi1620's CMD_SYNC "
                                   "times; the SMMU cost seed 000 measured is not modelled")


@seeds
@pytest.mark.parametrize("scenario", [pytest.param("c1", marks=C1_STRICT_MISS), "c3"])
def test_larger_mtu_helps_strict(scenario, seed):
    small = run(scenario, seed, **{"os.policy": "strict", "workload.nic_rx.mtu": 1500})
    big = run(scenario, seed, **{"os.policy": "strict", "workload.nic_rx.mtu": 9000})
    # Per-frame translations (descriptor, completion entry) and ACKs per byte fall with the MTU.
    assert big.throughput_gbps > 1.4 * small.throughput_gbps


@seeds
@C1_STRICT_MISS
def test_lazy_follows_the_line_rate_and_strict_does_not_on_c1(seed):
    lazy40 = run("c1", seed, **{"os.policy": "lazy"})
    lazy100 = run("c1", seed, **{"os.policy": "lazy", "workload.nic_rx.line_rate_gbps": 100})
    strict100 = run("c1", seed, **{"os.policy": "strict", "workload.nic_rx.line_rate_gbps": 100})
    strict40 = run("c1", seed, **{"os.policy": "strict"})
    assert lazy100.throughput_gbps > 2 * lazy40.throughput_gbps
    assert strict100.throughput_gbps == pytest.approx(strict40.throughput_gbps, rel=0.1), \
        "strict is bound by the SMMU's command queue, not the wire"


@seeds
def test_a_larger_ring_spreads_iova_over_more_walk_cache_entries(seed):
    # F&S: more RX buffers in flight touch more page-table pages; the walk caches miss more. With C3's own
    # DCTCP senders a bigger ring spreads the device's writes over more PT-L3 entries (its 64 channels'
    # rings interleave) and misses more there, but throughput barely moves (docs/validation.md, "Channels and
    # the PT-L3 working set").
    dctcp = {"os.policy": "strict"}
    small = run("c3", seed, **dctcp, **{"workload.nic_rx.ring_size": 256})
    big = run("c3", seed, **dctcp, **{"workload.nic_rx.ring_size": 1024})
    assert big.dma_locality["reuse_distance_p99"] > 2 * small.dma_locality["reuse_distance_p99"]
    assert big.pwc_misses_per_page[2] > small.pwc_misses_per_page[2]
    window = {"os.policy": "strict", "workload.nic_rx.sender": "window"}
    small = run("c3", seed, **window, **{"workload.nic_rx.ring_size": 256})
    big = run("c3", seed, **window, **{"workload.nic_rx.ring_size": 1024})
    assert big.pwc_misses_per_page[2] > small.pwc_misses_per_page[2]


def test_with_senders_that_overrun_the_nic_a_larger_ring_loses_throughput_on_average_over_seeds():
    # With senders that keep the NIC's buffer overrun (sender = "window") the bigger ring's extra walk-cache
    # misses cost throughput too. Since the page-table lines' transfers (docs/contention.md) the loss is 0.45
    # Gbps on the mean of seeds 1-6 (2.2 before), smaller than one seed's spread: seeds 1 and 6 go the other
    # way (+0.3, +2.0 Gbps), each with fewer PT-L1/L2 misses at 1024 than at 256 (PT-L3 misses rise at every
    # seed, asserted above). So it is asserted on the mean over the seeds.
    window = {"os.policy": "strict", "workload.nic_rx.sender": "window"}
    runs = {ring: [run("c3", seed, **window, **{"workload.nic_rx.ring_size": ring}) for seed in SEEDS]
            for ring in (256, 1024)}
    mean = lambda ring, f: statistics.fmean(f(r) for r in runs[ring])
    assert mean(1024, lambda r: sum(r.pwc_misses_per_page)) > mean(256, lambda r: sum(r.pwc_misses_per_page))
    assert mean(1024, lambda r: r.throughput_gbps) < mean(256, lambda r: r.throughput_gbps)


def ack_per_page(r):
    return r.tx_packets * 4096 / (r.throughput_gbps * 1e9 / 8 * r.sim_seconds)


@seeds
def test_more_flows_per_queue_send_more_acks_and_miss_more(seed):
    # With senders that keep to the receive window only (sender = "window", never backing off).
    # F&S (SOSP'24, Figure 2): with more flows on the same 5 cores, more ACKs per page of data contend for
    # the IOTLB and their unmaps drop walk-cache entries; throughput degrades further. In the model a flow's
    # ACKs come from its reader (one per drain, tcp_cleanup_rbuf) and from skbs landing in an emptied socket.
    # At 20 flows (4 per core) the CPUs saturate, readers fall behind and RX pages leave the mlx5 cache: ACKs
    # per page roughly double, misses rise and throughput falls, at every seed. Walk-cache misses per page
    # are not asserted here: with the NIC buffer always full (35-40 % dropped) PTcache-L1 misses move either
    # way with the seed; the dctcp test asserts them.
    window = {"os.policy": "strict", "workload.nic_rx.sender": "window"}
    few = run("c3", seed, **window)
    many = run("c3", seed, **window, **{"workload.nic_rx.flows": 20})
    assert ack_per_page(many) > 1.5 * ack_per_page(few)
    assert many.iotlb_misses_per_page > few.iotlb_misses_per_page
    assert many.throughput_gbps < few.throughput_gbps


def test_ten_flows_sit_between_five_and_twenty_on_average_over_seeds():
    # The 5 to 10 flow step is smaller than one seed's spread: at seed 6 ACKs per page rise 1.2x and
    # throughput is flat (69.7 against 69.4 Gbps), at seeds 1-5 they rise 1.4-1.7x and throughput falls
    # 5-10 Gbps. So the step is asserted on the mean over the seeds.
    window = {"os.policy": "strict", "workload.nic_rx.sender": "window"}
    mean = lambda flows, f: statistics.fmean(
        f(run("c3", seed, **window, **{"workload.nic_rx.flows": flows})) for seed in SEEDS)
    for f, rises in ((ack_per_page, True), (lambda r: r.iotlb_misses_per_page, True),
                     (lambda r: r.throughput_gbps, False)):
        five, ten, twenty = mean(5, f), mean(10, f), mean(20, f)
        assert (five < ten < twenty) if rises else (five > ten > twenty)
    assert mean(10, ack_per_page) > 1.3 * mean(5, ack_per_page)


@seeds
def test_with_dctcp_senders_more_flows_drop_more_and_ack_more(seed):
    # F&S (SOSP'24, Figure 2b-d, 5 to 40 flows on 5 cores, strict): drops rise from 0.27 % to 4.2 %, ACKs per
    # page-sized packet from 0.0435 to 0.12, IOTLB and walk-cache misses with them, and throughput falls;
    # the paper puts the ACKs down to the drops (out-of-order arrivals are ACKed at once). With DCTCP senders
    # the model shows each of these directions: more flows share the NIC buffer, AIMD overruns it more often,
    # and each gap draws duplicate ACKs. (Window-only senders keep the NIC buffer full at any flow count and
    # do not show them.) DCTCP is C3's own sender; it is named here so the test says what it needs.
    def c3(flows):
        return run("c3", seed, **{"os.policy": "strict", "workload.nic_rx.sender": "dctcp",
                            "workload.nic_rx.flows": flows})
    few, more, many = c3(5), c3(20), c3(40)
    packets = lambda r: r.packets_per_sec * r.sim_seconds
    drops = lambda r: r.drops["device"] / packets(r)
    acks = lambda r: r.tx_packets / packets(r)
    assert drops(few) < drops(more) < drops(many)
    assert acks(few) < acks(more) < acks(many)
    assert few.iotlb_misses_per_page < more.iotlb_misses_per_page < many.iotlb_misses_per_page
    assert few.pwc_misses_per_page[0] < more.pwc_misses_per_page[0]
    assert few.pwc_misses_per_page[2] < more.pwc_misses_per_page[2] < many.pwc_misses_per_page[2]
    assert few.throughput_gbps > more.throughput_gbps > many.throughput_gbps
    assert all(r.loss_recoveries > 0 for r in (few, more, many))
