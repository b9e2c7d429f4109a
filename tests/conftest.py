import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

# Property tests (test_fuzz_api.py, test_sweep.py) run the ci profile; HYPOTHESIS_PROFILE=long runs a long campaign.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=50_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Short runs keep the suite fast; the mechanisms are the same as in the full default run.
SHORT = ["--set", "run.duration_ms=10", "--set", "run.warmup_ms=5"]


def cli(*args, check_rc=None, env=None):
    """Run the installed CLI as a user would (python -m iommulab, same entry point as the script)."""
    p = subprocess.run([sys.executable, "-m", "iommulab", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=300)
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr}"
    return p


def cli_json(*args):
    p = cli("run", "--json", *args, check_rc=0)
    return json.loads(p.stdout)


@pytest.fixture
def write(tmp_path):
    def _write(name, text):
        f = tmp_path / name
        f.write_text(text)
        return f
    return _write


MINIMAL = """\
name = "mini"
[run]
duration_ms = 5
warmup_ms = 3
seed = 7
[platform]
profile = "vtd-server"
[os]
policy = "strict"
[workload.nic_rx]
line_rate_gbps = 100
queues = 4
flows = 4
mtu = 4000
ring_size = 512
page_pool = false
"""
