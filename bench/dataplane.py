#!/usr/bin/env python3
"""The data-plane benchmark: one synchronous step of dbs_ps against gloo all_reduce, same machine.

For each model size it starts dbs_ps (--workers=4, fixed split, one epoch; for the /Kshards
variants K of them, --shard=i/K) on a loopback port it
picks itself, runs bench/dataplane_client (4 fake workers using the workers' own C++ client: push a
gradient, receive the parameters) and reads the step time, the server's CPU and page faults per
step and its peak RSS; then it runs PyTorch's gloo all_reduce among 4 processes of the same size.
Both sides run --rounds times, interleaved, so that both see the same machine; the report quotes
the median over rounds of each round's median step (and the spread).

  python3 bench/dataplane.py --out_dir=out/dataplane                      # 46,730 .. 25M
  python3 bench/dataplane.py --sizes=46730,1000000 --rounds=1 --steps=5   # quick look

Writes dataplane.json (every round's figures), dataplane.md (the table) and dataplane.png.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_SIZES = "46730,1000000,10000000,25000000"
DEFAULT_VARIANTS = "fp32,fp32/shm,bf16,bf16/shm,fp32/arrival,fp32/2shards,bf16/2shards"

GLOO_WORKER = r"""
import os, sys, time, json, statistics
import torch, torch.distributed as dist
rank, world, port, n, warmup, steps = (int(a) for a in sys.argv[1:7])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
t = torch.full((n,), 1e-3 * (rank + 1), dtype=torch.float32)
times = []
for s in range(warmup + steps):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    t.div_(world)
    if s >= warmup:
        times.append(time.perf_counter() - t0)
# A step ends for everyone when the slowest rank is done.
gathered = [None] * world
dist.all_gather_object(gathered, times)
if rank == 0:
    per_step = [max(g[i] for g in gathered) for i in range(steps)]
    print(json.dumps({"step_ms_median": 1e3 * statistics.median(per_step),
                      "step_ms_min": 1e3 * min(per_step), "step_ms_max": 1e3 * max(per_step)}))
dist.destroy_process_group()
"""


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ps(argv, port_file):
    """Starts one dbs_ps; returns (process, port) once it serves."""
    ps = subprocess.Popen(argv + [f"--port_file={port_file}"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while not os.path.exists(port_file):
        if ps.poll() is not None or time.time() > deadline:
            ps.kill()
            raise RuntimeError("dbs_ps did not start: " + ps.stderr.read().decode()[-2000:])
        time.sleep(0.05)
    return ps, open(port_file).read().strip()


def run_dbs(args, n, variant):
    """One dbs_ps (or, for a variant like 'fp32/2shards', that many shards) and the client."""
    wire_dtype, *modes = variant.split("/")
    shards = next((int(m[:-len("shards")]) for m in modes if m.endswith("shards")), 1)
    ps_bin, client_bin = args.ps_bin, args.client_bin
    with tempfile.TemporaryDirectory(prefix="dbs_dataplane_") as tmp:
        ps_argv = [ps_bin, "--host=127.0.0.1", "--port=0",
                   f"--workers={args.clients}", f"--global_batch={args.clients}", "--epochs=1",
                   "--policy=fixed", "--metrics_port=-1", "--checkpoint_dir=",
                   "--max_message_mb=2047", "--stall_timeout_s=600", "--worker_timeout_s=600"]
        ps_argv.append(f"--wire_dtype={wire_dtype}")
        ps_argv.append(f"--deterministic={'false' if 'arrival' in modes else 'true'}")
        every = next((int(m[len("ckpt"):]) for m in modes if m.startswith("ckpt")), 0)
        if every:
            ps_argv += [f"--checkpoint_dir={os.path.join(tmp, 'ckpt')}",
                        f"--checkpoint_every_steps={every}"]
        procs = []
        try:
            leader, port = start_ps(
                ps_argv + [f"--summary_path={os.path.join(tmp, 'summary.json')}",
                           f"--shard=0/{shards}"], os.path.join(tmp, "port"))
            procs.append(leader)
            servers = [f"127.0.0.1:{port}"]
            for i in range(1, shards):
                p, shard_port = start_ps(
                    ps_argv + ["--summary_path=", f"--shard={i}/{shards}",
                               f"--leader=127.0.0.1:{port}"], os.path.join(tmp, f"port{i}"))
                procs.append(p)
                servers.append(f"127.0.0.1:{shard_port}")
            client = subprocess.run(
                [client_bin, f"--server={','.join(servers)}", f"--clients={args.clients}",
                 f"--params={n}", f"--warmup={args.warmup}", f"--steps={args.steps}",
                 f"--server_pid={','.join(str(p.pid) for p in procs)}",
                 f"--shared_memory={'true' if 'shm' in modes else 'false'}"],
                capture_output=True, text=True, timeout=1800)
            if client.returncode != 0:
                raise RuntimeError(f"dataplane_client failed ({client.returncode}): "
                                   f"{client.stderr[-2000:]}")
            return json.loads(client.stdout.strip().splitlines()[-1])
        finally:
            for p in procs:
                p.kill()
                p.wait()


def run_gloo(args, n):
    port = free_port()
    procs = [subprocess.Popen([args.python, "-c", GLOO_WORKER, str(r), str(args.clients), str(port),
                               str(n), str(args.warmup), str(args.steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(args.clients)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"gloo rank failed: {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def median_of(rounds, key):
    return statistics.median(r[key] for r in rounds)


def wire_width(variant):
    """Bytes per value on the wire for a variant such as bf16/shm."""
    return 2 if variant.split("/")[0] in ("bf16", "fp16") else 4


def summarize(results, clients):
    rows = []
    for key, entry in results.items():
        gloo = median_of(entry["gloo"], "step_ms_median")
        dbs = entry["dbs"]
        step = median_of(dbs, "step_ms_median")
        worst = max(r["step_ms_median"] for r in dbs)
        rows.append({
            "params": entry["params"], "wire_dtype": entry["wire_dtype"],
            "dbs_step_ms": step, "dbs_step_ms_worst_round": worst,
            "gloo_step_ms": gloo,
            "gloo_step_ms_spread": [min(r["step_ms_median"] for r in entry["gloo"]),
                                    max(r["step_ms_median"] for r in entry["gloo"])],
            "ratio": step / gloo,
            "server_cpu_ms_per_step": median_of(dbs, "server_cpu_ms_per_step"),
            "server_faults_per_step": median_of(dbs, "server_faults_per_step"),
            "server_faults_per_step_second_half": median_of(
                dbs, "server_faults_per_step_second_half"),
            "server_peak_rss_mib": max(r["server_peak_rss_bytes"] for r in dbs) / 2**20,
            "server_shared_rss_mib": max(r.get("server_shared_rss_bytes", 0) for r in dbs) / 2**20,
            "model_mib": entry["params"] * 4 / 2**20,
            # What of the peak is the clients' own gradient regions, mapped to be read (/shm).
            "client_regions_mib": (clients * entry["params"] * wire_width(entry["wire_dtype"])
                                   / 2**20 if "shm" in entry["wire_dtype"].split("/") else 0),
            "client_cpu_ms_per_step": median_of(dbs, "client_cpu_ms_per_step"),
        })
        rows[-1]["server_own_peak_mib"] = (rows[-1]["server_peak_rss_mib"]
                                           - rows[-1]["client_regions_mib"])
    return rows


def table(rows, clients, rounds):
    lines = [f"{clients} clients on loopback, median over {rounds} round(s) of each round's median "
             "step; gloo = PyTorch all_reduce among the same number of processes, same run. "
             "Sum: in worker order (deterministic, the default) unless marked /arrival. Each "
             "push and each answer is one message on the client's push session. /2shards: the "
             "model split across 2 dbs_ps processes (--shard=i/2); their CPU, faults and peak "
             "RSS are summed. /shm: the clients push through memory shared with dbs_ps (a "
             "worker's default on the server's host); without it over the loopback socket, as "
             "between hosts. Modes combine (bf16/shm/2shards). Faults/step: over all timed "
             "steps, and over their second half alone (the server's receive buffers grow over "
             "a large model's first steps). Peak RSS: VmHWM; in brackets, where not 0, what of "
             "it is shared memory at the end (RssShmem: the parameter slots, which in fp32 are the "
             "store's snapshots, and with /shm the clients' gradient regions) and, with /shm, the "
             "peak less the clients' regions (the server's own).", "",
             "| parameters | wire / sum | dbs_ps step ms | gloo ms | ratio | server CPU ms/step "
             "| faults/step (2nd half) | server peak RSS MiB (model MiB) | client CPU ms/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['params']:,} | {r['wire_dtype']} | {r['dbs_step_ms']:.1f} "
            f"(worst round {r['dbs_step_ms_worst_round']:.1f}) | {r['gloo_step_ms']:.1f} | "
            f"{r['ratio']:.2f}x | {r['server_cpu_ms_per_step']:.1f} | "
            f"{r['server_faults_per_step']:.0f} "
            f"({r['server_faults_per_step_second_half']:.0f}) | {r['server_peak_rss_mib']:.0f} "
            + (f"[shared {r['server_shared_rss_mib']:.0f}"
               + (f"; own {r['server_own_peak_mib']:.0f}" if r.get('client_regions_mib') else "")
               + "] " if r.get('server_shared_rss_mib') else "")
            + f"({r['model_mib']:.1f}) | {r['client_cpu_ms_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib in this python: no plot (run with /usr/bin/python3)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for dtype in sorted({r["wire_dtype"] for r in rows}):
        pts = [r for r in rows if r["wire_dtype"] == dtype]
        ax.plot([r["params"] for r in pts], [r["dbs_step_ms"] for r in pts], "o-",
                label=f"dbs_ps ({dtype} on the wire)")
    gl = sorted({(r["params"], r["gloo_step_ms"]) for r in rows if r["wire_dtype"] == "fp32"})
    ax.plot([p for p, _ in gl], [g for _, g in gl], "s--", label="gloo all_reduce (fp32)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("one synchronous step, ms (median)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="model sizes in floats, comma-separated")
    p.add_argument("--variants", default=None,
                   help="comma-separated wire dtypes (fp32, bf16, fp16), each over the socket "
                        "and summed in worker order (deterministic, the default), or with "
                        "/arrival summed on arrival, /shm pushed through memory shared with "
                        "dbs_ps, /Kshards split across K dbs_ps processes, /ckptN with a "
                        "checkpoint every N steps (what checkpointing costs a step: compare "
                        "the mean step); modes combine (bf16/shm/2shards); default: "
                        + DEFAULT_VARIANTS)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--warmup", type=int, default=60,
                   help="untimed steps first: at 10M parameters the server's heap grows for "
                        "about 50 steps while gRPC widens its flow-control windows, and the "
                        "timed steps should see the working set, not its growth")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="dbs and gloo runs per size, interleaved")
    p.add_argument("--no_gloo", action="store_true", help="skip gloo (no python3-torch)")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "out", "dataplane"))
    p.add_argument("--ps_bin", default=os.path.join(ROOT, "bazel-bin", "server", "dbs_ps"))
    p.add_argument("--client_bin",
                   default=os.path.join(ROOT, "bazel-bin", "bench", "dataplane_client"))
    p.add_argument("--python", default="/usr/bin/python3", help="a python3 with torch (gloo)")
    args = p.parse_args()
    if args.variants is None:
        args.variants = DEFAULT_VARIANTS
    for b in (args.ps_bin, args.client_bin):
        if not os.path.exists(b):
            sys.exit(f"{b} is missing: bazel build //server:dbs_ps //bench:dataplane_client")
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = args.variants.split(",")
    for v in dtypes:
        wire, *modes = v.split("/")
        kinds = [re.sub(r"[0-9]+", "", m) for m in modes]
        if wire not in ("fp32", "bf16", "fp16") or len(set(kinds)) < len(kinds) or not all(
                re.fullmatch(r"arrival|shm|[1-9][0-9]*shards|ckpt[1-9][0-9]*", m) for m in modes):
            sys.exit(f"unknown variant '{v}': a wire dtype (fp32, bf16, fp16), optionally with "
                     "/arrival, /shm, /Kshards and /ckptN, each at most once (bf16/shm/2shards)")
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    total = len(sizes) * args.rounds
    done = 0
    start = time.time()
    for n in sizes:
        for rnd in range(args.rounds):
            gloo = None if args.no_gloo else run_gloo(args, n)
            for dtype in dtypes:
                entry = results.setdefault(f"{n}/{dtype}", {"params": n, "wire_dtype": dtype,
                                                            "dbs": [], "gloo": []})
                entry["dbs"].append(run_dbs(args, n, dtype))
                if gloo is not None:
                    entry["gloo"].append(gloo)
                d = entry["dbs"][-1]
                print(f"[{done + 1}/{total}] {n:>10,} params {dtype} round {rnd + 1}: dbs "
                      f"{d['step_ms_median']:.1f} ms/step (mean {d['wall_ms_per_step']:.1f}, "
                      f"longest {d['step_ms_max']:.1f}; server CPU "
                      f"{d['server_cpu_ms_per_step']:.1f} ms, "
                      f"{d['server_faults_per_step']:.0f} faults, "
                      f"{d['server_faults_per_step_second_half']:.0f} in the second half)"
                      + (f", gloo {gloo['step_ms_median']:.1f} ms" if gloo else "")
                      + f" | {time.time() - start:.0f} s elapsed", flush=True)
            done += 1
            elapsed = time.time() - start
            print(f"  ETA {elapsed / done * (total - done):.0f} s", flush=True)
    record = {"clients": args.clients, "steps": args.steps, "rounds": args.rounds,
              "results": list(results.values())}
    if not args.no_gloo:
        rows = summarize(results, args.clients)
        record["summary"] = rows
        text = table(rows, args.clients, args.rounds)
        with open(os.path.join(args.out_dir, "dataplane.md"), "w") as f:
            f.write(text)
        plot(rows, os.path.join(args.out_dir, "dataplane.png"))
        print(text)
    with open(os.path.join(args.out_dir, "dataplane.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"written to {args.out_dir}/dataplane.json")


if __name__ == "__main__":
    main()
