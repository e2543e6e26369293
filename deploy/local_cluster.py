#!/usr/bin/env python3
"""Runs a dbs training job on this machine: one dbs_ps and N dbs_worker processes on loopback.

The parameter server binds a free port chosen at run time (it writes it to a file); workers are
started against it, optionally slowed down to emulate a heterogeneous cluster. Output of every
process is shown with a prefix and kept in --out_dir. On Ctrl-C, on SIGTERM, or when any process
fails, every process is stopped (SIGTERM, then SIGKILL) and the launcher exits non-zero.
At the end it prints the server's summary and leaves the JSON record in --out_dir/summary.json,
and dbs_ps's step trace (a JSON line per step) in --out_dir/steps.jsonl.
Only the Python standard library is used.
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hetero  # noqa: E402  (deploy/hetero.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PR_SET_PDEATHSIG = 1


def die_with_parent():
    """Runs in the child: ask the kernel to SIGTERM it if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def parse_slowdowns(text, workers, quotas_given):
    if not text and not quotas_given:
        # Default: the last worker is three times slower, so DBS has something to balance.
        return [1.0] * (workers - 1) + [3.0] if workers > 1 else [1.0]
    values = hetero.parse_floats(text, workers, "--slowdown", 1.0)
    if any(v < 1.0 for v in values):
        raise ValueError("slowdown factors must be >= 1")
    return values


def find_binary(explicit, bin_dir, rel):
    candidates = [explicit] if explicit else [os.path.join(bin_dir, rel)]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise FileNotFoundError(
        f"{candidates[0]} not found: build it first with "
        "'bazel build //server:dbs_ps //worker:dbs_worker' (or pass --bin_dir)")


class Cluster:
    """Owns the child processes; stop() is safe to call more than once."""

    def __init__(self, out_dir, quiet):
        self.out_dir = out_dir
        self.quiet = quiet
        self.procs = []  # (label, Popen)
        self.threads = []
        self.lock = threading.Lock()
        self.stopping = False

    def start(self, label, argv, cgroup=None):
        log_path = os.path.join(self.out_dir, f"{label}.log")

        def prepare_child():
            die_with_parent()
            if cgroup is not None:
                cgroup.join()

        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=prepare_child)
        t = threading.Thread(target=self._pump, args=(label, proc, log_path), daemon=True)
        t.start()
        with self.lock:
            self.procs.append((label, proc))
            self.threads.append(t)
        self._write_pids()
        return proc

    def _write_pids(self):
        with self.lock:
            pids = {label: p.pid for label, p in self.procs}
        with open(os.path.join(self.out_dir, "pids.json"), "w") as f:
            json.dump(pids, f)

    def _pump(self, label, proc, log_path):
        with open(log_path, "w") as log:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace")
                log.write(line)
                log.flush()
                if not self.quiet:
                    # Worker lines already start with the worker's name.
                    prefix = "[ps] " if label == "ps" else ""
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()

    def stop(self, grace=5.0):
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        for _, p in procs:
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        for _, p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(timeout=2)


def wait_for_port(port_file, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dbs_ps exited with code {proc.returncode} before listening")
        try:
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"dbs_ps did not report its port within {timeout} s")


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--python_workers", type=int, default=0,
                    help="of --workers, how many (the last ones) are Python workers "
                         "(python3 -m dbs.worker) beside the dbs_worker processes")
    ap.add_argument("--python_model", default="",
                    help="the Python workers' model: cnn, mlp or MODULE:FACTORY (default: "
                         "--model; a TorchScript file is the C++ workers' only)")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter of the Python workers (with python3-torch and "
                         "python3-grpcio); it imports dbs as installed, else from this "
                         "checkout (python/ and the stubs of 'bazel build //python:package')")
    ap.add_argument("--slowdown", default="",
                    help="per-worker slowdown factors, comma-separated, or one for all "
                         "(default: the last worker 3x slower, the others 1)")
    ap.add_argument("--cpu_quota", default="",
                    help="per-worker CPU quota in cores (cgroup v1, root), e.g. "
                         "0.125,0.125,0.25,0.5; without root it falls back to slowdown factors")
    ap.add_argument("--cpu_period_ms", type=float, default=0.0,
                    help="with --cpu_quota: the CFS period of every worker's cgroup (100 is the "
                         "kernel's default, which Kubernetes keeps); 0: the shortest the 1 ms "
                         "minimum quota allows, which slows a worker evenly")
    ap.add_argument("--cpu_limit", default="auto",
                    help="dbs_worker --cpu_limit: 'auto' (each worker reads its cgroup's quota and "
                         "reports a step's cost with it), 'none' (elapsed times only) or cores")
    ap.add_argument("--disturb", default="",
                    help="slow worker k by f from epoch e1 to e2: k:e1:e2:f[,k:e1:e2:f...]")
    ap.add_argument("--random_disturb", type=float, default=0.0,
                    help="each epoch, slow a random worker with this probability")
    ap.add_argument("--disturb_factor", type=float, default=3.0)
    ap.add_argument("--disturb_max_epochs", type=int, default=2)
    ap.add_argument("--init_params", default="", help="raw float32 initial parameters")
    ap.add_argument("--replan_window_steps", type=int, default=-1,
                    help="mid-epoch re-planning window in steps (-1: the policy's default, 8 for "
                         "dbs; 0: epoch boundaries only)")
    ap.add_argument("--replan_threshold", type=float, default=1.15,
                    help="re-plan mid-epoch when the slowest worker's recent step time is this "
                         "many times the fastest's")
    ap.add_argument("--wire_dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="how gradients and parameters travel each step (dbs_ps --wire_dtype)")
    ap.add_argument("--deterministic", default="true", choices=["true", "false"],
                    help="sum each step's gradients in worker order (bit-identical reruns)")
    ap.add_argument("--shared_memory", default="true", choices=["true", "false"],
                    help="workers push through memory shared with dbs_ps, not the loopback "
                         "socket (dbs_worker --shared_memory; docs/dataplane.md#shared-memory)")
    ap.add_argument("--ps_shards", type=int, default=1,
                    help="split the model's values across this many dbs_ps processes "
                         "(dbs_ps --shard=i/k; docs/dataplane.md#shards)")
    ap.add_argument("--noise_margin", type=float, default=None,
                    help="dbs: standard deviations of each worker's step time added to its "
                         "step-time curve (dbs_ps --noise_margin; default: dbs_ps's)")
    ap.add_argument("--corrupt_gradient", default="",
                    help="emulate a faulty GPU on the last worker (dbs_worker --corrupt_gradient, "
                         "e.g. nan@50): dbs_ps quarantines it (--faulty_gradients), the worker "
                         "exits and the job goes on without it")
    ap.add_argument("--faulty_gradients", default="evict", choices=["evict", "log", "off"],
                    help="what dbs_ps does about a faulty gradient (dbs_ps --faulty_gradients)")
    ap.add_argument("--faulty_norm_ratio", type=float, default=None,
                    help="dbs_ps --faulty_norm_ratio (default: dbs_ps's)")
    ap.add_argument("--speed_window", type=int, default=1,
                    help="proportional: lowest speed over this many recent epochs")
    ap.add_argument("--min_batch", type=int, default=0, help="dbs: smallest batch per worker")
    ap.add_argument("--max_batch", type=int, default=0,
                    help="dbs: largest batch per worker (0: no limit)")
    ap.add_argument("--worker_max_batch", default="",
                    help="the largest batch each worker computes at once (what its memory "
                         "holds: dbs_worker --max_batch), comma-separated or one for all; a "
                         "larger planned batch is computed as micro-batches; 0: no limit")
    ap.add_argument("--stall_timeout_s", type=float, default=300.0)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--policy", default="dbs", choices=["dbs", "proportional", "fixed"],
                    help="dbs: the converging controller (default); proportional: the paper's "
                         "rule; fixed: the equal split (plain S-SGD)")
    ap.add_argument("--fixed_split", default="",
                    help="with --policy=fixed: each worker's share of every batch, as weights "
                         "per worker (e.g. 1,1,2,4 for worker-0..3) or NAME:WEIGHT pairs "
                         "(dbs_ps --fixed_split)")
    ap.add_argument("--model", default="cnn",
                    help="cnn, mlp, or the path of a TorchScript file (docs/models.md)")
    ap.add_argument("--loss", default="auto",
                    help="auto, cross_entropy, nll or mse (dbs_worker --help)")
    ap.add_argument("--export_path", default="",
                    help="worker-0 writes the trained model here at the end of the job")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train_limit", type=int, default=0, help="0: every training sample")
    ap.add_argument("--test_limit", type=int, default=0, help="0: every test sample")
    ap.add_argument("--data", default="fashion-mnist",
                    help="fashion-mnist[:DIR], idx:DIR, cifar10:DIR or "
                         "npy:TRAIN_X.npy,TRAIN_Y.npy[,TEST_X.npy,TEST_Y.npy] (docs/data.md)")
    ap.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist",
                    help="the folder of --data=fashion-mnist")
    ap.add_argument("--normalize", default="auto",
                    help="auto, none, train or MEAN/STD per channel (dbs_worker --help)")
    ap.add_argument("--threads", type=int, default=1, help="libtorch threads per worker")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--log_every_s", type=float, default=10.0)
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "local_cluster"))
    ap.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--ps_bin", default="")
    ap.add_argument("--worker_bin", default="")
    ap.add_argument("--quiet", action="store_true", help="only log to files and print the summary")
    ap.add_argument("--timeout_s", type=float, default=0, help="stop everything after this long")
    return ap


def resolve_emulation(args):
    """Per-worker slowdown factors, slow windows, CPU quotas and cgroups (None without root)."""
    quotas = hetero.parse_floats(args.cpu_quota, args.workers, "--cpu_quota", 0.0)
    quotas_given = bool(args.cpu_quota)
    slowdowns = parse_slowdowns(args.slowdown, args.workers, quotas_given)
    windows = hetero.parse_disturbance(args.disturb, args.workers)
    if args.random_disturb > 0:
        drawn = hetero.random_disturbances(args.workers, args.epochs, args.random_disturb,
                                           args.disturb_factor, args.disturb_max_epochs,
                                           args.seed)
        windows = [";".join(filter(None, [a, b])) for a, b in zip(windows, drawn)]
    cgroups = [None] * args.workers
    if quotas_given:
        why = hetero.quota_unavailable_reason()
        if why is None:
            tag = f"dbs_{os.getpid()}"
            period_us = 1000 * args.cpu_period_ms if args.cpu_period_ms > 0 else None
            cgroups = []
            try:
                for i, q in enumerate(quotas):
                    cgroups.append(hetero.CpuQuota(f"{tag}_w{i}", q, period_us))
            except ValueError:
                for cg in cgroups:  # the ones made before the bad one
                    cg.remove()
                raise
        else:
            emulated = hetero.quotas_as_slowdowns(quotas)
            slowdowns = [a * b for a, b in zip(slowdowns, emulated)]
            print(f"local_cluster: {why}; emulating the quotas with slowdown factors "
                  f"{','.join(f'{s:.3g}' for s in emulated)}", file=sys.stderr)
    return slowdowns, windows, quotas, cgroups


def ps_argv(args, ps_bin, port_file, summary):
    return [
        ps_bin, "--host=127.0.0.1", "--port=0", f"--port_file={port_file}",
        f"--workers={args.workers}", f"--epochs={args.epochs}",
        f"--global_batch={args.global_batch}", f"--policy={args.policy}",
        f"--optimizer={args.optimizer}", f"--lr={args.lr}", f"--momentum={args.momentum}",
        f"--weight_decay={args.weight_decay}", f"--seed={args.seed}",
        f"--summary_path={summary}", f"--stall_timeout_s={args.stall_timeout_s}",
        f"--speed_window={args.speed_window}", f"--min_batch={args.min_batch}",
        f"--max_batch={args.max_batch}",
        f"--replan_window_steps={args.replan_window_steps}",
        f"--replan_threshold={args.replan_threshold}",
        f"--wire_dtype={args.wire_dtype}", f"--deterministic={args.deterministic}",
        f"--fixed_split={fixed_split_flag(args.fixed_split, args.workers)}",
        f"--faulty_gradients={args.faulty_gradients}"] + (
        [] if args.noise_margin is None else [f"--noise_margin={args.noise_margin}"]) + (
        [] if args.faulty_norm_ratio is None else [f"--faulty_norm_ratio={args.faulty_norm_ratio}"])


def fixed_split_flag(text, workers):
    """dbs_ps --fixed_split from the launcher's: weights per worker (worker-i) or NAME:WEIGHT."""
    if not text:
        return ""
    items = text.split(",")
    if all(":" in x for x in items):
        return text
    if len(items) != workers:
        raise ValueError(f"--fixed_split has {len(items)} weights for {workers} workers")
    return ",".join(f"worker-{i}:{w}" for i, w in enumerate(items))


def worker_max_batch(args):
    """Each worker's --max_batch from --worker_max_batch."""
    values = hetero.parse_floats(args.worker_max_batch, args.workers, "--worker_max_batch", 0)
    if any(v < 0 or v != int(v) for v in values):
        raise ValueError("--worker_max_batch takes whole numbers >= 0")
    return [int(v) for v in values]


def worker_argv(args, worker_bin, servers, i, slowdown, window):
    return [
        worker_bin, f"--server={servers}", f"--name=worker-{i}",
        f"--model={args.model}", f"--device={args.device}",
        f"--data={args.data}", f"--data_dir={args.data_dir}",
        f"--normalize={args.normalize}", f"--train_limit={args.train_limit}",
        f"--test_limit={args.test_limit}", f"--slowdown={slowdown}",
        f"--threads={args.threads}", f"--seed={args.seed}",
        f"--log_every_s={args.log_every_s}",
        f"--record_path={os.path.join(args.out_dir, f'worker-{i}.json')}",
        f"--slow_windows={window}", f"--init_params={args.init_params}",
        f"--loss={args.loss}", f"--cpu_limit={args.cpu_limit}",
        f"--shared_memory={args.shared_memory}",
        f"--max_batch={worker_max_batch(args)[i]}"] + (
            [f"--export_path={args.export_path}"] if args.export_path and i == 0 else []) + (
            [f"--corrupt_gradient={args.corrupt_gradient}"]
            if args.corrupt_gradient and i == args.workers - 1 else [])


def python_worker_argv(args, servers, i, slowdown, window):
    """A Python worker's command line: the flags of dbs_worker's that dbs.worker has too."""
    if window:
        raise ValueError(f"worker-{i} is a Python worker, which does not emulate slow windows "
                         "(--disturb, --random_disturb): make it a dbs_worker")
    return [
        args.python, "-m", "dbs.worker", f"--server={servers}", f"--name=worker-{i}",
        f"--model={args.python_model or args.model}", f"--device={args.device}",
        f"--data={args.data}", f"--data_dir={args.data_dir}",
        f"--normalize={args.normalize}", f"--train_limit={args.train_limit}",
        f"--test_limit={args.test_limit}", f"--slowdown={slowdown}",
        f"--threads={args.threads}", f"--seed={args.seed}",
        f"--log_every_s={args.log_every_s}",
        f"--record_path={os.path.join(args.out_dir, f'worker-{i}.json')}",
        f"--init_params={args.init_params}", f"--loss={args.loss}",
        f"--max_batch={worker_max_batch(args)[i]}"] + (
            [f"--export_path={args.export_path}"] if args.export_path and i == 0 else [])


def python_package_path(python, out_dir):
    """'' when `python` imports dbs already (installed), else a folder holding this checkout's
    package (python/dbs with the stubs bazel generated), for PYTHONPATH."""
    if subprocess.run([python, "-c", "import dbs.client"], capture_output=True).returncode == 0:
        return ""
    stubs = os.path.join(ROOT, "bazel-bin", "python", "dbs", "_proto")
    if not os.path.isfile(os.path.join(stubs, "dbs_pb2.py")):
        raise FileNotFoundError(f"{python} cannot import dbs and {stubs} does not exist: run "
                                "'bazel build //python:package' (or pip install ./python)")
    package = os.path.join(out_dir, "python", "dbs")
    shutil.rmtree(os.path.dirname(package), ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "python", "dbs"), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(stubs, os.path.join(package, "_proto"))
    return os.path.dirname(package)


def describe_emulation(slowdowns, windows, quotas, cgroups):
    described = f"slowdown {','.join(f'{s:.3g}' for s in slowdowns)}"
    if any(cgroups):
        periods = sorted({cg.period_us / 1000 for cg in cgroups})
        described += (f", CPU quota {','.join(f'{q:g}' for q in quotas)} cores over periods of "
                      f"{','.join(f'{p:g}' for p in periods)} ms")
    if any(windows):
        described += f", slow windows {windows}"
    return described


def supervise(everyone, start, timeout_s):
    """Waits until every process has exited and returns [], or returns the reasons to stop the
    cluster: dbs_ps (or a shard) exiting non-zero, a worker exiting 2 (a configuration every
    worker shares), every worker failed while dbs_ps still runs, or time running out. Any other
    worker exit is said once and the job goes on without it, as dbs_ps's failure model has it
    (a quarantined or crashed worker is removed and its samples re-planned)."""
    told = set()
    while True:
        codes = {label: p.poll() for label, p in everyone}
        workers = {label: c for label, c in codes.items() if label.startswith("worker-")}
        for label, c in workers.items():
            if c not in (None, 0, 2) and label not in told:
                told.add(label)
                print(f"local_cluster: {label} exited with code {c} (see {label}.log); the job "
                      "goes on without it", file=sys.stderr, flush=True)
        bad = [f"{label} exited with code {c}" for label, c in codes.items()
               if c not in (None, 0) and (label not in workers or c == 2)]
        if bad:
            return bad
        if all(c is not None for c in codes.values()):
            return []
        if all(c not in (None, 0) for c in workers.values()):
            return ["every worker has failed; dbs_ps has none left to train with"]
        if timeout_s and time.time() - start > timeout_s:
            return [f"timed out after {timeout_s} s"]
        time.sleep(0.1)


def run_cluster(args, ps_bin, worker_bin, emulation, port_file, summary):
    """Starts dbs_ps and the workers, waits for them, stops them all; returns failure reasons."""
    slowdowns, windows, quotas, cgroups = emulation
    cluster = Cluster(args.out_dir, args.quiet)
    failure = []

    def on_signal(signum, _frame):
        failure.append(f"stopped by signal {signum}")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    start = time.time()
    try:
        trace = os.path.join(args.out_dir, "steps.jsonl")
        ps = cluster.start("ps", ps_argv(args, ps_bin, port_file, summary)
                           + [f"--step_trace_path={trace}"]
                           + ([f"--shard=0/{args.ps_shards}"] if args.ps_shards > 1 else []))
        port = wait_for_port(port_file, ps, timeout=30)
        servers = [f"127.0.0.1:{port}"]
        everyone = [("ps", ps)]
        k = args.ps_shards
        for i in range(1, k):
            shard_port = f"{port_file}.{i}"
            if os.path.exists(shard_port):
                os.unlink(shard_port)
            argv = ps_argv(args, ps_bin, shard_port, os.devnull)
            shard = cluster.start(f"ps-{i}", argv + [f"--shard={i}/{k}",
                                                     f"--leader=127.0.0.1:{port}"])
            servers.append(f"127.0.0.1:{wait_for_port(shard_port, shard, timeout=30)}")
            everyone.append((f"ps-{i}", shard))
        print(f"local_cluster: dbs_ps on {', '.join(servers)}; starting {args.workers} workers "
              f"({describe_emulation(*emulation)}); logs in {args.out_dir}", flush=True)
        first_python = args.workers - args.python_workers
        workers = [cluster.start(f"worker-{i}",
                                 worker_argv(args, worker_bin, ",".join(servers), i, slow,
                                             windows[i])
                                 # Under a CPU quota a slow window slows the whole step (its
                                 # time off the CPU is the quota's throttling).
                                 + [f"--slowdown_of={'wall' if cgroups[i] else 'cpu'}"]
                                 if i < first_python else
                                 python_worker_argv(args, ",".join(servers), i, slow, windows[i]),
                                 cgroup=cgroups[i])
                   for i, slow in enumerate(slowdowns)]
        everyone += [(f"worker-{i}", w) for i, w in enumerate(workers)]
        failure.extend(supervise(everyone, start, args.timeout_s))
    except KeyboardInterrupt:
        if not failure:
            failure.append("interrupted (Ctrl-C)")
    except (RuntimeError, ValueError) as e:
        failure.append(str(e))
    finally:
        cluster.stop()
        for cg in cgroups:
            if cg is not None:
                cg.remove()
    return failure


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if not 0 <= args.python_workers <= args.workers:
        ap.error("--python_workers must be in [0, --workers]")
    if not 1 <= args.ps_shards <= 64:
        ap.error("--ps_shards must be in [1, 64]")
    if args.fixed_split and args.policy != "fixed":
        ap.error("--fixed_split needs --policy=fixed")
    try:
        fixed_split_flag(args.fixed_split, args.workers)
        worker_max_batch(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        emulation = resolve_emulation(args)
        ps_bin = find_binary(args.ps_bin, args.bin_dir, "server/dbs_ps")
        worker_bin = find_binary(args.worker_bin, args.bin_dir, "worker/dbs_worker")
        if args.python_workers:
            os.makedirs(args.out_dir, exist_ok=True)
            path = python_package_path(args.python, args.out_dir)
            if path:
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [path, os.environ.get("PYTHONPATH", "")]))
    except (ValueError, FileNotFoundError) as e:
        print(f"local_cluster: {e}", file=sys.stderr)
        return 2

    os.makedirs(args.out_dir, exist_ok=True)
    port_file = os.path.join(args.out_dir, "ps.port")
    summary = os.path.join(args.out_dir, "summary.json")
    for stale in (port_file, summary):
        if os.path.exists(stale):
            os.remove(stale)
    start = time.time()
    failure = run_cluster(args, ps_bin, worker_bin, emulation, port_file, summary)
    wall = time.time() - start
    if failure:
        print(f"local_cluster: FAILED after {wall:.1f} s: {'; '.join(failure)}. "
              f"Logs are in {args.out_dir}.", file=sys.stderr)
        return 1
    with open(summary) as f:
        record = json.load(f)
    quarantined = len(record.get("quarantined", []))
    print(f"local_cluster: done in {wall:.1f} s; final test accuracy "
          f"{100 * record['final_test_accuracy']:.2f}%, test loss "
          f"{record.get('final_test_loss', 0):.4g} after {record['epochs_completed']} "
          f"epochs" + (f", {quarantined} worker(s) quarantined" if quarantined else "") +
          f"; summary in {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
