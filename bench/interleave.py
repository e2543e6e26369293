#!/usr/bin/env python3
"""Runs one local-cluster job several ways, interleaved, and prints each way's epoch times.

This machine's speed drifts by 1.3-1.9x within an hour, so two ways of running a job compare only
when their runs alternate: every round runs each arm once, in the order given. Each arm is
deploy/local_cluster.py with the common flags plus its own. Epoch time is the mean of epochs 1+
(epoch 0 measures) of the training time in the run's summary.json.

  python3 bench/interleave.py --out_dir=out/interleave --rounds=3 \\
      --common="--workers=4 --epochs=5 --global_batch=64 --train_limit=2048 --slowdown=1,1,2,4" \\
      --arm="dbs=--policy=dbs" --arm="split=--policy=fixed --fixed_split=1,1,2,4"

Writes OUT_DIR/roundR/ARM/ (the launcher's files) and prints one line per run (with the time
left), then each arm's times and median; OUT_DIR/interleave.json is the record of every run and
each arm's median.
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def epoch_time(summary):
    return statistics.mean(e["train_seconds"] for e in summary["epochs"][1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--common", default="", help="local_cluster.py flags every arm gets")
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=FLAGS: one way of running the job (repeat for each)")
    args = ap.parse_args()
    arms = []
    for a in args.arm:
        name, sep, flags = a.partition("=")
        # A name is a directory name: letters, digits, '_', '.', '-', not starting with '-'
        # ('--arm=--policy=dbs' is flags without a name).
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", name):
            sys.exit(f"--arm must be NAME=FLAGS, not {a!r}")
        arms.append((name, shlex.split(flags)))
    if not arms or args.rounds < 1:
        sys.exit("give at least one --arm and --rounds >= 1")
    record = {"common": args.common, "rounds": args.rounds,
              "arms": [{"name": name, "flags": flags, "runs": []} for name, flags in arms]}
    total, done, start = args.rounds * len(arms), 0, time.monotonic()
    for r in range(1, args.rounds + 1):
        for k, (name, flags) in enumerate(arms):
            out = os.path.join(args.out_dir, f"round{r}", name)
            argv = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"), "--quiet",
                    f"--out_dir={out}"] + shlex.split(args.common) + flags
            run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
            if run.returncode != 0:
                sys.exit(f"round {r} arm {name} failed:\n{run.stdout[-3000:]}")
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            t = epoch_time(s)
            revisions = sum(e["revisions"] for e in s["epochs"][1:])
            last = [w["batch_size"]
                    for w in sorted(s["epochs"][-1]["workers"], key=lambda w: w["id"])]
            record["arms"][k]["runs"].append(
                {"round": r, "epoch_seconds": t, "revisions": revisions, "last_split": last,
                 "summary": os.path.relpath(os.path.join(out, "summary.json"), args.out_dir)})
            done += 1
            left = (time.monotonic() - start) / done * (total - done)
            print(f"round{r} {name:15s} epoch {t:.3f} s, revisions in epochs 1+: {revisions}, "
                  f"last split by worker id {last} | run {done}/{total}, ETA {left:.0f} s",
                  flush=True)
    for arm in record["arms"]:
        ts = [run["epoch_seconds"] for run in arm["runs"]]
        arm["median_epoch_seconds"] = statistics.median(ts)
        print(f"{arm['name']:15s} epochs {['%.3f' % t for t in ts]} "
              f"median {arm['median_epoch_seconds']:.3f}")
    path = os.path.join(args.out_dir, "interleave.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
