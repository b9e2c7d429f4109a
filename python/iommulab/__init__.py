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
    df = iommulab.sweep("sweep.toml", out="results")          # every point of a sweep: a polars DataFrame
    df = iommulab.load("results", aggregate=True)             # a sweep's dataset, seeds averaged
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ._core import ScenarioError, __version__  # first: the modules below read the version
from . import api, dataset  # noqa: E402
from .api import ResultSet, RunResult, run
from .replay import replay
from .sweeps import sweep


def load(source: str | os.PathLike | Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
         *, raw_strings: bool = False, aggregate: bool = False):
    """A sweep's results (its dataset directory, or a ``.parquet`` file) as a polars DataFrame (`aggregate`:
    seeds averaged); anything else is a scenario, loaded and expanded into its variants (see
    :func:`iommulab.api.load`)."""
    if isinstance(source, (str, os.PathLike)) and (os.path.isdir(source) or os.fspath(source).endswith(".parquet")):
        return dataset.load(source, aggregate)
    return api.load(source, overrides, raw_strings=raw_strings)


__all__ = ["run", "load", "sweep", "replay", "RunResult", "ResultSet", "ScenarioError", "__version__"]
