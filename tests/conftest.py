import collections
import json
import os
import resource
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

# Text output is set to 100 columns whatever the terminal the tests run in (every command and its subprocesses
# read COLUMNS first), so that what a test reads of a table does not depend on where it runs.
os.environ["COLUMNS"] = "100"

# Short runs keep the suite fast; the mechanisms are the same as in the full default run.
SHORT = ["--set", "run.duration_ms=10", "--set", "run.warmup_ms=5"]

# Property tests run few examples by default (CI); HYPOTHESIS_PROFILE=long is a fuzzing campaign.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
    """The order in which xdist hands files to its workers (pyproject's addopts: --dist loadfile
    --no-loadscope-reorder): tests/test_testbed.py first, then the others with the most tests first (xdist's own
    order, which put the testbed's 17 tests in the middle). Its boots keep about one core of two busy (a TCG guest
    sleeps between its phases and while its capture drains): started first, the other worker's files fill the
    rest; started late, the testbed ran on alone after the other worker had run out of files."""
    count = collections.Counter(i.path for i in items)
    items.sort(key=lambda i: (i.path.name != "test_testbed.py", -count[i.path], str(i.path)))


# Address space a bounded CLI run may use: several times what a replay or an inspect needs (under 500 MB).
BOUNDED_BYTES = 1 << 30


def cli(*args, check_rc=None, env=None, stdin=None, bounded=False, timeout=300):
    """Run the installed CLI as a user would (python -m iommulab, same entry point as the script). `bounded`:
    in at most BOUNDED_BYTES of address space (RLIMIT_AS), for inputs that would be read without end
    (/dev/zero), so that a regression fails the test fast instead of filling the machine's memory."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (BOUNDED_BYTES, BOUNDED_BYTES))
    p = subprocess.run([sys.executable, "-m", "iommulab", *args], capture_output=True, text=True,
                       errors="backslashreplace", env={**os.environ, **(env or {})}, stdin=stdin,
                       preexec_fn=limit if bounded else None, timeout=timeout)
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr}"
    return p


def one_line_error(p):
    """The one line a refused command printed (exit code 2, no traceback)."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert err and "\n" not in err, repr(p.stderr)
    assert "Traceback" not in p.stderr
    return err


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
