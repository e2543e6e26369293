"""dbs_worker's built-in networks in PyTorch, with the same parameter names and shapes, so a
Python worker given --model=cnn or --model=mlp joins a job of C++ workers running theirs."""

from collections import OrderedDict

import torch.nn as nn


def mlp(row_shape=(1, 28, 28), outputs=10):
    """Inputs flattened, then 256-128-outputs."""
    features = 1
    for d in row_shape:
        features *= int(d)
    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()), ("fc1", nn.Linear(features, 256)), ("relu1", nn.ReLU()),
        ("fc2", nn.Linear(256, 128)), ("relu2", nn.ReLU()), ("fc3", nn.Linear(128, outputs))]))


def cnn(row_shape=(1, 28, 28), outputs=10):
    """Two valid 5x5 convolutions, each followed by 2x2 max-pooling, then 64-outputs; image
    samples [C, H, W] or [H, W] of at least 16x16."""
    row_shape = [int(d) for d in row_shape]
    if len(row_shape) not in (2, 3) or min(row_shape[-2:]) < 16:
        raise ValueError(f"the built-in cnn takes image samples [C, H, W] or [H, W] of at least "
                         f"16x16; these are {row_shape} (use mlp or a model of your own)")
    c = row_shape[0] if len(row_shape) == 3 else 1
    h, w = row_shape[-2:]
    fh, fw = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    layers = [("conv1", nn.Conv2d(c, 16, 5)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
              ("conv2", nn.Conv2d(16, 32, 5)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
              ("flatten", nn.Flatten()), ("fc1", nn.Linear(32 * fh * fw, 64)),
              ("relu3", nn.ReLU()), ("fc2", nn.Linear(64, outputs))]
    if len(row_shape) == 2:
        layers.insert(0, ("unflatten", nn.Unflatten(1, (1, h))))
    return nn.Sequential(OrderedDict(layers))


BUILTIN = {"cnn": cnn, "mlp": mlp}
