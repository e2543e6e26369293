#!/usr/bin/python3
"""Real disturbances: a busy process started inside one worker's cgroup for a while, against the
same job undisturbed, for DBS, the paper's rule (proportional) and the fixed equal split.

Every worker runs under a CPU quota (cgroup v1, --cpu_quota cores at the kernel's default 100 ms
period). When dbs_ps plans epoch --at_epoch of a disturbed run, a busy loop starts in worker
--burst_worker's cgroup (the fastest by default) and runs --burst_s seconds. The worker is not
told: it shares its quota with the loop, as with any other task landing on its node. Per policy:

  cost       the disturbed job's training time minus the undisturbed one's (sum of epoch times);
  removed    the capacity the burst took: the CPU seconds the loop used over the cluster's cores
             (the sum of the quotas), which is what the burst costs a job that re-balances at once;
  ratio      cost / removed;
  recovery   after the burst starts and after it ends: the steps until the disturbed worker's
             step time is within 10% of the others' (of the median of theirs), counted from the
             first step that ends after the event to the first step from which its sum over the
             next --window steps is (one step under a 100 ms CFS period is mostly noise: a
             worker runs until its quota is spent, then waits for the next period); '-' where it
             never is before the job ends. Step times are each worker's step as dbs_ps timed it
             (what DBS balances), from its step trace. The undisturbed run gives the floor: the
             fraction of its windows where the same worker is within 10%.

  /usr/bin/python3 bench/disturbance.py --out_dir=out/disturbance --rounds=2
  /usr/bin/python3 bench/run_bench.py --disturbance      # the same, with these defaults

Needs root and a cgroup v1 cpu controller (deploy/hetero.py), and the binaries (bazel build
//server:dbs_ps //worker:dbs_worker). Writes OUT_DIR/disturbance.json; exits 2 where quotas
cannot be set, saying why.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "deploy"))
import hetero  # noqa: E402

POLICIES = ("dbs", "proportional", "fixed")
BUSY_LOOP = "while True:\n    pass\n"


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu_quota", default="0.1,0.1,0.15,0.15,0.25,0.35",
                    help="per-worker CPU quota in cores (their count is the number of workers)")
    ap.add_argument("--cpu_period_ms", type=float, default=100.0,
                    help="the CFS period of every worker's cgroup (100: the kernel's default)")
    ap.add_argument("--burst_worker", type=int, default=-1,
                    help="the worker whose cgroup gets the busy loop (-1: the largest quota)")
    ap.add_argument("--at_epoch", type=int, default=3,
                    help="the burst starts when dbs_ps plans this epoch (1-based)")
    ap.add_argument("--burst_s", type=float, default=10.0, help="how long the busy loop runs")
    ap.add_argument("--window", type=int, default=16,
                    help="steps over which the disturbed worker's step time is compared")
    ap.add_argument("--tolerance", type=float, default=0.10,
                    help="how close to the others' step time counts as recovered")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated, of " + ", ".join(POLICIES))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every policy's pair this many times (the report gives the spread)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--global_batch", type=int, default=96)
    ap.add_argument("--train_limit", type=int, default=15000)
    ap.add_argument("--test_limit", type=int, default=1000)
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "disturbance"))
    ap.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    return ap


def log(line):
    print(f"[disturbance] {line}", flush=True)


def cgroup_of(pid):
    """The cgroup v1 cpu directory that process `pid` is in."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(","):
                return os.path.join(hetero.CGROUP_CPU, path.lstrip("/"))
    raise RuntimeError(f"process {pid} is in no cpu cgroup")


def cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Burst:
    """A busy loop inside a cgroup: start() puts it there, stop() ends it and keeps what it
    used (its CPU seconds) and when it ran (Unix seconds)."""

    def __init__(self, cgroup):
        self.cgroup = cgroup
        self.proc = None
        self.began = self.ended = None
        self.cpu = 0.0

    def start(self):
        def join():
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=join,
                                     stdin=subprocess.DEVNULL)
        self.began = time.time()

    def stop(self):
        if self.proc is None or self.ended is not None:
            return
        self.cpu = cpu_seconds(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        self.ended = time.time()


def wait_for_plan(out_dir, epoch, job, timeout):
    """Waits until dbs_ps's log says `epoch` (1-based) is planned; False if the job ended."""
    pattern = re.compile(rf"\] epoch {epoch}/\d+ planned")
    path = os.path.join(out_dir, "ps.log")
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        try:
            with open(path) as f:
                if pattern.search(f.read()):
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    return False


def run_job(args, name, policy, quotas, burst_worker):
    """One local_cluster job; with burst_worker >= 0, the busy loop in that worker's cgroup.
    Returns (summary, step trace lines, Burst or None)."""
    out = os.path.join(args.out_dir, name)
    # A job's directory starts empty: a log or pids.json left by an earlier run in the same
    # --out_dir would start the burst before this job has planned the epoch.
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
            f"--out_dir={out}", f"--workers={len(quotas)}",
            f"--cpu_quota={','.join(f'{q:g}' for q in quotas)}",
            f"--cpu_period_ms={args.cpu_period_ms:g}", f"--policy={policy}",
            f"--epochs={args.epochs}", f"--global_batch={args.global_batch}",
            f"--train_limit={args.train_limit}", f"--test_limit={args.test_limit}",
            f"--bin_dir={args.bin_dir}", "--log_every_s=60"]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    burst = None
    try:
        if burst_worker >= 0 and wait_for_plan(out, args.at_epoch, job, 600):
            with open(os.path.join(out, "pids.json")) as f:
                pid = json.load(f)[f"worker-{burst_worker}"]
            burst = Burst(cgroup_of(pid))
            burst.start()
            try:
                job.wait(timeout=args.burst_s)
            except subprocess.TimeoutExpired:
                pass
            burst.stop()
        output, _ = job.communicate(timeout=1800)
    finally:
        if burst is not None:
            burst.stop()
        if job.poll() is None:
            job.kill()
            job.wait()
    if job.returncode != 0:
        raise RuntimeError(f"{name}: local_cluster exited {job.returncode}: {output[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "steps.jsonl")) as f:
        trace = [json.loads(line) for line in f]
    return summary, trace, burst


def step_table(trace, ids):
    """[(end, [each worker's step seconds, in the order of `ids`])] over the steps dbs_ps timed
    every worker of (from the step trace), in order."""
    rows = []
    for line in trace:
        seconds = {w["id"]: w.get("step_seconds") for w in line["workers"]}
        if all(seconds.get(i) is not None for i in ids):
            rows.append((line["time"], [seconds[i] for i in ids]))
    return rows


def within(rows, worker, i, window, tolerance):
    """Whether the worker's step time over the `window` steps from step i is within `tolerance`
    of the median of the others' over the same steps."""
    span = rows[i:i + window]
    own = sum(r[worker] for _, r in span)
    others = statistics.median(sum(r[w] for _, r in span)
                               for w in range(len(span[0][1])) if w != worker)
    return others > 0 and abs(own / others - 1) <= tolerance


def steps_to_recover(rows, worker, at, window, tolerance):
    """Steps from the first step ending at or after `at` to the first step from which the
    worker is within tolerance (within()); None if it never is."""
    first = next((i for i, (end, _) in enumerate(rows) if end >= at), None)
    if first is None:
        return None
    for i in range(first, len(rows) - window + 1):
        if within(rows, worker, i, window, tolerance):
            return i - first
    return None


def balanced_fraction(rows, worker, window, tolerance):
    """Of the windows of an undisturbed run, the fraction where the worker is within tolerance:
    how often the measure holds when nothing happens."""
    starts = range(0, len(rows) - window + 1)
    return sum(within(rows, worker, i, window, tolerance) for i in starts) / max(len(starts), 1)


def train_seconds(summary):
    return sum(e["wall_seconds"] for e in summary["epochs"])


def mean_batches(summary, worker):
    """The worker's mean batch each epoch (its samples over the epoch's steps: the plan's batch
    as re-planned within the epoch)."""
    out = []
    for e in summary["epochs"]:
        w = next((w for w in e["workers"] if w["id"] == worker), None)
        out.append(None if w is None else round(w["samples"] / max(e["steps"], 1), 1))
    return out


def launch_ids(summary, n):
    """The server's ids of the launcher's worker-0..n-1 (ids follow registration order)."""
    by_name = {w["name"]: w["id"] for w in summary["worker_info"]}
    return [by_name[f"worker-{i}"] for i in range(n)]


def measure(args, policy, quotas, worker, tag):
    """One policy's undisturbed and disturbed jobs and their figures."""
    calm, calm_trace, _ = run_job(args, f"{policy}-{tag}-calm", policy, quotas, -1)
    hit, trace, burst = run_job(args, f"{policy}-{tag}-burst", policy, quotas, worker)
    if burst is None:
        raise RuntimeError(f"{policy}: the job ended before epoch {args.at_epoch} was planned")
    ids, calm_ids = launch_ids(hit, len(quotas)), launch_ids(calm, len(quotas))
    rows = step_table(trace, ids)
    calm_rows = step_table(calm_trace, calm_ids)
    removed = burst.cpu / sum(quotas)
    cost = train_seconds(hit) - train_seconds(calm)
    result = {
        "policy": policy, "round": tag,
        "undisturbed_seconds": train_seconds(calm), "disturbed_seconds": train_seconds(hit),
        "cost_seconds": cost, "burst_cpu_seconds": burst.cpu,
        "burst_seconds": burst.ended - burst.began, "removed_seconds": removed,
        "cost_over_removed": cost / removed if removed > 0 else None,
        "steps_to_recover_after_start": steps_to_recover(rows, worker, burst.began,
                                                         args.window, args.tolerance),
        "steps_to_recover_after_end": steps_to_recover(rows, worker, burst.ended,
                                                       args.window, args.tolerance),
        "undisturbed_within_fraction": balanced_fraction(calm_rows, worker, args.window,
                                                         args.tolerance),
        "disturbed_batches": mean_batches(hit, ids[worker]),
        "undisturbed_batches": mean_batches(calm, calm_ids[worker]),
        "undisturbed_accuracy": calm["final_test_accuracy"],
        "disturbed_accuracy": hit["final_test_accuracy"],
    }
    log(f"{policy} round {tag}: {line(result)}")
    return result


def fmt_ratio(r):
    return "-" if r["cost_over_removed"] is None else f"{r['cost_over_removed']:.2f}"


def fmt_steps(n):
    return "-" if n is None else str(n)


def line(r):
    ratio = fmt_ratio(r)
    return (f"{r['undisturbed_seconds']:.1f} s undisturbed, {r['disturbed_seconds']:.1f} s "
            f"disturbed: cost {r['cost_seconds']:.2f} s over {r['removed_seconds']:.2f} s "
            f"removed = {ratio}; steps to recover after the start "
            f"{fmt_steps(r['steps_to_recover_after_start'])}, after the end "
            f"{fmt_steps(r['steps_to_recover_after_end'])}")


def report(results, policies):
    """The console table: per policy, each round's figures."""
    print("policy        | undisturbed s | disturbed s | cost s | removed s | cost/removed | "
          "steps after start | steps after end | undisturbed within")
    for p in policies:
        for r in (r for r in results if r["policy"] == p):
            ratio = fmt_ratio(r)
            print(f"{p:13} | {r['undisturbed_seconds']:13.1f} | {r['disturbed_seconds']:11.1f} | "
                  f"{r['cost_seconds']:6.2f} | {r['removed_seconds']:9.2f} | {ratio:>12} | "
                  f"{fmt_steps(r['steps_to_recover_after_start']):>17} | "
                  f"{fmt_steps(r['steps_to_recover_after_end']):>15} | "
                  f"{100 * r['undisturbed_within_fraction']:17.0f}%")


def main(argv=None):
    args = build_parser().parse_args(argv)
    why = hetero.quota_unavailable_reason()
    if why is not None:
        print(f"disturbance: {why}: a busy process in a worker's cgroup needs cgroup v1 CPU "
              "quotas (run as root on a host with /sys/fs/cgroup/cpu)", file=sys.stderr)
        return 2
    try:
        try:
            quotas = [float(q) for q in args.cpu_quota.split(",")]
        except ValueError:
            raise ValueError(f"--cpu_quota={args.cpu_quota}: cores per worker, e.g. "
                             "0.1,0.2,0.4") from None
        if len(quotas) < 2 or not all(0.01 <= q <= 1 for q in quotas):
            raise ValueError(f"--cpu_quota={args.cpu_quota}: two workers or more, each at "
                             "0.01-1 cores")
        policies = [p for p in args.policies.split(",") if p]
        if any(p not in POLICIES for p in policies) or not policies:
            raise ValueError(f"--policies takes {', '.join(POLICIES)}")
        if args.burst_worker >= len(quotas):
            raise ValueError(f"--burst_worker={args.burst_worker}: there are {len(quotas)} "
                             "workers (0-based)")
    except ValueError as e:
        print(f"disturbance: {e}", file=sys.stderr)
        return 2
    worker = args.burst_worker if args.burst_worker >= 0 else quotas.index(max(quotas))
    os.makedirs(args.out_dir, exist_ok=True)
    log(f"{len(quotas)} workers at {args.cpu_quota} cores ({args.cpu_period_ms:g} ms period); "
        f"a busy loop in worker {worker}'s cgroup for {args.burst_s:g} s from epoch "
        f"{args.at_epoch}; {args.epochs} epochs, B={args.global_batch}, D={args.train_limit}")
    results = []
    for r in range(args.rounds):
        for p in policies:
            results.append(measure(args, p, quotas, worker, str(r)))
    report(results, policies)
    path = os.path.join(args.out_dir, "disturbance.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "burst_worker": worker, "results": results}, f, indent=2)
    log(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
