#!/usr/bin/python3
"""The dbs heterogeneity benchmark: DBS against fixed-batch S-SGD and PyTorch DDP, one command.

On the same model, data, global batch, learning rate, epochs, seed, initial weights and emulated
heterogeneity (CPU quotas in the ratio --speeds, or slowdown factors where quotas need root), it
runs, one after another on this machine:
  1. each worker's standalone compute speed (dbs_worker --measure_speed_samples), for the ideal
     epoch time D / sum of speeds;
  2. dbs with the fixed equal split (S-SGD);   3. dbs with DBS;
  4. PyTorch DistributedDataParallel (gloo) with B/n per worker (bench/ddp_baseline.py);
  5. and 6. S-SGD and DBS again with one worker slowed --disturb_factor times from epoch
     --disturb_from to --disturb_to, like a background job (or randomly, --random_disturb).
Then bench/report.py writes report.md, report.json and PNG plots into --out_dir.

  /usr/bin/python3 bench/run_bench.py               # full run (minutes)
  /usr/bin/python3 bench/run_bench.py --small       # tiny subset, for CI (well under a minute)
  /usr/bin/python3 bench/run_bench.py --grid        # the scenario grid (bench/grid.py), ~30 min
  /usr/bin/python3 bench/run_bench.py --disturbance # a real burst of load (bench/disturbance.py)
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "deploy"))
sys.path.insert(0, HERE)
import disturbance  # noqa: E402
import grid  # noqa: E402
import hetero  # noqa: E402
import report  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg):
    print(f"[bench] {msg}", flush=True)


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out_dir)
        os.makedirs(os.path.join(self.out, "runs"), exist_ok=True)
        n = args.workers
        speeds = hetero.parse_floats(args.speeds, n, "--speeds", 1.0)
        self.speeds = speeds
        self.quotas = [args.total_cores * s / sum(speeds) for s in speeds]
        why = None if args.no_quota else hetero.quota_unavailable_reason()
        self.use_quota = not args.no_quota and why is None
        if self.use_quota:
            self.slowdowns = [1.0] * n
            self.emulation = ("cpu quota (cgroup v1) of "
                              + ", ".join(f"{q:.3g}" for q in self.quotas) + " cores")
        else:
            self.slowdowns = hetero.quotas_as_slowdowns(self.quotas)
            self.emulation = ("slowdown factors " + ", ".join(f"{s:.3g}" for s in self.slowdowns)
                              + f" ({why or 'quotas disabled'})")
        self.simulator = args.simulator_bin or os.path.join(args.bin_dir, "bench", "dbs_simulator")
        self.ps = args.ps_bin or os.path.join(args.bin_dir, "server", "dbs_ps")
        self.worker = args.worker_bin or os.path.join(args.bin_dir, "worker", "dbs_worker")
        for b in (self.ps, self.worker):
            if not os.access(b, os.X_OK):
                sys.exit(f"{b} not found: bazel build //server:dbs_ps //worker:dbs_worker")
        self.init = os.path.join(self.out, "init_params.f32")
        self.common = ["--epochs", str(args.epochs), "--global_batch", str(args.global_batch),
                       "--lr", str(args.lr), "--seed", str(args.seed),
                       "--train_limit", str(args.train_limit), "--test_limit", str(args.test_limit),
                       "--data_dir", args.data_dir]
        self.results = {"config": vars(args), "emulation": self.emulation,
                        "quotas": self.quotas if self.use_quota else None,
                        "slowdowns": self.slowdowns, "speeds_ratio": speeds, "runs": {}}

    def cgroup(self, tag, i):
        if not self.use_quota:
            return None
        return hetero.CpuQuota(f"dbs_bench_{os.getpid()}_{tag}_{i}", self.quotas[i])

    def spawn(self, argv, cg, **kw):
        def prepare():
            if cg is not None:
                cg.join()
        return subprocess.Popen(argv, preexec_fn=prepare, **kw)

    def dump_init(self):
        subprocess.run([sys.executable, os.path.join(HERE, "ddp_baseline.py"),
                        "--dump_init", self.init, "--seed", str(self.args.seed)],
                       check=True, stdout=subprocess.DEVNULL)

    def standalone_speeds(self):
        n, a = self.args.workers, self.args
        batch = max(1, a.global_batch // n)
        speeds = []
        for i in range(n):
            cg = self.cgroup("speed", i)
            try:
                p = self.spawn([self.worker, f"--measure_speed_samples={a.speed_samples}",
                                f"--measure_batch={batch}", f"--slowdown={self.slowdowns[i]}",
                                f"--data_dir={a.data_dir}", f"--train_limit={a.train_limit}"],
                               cg, stdout=subprocess.PIPE)
                out, _ = p.communicate(timeout=600)
                if p.returncode != 0:
                    sys.exit("standalone speed measurement failed")
                speeds.append(json.loads(out)["samples_per_second"])
            finally:
                if cg:
                    cg.remove()
            log(f"worker {i}: standalone {speeds[-1]:.0f} samples/s")
        self.results["standalone_speeds"] = speeds

    def run_dbs(self, name, policy, windows=None, extra=()):
        a = self.args
        out_dir = os.path.join(self.out, "runs", name)
        argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
                f"--ps_bin={self.ps}", f"--worker_bin={self.worker}", f"--out_dir={out_dir}",
                f"--workers={a.workers}", f"--policy={policy}", "--model=cnn",
                f"--init_params={self.init}", f"--momentum={a.momentum}",
                f"--speed_window={a.speed_window}"] + [f"{k}={v}" for k, v in
                                                        zip(self.common[::2], self.common[1::2])]
        if self.use_quota:
            argv.append("--cpu_quota=" + ",".join(f"{q:.6g}" for q in self.quotas))
        else:
            argv.append("--slowdown=" + ",".join(f"{s:.6g}" for s in self.slowdowns))
        if windows:
            argv.append("--disturb=" + windows)
        argv.extend(extra)
        log(f"run {name}: dbs --policy={policy}" + (f" --disturb={windows}" if windows else ""))
        t0 = time.time()
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            sys.exit(f"run {name} failed:\n{r.stdout}")
        self.results["runs"][name] = {"system": "dbs", "policy": policy, "disturb": windows or "",
                                      "summary": os.path.relpath(
                                          os.path.join(out_dir, "summary.json"), self.out),
                                      "command_seconds": time.time() - t0}
        log(r.stdout.strip().splitlines()[-1])

    def run_ddp(self, name, windows=""):
        a = self.args
        n = a.workers
        port = free_port()
        out = os.path.join(self.out, "runs", name + ".json")
        per_worker = hetero.parse_disturbance(windows, n) if windows else [""] * n
        procs, groups = [], []
        log(f"run {name}: PyTorch DDP (gloo), batch {a.global_batch // n} per worker")
        t0 = time.time()
        try:
            for i in range(n):
                cg = self.cgroup("ddp", i)
                groups.append(cg)
                argv = [sys.executable, os.path.join(HERE, "ddp_baseline.py"), "--rank", str(i),
                        "--world_size", str(n), "--master_port", str(port),
                        "--init_params", self.init, "--momentum", str(a.momentum),
                        "--slowdown", str(self.slowdowns[i]),
                        "--slow_windows", per_worker[i], "--out", out if i == 0 else ""]
                procs.append(self.spawn(argv + self.common_ddp(), cg,
                                        stdout=None if i == 0 else subprocess.DEVNULL))
            codes = [p.wait(timeout=3600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for cg in groups:
                if cg:
                    cg.remove()
        if any(codes):
            sys.exit(f"DDP run failed: exit codes {codes}")
        self.results["runs"][name] = {"system": "ddp", "policy": "ddp", "disturb": windows,
                                      "summary": os.path.relpath(out, self.out),
                                      "command_seconds": time.time() - t0}

    def simulate(self):
        """Scale beyond this machine: the simulator with the measured standalone speeds and the
        measured per-step communication cost (the least time any worker spent in server calls,
        per step: it arrives last and only communicates)."""
        with open(os.path.join(self.out, self.results["runs"]["dbs"]["summary"])) as f:
            dbs = json.load(f)
        eps = dbs["epochs"][1:] or dbs["epochs"]
        per_step = sum(min(w["wait_seconds"] for w in e["workers"]) / e["steps"] for e in eps)
        per_step /= len(eps)
        c1_ms = 1000.0 * per_step / self.args.workers
        out = os.path.join(self.out, "simulation.json")
        argv = [self.simulator, "--speeds=" + ",".join(
                    f"{v:.1f}" for v in self.results["standalone_speeds"]),
                f"--comm_base_ms=0", f"--comm_per_worker_ms={c1_ms:.4f}",
                f"--per_worker_batch={max(1, self.args.global_batch // self.args.workers)}",
                f"--json_out={out}"]
        log(f"simulator: per-step communication {1000 * per_step:.2f} ms measured with "
            f"{self.args.workers} workers, modelled as {c1_ms:.3f} ms per worker")
        r = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit("simulator failed")
        print(r.stdout, end="")
        self.results["simulation"] = {"json": "simulation.json", "comm_per_worker_ms": c1_ms,
                                      "measured_step_comm_ms": 1000 * per_step,
                                      "command": " ".join(argv[:-1])}

    def common_ddp(self):
        a = self.args
        return ["--epochs", str(a.epochs), "--global_batch", str(a.global_batch), "--lr",
                str(a.lr), "--seed", str(a.seed), "--train_limit", str(a.train_limit),
                "--test_limit", str(a.test_limit), "--data_dir", a.data_dir]


def run_grid(args):
    if args.small:
        args.grid_batches, args.grid_speeds, args.grid_emulations = "64", "1:1:2:4,1:1:1:8", "slowdown"
        args.grid_steps, args.grid_epochs, args.grid_test_limit = 12, 3, 128
        args.grid_speed_samples = 128
        args.grid_curve_samples = 64
    if args.grid_rounds < 1:
        sys.exit(f"--grid_rounds must be at least 1, not {args.grid_rounds}")
    ps = args.ps_bin or os.path.join(args.bin_dir, "server", "dbs_ps")
    worker = args.worker_bin or os.path.join(args.bin_dir, "worker", "dbs_worker")
    for b in (ps, worker):
        if not os.access(b, os.X_OK):
            sys.exit(f"{b} not found: bazel build //server:dbs_ps //worker:dbs_worker")
    g = grid.Grid(args, ps, worker)
    log(f"grid: B in {args.grid_batches}, speeds {args.grid_speeds}, emulations "
        f"{args.grid_emulations}; {args.grid_steps} steps x {args.grid_epochs} epochs per run")
    summary = g.run()
    log(f"grid report: {os.path.join(g.out, 'grid.md')}")
    for t in summary.get("targets", []):
        log(f"{t['figure']} <= {t['limit']}: worst {t['worst']:.3f}; cells missing: "
            f"{', '.join(t['cells_missing']) or 'none'}")
    for key in ("dbs_over_sgd", "dbs_over_ideal", "proportional_over_sgd"):
        if key in summary:
            log(f"{key}: worst {summary[key]['worst']:.3f} ({summary[key]['worst_cell']}), "
                f"median {summary[key]['median']:.3f}")
    problems = grid.check(g.out)
    for p in problems:
        log(f"INCONSISTENT: {p}")
    return 1 if problems else 0


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true",
                    help="tiny subset and 2 epochs: checks the harness, not the figures")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speeds", default="1,1,2,4", help="relative worker speeds")
    ap.add_argument("--total_cores", type=float, default=1.0,
                    help="the quotas add up to this many cores")
    ap.add_argument("--no_quota", action="store_true", help="use slowdown factors, not cgroups")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train_limit", type=int, default=12000)
    ap.add_argument("--test_limit", type=int, default=2000)
    ap.add_argument("--speed_samples", type=int, default=2000)
    ap.add_argument("--speed_window", type=int, default=1)
    ap.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--disturb_worker", type=int, default=1)
    ap.add_argument("--disturb_from", type=int, default=2)
    ap.add_argument("--disturb_to", type=int, default=4)
    ap.add_argument("--disturb_factor", type=float, default=3.0)
    ap.add_argument("--random_disturb", type=float, default=0.0,
                    help="instead of the fixed window: each epoch slow a random worker with this "
                         "probability for 1-2 epochs")
    ap.add_argument("--replan_window", type=int, default=4,
                    help="mid-epoch scenario: DBS re-planning window in steps")
    ap.add_argument("--grid", action="store_true",
                    help="run the scenario grid instead (bench/grid.py): DBS, the paper's rule and "
                         "the fixed split over --grid_batches x --grid_speeds x --grid_emulations")
    ap.add_argument("--grid_batches", default="64,128,256")
    ap.add_argument("--grid_speeds", default="1:1:2:4,1:3:3:9,1:1:1:8")
    ap.add_argument("--grid_emulations", default="quota,slowdown")
    ap.add_argument("--grid_steps", type=int, default=32, help="steps per epoch in every cell")
    ap.add_argument("--grid_epochs", type=int, default=5)
    ap.add_argument("--grid_test_limit", type=int, default=500)
    ap.add_argument("--grid_speed_samples", type=int, default=512)
    ap.add_argument("--grid_curve_samples", type=int, default=128,
                    help="samples per batch size of each worker's standalone curve")
    ap.add_argument("--grid_dbs_flags", default="",
                    help="extra launcher flags for the dbs runs, e.g. '--replan_window_steps=0'")
    ap.add_argument("--grid_rounds", type=int, default=1,
                    help="run each cell's policies this many times, in rounds that alternate "
                         "their order; figures come from each policy's median run, and the "
                         "report adds DBS/S-SGD paired round by round (odd counts are best)")
    ap.add_argument("--grid_oracles", nargs="?", const="all", default="none",
                    choices=grid.ORACLE_MODES,
                    help="also run two fixed splits (dbs_ps --fixed_split): the best split of "
                         "the standalone curves and DBS's own last split, so DBS is compared "
                         "with splits run on the same machine; 'all' (the flag alone) in every "
                         "cell, 'misses' only in cells where DBS missed the linear-ideal target")
    ap.add_argument("--skip_ddp", action="store_true")
    ap.add_argument("--skip_disturbance", action="store_true")
    ap.add_argument("--disturbance", action="store_true",
                    help="run the real-disturbance suite instead (bench/disturbance.py, with its "
                         "defaults, into OUT_DIR/disturbance): a busy process in the fastest "
                         "worker's cgroup for 10 s, DBS beside the paper's rule and the fixed "
                         "split; needs root and cgroup v1")
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "bench"))
    ap.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--ps_bin", default="")
    ap.add_argument("--worker_bin", default="")
    ap.add_argument("--simulator_bin", default="")
    return ap


def run_disturbances(bench, args):
    """The disturbed runs: a fixed window of slow epochs (or random ones), then a worker slowed
    from the middle of an epoch with DBS re-planning within epochs."""
    if args.random_disturb > 0:
        per_worker = hetero.random_disturbances(args.workers, args.epochs, args.random_disturb,
                                                args.disturb_factor, 2, args.seed)
        windows = ",".join(f"{k}:{w.split(':')[0][1:]}:{w.split(':')[1]}:{w.split(':')[2]}"
                           for k, ws in enumerate(per_worker) for w in ws.split(";") if w)
    else:
        windows = (f"{args.disturb_worker}:{args.disturb_from}:{args.disturb_to}:"
                   f"{args.disturb_factor:g}")
    bench.results["disturbance"] = windows
    if windows:
        bench.run_dbs("sgd_disturbed", "fixed", windows)
        bench.run_dbs("dbs_disturbed", "dbs", windows)
    # Mid-epoch: the same worker slowed from the middle of an epoch, DBS re-planning within
    # epochs (a window of --replan_window steps).
    steps = -(-(args.train_limit or 60000) // args.global_batch)
    first = steps * args.disturb_from + steps // 2
    mid = f"{args.disturb_worker}:s{first}:{first + 100000}:{args.disturb_factor:g}"
    bench.results["midepoch_disturbance"] = {"worker": args.disturb_worker,
                                             "from_global_step": first,
                                             "steps_per_epoch": steps,
                                             "window": args.replan_window}
    bench.run_dbs("dbs_replan", "dbs", mid, extra=[f"--replan_window_steps={args.replan_window}"])


def write_report(bench):
    """results.json, the report and its consistency checks; the exit status."""
    with open(os.path.join(bench.out, "results.json"), "w") as f:
        json.dump(bench.results, f, indent=2)
    figures = report.build(bench.out)
    problems = report.check(bench.out)
    print(report.console_table(figures))
    log(f"report: {os.path.join(bench.out, 'report.md')}")
    for p in problems:
        log(f"INCONSISTENT: {p}")
    return 1 if problems else 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.grid:
        return run_grid(args)
    if args.disturbance:
        return disturbance.main([f"--out_dir={os.path.join(args.out_dir, 'disturbance')}",
                                 f"--bin_dir={args.bin_dir}"])
    if args.small:
        # Slowdown factors rather than quotas: a worker under a 1/8-core quota alone takes
        # seconds to load libtorch, which is the whole budget of a CI check of the harness.
        args.no_quota = True
        args.epochs, args.train_limit, args.test_limit = 2, 1024, 256
        args.global_batch, args.speed_samples = 64, 256
        args.disturb_from, args.disturb_to = 1, 2

    bench = Bench(args)
    log(f"{args.workers} workers, speeds {args.speeds} emulated by {bench.emulation}; "
        f"{args.epochs} epochs, B={args.global_batch}, D={args.train_limit or 60000}")
    start = time.time()
    bench.dump_init()
    bench.standalone_speeds()
    bench.run_dbs("sgd", "fixed")
    bench.run_dbs("dbs", "dbs")
    if not args.skip_ddp:
        bench.run_ddp("ddp")
    if not args.skip_disturbance:
        run_disturbances(bench, args)
    if os.access(bench.simulator, os.X_OK):
        bench.simulate()
    else:
        log(f"{bench.simulator} not built: skipping the simulation (bazel build //bench:all)")
    bench.results["bench_seconds"] = time.time() - start
    return write_report(bench)


if __name__ == "__main__":
    sys.exit(main())
