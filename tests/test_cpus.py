"""kestrel_cli.core.cpus: the fast cores of a big.LITTLE CPU from fake sysfs trees, the thread
plan for the default and for -t, and pinning (checked on this machine's threads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_cli.core import cpus
from kestrel_cli.core.cpus import cpu_list, plan, topology

ROOT = Path(__file__).resolve().parents[1]

RK3588 = {**{c: 415 for c in range(4)}, **{c: 1024 for c in range(4, 8)}}
# a phone: four little, three big, one prime core
PHONE = {**{c: 325 for c in range(4)}, **{c: 856 for c in range(4, 7)}, 7: 1024}


def fake_sysfs(root: Path, capacity=None, max_freq=None) -> Path:
    """A /sys/devices/system/cpu lookalike: cpuN/cpu_capacity and/or
    cpuN/cpufreq/cpuinfo_max_freq from {cpu: text or int} (text is written as is)."""
    for name, values, rel in (
        ("capacity", capacity, "cpu_capacity"),
        ("freq", max_freq, "cpufreq/cpuinfo_max_freq"),
    ):
        for c, v in (values or {}).items():
            f = root / f"cpu{c}" / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(v, bytes):
                f.write_bytes(v)
            else:
                f.write_text(f"{v}\n" if isinstance(v, int) else v)
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_rk3588_takes_the_four_a76(tmp_path):
    t = topology(str(fake_sysfs(tmp_path, RK3588)), allowed=range(8))
    assert t.metric == "capacity" and t.mixed
    assert t.fast() == (4, 5, 6, 7) and t.slow() == (0, 1, 2, 3)
    p = plan(topo=t, env={})
    assert p.threads == 4 and p.pin == (4, 5, 6, 7) and p.mixed
    assert p.line == "threads: 4 (big cores 4-7 of 8: capacity 1024 vs 415)"


def test_rk3588_big_cores_numbered_first(tmp_path):
    caps = {c: 1024 if c < 4 else 415 for c in range(8)}
    t = topology(str(fake_sysfs(tmp_path, caps)), allowed=range(8))
    assert t.fast() == (0, 1, 2, 3) and t.slow() == (4, 5, 6, 7)


def test_phone_three_clusters_takes_prime_and_big(tmp_path):
    t = topology(str(fake_sysfs(tmp_path, PHONE)), allowed=range(8))
    assert [cs for _, cs in t.tiers()] == [(7,), (4, 5, 6), (0, 1, 2, 3)]
    # 1 x 1024 < 4 x 856 > 8 x 325: the prime core and the big ones
    assert t.fast() == (4, 5, 6, 7)
    p = plan(topo=t, env={})
    assert p.threads == 4 and p.pin == (4, 5, 6, 7)
    assert p.line == "threads: 4 (big cores 4-7 of 8: capacity 1024, 856 vs 325)"


def test_a_lone_fast_core_wins_only_when_the_rest_are_much_slower(tmp_path):
    caps = {0: 1024, 1: 500, **{c: 100 for c in range(2, 8)}}
    t = topology(str(fake_sysfs(tmp_path, caps)), allowed=range(8))
    assert t.fast() == (0,)  # 1024 > 2 x 500 > 8 x 100
    assert plan(topo=t, env={}).threads == 1
    caps[1] = 520  # 2 x 520 > 1024: both
    t = topology(str(fake_sysfs(tmp_path, caps)), allowed=range(8))
    assert t.fast() == (0, 1)
    caps = {0: 1024, 1: 1024, 2: 512, 3: 512}  # 2 x 1024 == 4 x 512: the fewer cores
    t = topology(str(fake_sysfs(tmp_path / "tie", caps)), allowed=range(4))
    assert t.fast() == (0, 1)


def test_homogeneous_keeps_every_core_unpinned(tmp_path):
    t = topology(str(fake_sysfs(tmp_path, {c: 1024 for c in range(6)})), allowed=range(6))
    assert not t.mixed and t.fast() == tuple(range(6)) and t.slow() == ()
    p = plan(topo=t, env={})
    assert (p.threads, p.pin, p.mixed) == (6, None, False)
    assert p.line == "threads: 6 (all 6 cores)"


def test_clusters_a_few_percent_apart_are_one_tier(tmp_path):
    caps = {0: 1024, 1: 1000, 2: 980, 3: 1024}
    t = topology(str(fake_sysfs(tmp_path, caps)), allowed=range(4))
    assert not t.mixed and t.fast() == (0, 1, 2, 3)
    # a desktop whose preferred cores boost ~12% higher is not big.LITTLE
    freq = {0: 5700000, 1: 5700000, 2: 5100000, 3: 5100000}
    t = topology(str(fake_sysfs(tmp_path / "f", max_freq=freq)), allowed=range(4))
    assert not t.mixed and plan(topo=t, env={}).pin is None
    # a tier is measured from its fastest core: no chaining of small steps
    caps = {0: 1024, 1: 900, 2: 800, 3: 700}
    t = topology(str(fake_sysfs(tmp_path / "c", caps)), allowed=range(4))
    assert [cs for _, cs in t.tiers()] == [(0, 1), (2, 3)]
    assert [s for s, _ in t.tiers()] == [900, 700]
    assert t.fast() == (0, 1, 2, 3)  # 4 x 700 > 2 x 900


def test_max_freq_when_capacity_is_missing(tmp_path):
    # an RK3588 without cpu_capacity: its two A76 clusters clock a little differently
    freq = {**{c: 1800000 for c in range(4)}, 4: 2352000, 5: 2352000, 6: 2256000, 7: 2256000}
    t = topology(str(fake_sysfs(tmp_path, max_freq=freq)), allowed=range(8))
    assert t.metric == "max_freq" and t.fast() == (4, 5, 6, 7)
    p = plan(topo=t, env={})
    assert p.threads == 4 and p.pin == (4, 5, 6, 7)
    assert p.line == "threads: 4 (big cores 4-7 of 8: max freq 2256 vs 1800 MHz)"


def test_max_freq_takes_only_the_fastest_tier(tmp_path):
    # 8 x 1.8 GHz > 4 x 2.4 GHz, but a little core also does less per cycle
    freq = {**{c: 1800000 for c in range(4)}, **{c: 2400000 for c in range(4, 8)}}
    t = topology(str(fake_sysfs(tmp_path, max_freq=freq)), allowed=range(8))
    assert t.fast() == (4, 5, 6, 7)


def test_capacity_partly_missing_falls_back_to_max_freq(tmp_path):
    caps = {c: v for c, v in RK3588.items() if c != 5}
    freq = {c: 1800000 if c < 4 else 2400000 for c in range(8)}
    t = topology(str(fake_sysfs(tmp_path, caps, freq)), allowed=range(8))
    assert t.metric == "max_freq" and t.fast() == (4, 5, 6, 7)


def test_neither_source_uses_every_cpu(tmp_path):
    t = topology(str(fake_sysfs(tmp_path)), allowed=range(8))
    assert t.metric is None and not t.mixed and t.fast() == tuple(range(8))
    assert plan(topo=t, env={}).pin is None
    t = topology(str(tmp_path / "no" / "such" / "dir"), allowed=[0, 1])
    assert t.metric is None and t.fast() == (0, 1)


def test_affinity_restricts_the_cpus(tmp_path):
    root = str(fake_sysfs(tmp_path, RK3588))
    little = topology(root, allowed={0, 1, 2, 3})  # taskset -c 0-3
    assert not little.mixed and little.fast() == (0, 1, 2, 3)
    p = plan(topo=little, env={})
    assert (p.threads, p.pin) == (4, None)
    mixed = topology(root, allowed={2, 3, 4, 5})
    assert mixed.fast() == (4, 5) and mixed.slow() == (2, 3)
    assert plan(topo=mixed, env={}).line == "threads: 2 (big cores 4-5 of 4: capacity 1024 vs 415)"
    # CPUs outside the affinity are never read: cpu4-7 missing does not matter
    only_little = fake_sysfs(tmp_path / "l", {c: 415 for c in range(4)})
    assert topology(str(only_little), allowed={0, 1}).metric == "capacity"


@pytest.mark.parametrize(
    "bad", ["abc", "", "-5", "0", "1024 415", "1e3", b"\xff\xfe", "9" * 200, "\x00"]
)
def test_malformed_capacity_is_ignored(tmp_path, bad):
    caps = {**RK3588, 6: bad}
    freq = {c: 1800000 if c < 4 else 2400000 for c in range(8)}
    t = topology(str(fake_sysfs(tmp_path, caps, freq)), allowed=range(8))
    assert t.metric == "max_freq" and t.fast() == (4, 5, 6, 7)
    # and with no max_freq either: every CPU
    t = topology(str(fake_sysfs(tmp_path / "b", caps)), allowed=range(8))
    assert t.metric is None and t.fast() == tuple(range(8))


def test_unreadable_entries_are_ignored(tmp_path):
    root = fake_sysfs(tmp_path, {c: v for c, v in RK3588.items() if c != 2})
    (root / "cpu2" / "cpu_capacity").mkdir(parents=True)  # a directory, not a file
    (root / "cpu3" / "cpu_capacity").unlink()
    (root / "cpu3" / "cpu_capacity").symlink_to(root / "cpu3" / "loop")
    (root / "cpu3" / "loop").symlink_to(root / "cpu3" / "cpu_capacity")
    t = topology(str(root), allowed=range(8))
    assert t.metric is None and t.fast() == tuple(range(8))


def test_explicit_threads(tmp_path):
    t = topology(str(fake_sysfs(tmp_path, RK3588)), allowed=range(8))
    p = plan(2, topo=t, env={})
    assert (p.threads, p.pin) == (2, (4, 5, 6, 7))  # -t 2: on the big cores
    assert p.line == "threads: 2 (-t; big cores 4-7 of 8: capacity 1024 vs 415)"
    p = plan(4, topo=t, env={})
    assert (p.threads, p.pin) == (4, (4, 5, 6, 7))
    p = plan(6, topo=t, env={})  # more than the big cores
    assert (p.threads, p.pin) == (6, None)
    assert p.line == "threads: 6 (-t 6 > 4 big cores: not pinned, all 8 cores 0-7)"
    homo = topology(str(fake_sysfs(tmp_path / "h", {c: 1024 for c in range(4)})), allowed=range(4))
    assert (plan(2, topo=homo, env={}).pin, plan(9, topo=homo, env={}).pin) == (None, None)


@pytest.mark.parametrize("var", cpus.OMP_BINDING_ENV)
def test_an_openmp_binding_in_the_environment_wins(tmp_path, var):
    t = topology(str(fake_sysfs(tmp_path, RK3588)), allowed=range(8))
    p = plan(topo=t, env={var: "4-7" if var == "GOMP_CPU_AFFINITY" else "true"})
    assert p.threads == 4 and p.pin is None
    assert p.line.endswith(f"; not pinned: {var} is set")


def test_sysfs_root_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cpus.SYSFS_ENV, str(fake_sysfs(tmp_path, RK3588)))
    assert cpus.sysfs_root() == str(tmp_path)
    assert topology(allowed=range(8)).fast() == (4, 5, 6, 7)
    monkeypatch.delenv(cpus.SYSFS_ENV)
    assert cpus.sysfs_root() == "/sys/devices/system/cpu"


def test_cpu_list():
    assert cpu_list([]) == ""
    assert cpu_list([3]) == "3"
    assert cpu_list({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"


def test_summary_lines(tmp_path):
    t = topology(str(fake_sysfs(tmp_path, PHONE)), allowed=range(8))
    assert cpus.summary(t) == [
        "cpus: 0-7",
        "big: 4-7",
        "little: 0-3",
        "metric: capacity",
        "threads: 4 (big cores 4-7 of 8: capacity 1024, 856 vs 325)",
    ]


# ------------------------------------------------------------ on this machine's threads


def _allowed() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="passive", **env)
    for k in cpus.OMP_BINDING_ENV:
        e.pop(k, None)
    return subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300
    )


# every thread's Cpus_allowed_list after a forward pass (the OpenMP team is started)
MASKS = """
import glob
def masks():
    out = set()
    for st in glob.glob('/proc/self/task/*/status'):
        for line in open(st):
            if line.startswith('Cpus_allowed_list:'):
                out.add(line.split(':', 1)[1].strip())
    return sorted(out)
"""


@pytest.fixture
def big_little(tmp_path):
    """This process's allowed CPUs as a fake big.LITTLE tree: the last one big (capacity
    1024), the others little (415); (allowed, big, root). A machine with one CPU in the
    affinity has no little core to leave out, so the pinning cannot be shown there."""
    allowed = _allowed()
    if len(allowed) < 2:
        pytest.skip("needs two CPUs in the affinity to tell big from little")
    big = allowed[-1]
    root = fake_sysfs(tmp_path / "bl", {c: 1024 if c == big else 415 for c in allowed})
    return allowed, big, root


def test_default_load_pins_every_thread_to_the_big_core(tmp_path, big_little):
    allowed, big, root = big_little
    code = (
        MASKS
        + """
from kestrel_cli.inference.engine import Engine, LoadOptions, default_threads
eng = Engine.load(None, LoadOptions())
cache = eng.make_cache(64)
eng.model([1, 2, 3, 4, 5, 6, 7, 8], cache)
eng.model([9], cache)
print(eng.threads, default_threads(), masks(), eng.thread_plan.line, sep='|')
"""
    )
    r = _run(code, KESTREL_SYSFS_CPU=str(root))
    assert r.returncode == 0, r.stderr
    threads, default, masks, line = r.stdout.strip().split("|")
    assert (threads, default) == ("1", "1")
    assert masks == repr([str(big)])
    assert line == f"threads: 1 (big cores {big} of {len(allowed)}: capacity 1024 vs 415)"


def test_more_threads_than_big_cores_run_unpinned(tmp_path, big_little):
    allowed, big, root = big_little
    # a first engine pins to the big core, a second with -t 2 goes back to every CPU
    code = (
        MASKS
        + """
from kestrel_cli.inference.engine import Engine, LoadOptions
a = Engine.load(None, LoadOptions())
a.model([1, 2, 3], a.make_cache(16))
first = masks()
b = Engine.load(None, LoadOptions(threads=2))
b.model([1, 2, 3], b.make_cache(16))
print(first, masks(), b.thread_plan.line, sep='|')
"""
    )
    r = _run(code, KESTREL_SYSFS_CPU=str(root))
    assert r.returncode == 0, r.stderr
    first, after, line = r.stdout.strip().split("|")
    assert first == repr([str(big)])
    assert after == repr([cpu_list(allowed)])
    assert line == (
        f"threads: 2 (-t 2 > 1 big cores: not pinned, all {len(allowed)} cores {cpu_list(allowed)})"
    )


def test_cli_prints_the_choice_once(tmp_path, smollm2_path, big_little):
    allowed, big, root = big_little
    code = (
        "import sys; sys.argv = ['kestrel', 'run', '-p', 'Hi', '-n', '2', '--temp', '0', "
        "'--no-timing']; from kestrel_cli.cli import main; main()"
    )
    r = _run(code, KESTREL_SYSFS_CPU=str(root))
    assert r.returncode == 0, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.startswith("threads:")]
    assert lines == [f"threads: 1 (big cores {big} of {len(allowed)}: capacity 1024 vs 415)"]
    # cores all alike: nothing printed, as before
    homo = fake_sysfs(tmp_path / "h", {c: 1024 for c in allowed})
    r = _run(code, KESTREL_SYSFS_CPU=str(homo))
    assert r.returncode == 0, r.stderr
    assert "threads:" not in r.stderr


def test_kestrel_cpus_command(tmp_path):
    allowed = _allowed()
    root = fake_sysfs(tmp_path, {c: 1024 if c == allowed[-1] else 415 for c in allowed})
    code = "import sys; sys.argv = ['kestrel', 'cpus']; from kestrel_cli.cli import main; main()"
    r = _run(code, KESTREL_SYSFS_CPU=str(root))
    assert r.returncode == 0, r.stderr
    out = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert out["cpus"] == cpu_list(allowed)
    assert out["big"] == str(allowed[-1])
    assert out["little"] == cpu_list(allowed[:-1])
    assert out["metric"] == "capacity"
    assert list(out) == ["cpus", "big", "little", "metric", "threads"]


def test_topology_of_this_machine_never_fails():
    t = topology()
    assert set(t.allowed) == set(os.sched_getaffinity(0))
    assert set(t.fast()) | set(t.slow()) == set(t.allowed) and t.fast()
    assert not set(t.fast()) & set(t.slow())
