"""Every command the README and the docs show runs as written (the two set-up commands aside), and every output
they show is what its command prints, so they cannot drift."""

import lzma
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
# The README first, then the docs pages, each in its own order.
PAGE_PATHS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
PAGES = [p.read_text() for p in PAGE_PATHS]
# A real kernel's trace stands for the README's trace.txt / trace.txt.xz.
TRACE = ROOT / "tests/data/testbed/k6.12-intel-cmoff-lazy/guest-trace.txt.xz"


def commands() -> list[str]:
    """The shell commands of the README's and the docs' ```sh blocks, comments dropped, set-up commands (pip)
    and commands of other tools left out."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", "\n".join(PAGES), re.S):
        for line in block.splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd.startswith("iommulab"):
                out.append(cmd)
    return out


def python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", "\n".join(PAGES), re.S)


def shown_outputs() -> list[tuple[str, str, list[str]]]:
    """The outputs the README and the docs show: (page, command, lines) for each plain ``` block whose
    paragraph names one `iommulab ...` command in backticks; a block right after another continues it."""
    out = []
    for path, page in zip(PAGE_PATHS, PAGES):
        cmd, end = None, 0
        for m in re.finditer(r"```(\w*)\n(.*?)```", page, re.S):
            before, end = page[end:m.start()], m.end()
            if before.strip():
                named = re.findall(r"`(iommulab [^`]*)`", re.split(r"\n\s*\n", before.strip())[-1])
                cmd = named[0] if len(named) == 1 else None
            if cmd and not m.group(1):
                out.append((path.name, cmd, m.group(2).splitlines()))
    return out


def shown_in(shown: str, printed: str) -> bool:
    """A shown line is a printed one; one that ends in "…)" shortens the printed line's last note."""
    if shown.endswith("…)"):
        return printed.startswith(shown[:-2])
    return shown == printed


SHOWN = shown_outputs()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    # Commands run from a clone's top: the committed files they name (tests/data/...) are there.
    (d / "tests").symlink_to(ROOT / "tests")
    shutil.copy(TRACE, d / "trace.txt.xz")
    (d / "trace.txt").write_bytes(lzma.decompress(TRACE.read_bytes()))
    return d


def run_in(workdir, cmd: str) -> subprocess.CompletedProcess:
    shell = re.sub(r"^iommulab\b", f"{sys.executable} -m iommulab", cmd)
    return subprocess.run(["bash", "-c", shell], cwd=workdir, capture_output=True, text=True, timeout=600)


# A command's outputs: what it redirects into and the files or folders its options name.
OUTPUT = re.compile(r"(?:>|--save|--out|-o|--csv|--parquet|--plot)\s+(\S+)")


def after(cmds: list[str]) -> dict[str, set[str]]:
    """For each command, the earlier ones it must wait for: those writing a file or folder it names
    (`scenarios default > my.toml` before `run my.toml`)."""
    deps = {}
    for i, cmd in enumerate(cmds):
        words = set(cmd.split())
        deps[cmd] = {c for c in cmds[:i] if c != cmd and set(OUTPUT.findall(c)) & words}
    return deps


@pytest.fixture(scope="module")
def ran(workdir) -> dict[str, subprocess.CompletedProcess]:
    """Every README and docs command, run once, by command: several at a time, each after those whose
    outputs it reads."""
    cmds = list(dict.fromkeys(commands()))
    deps = after(cmds)
    done: dict[str, Future] = {}

    def one(cmd):
        for d in deps[cmd]:
            done[d].result()
        return run_in(workdir, cmd)

    # Submitted in page order, so a command waits only for ones already running or done.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for cmd in cmds:
            done[cmd] = pool.submit(one, cmd)
    return {cmd: f.result() for cmd, f in done.items()}


def test_a_command_waits_for_those_writing_what_it_reads():
    deps = after(commands())
    assert "iommulab scenarios default > my.toml" in deps["iommulab run my.toml --set run.seed=7"]
    assert "iommulab inspect --save host-tree" in deps[
        "iommulab advise --root host-tree --max-exposure 1ms --set platform.cpu.cores=32"]
    assert "iommulab sweep sweep.toml --out results" in deps["iommulab report results -o report.html"]
    assert not deps["iommulab run"]


def test_the_readme_shows_commands():
    assert len(commands()) >= 15 and python_examples()


def test_the_readme_shows_the_outputs_of_run_validate_and_replay():
    shown = {cmd for page, cmd, _ in SHOWN if page == "README.md"}
    assert shown == {"iommulab run", "iommulab validate",
                     "iommulab replay tests/data/testbed/k6.12-intel-cmoff-lazy/guest-trace.txt.xz --mode lazy"}


def test_the_readme_is_a_front_page_under_150_lines_naming_its_files():
    """Issue 64 item 10: the README was 188 lines, its replay example named a trace.txt no clone has, and
    `profile fit` had no measurement to try it on."""
    assert README.count("\n") < 150
    for path in re.findall(r"\btests/data/[\w./-]+\.(?:xz|gz|txt)\b", README):
        assert (ROOT / path).is_file(), path
    assert "tests/data/measure/strict-vtd.txt" in README and "replay tests/data/" in README
    assert "seed004" not in README


def test_every_readme_command_runs_as_written(ran):
    for cmd, p in ran.items():
        assert p.returncode == 0, f"{cmd}\nstdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}"


@pytest.mark.parametrize("page, cmd, lines", SHOWN, ids=[f"{page}: {cmd}" for page, cmd, _ in SHOWN])
def test_every_output_shown_is_what_its_command_prints(page, cmd, lines, ran, workdir):
    """The simulation is deterministic: each line shown (a table's header, rule and rows) is a line the
    command prints now, in the order it prints them."""
    p = ran.get(cmd) or run_in(workdir, cmd)
    assert p.returncode == 0, p.stderr
    printed = iter(l.rstrip() for l in p.stdout.splitlines())
    for line in lines:
        assert any(shown_in(line.rstrip(), l) for l in printed), f"{page}: `{cmd}` no longer prints\n{line}"


def test_the_readme_shows_the_whole_default_comparison(ran):
    """`iommulab run` is shown in full: the first block of the table it prints (goodput, CPU, exposure and what
    bound each run, the columns that fit 100 columns), every row."""
    lines = next(l for page, cmd, l in SHOWN if page == "README.md" and cmd == "iommulab run")
    printed = [l.rstrip() for l in ran["iommulab run"].stdout.splitlines()]
    start = printed.index(lines[0])
    assert printed[start:printed.index("", start)] == lines


def test_the_readme_counts_the_targets_validate_meets(ran):
    """ "How far to trust it" says how many published targets are within tolerance: as `iommulab validate`
    counts them."""
    ok, total = re.search(r"(\d+) of (\d+) within\s+tolerance", README).groups()
    assert f"{ok} of {total} within tolerance" in ran["iommulab validate"].stdout


def test_the_readme_python_example_runs(workdir):
    if not (workdir / "my.toml").exists():
        subprocess.run([sys.executable, "-m", "iommulab", "scenarios", "default"], cwd=workdir, check=True,
                       stdout=(workdir / "my.toml").open("w"))
    for code in python_examples():
        p = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{code}\nstderr: {p.stderr[-2000:]}"


def test_every_scenario_key_is_in_the_scenario_reference():
    """Every key a built-in scenario's run, os, workload and attack tables hold (defaults included) is named in
    docs/scenarios.md, as `key =` in its example or in backticks."""
    import json

    import iommulab
    from iommulab import _core

    doc = (ROOT / "docs" / "scenarios.md").read_text()
    keys = set()

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}.{k}")
            elif v is not None:
                keys.add(f"{prefix}.{k}")

    for name, _ in _core.builtin_scenarios():
        for v in iommulab.load(name, {}):
            sc = json.loads(v.scenario_json())
            for section in ("run", "os", "workload", "attack"):
                walk(sc.get(section) or {}, section)
    named = lambda k: re.search(rf"(^|[\s#`\"]){re.escape(k)}\s*=", doc, re.M) or f"`{k}`" in doc
    missing = sorted(k for k in keys if not named(k.rsplit(".", 1)[-1]))
    assert len(keys) > 60 and not missing, missing


def test_the_scenario_reference_is_generated_from_the_schema():
    """docs/scenario-reference.md is what tools/scenario_reference.py writes from the schema (every key with
    type, default, valid range and meaning), so it cannot fall behind the code."""
    import json
    sys.path.insert(0, str(ROOT / "tools"))
    import scenario_reference
    from iommulab import _core

    want = scenario_reference.render(json.loads(_core.scenario_schema()))
    have = (ROOT / "docs/scenario-reference.md").read_text()
    assert have == want, "docs/scenario-reference.md is stale: python tools/scenario_reference.py > docs/scenario-reference.md"
    # Every key of the schema has a row with a meaning.
    rows = [l for l in have.splitlines() if l.startswith("| `")]
    assert len(rows) > 150 and all(not l.rstrip().endswith("|  |") for l in rows)
