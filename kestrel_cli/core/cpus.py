"""Which cores the kernels run on by default: the fast cores of a big.LITTLE CPU.

On a machine whose cores differ (an RK3588: four Cortex-A76 and four Cortex-A55), an
OpenMP kernel split evenly over all cores waits for its slowest thread: eight threads there
run no faster than the little cores allow (the case llama.cpp gets wrong, its issue #7176).
So by default Kestrel starts one thread per fast core and pins the process to those cores.

The speed of each core comes from sysfs, for the CPUs in this process's affinity only
(`taskset` and cgroups are obeyed): `cpuN/cpu_capacity` (the kernel's per-core compute
capacity, 1024 for the fastest), else `cpuN/cpufreq/cpuinfo_max_freq`. A source is used
only when it gives a positive integer for every allowed CPU; unreadable or malformed files
count as missing, and with neither source every allowed CPU is used (today's behaviour, as
on a machine whose cores are all alike).

Cores within TIER_TOLERANCE of each other form one tier (the two A76 clusters of an RK3588
may differ a few percent in clock). With capacities, the default takes the fastest tiers
that maximise (cores used) x (capacity of the slowest core used): a static OpenMP split
(the kernels' schedule) runs at the pace of its slowest thread, so adding a slower tier
pays only when the extra cores make up for it. On an RK3588 (4 x 1024, 4 x 415) that is the
four A76; on a phone with 1 x 1024, 3 x 856 and 4 x 325 it is the four big and prime cores.
A clock frequency does not show that a little core also does less per cycle, so with
cpuinfo_max_freq only the fastest tier is taken.

`-t N` keeps N threads. With N at most the fast cores they are pinned to those cores; with
more, the process is not pinned and the threads run on every allowed CPU (pinning N
threads to fewer cores would only make them wait on each other). An OpenMP binding given
in the environment (OMP_PLACES, OMP_PROC_BIND, GOMP_CPU_AFFINITY) wins: then nothing is
pinned here.

Pinning sets the affinity of every thread of the process (os.sched_setaffinity on each
task): the OpenMP pool (libgomp, loaded with the kernels) creates its threads at the first
parallel region and they inherit the creating thread's mask; threads made earlier (a BLAS
pool, an earlier engine's OpenMP team) are moved too.

KESTREL_SYSFS_CPU names another directory laid out as /sys/devices/system/cpu (tests use
fake trees). `kestrel cpus` prints what this module finds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SYSFS_ENV = "KESTREL_SYSFS_CPU"
SYSFS_CPU = "/sys/devices/system/cpu"
TIER_TOLERANCE = 0.15  # cores within 15% of each other count as one tier
MAX_SYSFS_BYTES = 64  # a sysfs number file is a few bytes; more is not one
OMP_BINDING_ENV = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")

_original_affinity: frozenset[int] | None = None  # the mask before we first pinned


def sysfs_root(root: str | None = None) -> str:
    """The sysfs cpu directory: `root`, else $KESTREL_SYSFS_CPU, else the real one."""
    return root or os.environ.get(SYSFS_ENV) or SYSFS_CPU


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on, as it was before this module pinned it (so a
    second engine in the same process chooses from the same cores as the first)."""
    if _original_affinity is not None:
        return _original_affinity
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: every CPU
        return frozenset(range(os.cpu_count() or 1))


def _read_int(path: str) -> int | None:
    """A positive integer from a small sysfs file; None when missing, unreadable or not
    one positive integer."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SYSFS_BYTES + 1)
    except OSError:
        return None
    if len(text) > MAX_SYSFS_BYTES:
        return None
    try:
        value = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if value > 0 else None


def cpu_list(cpus) -> str:
    """Sorted CPU numbers as a Linux cpu list: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class Topology:
    """The allowed CPUs and how fast each is.

    allowed: the CPUs this process may use, sorted.
    metric: "capacity" (cpu_capacity), "max_freq" (cpuinfo_max_freq, kHz) or None (no
        source covered every allowed CPU: all are taken as alike).
    speed: CPU -> its value of `metric` (empty when metric is None).
    """

    allowed: tuple[int, ...]
    metric: str | None
    speed: dict

    def tiers(self) -> list[tuple[int, tuple[int, ...]]]:
        """(speed, cpus) per tier, fastest first; a tier's speed is its slowest core's.
        One tier of every allowed CPU when the speeds are unknown."""
        if self.metric is None:
            return [(0, self.allowed)]
        tiers: list[list] = []
        for c in sorted(self.allowed, key=lambda c: (-self.speed[c], c)):
            s = self.speed[c]
            if tiers and s >= tiers[-1][0] * (1 - TIER_TOLERANCE):
                tiers[-1][1].append(c)
            else:
                tiers.append([s, [c]])
        # a tier's speed: its slowest core (the pace of a static split over it)
        return [(min(self.speed[c] for c in cs), tuple(sorted(cs))) for _, cs in tiers]

    @property
    def mixed(self) -> bool:
        """Whether the allowed cores differ in speed (more than one tier)."""
        return len(self.tiers()) > 1

    def fast(self) -> tuple[int, ...]:
        """The cores the default runs on (see the module docstring)."""
        tiers = self.tiers()
        if len(tiers) == 1 or self.metric == "max_freq":
            return tiers[0][1]
        best, best_rate, used = tiers[0][1], 0, ()
        for speed, cpus in tiers:
            used = used + cpus
            rate = len(used) * speed
            if rate > best_rate:  # ties keep the fewer cores
                best, best_rate = used, rate
        return tuple(sorted(best))

    def slow(self) -> tuple[int, ...]:
        """The allowed cores the default leaves out."""
        fast = set(self.fast())
        return tuple(c for c in self.allowed if c not in fast)

    def describe(self) -> str:
        """The fast cores and why, e.g. "big cores 4-7 of 8: capacity 1024 vs 415"."""
        fast, slow = self.fast(), self.slow()
        tiers = self.tiers()
        if not slow:
            return f"all {len(self.allowed)} cores"
        fast_set = set(fast)
        unit = " MHz" if self.metric == "max_freq" else ""

        def val(s: int) -> str:
            return str(s // 1000) if self.metric == "max_freq" else str(s)

        kept = ", ".join(val(s) for s, cs in tiers if set(cs) <= fast_set)
        left = ", ".join(val(s) for s, cs in tiers if not set(cs) <= fast_set)
        name = "capacity" if self.metric == "capacity" else "max freq"
        return f"big cores {cpu_list(fast)} of {len(self.allowed)}: {name} {kept} vs {left}{unit}"


def topology(root: str | None = None, allowed=None) -> Topology:
    """Read the speed of each allowed CPU from the sysfs tree at `root` (see sysfs_root);
    `allowed`: the CPUs to consider (default: this process's, allowed_cpus())."""
    base = sysfs_root(root)
    cpus = tuple(sorted(allowed_cpus() if allowed is None else allowed))
    for metric, rel in (("capacity", "cpu_capacity"), ("max_freq", "cpufreq/cpuinfo_max_freq")):
        speed = {c: _read_int(os.path.join(base, f"cpu{c}", rel)) for c in cpus}
        if cpus and all(v is not None for v in speed.values()):
            return Topology(cpus, metric, speed)
    return Topology(cpus, None, {})


@dataclass(frozen=True)
class ThreadPlan:
    """How many threads the kernels run and on which cores.

    threads: OpenMP threads.
    pin: the CPUs to pin the process to, or None (leave its affinity as it was).
    line: the choice in one line for the CLI, e.g. "threads: 4 (big cores 4-7 of 8: ...)".
    mixed: whether the allowed cores differ in speed (the CLI prints `line` only then).
    """

    threads: int
    pin: tuple[int, ...] | None
    line: str
    mixed: bool


def plan(threads: int | None = None, topo: Topology | None = None, env=None) -> ThreadPlan:
    """The thread plan for `-t threads` (None: the default, one per fast core)."""
    topo = topology() if topo is None else topo
    env = os.environ if env is None else env
    fast = topo.fast()
    why = topo.describe()
    if threads is None:
        n = max(1, len(fast))
        pin = fast if topo.mixed else None
        head = f"threads: {n} ({why})"
    elif threads <= len(fast):
        n = threads
        pin = fast if topo.mixed else None
        head = f"threads: {n} (-t; {why})"
    else:
        n = threads
        pin = None
        head = (
            f"threads: {n} (-t {n} > {len(fast)} big cores: not pinned, all "
            f"{len(topo.allowed)} cores {cpu_list(topo.allowed)})"
            if topo.mixed
            else f"threads: {n} (-t; {why})"
        )
    bound = [k for k in OMP_BINDING_ENV if env.get(k)]
    if pin is not None and bound:
        pin = None
        head += f"; not pinned: {bound[0]} is set"
    return ThreadPlan(n, pin, head, topo.mixed)


def pin_process(cpus) -> None:
    """Pin every thread of this process to `cpus` (None: back to the mask it had before
    the first pin). Threads created later inherit the mask of the thread creating them."""
    global _original_affinity
    if not hasattr(os, "sched_setaffinity"):
        return
    if cpus is None:
        if _original_affinity is None:
            return
        mask = set(_original_affinity)
    else:
        if _original_affinity is None:
            _original_affinity = frozenset(os.sched_getaffinity(0))
        mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # a thread that has just exited, or a CPU gone offline
            pass


def apply(p: ThreadPlan) -> None:
    """Pin (or un-pin) the process as the plan says."""
    pin_process(p.pin)


def summary(topo: Topology | None = None) -> list[str]:
    """`kestrel cpus`: the allowed CPUs, the big and little cores (little: those the
    default leaves out, empty when all are alike), the speed source and the default plan,
    one `key: value` line each (scripts/board_bench.sh reads them)."""
    topo = topology() if topo is None else topo
    return [
        f"cpus: {cpu_list(topo.allowed)}",
        f"big: {cpu_list(topo.fast())}",
        f"little: {cpu_list(topo.slow())}",
        f"metric: {topo.metric or 'none'}",
        plan(topo=topo).line,
    ]
