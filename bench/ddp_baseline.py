#!/usr/bin/python3
"""PyTorch DistributedDataParallel (gloo, CPU) baseline for the dbs benchmark.

Trains the same CNN as dbs_worker (same layer names and order, same initial weights from a raw
float32 file), on the same Fashion-MNIST IDX files, with a fixed batch of B/n per worker, SGD with
momentum. One process per rank; bench/run_bench.py starts them (each in its own CPU-quota cgroup,
when quotas are used). Rank 0 writes a JSON record in the shape of dbs_ps's summary.

Also: `--dump_init=PATH` writes the model's initial parameters (seeded) as raw float32 for both
systems to start from, and exits.

Uses Debian's python3-torch (1.13); run it with /usr/bin/python3.
"""

import argparse
import datetime
import collections
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530  # the same normalisation as dbs_worker


def make_cnn():
    """The layers of dbs_worker's 'cnn' (worker/model.cc), with the same parameter names."""
    return nn.Sequential(collections.OrderedDict([
        ("conv1", nn.Conv2d(1, 16, 5)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 32, 5)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()), ("fc1", nn.Linear(32 * 4 * 4, 64)), ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(64, 10))]))


def load_idx(data_dir, prefix, limit):
    def read(name):
        path = os.path.join(data_dir, name)
        opener = gzip.open if os.path.exists(path + ".gz") else open
        with opener(path + ".gz" if os.path.exists(path + ".gz") else path, "rb") as f:
            return f.read()
    images = read(f"{prefix}-images-idx3-ubyte")
    labels = read(f"{prefix}-labels-idx1-ubyte")
    n, rows, cols = struct.unpack(">III", images[4:16])
    if limit:
        n = min(n, limit)
    x = np.frombuffer(images, dtype=np.uint8, offset=16, count=n * rows * cols)
    y = np.frombuffer(labels, dtype=np.uint8, offset=8, count=n)
    x = torch.from_numpy(x.astype(np.float32).reshape(n, 1, rows, cols) / 255.0)
    return (x - MEAN) / STD, torch.from_numpy(y.astype(np.int64))


def parse_windows(text):
    windows = []
    for part in filter(None, text.split(";")):
        kind, rest = part[0], part[1:]
        b, e, f = rest.split(":")
        windows.append((kind, int(b), int(e), float(f)))
    return windows


def factor_at(base, windows, epoch, step):
    f = base
    for kind, b, e, w in windows:
        at = epoch if kind == "e" else step
        if b <= at < e:
            f *= w
    return f


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump_init", default="", help="write the initial parameters here and exit")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world_size", type=int, default=1)
    ap.add_argument("--master_port", type=int, default=29500)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train_limit", type=int, default=0)
    ap.add_argument("--test_limit", type=int, default=0)
    ap.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--init_params", default="")
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--slow_windows", default="")
    ap.add_argument("--out", default="")
    return ap


def load_init_params(model, path):
    """Overwrites the model's parameters with raw float32 values written in parameter order."""
    flat = torch.from_numpy(np.fromfile(path, dtype="<f4"))
    total = sum(p.numel() for p in model.parameters())
    if flat.numel() != total:
        sys.exit(f"{path} holds {flat.numel()} floats; the model has {total}")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class Trainer:
    """One DDP rank: its data, model, optimizer and emulated slowness."""

    def __init__(self, args, model):
        self.args = args
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(args.master_port)
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                                timeout=datetime.timedelta(seconds=300))
        self.ddp = nn.parallel.DistributedDataParallel(model)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=args.momentum)
        self.train_x, self.train_y = load_idx(args.data_dir, "train", args.train_limit)
        self.test_x, self.test_y = load_idx(args.data_dir, "t10k", args.test_limit)
        self.batch = args.global_batch // args.world_size
        self.sampler = torch.utils.data.distributed.DistributedSampler(
            range(len(self.train_x)), num_replicas=args.world_size, rank=args.rank, shuffle=True,
            seed=args.seed)
        self.windows = parse_windows(args.slow_windows)
        n_test = len(self.test_x)
        self.test_lo = n_test * args.rank // args.world_size
        self.test_hi = n_test * (args.rank + 1) // args.world_size
        self.step = 0

    def train_epoch(self, epoch):
        """Returns (busy seconds, loss sum, samples) of this rank's steps."""
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(self.sampler)))
        busy, loss_sum, samples = 0.0, 0.0, 0
        self.ddp.train()
        for b in range(0, len(order), self.batch):
            idx = order[b:b + self.batch]
            t0, cpu0 = time.time(), time.thread_time()  # one intra-op thread (main)
            out = self.ddp(self.train_x[idx])
            loss = F.cross_entropy(out, self.train_y[idx])
            f = factor_at(self.args.slowdown, self.windows, epoch, self.step)
            if f > 1.0:
                # Emulated slowness, as dbs_worker --slowdown_of=cpu does it: the computation
                # takes f x its CPU time, a wait for a core counting inside that. The forward
                # x 3 stands for forward + backward, which cannot be timed apart from DDP's
                # all-reduce inside backward.
                wall, cpu = time.time() - t0, time.thread_time() - cpu0
                time.sleep(max(0.0, 3.0 * (f * cpu - wall)))
            self.opt.zero_grad()
            loss.backward()  # includes the gloo all-reduce (and waiting for the slowest rank)
            self.opt.step()
            busy += time.time() - t0
            loss_sum += loss.item() * len(idx)
            samples += len(idx)
            self.step += 1
        return busy, loss_sum, samples

    def evaluate(self):
        """Returns (correct, evaluated, seconds) on this rank's slice of the test set."""
        self.ddp.eval()
        t0 = time.time()
        with torch.no_grad():
            logits = self.ddp.module(self.test_x[self.test_lo:self.test_hi])
            correct = (logits.argmax(1) == self.test_y[self.test_lo:self.test_hi]).sum().item()
        return correct, self.test_hi - self.test_lo, time.time() - t0

    def run_epoch(self, epoch, start):
        """Trains and evaluates one epoch; returns its record, gathered from every rank."""
        epoch_start = time.time()
        busy, loss_sum, samples = self.train_epoch(epoch)
        correct, evaluated, eval_s = self.evaluate()
        stats = torch.tensor([correct, evaluated, loss_sum, samples], dtype=torch.float64)
        dist.all_reduce(stats)
        now = time.time()
        mine = {"id": self.args.rank, "batch_size": self.batch, "samples": samples,
                "step_seconds": busy, "eval_seconds": eval_s}
        gathered = [None] * self.args.world_size
        dist.all_gather_object(gathered, mine)
        return {"epoch": epoch, "start_seconds": epoch_start - start,
                "wall_seconds": now - epoch_start,
                "test_accuracy": stats[0].item() / stats[1].item(),
                "train_loss": stats[2].item() / stats[3].item(),
                "workers": gathered}


def main():
    args = build_parser().parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = make_cnn()
    if args.dump_init:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        flat.numpy().astype("<f4").tofile(args.dump_init)
        print(json.dumps({"parameters": int(flat.numel()), "path": args.dump_init}))
        return 0
    if args.init_params:
        load_init_params(model, args.init_params)
    trainer = Trainer(args, model)
    dist.barrier()
    start = time.time()
    epochs = []
    for epoch in range(args.epochs):
        epochs.append(trainer.run_epoch(epoch, start))
        if args.rank == 0:
            print(f"[ddp] epoch {epoch + 1}/{args.epochs} | {epochs[-1]['wall_seconds']:.1f} s | "
                  f"train loss {epochs[-1]['train_loss']:.4f} | test acc "
                  f"{100 * epochs[-1]['test_accuracy']:.2f}%", flush=True)
    wall = time.time() - start
    if args.rank == 0 and args.out:
        record = {"format": "dbs.run_summary.v1", "status": "ok", "policy": "ddp",
                  "workers": args.world_size, "global_batch": trainer.batch * args.world_size,
                  "epochs": epochs, "epochs_completed": len(epochs),
                  "final_test_accuracy": epochs[-1]["test_accuracy"], "wall_seconds": wall}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    dist.barrier()
    # Without this, gloo's threads can outlive the interpreter's teardown and abort the process
    # ("terminate called without an active exception", exit -6) after a run that succeeded, as it
    # did in a CI run. Drop DDP's reducer first, then the process group.
    del trainer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
