#!/usr/bin/python3
"""The scenario grid: DBS (the default controller), the paper's proportional rule and the fixed
split (S-SGD) on every combination of global batch x worker speeds x emulation.

Each cell is a real local cluster (deploy/local_cluster.py: one dbs_ps, 4 dbs_workers, the CNN on
Fashion-MNIST) with the same seed, data and number of steps per epoch for every policy. Per cell it
measures each worker's standalone speed (for the ideal epoch time D / sum of speeds) and its standalone
step-time curve over batch sizes (for the best split: the fastest epoch any split of B whole samples
can give those curves, without assuming time linear in the batch), runs the three
policies one after another, and records epoch times, the compute-time spread (max/min over workers)
of every epoch and the batch trajectory. The report gives every cell: DBS/S-SGD, DBS/ideal, the
paper's rule beside them, whether DBS settled (spread <= 1.15 from epoch 2 on), and the batches per
epoch; then the worst and median cell against the targets.

  /usr/bin/python3 bench/run_bench.py --grid            # the full grid, about 30 minutes here
  /usr/bin/python3 bench/run_bench.py --grid --small    # 2 tiny cells, checks the harness (CI)
  /usr/bin/python3 bench/run_bench.py --grid --grid_rounds=3   # each cell's policies 3 times,
                                                               # interleaved (about 3x as long)
  /usr/bin/python3 bench/grid.py OUT_DIR/grid           # rebuild and check the report
  /usr/bin/python3 bench/grid.py --combine OUT DIR/grid DIR2/grid ...
      # one worst/median report over the cells of several grid runs (e.g. one per batch size)
"""

import csv
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "deploy"))
import hetero  # noqa: E402
from report import by_launch_index  # noqa: E402  (bench/report.py)

POLICIES = ("fixed", "proportional", "dbs")
# --grid_oracles: fixed splits by weight (dbs_ps --fixed_split) that DBS is held against.
ORACLES = ("split_best", "split_dbs")
ORACLE_MODES = ("none", "all", "misses")
TARGETS = {"dbs_over_sgd": 0.65, "dbs_over_ideal": 1.35, "settled_spread": 1.15}
SETTLE_EPOCH = 2  # the split must have settled from this epoch on
SUMMARY_KEYS = ("dbs_over_sgd", "dbs_over_ideal", "dbs_over_best", "dbs_settled_spread",
                "dbs_settled_compute_spread", "dbs_wall_over_sgd", "proportional_over_sgd",
                "proportional_over_ideal", "proportional_over_best", "proportional_settled_spread",
                "proportional_settled_compute_spread", "noise_floor", "dbs_compute_over_ideal",
                "dbs_sync_share", "dbs_over_ideal_with_comm", "dbs_over_split_best",
                "dbs_over_split_dbs", "split_best_over_ideal", "dbs_over_sgd_paired",
                "proportional_over_sgd_paired")


def log(msg):
    print(f"[grid] {msg}", flush=True)


def parse_speeds(text):
    return [float(x) for x in text.split(":")]


class Grid:
    def __init__(self, args, ps_bin, worker_bin):
        self.args = args
        self.ps, self.worker = ps_bin, worker_bin
        self.out = os.path.join(os.path.abspath(args.out_dir), "grid")
        os.makedirs(self.out, exist_ok=True)
        self.quota_why = hetero.quota_unavailable_reason()

    def cells(self):
        a = self.args
        emulations = a.grid_emulations.split(",")
        for b in [int(x) for x in a.grid_batches.split(",")]:
            for speeds in a.grid_speeds.split(","):
                for emulation in emulations:
                    yield {"global_batch": b, "speeds": speeds, "emulation": emulation,
                           "name": f"B{b}_{speeds.replace(':', '-')}_{emulation}"}

    def emulate(self, cell):
        """Launcher flags and per-worker settings for the cell's emulation."""
        speeds = parse_speeds(cell["speeds"])
        quotas = [self.args.total_cores * s / sum(speeds) for s in speeds]
        if cell["emulation"] == "quota":
            if self.quota_why is not None:
                return None, f"CPU quotas unavailable here: {self.quota_why}"
            return {"flag": "--cpu_quota=" + ",".join(f"{q:.6g}" for q in quotas),
                    "quotas": quotas, "slowdowns": [1.0] * len(speeds)}, None
        # The same CPU budget as the quotas: a worker at q cores computes 1/q times slower than
        # a full core, so the workers together never ask for more than --total_cores and the
        # ideal (from standalone speeds) stays reachable on this machine. A wait for a core the
        # other workers hold counts inside the slower core's time (dbs_worker --slowdown_of=cpu),
        # as on machines of their own.
        if cell["emulation"] != "slowdown":
            sys.exit(f"unknown emulation {cell['emulation']!r}: quota or slowdown")
        slowdowns = [1.0 / q for q in quotas]
        return {"flag": "--slowdown=" + ",".join(f"{s:.6g}" for s in slowdowns),
                "quotas": None, "slowdowns": slowdowns}, None

    def standalone(self, cell, emu, train_limit):
        """Each worker alone under its emulation: its speed at the equal split's batch B/n over
        --grid_speed_samples samples (for the linear ideal) and its step-time curve over batches
        from B/64 to 3B/4, --grid_curve_samples samples each (for the best split)."""
        b = cell["global_batch"]
        equal = max(1, b // self.args.workers)
        others = sorted({max(1, b // 64), max(1, b // 32), max(1, b // 16), max(1, b // 8),
                         max(1, b // 2), max(1, 3 * b // 4)} - {equal})
        speeds, curves = [], []
        for i in range(self.args.workers):
            cg = None
            if emu["quotas"] is not None:
                cg = hetero.CpuQuota(f"dbs_grid_{os.getpid()}_s{i}", emu["quotas"][i])
            try:
                curve = []
                for samples, batches in ((self.args.grid_speed_samples, [equal]),
                                         (self.args.grid_curve_samples, others)):
                    m = self.measure(cell, cg, emu["slowdowns"][i], train_limit, samples,
                                     batches)
                    if batches[0] == equal:
                        speeds.append(m["samples_per_second"])
                    curve += [[c["batch"], c["batch"] / c["samples_per_second"]]
                              for c in m["curve"]]
                curves.append(curve)
            finally:
                if cg:
                    cg.remove()
        return speeds, curves

    def measure(self, cell, cg, slowdown, train_limit, samples, batches):
        argv = [self.worker, f"--measure_speed_samples={samples}",
                "--measure_batch=" + ",".join(str(x) for x in batches),
                f"--slowdown={slowdown}", f"--slowdown_of={'wall' if cg else 'cpu'}",
                f"--data_dir={self.args.data_dir}",
                f"--train_limit={train_limit}"]
        p = subprocess.run(argv, stdout=subprocess.PIPE, timeout=600,
                           preexec_fn=(cg.join if cg else None))
        if p.returncode != 0:
            sys.exit(f"standalone speed measurement failed in {cell['name']}")
        return json.loads(p.stdout)

    def run_policy(self, cell, emu, policy, train_limit, label=None, extra=()):
        out_dir = os.path.join(self.out, cell["name"], label or policy)
        argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
                f"--ps_bin={self.ps}", f"--worker_bin={self.worker}", f"--out_dir={out_dir}",
                f"--workers={self.args.workers}", f"--policy={policy}", "--model=cnn",
                f"--epochs={self.args.grid_epochs}", f"--global_batch={cell['global_batch']}",
                f"--train_limit={train_limit}", f"--test_limit={self.args.grid_test_limit}",
                f"--lr={self.args.lr}", f"--seed={self.args.seed}",
                f"--data_dir={self.args.data_dir}", emu["flag"]]
        if policy == "dbs" and self.args.grid_dbs_flags:
            argv += self.args.grid_dbs_flags.split()
        argv += list(extra)
        t0 = time.time()
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            sys.exit(f"grid cell {cell['name']} policy {policy} failed:\n{r.stdout[-3000:]}")
        with open(os.path.join(out_dir, "summary.json")) as f:
            summary = json.load(f)
        return summary, time.time() - t0

    def run_rounds(self, cell, emu, train_limit):
        """Runs the policies --grid_rounds times, in rounds that alternate their order (fixed,
        paper, DBS; then DBS, paper, fixed; ...), so that the machine's drift over the cell reaches
        every policy alike. Each policy's figures come from its median run by epoch time
        (cell["runs"]); every run is in cell["rounds"], in the order they ran."""
        rounds = self.args.grid_rounds
        cell["rounds"] = []
        for r in range(rounds):
            for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
                label = policy if rounds == 1 else f"{policy}_r{r + 1}"
                summary, seconds = self.run_policy(cell, emu, policy, train_limit, label, ())
                cell["rounds"].append({
                    "round": r + 1, "policy": policy,
                    "summary": os.path.relpath(
                        os.path.join(self.out, cell["name"], label, "summary.json"), self.out),
                    "command_seconds": seconds, "epoch_seconds": steady_epoch_seconds(summary)})
        for policy in POLICIES:
            cell["runs"][policy] = median_run([x for x in cell["rounds"]
                                               if x["policy"] == policy])

    def run(self):
        results = {"config": {k: v for k, v in vars(self.args).items()},
                   "policies": POLICIES, "targets": TARGETS, "cells": []}
        start = time.time()
        cells = list(self.cells())
        for k, cell in enumerate(cells):
            emu, why = self.emulate(cell)
            if emu is None:
                log(f"cell {cell['name']}: skipped ({why})")
                cell["skipped"] = why
                results["cells"].append(cell)
                continue
            train_limit = self.args.grid_steps * cell["global_batch"]
            cell["train_samples"] = train_limit
            cell["shares"] = emu["quotas"] or [1.0 / x for x in emu["slowdowns"]]
            cell["standalone_speeds"], cell["standalone_curves"] = self.standalone(
                cell, emu, train_limit)
            cell["runs"] = {}
            self.run_rounds(cell, emu, train_limit)
            mode = self.args.grid_oracles
            wanted = wants_oracles(mode, cell_figures(cell, self.out) if mode == "misses" else {})
            runs = [("fixed", label, None) for label in ORACLES] if wanted else []
            for policy, label, extra in runs:
                if extra is None:  # an oracle: a fixed split by weights, known only now
                    extra = ("--fixed_split=" + ",".join(
                        str(w) for w in oracle_weights(label, cell, self.out)),)
                summary, seconds = self.run_policy(cell, emu, policy, train_limit, label, extra)
                cell["runs"][label] = {
                    "summary": os.path.relpath(
                        os.path.join(self.out, cell["name"], label, "summary.json"), self.out),
                    "command_seconds": seconds}
            figures = cell_figures(cell, self.out)
            cell.update(figures)
            results["cells"].append(cell)
            elapsed = time.time() - start
            paired = (f" (paired by round {figures['dbs_over_sgd_paired']:.3f})"
                      if "dbs_over_sgd_paired" in figures else "")
            log(f"[{k + 1}/{len(cells)}] {cell['name']}: DBS/S-SGD "
                f"{figures['dbs_over_sgd']:.3f}{paired}, "
                f"DBS/ideal {figures['dbs_over_ideal']:.3f}, paper/S-SGD "
                f"{figures['proportional_over_sgd']:.3f}, DBS balance from epoch {SETTLE_EPOCH} "
                f"{figures['dbs_settled_spread']:.2f} | {elapsed:.0f} s, ETA "
                f"{elapsed / (k + 1) * (len(cells) - k - 1):.0f} s")
        results["grid_seconds"] = time.time() - start
        with open(os.path.join(self.out, "grid_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        return build(self.out)


def _curve_at(curve, b):
    """A standalone curve read piecewise linearly, continued with its end segments' slopes."""
    pts = sorted(curve)
    if b <= 0:
        return 0.0
    if len(pts) == 1:
        return pts[0][1] * b / pts[0][0]
    k = 0
    while k + 2 < len(pts) and b > pts[k + 1][0]:
        k += 1
    (b0, t0), (b1, t1) = pts[k], pts[k + 1]
    return max(1e-9, t0 + (t1 - t0) * (b - b0) / (b1 - b0))


def _step_table(curve, global_batch):
    """One curve's step time at every batch 0..global_batch, made non-decreasing."""
    t, best = [], 0.0
    for b in range(global_batch + 1):
        best = max(best, _curve_at(curve, b))
        t.append(best)
    return t


def _most_under(table, tau):
    """The largest batch whose step takes at most tau."""
    return max(b for b in range(len(table)) if table[b] <= tau)


def best_split_step(curves, global_batch, tables=None):
    """The best any split of `global_batch` whole samples can do with these standalone
    step-time curves ([[batch, seconds per step], ...] per worker): the smallest slowest step.
    Each curve is read piecewise linearly between its points, made non-decreasing, and
    continued with its end segments' slopes (a batch of 0 costs nothing)."""
    tables = tables or [_step_table(c, global_batch) for c in curves]
    candidates = sorted({x for t in tables for x in t})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(_most_under(t, candidates[mid]) for t in tables) >= global_batch:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def best_split_batches(curves, global_batch):
    """A split of `global_batch` whole samples whose slowest step, on these curves, is
    best_split_step's: each worker takes the most its curve fits under that step, and the
    excess is taken back from whichever worker is then slowest."""
    tables = [_step_table(c, global_batch) for c in curves]
    tau = best_split_step(curves, global_batch, tables)
    batches = [_most_under(t, tau) for t in tables]
    while sum(batches) > global_batch:
        i = max((k for k in range(len(batches)) if batches[k] > 0),
                key=lambda k: tables[k][batches[k]])
        batches[i] -= 1
    return batches


def best_split_time(curve, b):
    """best_split_step's reading of one curve: non-decreasing step time at batch b."""
    return _step_table(curve, b)[b]


def wants_oracles(mode, figures):
    """Whether a cell runs the oracle splits (--grid_oracles): 'all' in every cell, 'misses' only
    where DBS missed the linear-ideal target (`figures`, the cell's figures from its policies'
    runs), which is where they are needed to tell whether any split reaches the ideal on this
    machine; 'none' (or an old record's False) nowhere."""
    if mode in (True, "all"):
        return True
    if mode == "misses":
        return figures["dbs_over_ideal"] > TARGETS["dbs_over_ideal"]
    return False


def ideal_misses_against_splits(done):
    """The cells that miss DBS/ideal, by what the oracle splits run beside DBS gave there:
    (every split run missed the ideal too, a split run met it, no split was run)."""
    limit = TARGETS["dbs_over_ideal"]
    too, met, unrun = [], [], []
    for c in done:
        if c["dbs_over_ideal"] <= limit:
            continue
        runs = [c[f"{label}_over_ideal"] for label in ORACLES if f"{label}_over_ideal" in c]
        (unrun if not runs else too if min(runs) > limit else met).append(c["name"])
    return too, met, unrun


def oracle_weights(label, cell, out):
    """The fixed splits the controller is held against, per worker in launch order:
    split_best, the best split of the standalone curves; split_dbs, the samples each worker
    trained on in the DBS run's last epoch (DBS's own settled split, held still)."""
    if label == "split_best":
        return best_split_batches(cell["standalone_curves"], cell["global_batch"])
    with open(os.path.join(out, cell["runs"]["dbs"]["summary"])) as f:
        summary = json.load(f)
    return [w["samples"] for w in by_launch_index(summary)[-1]]


def epoch_seconds(e):
    """An epoch's training time: from its plan to its last step's update, without validation
    and reports (the ideal counts training only); the wall time for records without it."""
    return e.get("train_seconds") or e["wall_seconds"]


def steady_epoch_seconds(summary):
    """A run's epoch time: the mean training time of epochs 1+ (epoch 0 measures)."""
    return statistics.mean(epoch_seconds(e) for e in summary["epochs"][1:] or summary["epochs"])


def median_run(runs):
    """The run with the median epoch time (the faster of the middle two for an even count)."""
    ordered = sorted(runs, key=lambda x: x["epoch_seconds"])
    return ordered[(len(ordered) - 1) // 2]


def balance(e):
    """(raw compute spread, balance) of one epoch over the workers that trained.

    Raw: max/min of the compute time the workers report. Balance: max/min of the step time the
    server measured for each worker (compute plus its own communication, what the controller
    balances), where a worker counts as fully loaded when one more sample per step would make it
    the slowest: batches are whole samples, and a worker at 4 samples cannot be loaded finer than
    25%."""
    ws = [w for w in e["workers"] if w.get("samples", 0) > 0]
    compute = [w["compute_seconds"] for w in ws]
    raw = max(compute) / max(1e-9, min(compute))
    steps = max(1, e.get("steps", 1))
    times = [(w.get("step_seconds") or w["compute_seconds"], w["samples"] / steps) for w in ws]
    slowest = max(t for t, _ in times)
    loaded = [min(slowest, t * (m + 1) / m) for t, m in times]
    return raw, slowest / max(1e-9, min(loaded))


def noise_floor(s):
    """The balance a split that never moves shows from measurement noise alone, from the fixed
    split's run: each worker's step time in each epoch from SETTLE_EPOCH on, divided by its own
    mean over those epochs; per epoch max/min over the workers; the worst epoch. A controller
    cannot be held to a balance tighter than this on the same machine."""
    late = [e for e in s["epochs"][1:]][SETTLE_EPOCH - 1:] or s["epochs"][-1:]
    ids = [w["id"] for w in late[0]["workers"] if w.get("samples", 0) > 0]
    times = {i: [next(w for w in e["workers"] if w["id"] == i).get("step_seconds") or
                 next(w for w in e["workers"] if w["id"] == i)["compute_seconds"] for e in late]
             for i in ids}
    means = {i: statistics.mean(t) for i, t in times.items()}
    worst = 1.0
    for k in range(len(late)):
        r = [times[i][k] / max(1e-9, means[i]) for i in ids]
        worst = max(worst, max(r) / max(1e-9, min(r)))
    return worst


def outside_compute_cpu(out, cell, policy):
    """Each worker's CPU seconds per step outside its computation (communication, mostly), from
    the workers' own records of epochs 1+, in launch order; None for records without it."""
    per_worker = []
    run_dir = os.path.dirname(cell["runs"][policy]["summary"])  # dbs_r2 with --grid_rounds
    for i in range(len(cell["standalone_speeds"])):
        path = os.path.join(out, run_dir, f"worker-{i}.json")
        try:
            with open(path) as fh:
                epochs = json.load(fh)["epochs"][1:]
        except (OSError, KeyError, ValueError):
            return None
        steps = sum(e.get("outside_compute_cpu_steps", 0) for e in epochs)
        if steps == 0:
            return None
        per_worker.append(sum(e["outside_compute_cpu_seconds"] for e in epochs) / steps)
    return per_worker


def ideal_with_communication_step(speeds, comm_seconds, global_batch):
    """The shortest step T in which the workers, each computing at its standalone speed s_i
    after t_i seconds of its step went to communication, train global_batch samples:
    sum_i s_i * max(0, T - t_i) = B (bisection)."""
    lo, hi = 0.0, max(comm_seconds) + global_batch / min(speeds)
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(s * max(0.0, mid - t) for s, t in zip(speeds, comm_seconds)) >= global_batch:
            hi = mid
        else:
            lo = mid
    return hi


def cell_figures(cell, out):
    f = {}
    runs = {}
    for policy, run in cell["runs"].items():
        with open(os.path.join(out, run["summary"])) as fh:
            runs[policy] = json.load(fh)
    d = cell["train_samples"]
    f["ideal_epoch_seconds"] = d / sum(cell["standalone_speeds"])
    if cell.get("standalone_curves"):
        steps = d // cell["global_batch"]
        f["best_split_epoch_seconds"] = steps * best_split_step(cell["standalone_curves"],
                                                                cell["global_batch"])
    for policy, s in runs.items():
        steady = s["epochs"][1:] or s["epochs"]
        f[f"{policy}_epoch_seconds"] = steady_epoch_seconds(s)
        f[f"{policy}_wall_epoch_seconds"] = statistics.mean(e["wall_seconds"] for e in steady)
        spreads = [balance(e) for e in s["epochs"]]
        f[f"{policy}_compute_spread"] = [raw for raw, _ in spreads]
        f[f"{policy}_spread"] = [b for _, b in spreads]
        late = f[f"{policy}_spread"][SETTLE_EPOCH:] or f[f"{policy}_spread"][-1:]
        f[f"{policy}_settled_spread"] = max(late)
        late = f[f"{policy}_compute_spread"][SETTLE_EPOCH:] or f[f"{policy}_compute_spread"][-1:]
        f[f"{policy}_settled_compute_spread"] = max(late)
        # Where the epoch goes beyond the ideal: the slowest worker's compute (against the
        # ideal, which counts the same compute at standalone speed), and the rest of the epoch
        # (communication, the server's step, the barrier's wait). epoch/ideal is
        # compute_over_ideal / (1 - sync_share).
        slowest = statistics.mean(max(w["compute_seconds"] for w in e["workers"]
                                      if w.get("samples", 0) > 0) for e in steady)
        f[f"{policy}_compute_over_ideal"] = slowest / f["ideal_epoch_seconds"]
        f[f"{policy}_sync_share"] = 1.0 - slowest / f[f"{policy}_epoch_seconds"]
        f[f"{policy}_batches"] = [[w["batch_size"] for w in ws] for ws in by_launch_index(s)]
        f[f"{policy}_revisions"] = [e.get("revisions", 0) for e in s["epochs"]]
        f[f"{policy}_audit_ok"] = all(e["audit"]["every_sample_once"] for e in s["epochs"])
    f["noise_floor"] = noise_floor(runs["fixed"])
    # The linear ideal with what communication costs each worker: its CPU outside the
    # computation per step (as DBS's run measured it), over its share of a core in a quota cell
    # (that CPU runs at the quota too), as it is in a slowdown cell (the slowdown multiplies the
    # computation only). A diagnosis of the gap to the ideal, not a target.
    comm = outside_compute_cpu(out, cell, "dbs")
    if comm is not None and cell.get("shares"):
        f["dbs_comm_cpu_ms_per_step"] = [1e3 * c for c in comm]
        t = [c / q if cell["emulation"] == "quota" else c for c, q in zip(comm, cell["shares"])]
        f["dbs_comm_seconds_per_step"] = t
        f["ideal_with_comm_epoch_seconds"] = (d // cell["global_batch"]) * \
            ideal_with_communication_step(cell["standalone_speeds"], t, cell["global_batch"])
        f["dbs_over_ideal_with_comm"] = (f["dbs_epoch_seconds"] /
                                         f["ideal_with_comm_epoch_seconds"])
    # DBS against fixed splits run for real in the same cell (--grid_oracles): what the best
    # split of the standalone curves, and DBS's own last split held still, give on this machine.
    for label in ORACLES:
        if f"{label}_epoch_seconds" in f:
            f[f"dbs_over_{label}"] = f["dbs_epoch_seconds"] / f[f"{label}_epoch_seconds"]
            f[f"{label}_over_ideal"] = f[f"{label}_epoch_seconds"] / f["ideal_epoch_seconds"]
    # --grid_rounds: each round's DBS and paper against that round's fixed split, run minutes
    # apart at most, so the machine's drift between rounds cancels out of the ratio.
    by_round = {}
    for x in cell.get("rounds", []):
        with open(os.path.join(out, x["summary"])) as fh:
            by_round.setdefault(x["round"], {})[x["policy"]] = steady_epoch_seconds(json.load(fh))
    if len(by_round) > 1:
        for policy in ("dbs", "proportional"):
            ratios = [r[policy] / r["fixed"] for _, r in sorted(by_round.items())]
            f[f"{policy}_over_sgd_by_round"] = ratios
            f[f"{policy}_over_sgd_paired"] = statistics.median(ratios)
    sgd = f["fixed_epoch_seconds"]
    for policy in ("dbs", "proportional"):
        f[f"{policy}_over_sgd"] = f[f"{policy}_epoch_seconds"] / sgd
        f[f"{policy}_over_ideal"] = f[f"{policy}_epoch_seconds"] / f["ideal_epoch_seconds"]
        if "best_split_epoch_seconds" in f:
            f[f"{policy}_over_best"] = (f[f"{policy}_epoch_seconds"] /
                                        f["best_split_epoch_seconds"])
        f[f"{policy}_wall_over_sgd"] = (f[f"{policy}_wall_epoch_seconds"] /
                                        f["fixed_wall_epoch_seconds"])
    return f


def summarize(cells):
    done = [c for c in cells if "runs" in c]
    s = {"cells": len(cells), "cells_run": len(done),
         "cells_skipped": [c["name"] for c in cells if "skipped" in c]}
    if not done:
        return s
    for key in SUMMARY_KEYS:
        if any(key not in c for c in done):
            continue  # a record from before the figure existed
        values = sorted(c[key] for c in done)
        worst = max(done, key=lambda c: c[key])
        s[key] = {"worst": values[-1], "median": statistics.median(values), "best": values[0],
                  "worst_cell": worst["name"]}
    s["dbs_slower_than_fixed"] = [c["name"] for c in done if c["dbs_over_sgd"] >= 1.0]
    s["proportional_slower_than_fixed"] = [c["name"] for c in done
                                           if c["proportional_over_sgd"] >= 1.0]
    s["targets"] = [
        {"figure": "dbs_over_sgd", "limit": TARGETS["dbs_over_sgd"],
         "worst": s["dbs_over_sgd"]["worst"],
         "cells_missing": [c["name"] for c in done if c["dbs_over_sgd"] > TARGETS["dbs_over_sgd"]]},
        {"figure": "dbs_over_ideal", "limit": TARGETS["dbs_over_ideal"],
         "worst": s["dbs_over_ideal"]["worst"],
         "cells_missing": [c["name"] for c in done
                           if c["dbs_over_ideal"] > TARGETS["dbs_over_ideal"]]},
        {"figure": "dbs_over_best", "limit": TARGETS["dbs_over_ideal"],
         "worst": s.get("dbs_over_best", {}).get("worst", float("nan")),
         "cells_missing": [c["name"] for c in done
                           if c.get("dbs_over_best", 0) > TARGETS["dbs_over_ideal"]]},
        {"figure": f"dbs balance from epoch {SETTLE_EPOCH}", "limit": TARGETS["settled_spread"],
         "worst": s["dbs_settled_spread"]["worst"],
         "cells_missing": [c["name"] for c in done
                           if c["dbs_settled_spread"] > TARGETS["settled_spread"]]},
    ]
    (s["ideal_missed_by_every_split_run"], s["ideal_met_by_a_split_run"],
     s["ideal_missed_without_splits_run"]) = ideal_misses_against_splits(done)
    # Misses of the balance target where the machine's own noise is above the target too.
    s["balance_missed_within_noise"] = [
        c["name"] for c in done if c["dbs_settled_spread"] > TARGETS["settled_spread"]
        and c.get("noise_floor", 1.0) > TARGETS["settled_spread"]]
    return s


def build(out):
    """Writes grid.md, grid.json, grid.csv and grid_batches.png from grid_results.json."""
    with open(os.path.join(out, "grid_results.json")) as f:
        results = json.load(f)
    cells = results["cells"]
    for c in cells:
        if "runs" in c:
            c.update(cell_figures(c, out))  # recomputed from the runs' own records
    summary = summarize(cells)
    with open(os.path.join(out, "grid.json"), "w") as f:
        json.dump({"summary": summary, "cells": cells}, f, indent=2)
    write_csv(out, cells)
    lines = intro_lines(results) + cell_rows(cells)
    if summary.get("cells_run"):
        lines += summary_sections(summary, cells, results, out)
    if results.get("note"):  # provenance added to the record by hand
        lines += ["", results["note"]]
    with open(os.path.join(out, "grid.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


GRID_CSV_COLUMNS = ["name", "global_batch", "speeds", "emulation", "ideal_epoch_seconds",
                    "best_split_epoch_seconds", "fixed_epoch_seconds",
                    "proportional_epoch_seconds", "dbs_epoch_seconds", "dbs_over_best",
                    "dbs_over_sgd", "dbs_over_ideal", "proportional_over_sgd",
                    "proportional_over_ideal", "dbs_settled_spread",
                    "proportional_settled_spread", "dbs_settled_compute_spread",
                    "proportional_settled_compute_spread", "dbs_wall_epoch_seconds",
                    "fixed_wall_epoch_seconds", "dbs_wall_over_sgd",
                    "ideal_with_comm_epoch_seconds", "dbs_over_ideal_with_comm"]


def write_csv(out, cells):
    """grid.csv: one row of figures per cell that ran."""
    with open(os.path.join(out, "grid.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(GRID_CSV_COLUMNS)
        for c in cells:
            if "runs" in c:
                w.writerow([c.get(k, "") if not isinstance(c.get(k), float) else f"{c[k]:.4g}"
                            for k in GRID_CSV_COLUMNS])


def intro_lines(results):
    """grid.md's title, what the grid ran, and its table's header."""
    lines = ["# Scenario grid: DBS, the paper's rule and the fixed split", "",
             f"4 workers, CNN on Fashion-MNIST, {results['config']['grid_steps']} steps per epoch "
             f"(D = steps x B), {results['config']['grid_epochs']} epochs, lr "
             f"{results['config']['lr']}, seed {results['config']['seed']}; the quota emulation "
             f"gives the workers CPU quotas in the ratio of the speeds adding up to "
             f"{results['config']['total_cores']:g} core, the slowdown emulation the same shares "
             f"of a core as slowdown factors (1/share): a step's computation takes the factor "
             f"x its CPU time, a wait for a core the other workers hold counting inside it. "
             f"Epoch times are means over epochs 1+ (epoch 0 "
             f"measures) of the training time, from the plan to the last step's update (the "
             f"ideal counts training only; the wall-time ratio, with validation and reports, is "
             f"in its own column). Balance = max/min over the workers of the step time the "
             f"server measured (compute plus the worker's own communication, what the "
             f"controller balances), a worker counting as fully loaded when one more sample per "
             f"step would make it the slowest; compute spread = max/min of the compute time the "
             f"workers report, as measured before. Grid wall time "
             f"{results.get('grid_seconds', 0) / 60:.1f} min."
             + (f" The DBS runs had the extra flags `{results['config']['grid_dbs_flags']}`."
                if results["config"].get("grid_dbs_flags") else ""), "",
             "| cell | ideal s | best split s | S-SGD s | paper s | DBS s | DBS/S-SGD | DBS/ideal "
             "| DBS/best split | paper/S-SGD | paper/ideal | DBS balance from epoch 2 | paper balance from epoch 2 "
             "| DBS compute spread from epoch 2 | DBS/S-SGD wall | noise floor "
             "| DBS slowest compute/ideal | DBS epoch beyond the slowest compute "
             "| workers' CPU outside compute, ms/step | DBS/ideal with that CPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- | --- | --- | --- | --- |"]
    return lines


def cell_rows(cells):
    """grid.md's table: one row per cell."""
    lines = []
    for c in cells:
        if "skipped" in c:
            lines.append(f"| {c['name']} | skipped: {c['skipped']} |||||||||||||||||")
            continue
        lines.append(
            f"| {c['name']} | {c['ideal_epoch_seconds']:.2f} | "
            f"{c.get('best_split_epoch_seconds', float('nan')):.2f} | "
            f"{c['fixed_epoch_seconds']:.2f} | "
            f"{c['proportional_epoch_seconds']:.2f} | {c['dbs_epoch_seconds']:.2f} | "
            f"**{c['dbs_over_sgd']:.3f}** | **{c['dbs_over_ideal']:.3f}** | "
            f"**{c.get('dbs_over_best', float('nan')):.3f}** | "
            f"{c['proportional_over_sgd']:.3f} | {c['proportional_over_ideal']:.3f} | "
            f"{c['dbs_settled_spread']:.2f} | {c['proportional_settled_spread']:.2f} | "
            f"{c['dbs_settled_compute_spread']:.2f} | {c['dbs_wall_over_sgd']:.3f} | "
            f"{c['noise_floor']:.2f} | {c['dbs_compute_over_ideal']:.3f} | "
            f"{100 * c['dbs_sync_share']:.0f}% | "
            + (" ".join(f"{x:.2f}" for x in c["dbs_comm_cpu_ms_per_step"])
               + f" | {c['dbs_over_ideal_with_comm']:.3f} |"
               if "dbs_over_ideal_with_comm" in c else "n/a | n/a |"))
    return lines


def summary_sections(summary, cells, results, out):
    """grid.md after the table: worst and median cells, targets, the oracle splits, the rounds
    and the batch trajectories (and the plot, written to `out`)."""
    lines = []
    lines += ["", "## Worst and median cell", ""] + summary_table(summary)
    lines += ["", f"Cells where DBS was slower than the fixed split: "
              f"{', '.join(summary['dbs_slower_than_fixed']) or 'none'}; the paper's rule: "
              f"{', '.join(summary['proportional_slower_than_fixed']) or 'none'}.", "",
              "## Targets", ""] + targets_table(summary)
    lines += ["", "Noise floor: the balance the fixed split (which never moves) shows from "
              f"epoch {SETTLE_EPOCH} on, each worker's step time divided by its own mean: "
              "what measurement noise alone does to a perfectly static split. Cells that "
              "miss the balance target where the noise floor is above it too: "
              f"{', '.join(summary['balance_missed_within_noise']) or 'none'}.", "",
              "The linear ideal against splits run for real (`--grid_oracles`): cells that "
              "miss DBS/ideal where every split run beside DBS missed it too: "
              f"{', '.join(summary.get('ideal_missed_by_every_split_run', [])) or 'none'}; "
              "where a split run met it: "
              f"{', '.join(summary.get('ideal_met_by_a_split_run', [])) or 'none'}; with no "
              "split run: "
              f"{', '.join(summary.get('ideal_missed_without_splits_run', [])) or 'none'}.",
              "",
              "Where DBS's epoch goes beyond the ideal: DBS/ideal = (slowest compute/ideal) / "
              "(1 - epoch beyond the slowest compute). The first is the slowest worker's "
              "compute in the cluster against the ideal's standalone compute (contention "
              "for the cores, and a split that is not perfectly balanced); the second is "
              "the share of the epoch that is not that compute: communication, the "
              "server's step and the barrier's wait, which no split of the batch removes.",
              "",
              "DBS/ideal with that CPU: the linear ideal if each worker also spends, every "
              "step, the CPU its DBS run measured outside its computation (its own record: "
              "push, answer, loading the parameters), at its quota in a quota cell (1 ms "
              "of CPU at 1/11 core is 11 ms), as it is in a slowdown cell. It says how much "
              "of the gap to the ideal is the data plane's cost per step on the slowest "
              "workers rather than the split; it is a diagnosis, not the target."]
    lines += oracle_lines(cells) + round_lines(cells, results)
    lines += ["", "## Batch trajectories (per epoch, workers in launch order: slowest first)",
              ""]
    for c in cells:
        if "runs" not in c:
            continue
        lines.append(f"- {c['name']}: DBS {fmt_traj(c['dbs_batches'])}, balance "
                     f"{' '.join(f'{x:.2f}' for x in c['dbs_spread'])} (compute "
                     f"{' '.join(f'{x:.2f}' for x in c['dbs_compute_spread'])}); paper "
                     f"{fmt_traj(c['proportional_batches'])}, balance "
                     f"{' '.join(f'{x:.2f}' for x in c['proportional_spread'])}")
    if plot(out, cells):
        lines += ["", "![balance per epoch, every cell](grid_batches.png)"]
    return lines


def oracle_lines(cells):
    """DBS against the fixed splits run beside it (--grid_oracles)."""
    oracle_cells = [c for c in cells if "dbs_over_split_best" in c]
    if not oracle_cells:
        return []
    lines = ["", "## DBS against fixed splits run in the same cell", "",
             "split_best: the best split of the workers' standalone step-time curves, "
             "held fixed (`dbs_ps --policy=fixed --fixed_split`); split_dbs: the "
             "samples each worker trained on in DBS's last epoch, held fixed. Each ran "
             "right after DBS in the cell, with the same emulation. DBS/split near 1: "
             "no split DBS could have chosen does better on this machine.", "",
             "| cell | split_best batches | split_best/ideal | DBS/split_best "
             "| split_dbs/ideal | DBS/split_dbs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in oracle_cells:
        lines.append(
            f"| {c['name']} | {' '.join(str(b) for b in c['split_best_batches'][-1])} | "
            f"{c['split_best_over_ideal']:.3f} | **{c['dbs_over_split_best']:.3f}** | "
            f"{c['split_dbs_over_ideal']:.3f} | **{c['dbs_over_split_dbs']:.3f}** |")
    return lines


def round_lines(cells, results):
    """Each round's DBS and paper over that round's fixed split (--grid_rounds)."""
    round_cells = [c for c in cells if "dbs_over_sgd_by_round" in c]
    if not round_cells:
        return []
    lines = ["", "## Rounds", "",
             f"Each cell ran its policies {results['config']['grid_rounds']} times, in "
             "rounds that alternate their order (fixed, paper, DBS; then DBS, paper, "
             "fixed). The tables above take each policy's median run by epoch time; "
             "here each round's DBS and paper are divided by that round's fixed split "
             "(paired: the machine's drift between rounds cancels), and `paired` is the "
             "median of those ratios.", "",
             "| cell | DBS/S-SGD by round | paired | paper/S-SGD by round | paired |",
             "| --- | --- | --- | --- | --- |"]
    for c in round_cells:
        lines.append(
            f"| {c['name']} | "
            f"{' '.join(f'{x:.3f}' for x in c['dbs_over_sgd_by_round'])} | "
            f"**{c['dbs_over_sgd_paired']:.3f}** | "
            f"{' '.join(f'{x:.3f}' for x in c['proportional_over_sgd_by_round'])} | "
            f"{c['proportional_over_sgd_paired']:.3f} |")
    return lines


def summary_table(summary):
    """The worst, median and best cell of every summary figure, as markdown table lines."""
    lines = ["| figure | worst | median | best | worst cell |", "| --- | --- | --- | --- | --- |"]
    for key in SUMMARY_KEYS:
        if key in summary:
            v = summary[key]
            lines.append(f"| {key} | {v['worst']:.3f} | {v['median']:.3f} | {v['best']:.3f} | "
                         f"{v['worst_cell']} |")
    return lines


def targets_table(summary):
    """Each target's limit, its worst cell's figure and the cells missing it."""
    lines = ["| figure | at most | worst cell | cells missing |", "| --- | --- | --- | --- |"]
    for t in summary["targets"]:
        lines.append(f"| {t['figure']} | {t['limit']} | {t['worst']:.3f} | "
                     f"{', '.join(t['cells_missing']) or 'none'} |")
    return lines


def fmt_traj(batches):
    return " -> ".join("[" + " ".join(str(b) for b in e) + "]" for e in batches)


def plot(out, cells):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [c for c in cells if "runs" in c]
    cols = min(6, len(done))
    rows = (len(done) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.4 * rows), squeeze=False)
    for ax, c in zip(axes.flat, done):
        for policy, style in (("dbs", "-"), ("proportional", ":")):
            traj = c[f"{policy}_spread"]
            ax.plot(range(len(traj)), traj, style, label="DBS" if policy == "dbs" else "paper")
        ax.axhline(TARGETS["settled_spread"], color="grey", lw=0.5)
        ax.set_title(c["name"], fontsize=7)
        ax.set_ylim(1, 3)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(done):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle("balance (max/min step time, one sample allowed) per epoch", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "grid_batches.png"), dpi=80)
    plt.close(fig)
    return True


def check(out):
    """Problems with the grid record (an empty list when it is complete and consistent)."""
    problems = []
    with open(os.path.join(out, "grid.json")) as f:
        grid = json.load(f)
    for c in grid["cells"]:
        if "runs" not in c:
            continue
        for policy in POLICIES + tuple(o for o in ORACLES if f"{o}_batches" in c):
            if not c.get(f"{policy}_audit_ok"):
                problems.append(f"{c['name']} {policy}: a sample audit failed")
            for e, batches in enumerate(c[f"{policy}_batches"]):
                if sum(batches) != c["global_batch"]:
                    problems.append(f"{c['name']} {policy} epoch {e}: batches sum to "
                                    f"{sum(batches)}, not {c['global_batch']}")
        for fixed in ("fixed",) + tuple(o for o in ORACLES if f"{o}_batches" in c):
            if any(b != c[f"{fixed}_batches"][0] for b in c[f"{fixed}_batches"]):
                problems.append(f"{c['name']}: the {fixed} split moved")
    for name in ("grid.md", "grid.csv"):
        if not os.path.exists(os.path.join(out, name)):
            problems.append(f"{name} missing")
    return problems


def combine(out, dirs):
    """One report over the cells of several grid runs: every cell's headline figures, then the
    worst and median cell against the targets (summarize). A cell named twice is refused."""
    cells, sources = [], {}
    for d in dirs:
        with open(os.path.join(d, "grid.json")) as f:
            for c in json.load(f)["cells"]:
                if "runs" not in c:
                    continue
                if c["name"] in sources:
                    sys.exit(f"cell {c['name']} is in both {sources[c['name']]} and {d}")
                sources[c["name"]] = d
                cells.append(c)
    if not cells:
        sys.exit("no cells that ran in " + ", ".join(dirs))
    summary = summarize(cells)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "grid_combined.json"), "w") as f:
        json.dump({"summary": summary, "sources": sources}, f, indent=2)

    def fig(c, key):
        return f"{c[key]:.3f}" if isinstance(c.get(key), (int, float)) else "n/a"

    lines = ["# Scenario grid, combined", "",
             f"{len(cells)} cells from: " + ", ".join(f"`{d}`" for d in dirs), "",
             "| cell | DBS/S-SGD | paired by round | DBS/ideal | best split run/ideal | "
             "DBS/best split run | balance from epoch 2 | paper/S-SGD |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in sorted(cells, key=lambda c: (c["global_batch"], c["speeds"], c["emulation"])):
        lines.append(f"| {c['name']} | {fig(c, 'dbs_over_sgd')} | {fig(c, 'dbs_over_sgd_paired')}"
                     f" | {fig(c, 'dbs_over_ideal')} | {fig(c, 'split_best_over_ideal')} | "
                     f"{fig(c, 'dbs_over_split_best')} | {fig(c, 'dbs_settled_spread')} | "
                     f"{fig(c, 'proportional_over_sgd')} |")
    lines += [""] + summary_table(summary) + [""] + targets_table(summary)
    lines += ["", "Cells where DBS was slower than the fixed split: "
              f"{', '.join(summary['dbs_slower_than_fixed']) or 'none'}."]
    with open(os.path.join(out, "grid_combined.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == ["--combine"]:
        if len(sys.argv) < 4:
            sys.exit("usage: bench/grid.py --combine OUT GRID_DIR [GRID_DIR ...]")
        combine(sys.argv[2], sys.argv[3:])
        print(os.path.join(sys.argv[2], "grid_combined.md"))
        sys.exit(0)
    build(sys.argv[1])
    found = check(sys.argv[1])
    for p in found:
        print(f"INCONSISTENT: {p}")
    sys.exit(1 if found else 0)
