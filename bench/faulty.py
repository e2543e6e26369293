#!/usr/bin/env python3
"""Measures how a job contains a worker whose GPU goes bad (dbs_ps --faulty_gradients).

Runs local-cluster jobs of 4 workers (the built-in CNN, Fashion-MNIST): first --clean_runs jobs
without a fault (seeds 1, 2, ...), which count false alarms (a worker quarantined, or a push
found faulty); then, for each corruption in --faults, --fault_runs jobs whose last worker
corrupts every gradient from its step --from_step on (dbs_worker --corrupt_gradient), each
paired with the clean job of the same seed. For each it prints and records: whether the job
completed, at which step the worker was quarantined (or not), the samples re-assigned, whether
every sample was trained on once, and the final accuracy against the paired clean job's.

  python3 bench/faulty.py --out_dir=out/faulty --clean_runs=20 --fault_runs=2

Writes OUT_DIR/<run>/ (the launcher's files) and OUT_DIR/faulty.json (every run and a summary).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = "nan,scale:1000,bitflip,scale:10,sign"


def run_job(args, name, seed, fault):
    out = os.path.join(args.out_dir, name)
    argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
            f"--out_dir={out}", "--workers=4", "--slowdown=1", f"--epochs={args.epochs}",
            f"--global_batch={args.global_batch}", f"--train_limit={args.train_limit}",
            f"--seed={seed}", "--log_every_s=60"]
    if fault:
        argv.append(f"--corrupt_gradient={fault}@{args.from_step}")
    start = time.monotonic()
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = {"name": name, "seed": seed, "fault": fault, "exit": done.returncode,
           "seconds": round(time.monotonic() - start, 1)}
    try:
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        run["status"] = "no summary: " + done.stdout[-500:]
        return run
    steps = s["epochs"][0]["steps"] if s["epochs"] else 0
    run.update(status=s["status"], accuracy=s["final_test_accuracy"],
               every_sample_once=all(e["audit"]["every_sample_once"] for e in s["epochs"]),
               faulty_pushes=s["faulty_pushes"],
               quarantined=[{"step": q["epoch"] * steps + q["step"],
                             "samples_reassigned": q["samples_reassigned"],
                             "reason": q["reason"]} for q in s["quarantined"]])
    return run


def describe(run, clean):
    if "accuracy" not in run:
        return f"{run['name']}: {run['status']}"
    q = run["quarantined"]
    caught = (f"quarantined at step {q[0]['step']} ({q[0]['step'] - run['from_step']} after its "
              f"first bad push), {q[0]['samples_reassigned']} samples re-assigned"
              if q else "not quarantined")
    delta = ""
    if clean is not None and "accuracy" in clean:
        delta = f" (clean {100 * clean['accuracy']:.2f}%, {100 * (run['accuracy'] - clean['accuracy']):+.2f} pp)"
    return (f"{run['name']}: {run['status']}, {caught}, every sample once "
            f"{run['every_sample_once']}, accuracy {100 * run['accuracy']:.2f}%{delta}, "
            f"{run['seconds']} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "faulty"))
    ap.add_argument("--clean_runs", type=int, default=20)
    ap.add_argument("--fault_runs", type=int, default=2, help="jobs per corruption")
    ap.add_argument("--faults", default=FAULTS, help=f"corruptions, comma-separated ({FAULTS})")
    ap.add_argument("--from_step", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--train_limit", type=int, default=12000)
    args = ap.parse_args()
    if args.clean_runs < args.fault_runs:
        sys.exit("--clean_runs must be at least --fault_runs (each faulty job has a clean pair)")
    os.makedirs(args.out_dir, exist_ok=True)
    record = {"args": vars(args), "clean": [], "faulty": []}
    for seed in range(1, args.clean_runs + 1):
        run = run_job(args, f"clean-{seed}", seed, "")
        record["clean"].append(run)
        print(describe(run, None), flush=True)
    for fault in args.faults.split(","):
        for seed in range(1, args.fault_runs + 1):
            run = run_job(args, f"{fault.replace(':', '')}-{seed}", seed, fault)
            run["from_step"] = args.from_step
            record["faulty"].append(run)
            print(describe(run, record["clean"][seed - 1]), flush=True)
    clean_ok = [r for r in record["clean"] if "accuracy" in r]
    summary = {
        "clean_jobs": len(record["clean"]),
        "clean_jobs_ok": sum(r["status"] == "ok" for r in clean_ok),
        "false_quarantines": sum(len(r["quarantined"]) for r in clean_ok),
        "clean_faulty_pushes": sum(r["faulty_pushes"] for r in clean_ok),
        "clean_accuracy_median": statistics.median(r["accuracy"] for r in clean_ok)
        if clean_ok else None,
        "by_fault": {},
    }
    for fault in args.faults.split(","):
        runs = [r for r in record["faulty"] if r["fault"] == fault and "accuracy" in r]
        summary["by_fault"][fault] = {
            "jobs": len(runs),
            "completed": sum(r["status"] == "ok" for r in runs),
            "quarantined": sum(bool(r["quarantined"]) for r in runs),
            "steps_to_quarantine": [r["quarantined"][0]["step"] - args.from_step
                                    for r in runs if r["quarantined"]],
            "accuracy_delta_pp": [round(100 * (r["accuracy"] - record["clean"][r["seed"] - 1]
                                               ["accuracy"]), 2) for r in runs],
        }
    record["summary"] = summary
    with open(os.path.join(args.out_dir, "faulty.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
