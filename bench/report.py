#!/usr/bin/python3
"""Builds the benchmark report (report.md, report.json, PNG plots) from run_bench.py's results,
and checks that it is complete and self-consistent.

  /usr/bin/python3 bench/report.py out/bench       # rebuild and check
"""

import json
import os
import sys

TARGETS = {
    "dbs_over_ideal": 1.10,
    "dbs_over_sgd": 0.60,
    "dbs_time_to_ddp_accuracy_ratio": 0.60,
    "max_barrier_wait_fraction": 0.05,
    "disturbance_added_ratio": 0.50,
    "accuracy_gap_pp": 0.5,
}


def load(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    results["_out_dir"] = out_dir
    runs = {}
    for name, run in results["runs"].items():
        with open(os.path.join(out_dir, run["summary"])) as f:
            runs[name] = json.load(f)
    return results, runs


def by_launch_index(summary):
    """Per epoch, the workers in launch order (dbs ids follow registration order)."""
    order = {}
    for w in summary.get("worker_info", []):
        if w["name"].startswith("worker-"):
            order[w["id"]] = int(w["name"].split("-")[1])
    out = []
    for e in summary["epochs"]:
        ws = sorted(e["workers"], key=lambda w: order.get(w["id"], w["id"]))
        out.append(ws)
    return out


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def steady(summary):
    """Epochs after the first (the first DBS epoch is the equal split that measures speeds)."""
    eps = summary["epochs"]
    return eps[1:] if len(eps) > 1 else eps


def end_times(summary):
    """When each epoch ended, in seconds from the start of the first epoch (so start-up, data
    loading and registration are left out for every system alike)."""
    t0 = summary["epochs"][0]["start_seconds"]
    return [e["start_seconds"] + e["wall_seconds"] - t0 for e in summary["epochs"]]


def compute(results, runs):
    f = {"emulation": results["emulation"], "workers": results["config"]["workers"],
         "epochs": results["config"]["epochs"], "global_batch": results["config"]["global_batch"]}
    sgd, dbs = runs["sgd"], runs["dbs"]
    d = sum(w["samples"] for w in sgd["epochs"][0]["workers"])
    f["train_samples"] = d
    speeds = results["standalone_speeds"]
    f["standalone_speeds"] = speeds
    f["ideal_epoch_seconds"] = d / sum(speeds)
    f["sgd_epoch_seconds"] = mean(e["wall_seconds"] for e in steady(sgd))
    f["dbs_epoch_seconds"] = mean(e["wall_seconds"] for e in steady(dbs))
    f["dbs_over_ideal"] = f["dbs_epoch_seconds"] / f["ideal_epoch_seconds"]
    f["dbs_over_sgd"] = f["dbs_epoch_seconds"] / f["sgd_epoch_seconds"]
    f["sgd_over_ideal"] = f["sgd_epoch_seconds"] / f["ideal_epoch_seconds"]
    # Time in server calls = per-step communication + waiting at the barrier. The worker that
    # arrives last at every step waits only for communication, so the barrier part of worker i
    # is its time in calls minus the smallest of the epoch.
    calls, barrier = [], []
    for e in steady(dbs):
        low = min(w["wait_seconds"] for w in e["workers"])
        for w in e["workers"]:
            calls.append(w["wait_seconds"] / e["wall_seconds"])
            barrier.append((w["wait_seconds"] - low) / e["wall_seconds"])
    f["max_call_fraction"] = max(calls)
    f["max_barrier_wait_fraction"] = max(barrier)
    f["sgd_max_barrier_wait_fraction"] = max(
        (w["wait_seconds"] - min(x["wait_seconds"] for x in e["workers"])) / e["wall_seconds"]
        for e in steady(sgd) for w in e["workers"])
    # Why an epoch is longer than the ideal: per-step communication that no split can move.
    steps = dbs["epochs"][0]["steps"]
    comm = mean(min(w["wait_seconds"] for w in e["workers"]) / e["steps"] for e in steady(dbs))
    f["steps_per_epoch"] = steps
    f["step_comm_seconds"] = comm
    f["dbs_epoch_without_comm_seconds"] = f["dbs_epoch_seconds"] - steps * comm
    f["sgd_epoch_without_comm_seconds"] = f["sgd_epoch_seconds"] - steps * comm
    f["dbs_without_comm_over_ideal"] = f["dbs_epoch_without_comm_seconds"] / f["ideal_epoch_seconds"]
    f["dbs_over_sgd_without_comm"] = (f["dbs_epoch_without_comm_seconds"] /
                                      f["sgd_epoch_without_comm_seconds"])
    f["barrier_wait_ms_per_step"] = 1000 * f["max_barrier_wait_fraction"] * f["dbs_epoch_seconds"] / steps
    n_test = sum(w["test_samples"] for w in dbs["epochs"][-1]["workers"])
    p_acc = dbs["final_test_accuracy"]
    f["test_samples"] = n_test
    f["accuracy_standard_error_pp"] = 100 * (p_acc * (1 - p_acc) / max(1, n_test)) ** 0.5
    if "dbs_disturbed" in runs:
        f["dbs_run_to_run_accuracy_pp"] = 100 * abs(
            runs["dbs_disturbed"]["final_test_accuracy"] - dbs["final_test_accuracy"])
    f["sgd_final_accuracy"] = sgd["final_test_accuracy"]
    f["dbs_final_accuracy"] = dbs["final_test_accuracy"]
    f["accuracy_gap_pp"] = abs(dbs["final_test_accuracy"] - sgd["final_test_accuracy"]) * 100
    f["sgd_wall_seconds"] = end_times(sgd)[-1]
    f["dbs_wall_seconds"] = end_times(dbs)[-1]
    if "ddp" in runs:
        ddp_figures(f, runs["ddp"], dbs)
    if "dbs_replan" in runs:
        midepoch_figures(f, results)
    if "sgd_disturbed" in runs:
        disturbance_figures(f, results, runs)
    return f


def ddp_figures(f, ddp, dbs):
    """DDP's accuracy and time, and when DBS reached DDP's final accuracy."""
    target = ddp["final_test_accuracy"]
    f["ddp_final_accuracy"] = target
    f["ddp_wall_seconds"] = end_times(ddp)[-1]
    f["ddp_epoch_seconds"] = mean(e["wall_seconds"] for e in steady(ddp))
    reached = [t for t, e in zip(end_times(dbs), dbs["epochs"])
               if e["test_accuracy"] >= target]
    f["dbs_time_to_ddp_accuracy"] = reached[0] if reached else None
    f["dbs_time_to_ddp_accuracy_ratio"] = (reached[0] / f["ddp_wall_seconds"]
                                           if reached else None)


def midepoch_figures(f, results):
    """Where DBS re-planned within epochs after the mid-epoch slowdown began (from ps.log)."""
    mid = results["midepoch_disturbance"]
    log_path = os.path.join(results["_out_dir"], os.path.dirname(
        results["runs"]["dbs_replan"]["summary"]), "ps.log")
    replans = []  # global steps after which the rest of an epoch was re-planned
    with open(log_path) as fh:
        for line in fh:
            if " re-planned after step " in line:
                e = int(line.split("epoch ")[1].split()[0]) - 1
                s = int(line.split("re-planned after step ")[1].split(":")[0])
                replans.append(e * mid["steps_per_epoch"] + s)
    after = [g for g in replans if g > mid["from_global_step"]]
    f["midepoch_replans"] = replans
    f["midepoch_window"] = mid["window"]
    f["midepoch_replan_delay_steps"] = (after[0] - mid["from_global_step"]) if after else None


def disturbance_figures(f, results, runs):
    """What the disturbance window added to each policy's time, and the compute spreads."""
    sgd, dbs = runs["sgd"], runs["dbs"]
    f["disturbance"] = results.get("disturbance", "")
    add_sgd = end_times(runs["sgd_disturbed"])[-1] - end_times(sgd)[-1]
    add_dbs = end_times(runs["dbs_disturbed"])[-1] - end_times(dbs)[-1]
    f["sgd_disturbance_added_seconds"] = add_sgd
    f["dbs_disturbance_added_seconds"] = add_dbs
    f["disturbance_added_ratio"] = add_dbs / add_sgd if add_sgd > 0 else None
    spreads = [e["compute_seconds_max_over_min"] for e in runs["dbs_disturbed"]["epochs"]]
    f["dbs_disturbed_compute_spread"] = spreads
    f["sgd_disturbed_compute_spread"] = [
        e["compute_seconds_max_over_min"] for e in runs["sgd_disturbed"]["epochs"]]


def verdicts(f):
    rows = []
    for key, limit in TARGETS.items():
        value = f.get(key)
        if value is None:
            rows.append((key, limit, None, "not measured"))
            continue
        ok = value <= limit
        rows.append((key, limit, value,
                     "met" if ok else f"missed by {value - limit:.3g} ({value / limit:.2f}x)"))
    return rows


def plots(out_dir, results, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    n = results["config"]["workers"]
    speeds = results["speeds_ratio"]
    labels = [f"worker {i} (speed {speeds[i]:g})" for i in range(n)]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for col, name in enumerate(("sgd", "dbs")):
        per_epoch = by_launch_index(runs[name])
        epochs = range(1, len(per_epoch) + 1)
        for i in range(n):
            axes[0][col].plot(epochs, [ws[i]["compute_seconds"] for ws in per_epoch], "o-",
                              label=labels[i])
            axes[1][col].plot(epochs, [ws[i]["batch_size"] for ws in per_epoch], "o-",
                              label=labels[i])
        axes[0][col].plot(epochs, [e["wall_seconds"] for e in runs[name]["epochs"]], "k--",
                          label="epoch wall time")
        title = "S-SGD (fixed split)" if name == "sgd" else "DBS"
        axes[0][col].set_title(f"{title}: compute time per epoch")
        axes[1][col].set_title(f"{title}: batch size")
        axes[1][col].set_xlabel("epoch")
    axes[0][0].set_ylabel("seconds")
    axes[1][0].set_ylabel("samples per step")
    axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "worker_times.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"sgd": "dbs S-SGD (fixed)", "dbs": "dbs DBS", "ddp": "PyTorch DDP (gloo)"}
    for name, label in names.items():
        if name in runs:
            ax.plot(end_times(runs[name]), [e["test_accuracy"] * 100 for e in runs[name]["epochs"]],
                    "o-", label=label)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy against wall time")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "accuracy_vs_time.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)

    if "sgd_disturbed" in runs:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, style in (("sgd", "C0--"), ("sgd_disturbed", "C0o-"), ("dbs", "C1--"),
                            ("dbs_disturbed", "C1o-")):
            eps = runs[name]["epochs"]
            axes[0].plot(range(1, len(eps) + 1), [e["wall_seconds"] for e in eps], style,
                         label=name.replace("sgd", "S-SGD").replace("dbs", "DBS"))
        disturb = results.get("disturbance", "")
        for part in filter(None, disturb.split(",")):
            k, e1, e2, fac = part.split(":")
            for ax in axes:
                ax.axvspan(int(e1) + 0.5, int(e2) + 0.5, color="grey", alpha=0.2)
        axes[0].set_title(f"Epoch wall time; shaded: slowed ({disturb})")
        axes[0].set_xlabel("epoch")
        axes[0].set_ylabel("seconds")
        axes[0].legend(fontsize=8)
        per_epoch = by_launch_index(runs["dbs_disturbed"])
        for i in range(n):
            axes[1].plot(range(1, len(per_epoch) + 1), [ws[i]["batch_size"] for ws in per_epoch],
                         "o-", label=labels[i])
        axes[1].set_title("DBS batch sizes under the disturbance")
        axes[1].set_xlabel("epoch")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "disturbance.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def fmt(v, digits=3):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def out_dir_of(results):
    return results["_out_dir"]


def simulation_lines(f, results):
    """The simulated larger clusters (f gets their rows)."""
    with open(os.path.join(out_dir_of(results), results["simulation"]["json"])) as fh:
        sim = json.load(fh)
    lines = ["", "## Beyond one machine (simulation)", "",
             "The real scheduler and allocator on a simulated clock, replaying the measured "
             "standalone speeds (repeated to n workers) and the measured per-step "
             f"communication ({fmt(results['simulation']['measured_step_comm_ms'])} ms with "
             f"{f['workers']} workers, modelled as "
             f"{fmt(results['simulation']['comm_per_worker_ms'])} ms per worker at the "
             "server); per-worker batch fixed, so the global batch grows with n.", "",
             "| workers | global batch | ideal s | S-SGD s | DBS s | DBS / S-SGD | comm per step ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sim:
        lines.append(f"| {r['workers']} | {r['global_batch']} | {fmt(r['ideal_epoch_seconds'])} "
                     f"| {fmt(r['sgd_epoch_seconds'])} | {fmt(r['dbs_epoch_seconds'])} | "
                     f"{fmt(r['dbs_over_sgd'])} | {fmt(1000 * r['step_comm_seconds'])} |")
    f["simulation"] = sim
    return lines


def misses_lines(f):
    """What keeps DBS from the ideal, each cause measured."""
    return ["", "## Why the misses (measured)", "",
            f"- Per-step communication: the worker that arrives last at a step only "
            f"communicates, and spent {fmt(1000 * f['step_comm_seconds'])} ms per step in server "
            f"calls; {f['steps_per_epoch']} steps make {fmt(f['steps_per_epoch'] * f['step_comm_seconds'])} s "
            f"of every epoch that no batch split can move (the 1/8-core worker's gRPC work is "
            f"throttled too). Without it DBS takes {fmt(f['dbs_epoch_without_comm_seconds'])} s, "
            f"{fmt(f['dbs_without_comm_over_ideal'])}x the ideal, and "
            f"{fmt(f['dbs_over_sgd_without_comm'])}x S-SGD's "
            f"{fmt(f['sgd_epoch_without_comm_seconds'])} s.",
            f"- Barrier wait: the largest is {fmt(f['barrier_wait_ms_per_step'])} ms per step, "
            f"about one CFS period of the 1/8-core worker (8 ms), consistent with a worker that "
            f"has used its quota sleeping to the end of the period.",
            f"- Accuracy: {f['test_samples']} test images give a standard error of "
            f"{fmt(f['accuracy_standard_error_pp'])} pp; the two DBS runs (undisturbed and "
            f"disturbed, so with different splits) "
            + (f"ended {fmt(f['dbs_run_to_run_accuracy_pp'])} pp apart."
               if "dbs_run_to_run_accuracy_pp" in f else "were not compared.")]


def markdown(f, results, runs, written):
    lines = ["# dbs heterogeneity benchmark", ""]
    c = results["config"]
    lines += [f"{f['workers']} workers with relative speeds {c['speeds']} emulated by "
              f"{f['emulation']}; CNN on {f['train_samples']} Fashion-MNIST images, "
              f"{f['epochs']} epochs, global batch {f['global_batch']}, SGD lr {c['lr']} momentum "
              f"{c['momentum']}, seed {c['seed']}, the same initial weights for every system.",
              "", "## Epoch time", "",
              "| | seconds per epoch (epochs 2+) | vs ideal |", "| --- | --- | --- |",
              f"| ideal: D / sum of standalone speeds ({', '.join(f'{s:.0f}' for s in f['standalone_speeds'])} samples/s) | "
              f"{fmt(f['ideal_epoch_seconds'])} | 1 |",
              f"| dbs S-SGD (fixed split) | {fmt(f['sgd_epoch_seconds'])} | {fmt(f['sgd_over_ideal'])} |",
              f"| dbs DBS | {fmt(f['dbs_epoch_seconds'])} | {fmt(f['dbs_over_ideal'])} |"]
    if "ddp_epoch_seconds" in f:
        lines.append(f"| PyTorch DDP | {fmt(f['ddp_epoch_seconds'])} | "
                     f"{fmt(f['ddp_epoch_seconds'] / f['ideal_epoch_seconds'])} |")
    lines += ["", f"DBS / S-SGD epoch time: **{fmt(f['dbs_over_sgd'])}**; DBS / ideal: "
              f"**{fmt(f['dbs_over_ideal'])}**.", "",
              "## Accuracy", "", "| system | final test accuracy | wall time (s) |",
              "| --- | --- | --- |",
              f"| dbs S-SGD | {f['sgd_final_accuracy'] * 100:.2f}% | {fmt(f['sgd_wall_seconds'])} |",
              f"| dbs DBS | {f['dbs_final_accuracy'] * 100:.2f}% | {fmt(f['dbs_wall_seconds'])} |"]
    if "ddp_final_accuracy" in f:
        lines.append(f"| PyTorch DDP | {f['ddp_final_accuracy'] * 100:.2f}% | "
                     f"{fmt(f['ddp_wall_seconds'])} |")
        lines += ["", "DBS reached DDP's final accuracy after "
                  f"{fmt(f['dbs_time_to_ddp_accuracy'])} s, "
                  f"{fmt(f['dbs_time_to_ddp_accuracy_ratio'])}x DDP's time."]
    lines += ["", "## Waiting", "",
              f"Largest share of an epoch a DBS worker spent inside server calls: "
              f"{fmt(f['max_call_fraction'])} (per-step communication included); of it, waiting "
              f"for other workers at the step barrier: {fmt(f['max_barrier_wait_fraction'])} "
              f"(S-SGD: {fmt(f['sgd_max_barrier_wait_fraction'])})."]
    if "disturbance" in f:
        lines += ["", "## Disturbance", "",
                  f"Slow window (worker:first epoch:end epoch:factor, epochs from 0): "
                  f"`{f['disturbance']}`. Time added to the run: S-SGD "
                  f"{fmt(f['sgd_disturbance_added_seconds'])} s, DBS "
                  f"{fmt(f['dbs_disturbance_added_seconds'])} s (ratio "
                  f"{fmt(f['disturbance_added_ratio'])}). Compute-time spread (max/min) per epoch, "
                  f"DBS: {', '.join(fmt(s) for s in f['dbs_disturbed_compute_spread'])}; S-SGD: "
                  f"{', '.join(fmt(s) for s in f['sgd_disturbed_compute_spread'])}."]
    if "simulation" in results:
        lines += simulation_lines(f, results)
    if "midepoch_replan_delay_steps" in f:
        lines += ["", "## Mid-epoch re-planning", "",
                  f"Worker {results['midepoch_disturbance']['worker']} slowed from global step "
                  f"{results['midepoch_disturbance']['from_global_step'] + 1} (the middle of an "
                  f"epoch), DBS with a {f['midepoch_window']}-step re-planning window: re-planned "
                  f"after {fmt(f['midepoch_replan_delay_steps'])} slowed steps."]
    lines += misses_lines(f)
    lines += ["", "## Targets", "", "| figure | target (at most) | measured | verdict |",
              "| --- | --- | --- | --- |"]
    for key, limit, value, verdict in verdicts(f):
        lines.append(f"| {key} | {limit} | {fmt(value)} | {verdict} |")
    lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                      for p in written]
    return "\n".join(lines) + "\n"


def console_table(f):
    rows = [("ideal epoch (s)", f["ideal_epoch_seconds"]), ("S-SGD epoch (s)", f["sgd_epoch_seconds"]),
            ("DBS epoch (s)", f["dbs_epoch_seconds"]), ("DBS / ideal", f["dbs_over_ideal"]),
            ("DBS / S-SGD", f["dbs_over_sgd"]), ("accuracy gap (pp)", f["accuracy_gap_pp"])]
    if "ddp_epoch_seconds" in f:
        rows += [("DDP epoch (s)", f["ddp_epoch_seconds"]),
                 ("DBS time to DDP acc / DDP time", f["dbs_time_to_ddp_accuracy_ratio"])]
    if "disturbance_added_ratio" in f:
        rows += [("disturbance added DBS/S-SGD", f["disturbance_added_ratio"])]
    return "\n".join(f"  {k:32s} {fmt(v, 4)}" for k, v in rows)


def build(out_dir):
    results, runs = load(out_dir)
    f = compute(results, runs)
    written = plots(out_dir, results, runs)
    md = markdown(f, results, runs, written)
    f["targets"] = [{"figure": k, "limit": lim, "value": v, "verdict": verdict}
                    for k, lim, v, verdict in verdicts(f)]
    f["plots"] = [os.path.basename(p) for p in written]
    with open(os.path.join(out_dir, "report.json"), "w") as fh:
        json.dump(f, fh, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as fh:
        fh.write(md)
    return f


def check(out_dir):
    """Problems with the report: missing workers or epochs, times that do not add up, samples not
    used exactly once per epoch, missing plots. An empty list means complete and consistent."""
    problems = []
    results, runs = load(out_dir)
    n, epochs = results["config"]["workers"], results["config"]["epochs"]
    with open(os.path.join(out_dir, "report.json")) as fh:
        rep = json.load(fh)
    d = rep["train_samples"]
    for name, s in runs.items():
        if s["status"] != "ok":
            problems.append(f"{name}: status {s['status']}")
        if len(s["epochs"]) != epochs:
            problems.append(f"{name}: {len(s['epochs'])} of {epochs} epochs")
        for e in s["epochs"]:
            ws = e["workers"]
            if sorted(w["id"] for w in ws) != list(range(n)):
                problems.append(f"{name} epoch {e['epoch']}: workers {[w['id'] for w in ws]}")
            if results["runs"][name]["system"] == "dbs":
                if sum(w["samples"] for w in ws) != d:
                    problems.append(f"{name} epoch {e['epoch']}: samples do not add up to {d}")
                if sum(w["batch_size"] for w in ws) != results["config"]["global_batch"]:
                    problems.append(f"{name} epoch {e['epoch']}: batches do not sum to B")
                for w in ws:
                    spent = w["compute_seconds"] + w["wait_seconds"] + w["eval_seconds"]
                    if spent > e["wall_seconds"] * 1.05 + 0.5:
                        problems.append(f"{name} epoch {e['epoch']} worker {w['id']}: "
                                        f"{spent:.2f} s accounted in a {e['wall_seconds']:.2f} s epoch")
            if e["wall_seconds"] <= 0:
                problems.append(f"{name} epoch {e['epoch']}: no wall time")
        times = end_times(s)
        if any(b < a for a, b in zip(times, times[1:])):
            problems.append(f"{name}: epoch end times go backwards")
        span = s["wall_seconds"] - s["epochs"][0]["start_seconds"]
        if abs(times[-1] - span) > max(2.0, 0.1 * span):
            problems.append(f"{name}: epochs end at {times[-1]:.1f} s, run wall {s['wall_seconds']:.1f} s")
    for p in rep["plots"]:
        if not os.path.getsize(os.path.join(out_dir, p)) > 1000:
            problems.append(f"plot {p} missing or empty")
    for key in ("ideal_epoch_seconds", "dbs_over_ideal", "dbs_over_sgd"):
        if not rep.get(key, 0) > 0:
            problems.append(f"figure {key} missing")
    return problems


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out", "bench")
    print(console_table(build(out)))
    issues = check(out)
    for i in issues:
        print("INCONSISTENT:", i)
    sys.exit(1 if issues else 0)
