"""Writes strict-vtd.txt: a small trace in the format `capture.sh -M` records (the stand-in of
tests/test_measure.py), for trying `iommulab profile measure --trace` and `profile fit` without root.

Its latencies are made up, not measured: 40 map/unmap pairs, of 1 and of 4 pages, by one task on one CPU under
strict VT-d, each function's time drawn around a plausible figure for a server (tracefs prints microseconds, so
every span is whole µs). Run `python make.py` to write it again; the seed fixes the draws."""

import random
from pathlib import Path

HEADER = """# A made-up trace (tests/data/measure/make.py), not a measurement: see its docstring.
# iommulab measure: host example
# iommulab measure: kernel 6.12.9-amd64
# iommulab measure: machine x86_64
# iommulab measure: date 2026-11-29T00:00:00Z
# iommulab measure: cmdline ro intel_iommu=on iommu.strict=1
# iommulab measure: iommu dmar0
# iommulab measure: group 7 type DMA devices 0000:00:03.0
# iommulab measure: probe iommu_dma_map_page size=$arg4:u64
# iommulab measure: probe alloc_iova_fast pages=$arg2:u64
# iommulab measure: probe iommu_map size=$arg4:u64
# iommulab measure: probe iommu_dma_unmap_page size=$arg3:u64
# iommulab measure: probe iommu_iova_to_phys
# iommulab measure: probe iommu_unmap_fast size=$arg3:u64
# iommulab measure: probe qi_submit_sync count=$arg3:u32
# iommulab measure: probe free_iova_fast pages=$arg3:u64
"""


def ev(us: int, fn: str, ret: bool = False, args: str = "") -> str:
    site = f"(caller+0x10/0x40 <- {fn})" if ret else f"({fn}+0x0/0x90)"
    return (f"           iperf3-4242    [002] d..1.  {us // 1_000_000}.{us % 1_000_000:06d}: "
            f"lat_{fn}{'_r' if ret else ''}: {site}{' ' + args if args else ''}\n")


def pair(r: random.Random, t: int, pages: int) -> list[str]:
    """A map of `pages` pages, then its strict unmap: 2 + pages µs for iommu_map, 3 µs of qi_submit_sync."""
    size = pages * 4096
    j = lambda: r.choice((0, 0, 0, 1))  # noqa: E731 - the odd µs a cache miss adds
    a = t + 1 + j()
    b = a + 1 + j()
    c = b + 1 + pages + j()
    m_end = c + 1
    u0 = m_end + 5
    v = u0 + 1
    w = v + 1 + j()
    x = w + 1 + pages
    q = x + 3 + j()
    f = q + 1 + j()
    return [ev(t, "iommu_dma_map_page", args=f"size={size}"),
            ev(a, "alloc_iova_fast", args=f"pages={pages}"), ev(b, "alloc_iova_fast", True),
            ev(b, "iommu_map", args=f"size={hex(size)}"), ev(c, "iommu_map", True),
            ev(m_end, "iommu_dma_map_page", True),
            ev(u0, "iommu_dma_unmap_page", args=f"size={size}"),
            ev(u0, "iommu_iova_to_phys"), ev(v, "iommu_iova_to_phys", True),
            ev(v, "iommu_unmap_fast", args=f"size={hex(size)}"), ev(w + pages, "iommu_unmap_fast", True),
            ev(x, "qi_submit_sync", args="count=1"), ev(q, "qi_submit_sync", True),
            ev(q, "free_iova_fast", args=f"pages={pages}"), ev(f, "free_iova_fast", True),
            ev(f + 1, "iommu_dma_unmap_page", True)]


def main() -> None:
    r = random.Random(64)
    lines, t = [HEADER], 52_000_000
    for i in range(40):
        lines += pair(r, t, 1 + 3 * (i % 2))  # FIT_MIN_CALLS (20) at each of two sizes: a line per page
        t += 40 + r.randrange(20)
    Path(__file__).with_name("strict-vtd.txt").write_text("".join(lines))


if __name__ == "__main__":
    main()
