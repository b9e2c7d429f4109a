"""Bounce buffers (issue 68): a confidential guest's DMA through swiotlb, as `run`, `--json` and `advise` say it
(docs/swiotlb.md). The model's mechanisms are unit-tested in crates/iommulab-core/src/dma/swiotlb.rs and run.rs."""

import json
import shutil

from conftest import cli, one_line_error
from test_advise import advise, tree

SHORT = ["--set", "run.duration_ms=10", "--set", "run.warmup_ms=5"]
SWIOTLB_KEYS = {"bounces", "bounced_bytes", "copies", "bounced_gbps", "full_events", "too_large", "high_water_slots",
                "pool_slots", "used_slots", "transient_pools", "pools_added", "slots_searched_per_map"}


def test_coco_net_reports_bounces_the_pool_and_what_filled_it():
    runs = {r["label"]: r for r in json.loads(cli("run", "coco-net", "--json", *SHORT, check_rc=0).stdout)["runs"]}
    assert "swiotlb" not in runs["guest rx"]
    for label in ("sev-snp rx", "sev-snp tx", "sev-snp-1mib rx", "sev-snp-1mib tx"):
        assert set(runs[label]["swiotlb"]) == SWIOTLB_KEYS, label
        assert runs[label]["safety"]["protected"] is True
    # The kernel's pool for 16 GiB (6 %, rounded up to a power of two) against swiotlb=512.
    assert runs["sev-snp rx"]["swiotlb"]["pool_slots"] == 1 << 19
    assert runs["sev-snp-1mib tx"]["swiotlb"]["pool_slots"] == 512
    # The RX ring's buffers fill the small pool: every send's mapping fails and is dropped.
    small = runs["sev-snp-1mib tx"]
    assert small["limited_by"] == "swiotlb.full" and small["drops"]["dma_map"] > 0
    assert small["drops"]["dma_map"] == small["swiotlb"]["full_events"]
    text = cli("run", "coco-net", *SHORT, check_rc=0).stdout
    assert "bounce buffers (swiotlb" in text and "packets dropped" in text and "swiotlb.full" in text


def test_bouncing_where_the_kernel_would_not_is_one_line():
    err = one_line_error(cli("run", "coco-net", "--set", "os.policy=strict"))
    assert "os.coco" in err and "passthrough" in err
    err = one_line_error(cli("run", "--set", "os.swiotlb.force=true"))
    assert "os.swiotlb.force" in err
    err = one_line_error(cli("run", "coco-net", "--set", "os.coco=sev"))
    assert "os.coco" in err


def confidential(name, tmp_path, line="Memory Encryption Features active: AMD SEV SEV-ES SEV-SNP"):
    """A saved guest's tree whose kernel log says it is a confidential guest."""
    root = tree(name, tmp_path)
    kmsg = root / "dev/kmsg"
    kmsg.write_text(kmsg.read_text() + f"[    0.000000] {line}\n")
    return root


def test_advise_in_a_confidential_guest_sizes_the_pool_instead_of_ranking_iommu_options(tmp_path):
    doc = advise(confidential("no-iommu", tmp_path))
    b = doc["bounce"]
    assert b["coco"] == "sev-snp" and any("confidential guest" in t for t in doc["from_host"])
    # The smallest power of two of slots at or above the high-water mark that no seed filled.
    assert b["slabs"] >= b["high_water_slots"] and b["slabs"] & (b["slabs"] - 1) == 0
    assert doc["recommendation"]["cmdline"] == f"swiotlb={b['slabs']}"
    assert [o["option"] for o in doc["options"]] == ["not confidential", "sev-snp"]
    assert "bouncing costs" in doc["recommendation"]["why"]
    text = cli("advise", "--root", str(confidential("no-iommu", tmp_path / "again")), "--no-ranges",
               check_rc=0).stdout
    assert f"swiotlb={b['slabs']}" in text and "swiotlb's shared slots" in text
    # --set os.coco=none: the options as if it were not confidential.
    plain = advise(confidential("no-iommu", tmp_path / "plain"), "--set", "os.coco=none")
    assert "bounce" not in plain and len(plain["options"]) == 3


def test_advise_with_os_coco_set_on_an_ordinary_guest(tmp_path):
    root = tree("no-iommu", tmp_path)
    doc = advise(root, "--set", 'os.coco="tdx"')
    assert doc["bounce"]["coco"] == "tdx"
    shutil.rmtree(root)
