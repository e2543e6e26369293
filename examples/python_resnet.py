#!/usr/bin/env python3
"""A mixed job end to end: a ResNet that torch.jit.script cannot compile, trained on
CIFAR-10-format data by 2 Python workers (python3 -m dbs.worker, the nn.Module itself) and 2 C++
workers (dbs_worker, the module's trace), then the trained weights loaded back into the Python
module and scored.

    /usr/bin/python3 examples/python_resnet.py --out_dir=out/python_resnet
    /usr/bin/python3 examples/python_resnet.py --cifar_dir=DIR   # the real CIFAR-10 (binary)

Without --cifar_dir it writes a small CIFAR-10-format data set of its own (coloured patterns,
one per class, with noise). Needs the binaries and the package (bazel build //server:dbs_ps
//worker:dbs_worker //python:package, or pip install ./python). The model's factory is
`python_resnet:make_model` (this file, on PYTHONPATH), which the Python workers import.
"""

import argparse
import functools
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Block(nn.Module):
    """conv-norm-act-conv-norm plus the input; GroupNorm, which behaves the same in training and
    evaluation, so the trace of the module is the module."""

    def __init__(self, channels, act):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, channels)
        self.act = act

    def forward(self, x):
        return self.act(x + self.norm2(self.conv2(self.act(self.norm1(self.conv1(x))))))


class ResNet(nn.Module):
    """A stem, residual stages at 32x32, 16x16 and 8x8, global pooling and a head. The
    activation is a functools.partial held by every block: plain Python that torch.jit.script
    refuses, and the kind of model one does not want to rewrite for TorchScript."""

    def __init__(self, classes=10, width=16, channels=3, slope=0.1):
        super().__init__()
        act = functools.partial(F.leaky_relu, negative_slope=slope)
        self.act = act
        self.stem = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(4, width)
        self.stages = nn.ModuleList([Block(width, act) for _ in range(3)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.act(self.norm(self.stem(x)))
        for i, stage in enumerate(self.stages):
            x = stage(x if i == 0 else F.max_pool2d(x, 2))
        return self.head(x.mean((2, 3)))


def make_model(row_shape=(3, 32, 32), num_classes=10):
    """The factory of `python3 -m dbs.worker --model=python_resnet:make_model`."""
    torch.manual_seed(1)
    return ResNet(classes=max(num_classes, 1), channels=int(row_shape[0]))


def write_cifar_like(folder, train, test, seed=0):
    """A CIFAR-10-format data set (data_batch_1.bin to data_batch_5.bin, test_batch.bin): each
    class a colour and a stripe direction, with noise."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(100, 156, size=(10, 3))
    yy, xx = np.mgrid[0:32, 0:32]
    os.makedirs(folder, exist_ok=True)
    files = [(f"data_batch_{i}.bin", train // 5) for i in range(1, 6)] + [("test_batch.bin", test)]
    for name, n in files:
        labels = rng.integers(0, 10, size=n)
        records = np.zeros((n, 3073), np.uint8)
        for i, c in enumerate(labels):
            stripes = np.sin((xx * np.cos(c * 0.314) + yy * np.sin(c * 0.314)) * 0.8) * 12
            img = palette[c][:, None, None] + stripes[None] + rng.normal(0, 90, (3, 32, 32))
            records[i, 0] = c
            records[i, 1:] = np.clip(img, 0, 255).astype(np.uint8).reshape(-1)
        records.tofile(os.path.join(folder, name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "python_resnet"))
    ap.add_argument("--cifar_dir", default="", help="real CIFAR-10 (binary version)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train_limit", type=int, default=0)
    ap.add_argument("--test_limit", type=int, default=0)
    ap.add_argument("--launcher_args", default="", help="more deploy/local_cluster.py flags")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    data_dir = args.cifar_dir or os.path.join(args.out_dir, "data")
    if not args.cifar_dir:
        write_cifar_like(data_dir, 4000, 1000)

    model = make_model()
    try:
        torch.jit.script(model)
        sys.exit("python_resnet: torch.jit.script compiled the model; it is meant not to")
    except Exception as e:  # noqa: BLE001 - whatever torch.jit.script raises
        print(f"python_resnet: torch.jit.script cannot compile it ({type(e).__name__}); the "
              "C++ workers run its trace", flush=True)
    traced = os.path.join(args.out_dir, "resnet_trace.pt")
    torch.jit.trace(model, torch.zeros(2, 3, 32, 32)).save(traced)

    export = os.path.join(args.out_dir, "trained.pt")
    cluster = os.path.join(args.out_dir, "cluster")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH", "")]))
    launcher = [sys.executable, os.path.join(ROOT, "deploy", "local_cluster.py"),
                "--workers=4", "--python_workers=2", "--slowdown=1,2,1,2",
                f"--model={traced}", "--python_model=python_resnet:make_model",
                f"--data=cifar10:{data_dir}", f"--epochs={args.epochs}", "--global_batch=64",
                f"--train_limit={args.train_limit}", f"--test_limit={args.test_limit}",
                f"--export_path={export}", f"--out_dir={cluster}", "--quiet", "--lr=0.02",
                *args.launcher_args.split()]
    done = subprocess.run(launcher, env=env)
    if done.returncode != 0:
        sys.exit(f"python_resnet: the job failed (exit {done.returncode}); logs in {cluster}")
    with open(os.path.join(cluster, "summary.json")) as f:
        job_accuracy = json.load(f)["final_test_accuracy"]

    # The export (worker 0, a C++ worker) holds the trained network as submodule `model`: its
    # weights go straight back into the Python module, which scores the test set as the job did.
    trained = make_model()
    trained.load_state_dict(torch.jit.load(export).model.state_dict())
    trained.eval()
    # dbs as installed, else the launcher's copy of the checkout's package.
    sys.path.append(os.path.join(cluster, "python"))
    from dbs import data as dbs_data
    d = dbs_data.load(f"cifar10:{data_dir}").limit(args.train_limit, args.test_limit)
    norm = dbs_data.choose_normalization("auto", d)
    with torch.no_grad():
        out = trained(dbs_data.prepare(d.test_x, norm))
    accuracy = float((out.argmax(1) == d.test_y).float().mean())
    print(json.dumps({"job_accuracy": job_accuracy, "reloaded_accuracy": accuracy,
                      "export": export}))


if __name__ == "__main__":
    main()
