"""Heterogeneity emulation for local clusters and benchmarks (Python standard library only).

Two ways to make workers differ in speed on one machine:
  * CPU quotas with cgroup v1 (`cpu.cfs_quota_us`): real throttling of everything the process does,
    compute and communication alike. Needs root and a cgroup v1 cpu controller.
  * A worker-side slowdown factor (dbs_worker --slowdown, bench/ddp_baseline.py --slowdown): each
    step's compute is followed by a sleep so it takes f times longer. Works anywhere.
Disturbances (a worker slowed by f from epoch e1 to e2) are passed to workers as slow windows
("e<e1>:<e2>:<f>"); the random mode draws them from a seeded generator, like the DBS paper's test
that slows a random worker for a few epochs.
"""

import os
import random

CGROUP_CPU = "/sys/fs/cgroup/cpu"
# The kernel's smallest quota is 1 ms. Each cgroup gets that quota over a period of 1 ms / fraction
# (8 ms for 1/8 of a core). The default 100 ms period would let a throttled worker run at full speed
# in bursts while it is mostly idle and only show its quota under load, so its measured speed would
# depend on how much work it was given; with a short period it is slowed evenly, like a slower CPU.
MIN_QUOTA_US = 1000
MAX_PERIOD_US = 1000000


def parse_floats(text, n, name, default):
    """'a,b,c' (n values) or 'a' (for all) -> list of n floats; '' -> n copies of default."""
    if not text:
        return [default] * n
    values = [float(v) for v in text.split(",") if v.strip()]
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        raise ValueError(f"{name} lists {len(values)} values for {n} workers")
    return values


def quota_unavailable_reason():
    """None when cgroup v1 CPU quotas can be used here, else why not."""
    if os.geteuid() != 0:
        return "CPU quotas need root (cgroup v1)"
    if not os.path.exists(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    probe = os.path.join(CGROUP_CPU, f"dbs_probe_{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        return f"cannot create a cgroup under {CGROUP_CPU}: {e.strerror}"
    return None


class CpuQuota:
    """One cgroup holding a process at `fraction` of one core. Use join() from preexec_fn.

    The period is the shortest the 1 ms minimum quota allows, unless `period_us` is given (the
    kernel's default, which Kubernetes and docker keep, is 100000: 100 ms)."""

    def __init__(self, name, fraction, period_us=None):
        if not 0.01 <= fraction <= 1:
            raise ValueError(f"CPU quota {fraction} out of range [0.01, 1] cores")
        if period_us is None:
            period = min(MAX_PERIOD_US, max(MIN_QUOTA_US, int(round(MIN_QUOTA_US / fraction))))
        else:
            period = int(period_us)
            if not MIN_QUOTA_US <= period <= MAX_PERIOD_US or fraction * period < MIN_QUOTA_US:
                raise ValueError(f"a CPU period of {period} us cannot hold a quota of {fraction} "
                                 f"cores (the quota must be at least {MIN_QUOTA_US} us, the "
                                 f"period at most {MAX_PERIOD_US} us)")
        self.path = os.path.join(CGROUP_CPU, name)
        os.makedirs(self.path, exist_ok=True)
        quota = max(MIN_QUOTA_US, int(round(fraction * period)))
        self.period_us = period
        # Lower the quota first so the pair is valid at every moment (quota <= period * cores).
        with open(os.path.join(self.path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota))
        with open(os.path.join(self.path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        self.fraction = fraction

    def join(self):
        """Moves the calling process into the cgroup (call in the child before exec)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def quotas_as_slowdowns(quotas):
    """Fallback without cgroups: the fastest quota runs at natural speed, the others slower."""
    top = max(quotas)
    return [top / q for q in quotas]


def random_disturbances(workers, epochs, probability, factor, max_len, seed):
    """Per worker, a ';'-joined list of slow windows: each epoch, with `probability`, a random
    worker is slowed by `factor` for 1..max_len epochs (the DBS paper's disturbance test)."""
    rng = random.Random(seed)
    windows = [[] for _ in range(workers)]
    for e in range(epochs):
        if rng.random() < probability:
            k = rng.randrange(workers)
            length = rng.randint(1, max_len)
            windows[k].append(f"e{e}:{min(epochs, e + length)}:{factor:g}")
    return [";".join(w) for w in windows]


def parse_disturbance(text, workers):
    """'k:e1:e2:f[,...]' (epochs e1..e2-1) or 'k:s<b>:<e>:f' (global steps) -> per-worker
    slow-window strings."""
    windows = [[] for _ in range(workers)]
    for part in filter(None, (p.strip() for p in text.split(","))):
        fields = part.split(":")
        if len(fields) != 4:
            raise ValueError(f"bad disturbance '{part}': expected worker:e1:e2:factor")
        unit = "s" if fields[1].startswith("s") else "e"
        k, e1, e2, f = (int(fields[0]), int(fields[1].lstrip("s")), int(fields[2]),
                        float(fields[3]))
        if not 0 <= k < workers or e2 <= e1 or e1 < 0 or f < 1:
            raise ValueError(f"bad disturbance '{part}'")
        windows[k].append(f"{unit}{e1}:{e2}:{f:g}")
    return [";".join(w) for w in windows]
