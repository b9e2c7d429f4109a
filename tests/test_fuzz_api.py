"""Property-based fuzzing of the Python API and CLI arguments (hypothesis): whatever a user passes, the
answer is a result or a one-line ScenarioError, never another exception. HYPOTHESIS_PROFILE=long runs a longer
campaign (the profiles are in conftest.py)."""

from hypothesis import given, strategies as st

import iommulab
from iommulab.api import run_variants

KEYS = ["os.policy", "os.kernel", "os.arch", "os.cmdline", "os.hz", "run.seed", "workload.nic_rx.queues",
        "workload.nic_rx.flows", "workload.nic_rx.mtu", "workload.nic_rx.ring_size", "workload.nic_rx.page_pool",
        "workload.nic_rx.line_rate_gbps", "platform.profile", "platform.memory.pages", "platform.cpu.cores",
        "platform.pcie.ats", "platform.iommu.iotlb_entries", "attack.replay_per_sec", "nonsense.key", "compare"]
VALUES = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.text(max_size=12), st.sampled_from(["strict", "lazy", "fands", "arm64", "6.12", "smmuv3-server"]),
                   st.lists(st.integers(0, 5), max_size=3))


@given(scenario=st.sampled_from([None, "default", "c1", "nvme", "tx", "rr", "iotlb-sync-map", "nope", ""]),
       sets=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3))
def test_any_settings_give_a_result_or_a_scenario_error(scenario, sets):
    sets = {**sets, "run.duration_ms": 0.2, "run.warmup_ms": 0.1}
    try:
        variants = iommulab.load(scenario, sets)
        run_variants(variants[:1])
    except iommulab.ScenarioError as e:
        assert "\n" not in str(e).strip()


@given(kernel=st.text(max_size=8), cmdline=st.text(max_size=40), hz=st.integers(-5, 20000),
       iommu=st.sampled_from(["vtd", "smmuv3", "virtio", "amd", ""]), mode=st.sampled_from([None, "strict", "x"]))
def test_any_replay_arguments_give_a_result_or_a_scenario_error(tmp_path_factory, kernel, cmdline, hz, iommu, mode):
    trace = tmp_path_factory.mktemp("t") / "t.txt"
    trace.write_text("  dd-1 [000] ..... 1.000000: map: IOMMU: iova=0x00000000fff00000 - 0x00000000fff01000 "
                     "paddr=0x0000000000100000 size=4096\n")
    try:
        iommulab.replay(trace, kernel=kernel, cmdline=cmdline, hz=hz, iommu=iommu, mode=mode)
    except iommulab.ScenarioError as e:
        assert "\n" not in str(e).strip()
