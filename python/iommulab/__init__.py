"""iommulab: a laboratory for IOMMU protection.

Simulates IOMMU hardware, the Linux DMA-mapping layer and the I/O workloads on top, and reports what each
invalidation policy costs in throughput. The simulation core is Rust (``iommulab._core``); this package holds
the CLI and the Python API::

    import iommulab
    res = iommulab.run()                      # the built-in default comparison
    print(res.to_pandas()[["label", "throughput_gbps", "inv_per_page"]])
    one = iommulab.run("my.toml", **{"os.policy": "strict", "workload.nic_rx.queues": 4})
    print(one.throughput_gbps, one.to_dict()["invalidations"])
    rep = iommulab.replay("trace.txt.xz", caching_mode=True)   # a real kernel's DMA trace, per phase
"""

from ._core import ScenarioError, __version__
from .api import ResultSet, RunResult, load, run
from .replay import replay

__all__ = ["run", "load", "replay", "RunResult", "ResultSet", "ScenarioError", "__version__"]
