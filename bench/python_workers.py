#!/usr/bin/env python3
"""Measures Python workers (python3 -m dbs.worker) against dbs_worker, side by side:

1. compute speed: standalone samples/s of the built-in CNN on Fashion-MNIST at the same thread
   count and batch (--measure_speed_samples of each), alternating C++ and Python --rounds times;
2. the CPU a step costs outside its computation (push, answer, loading the parameters), from the
   records of a 2-worker job of one C++ and one Python worker;
3. DBS with a Python worker: a job of two workers of speeds 1 and 1/2 (dbs_worker --slowdown=2
   and dbs.worker --slowdown=2), all-C++ and with the slow worker a Python one, alternating
   --rounds times: the step time max/min across workers of each epoch from the second (each
   worker's steps as dbs_ps times them, what DBS balances), the compute max/min beside it, the
   slow worker's samples per second of its steps in the job, and each job's mean epoch time
   from the second against the all-C++ job of its round.

  /usr/bin/python3 bench/python_workers.py --out_dir=out/python_workers --rounds=3

Needs the binaries and the package's stubs (bazel build //server:dbs_ps //worker:dbs_worker
//python:package). Writes OUT_DIR/python_workers.json (every measurement and a summary).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "deploy"))
import local_cluster  # noqa: E402  (deploy/local_cluster.py)

PYTHON = "/usr/bin/python3"


def speed(argv):
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_second"]


def measure_speeds(args, env):
    flags = [f"--measure_speed_samples={args.samples}", f"--measure_batch={args.batch}",
             f"--threads={args.threads}"]
    cpp = [os.path.join(ROOT, "bazel-bin", "worker", "dbs_worker")] + flags
    py = [PYTHON, "-m", "dbs.worker"] + flags
    rounds = []
    for r in range(args.rounds):
        c = speed(cpp)
        p = subprocess.run(py, capture_output=True, text=True, check=True, env=env, timeout=600)
        p = json.loads(p.stdout.strip().splitlines()[-1])["samples_per_second"]
        rounds.append({"cpp": c, "python": p, "ratio": p / c})
        print(f"speed round {r + 1}: C++ {c:.0f}, Python {p:.0f} samples/s: "
              f"{p / c:.3f}x", flush=True)
    return rounds


def job(args, name, python_workers, env):
    out = os.path.join(args.out_dir, name)
    argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
            f"--out_dir={out}", "--workers=2", "--slowdown=1,2",
            f"--python_workers={python_workers}", f"--epochs={args.epochs}",
            f"--global_batch={args.global_batch}", f"--train_limit={args.train_limit}",
            "--test_limit=2000", f"--threads={args.threads}", "--log_every_s=60"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    later = s["epochs"][1:]

    def slow(epoch):  # the worker of speed 1/2: the smaller share
        return min(epoch["workers"], key=lambda w: w["samples"])

    def spread(key):
        return [max(w[key] for w in e["workers"]) / min(w[key] for w in e["workers"])
                for e in later]
    outside = {}
    for w in range(2):
        with open(os.path.join(out, f"worker-{w}.json")) as f:
            epochs = json.load(f)["epochs"]
        steps = sum(e["outside_compute_cpu_steps"] for e in epochs)
        outside[f"worker-{w}"] = 1e3 * sum(e["outside_compute_cpu_seconds"]
                                           for e in epochs) / max(steps, 1)
    return {"name": name, "python_workers": python_workers,
            "epoch_seconds": statistics.mean(e["wall_seconds"] for e in later),
            "balance": spread("step_seconds"), "compute_balance": spread("compute_seconds"),
            "accuracy": s["final_test_accuracy"],
            "slow_worker_samples_per_s": sum(slow(e)["samples"] for e in later) /
            sum(slow(e)["step_seconds"] for e in later),
            "outside_cpu_ms_per_step": outside}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "python_workers"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=12800, help="samples of a speed measurement")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--train_limit", type=int, default=12000)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    env = dict(os.environ)
    path = local_cluster.python_package_path(PYTHON, args.out_dir)
    if path:
        env["PYTHONPATH"] = path
    start = time.monotonic()
    speeds = measure_speeds(args, env)
    jobs = []
    for r in range(args.rounds):
        pair = [job(args, f"cpp-{r}", 0, env), job(args, f"mixed-{r}", 1, env)]
        pair[1]["epoch_time_vs_cpp"] = pair[1]["epoch_seconds"] / pair[0]["epoch_seconds"]
        for j in pair:
            print(f"{j['name']}: epoch {j['epoch_seconds']:.2f} s, from epoch 2 step time max/min "
                  f"{', '.join(f'{b:.2f}' for b in j['balance'])} (compute "
                  f"{', '.join(f'{b:.2f}' for b in j['compute_balance'])}), accuracy "
                  f"{j['accuracy']:.4f}, CPU outside compute ms/step "
                  f"{j['outside_cpu_ms_per_step']}", flush=True)
        jobs += pair
    mixed = [j for j in jobs if j["python_workers"]]
    cpp = [j for j in jobs if not j["python_workers"]]
    ratios = sorted(s["ratio"] for s in speeds)
    summary = {
        "speed_ratio_median": statistics.median(ratios), "speed_ratio_worst": ratios[0],
        "speed_ratio_best": ratios[-1],
        "mixed_balance_worst": max(max(j["balance"]) for j in mixed),
        "cpp_balance_worst": max(max(j["balance"]) for j in cpp),
        "mixed_balance_epochs": sorted(b for j in mixed for b in j["balance"]),
        "mixed_compute_balance_worst": max(max(j["compute_balance"]) for j in mixed),
        "cpp_compute_balance_worst": max(max(j["compute_balance"]) for j in cpp),
        "mixed_epoch_time_vs_cpp": sorted(j["epoch_time_vs_cpp"] for j in mixed),
        "slow_worker_samples_per_s_cpp": statistics.median(
            j["slow_worker_samples_per_s"] for j in cpp),
        "slow_worker_samples_per_s_python": statistics.median(
            j["slow_worker_samples_per_s"] for j in mixed),
        "outside_cpu_ms_per_step_cpp": statistics.median(
            j["outside_cpu_ms_per_step"]["worker-0"] for j in mixed),
        "outside_cpu_ms_per_step_python": statistics.median(
            j["outside_cpu_ms_per_step"]["worker-1"] for j in mixed),
        "seconds": round(time.monotonic() - start, 1),
    }
    with open(os.path.join(args.out_dir, "python_workers.json"), "w") as f:
        json.dump({"args": vars(args), "speeds": speeds, "jobs": jobs, "summary": summary}, f,
                  indent=2)
    print(f"Python/C++ compute speed (batch {args.batch}, {args.threads} thread): median "
          f"{summary['speed_ratio_median']:.3f}x, worst {summary['speed_ratio_worst']:.3f}x "
          f"over {args.rounds} rounds")
    print(f"CPU outside compute per step: C++ {summary['outside_cpu_ms_per_step_cpp']:.3f} ms, "
          f"Python {summary['outside_cpu_ms_per_step_python']:.3f} ms")
    print(f"mixed job from epoch 2: step time max/min at worst "
          f"{summary['mixed_balance_worst']:.2f} (all-C++ {summary['cpp_balance_worst']:.2f}), "
          f"compute max/min at worst {summary['mixed_compute_balance_worst']:.2f} (all-C++ "
          f"{summary['cpp_compute_balance_worst']:.2f}); epoch time against the all-C++ job "
          f"{', '.join(f'{x:.3f}' for x in summary['mixed_epoch_time_vs_cpp'])}")
    print(f"the slow worker's samples/s over its steps in the job (median): C++ "
          f"{summary['slow_worker_samples_per_s_cpp']:.0f}, Python "
          f"{summary['slow_worker_samples_per_s_python']:.0f}")
    print(f"record: {os.path.join(args.out_dir, 'python_workers.json')}")


if __name__ == "__main__":
    main()
