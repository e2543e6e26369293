"""Evaluates a model dbs_worker exported (--export_path) on the first N Fashion-MNIST test
images, the way the job did, and prints the accuracy. Run with Debian's python3 (python3-torch):

    /usr/bin/python3 tests/eval_export.py script|cnn|mlp PATH N
"""

import gzip
import os
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn

DATA = "/usr/share/datasets/fashion-mnist"


def builtin(name):
    """The built-in models as PyTorch modules with dbs's parameter names (docs/models.md)."""
    if name == "mlp":
        layers = [("flatten", nn.Flatten()), ("fc1", nn.Linear(784, 256)), ("relu1", nn.ReLU()),
                  ("fc2", nn.Linear(256, 128)), ("relu2", nn.ReLU()), ("fc3", nn.Linear(128, 10))]
    else:
        layers = [("conv1", nn.Conv2d(1, 16, 5)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
                  ("conv2", nn.Conv2d(16, 32, 5)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
                  ("flatten", nn.Flatten()), ("fc1", nn.Linear(512, 64)), ("relu3", nn.ReLU()),
                  ("fc2", nn.Linear(64, 10))]
    return nn.Sequential(OrderedDict(layers))


def read(name):
    for n in (name, name + ".gz"):
        path = os.path.join(DATA, n)
        if os.path.exists(path):
            with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
                return f.read()
    raise FileNotFoundError(name)


def main(kind, path, limit):
    x = np.frombuffer(read("t10k-images-idx3-ubyte"), np.uint8, offset=16)
    x = x.reshape(-1, 1, 28, 28)[:limit]
    y = np.frombuffer(read("t10k-labels-idx1-ubyte"), np.uint8, offset=8)[:limit]
    x = (torch.from_numpy(x.astype(np.float32) / 255.0) - 0.2860) / 0.3530
    if kind == "script":
        model = torch.jit.load(path)
    else:
        model = builtin(kind)
        model.load_state_dict(torch.load(path))
    model.eval()
    with torch.no_grad():
        hits = (model(x).argmax(1) == torch.from_numpy(y.astype(np.int64))).sum().item()
    print(f"{hits / len(y):.6f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
