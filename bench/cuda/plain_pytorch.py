"""The plain-PyTorch side of bench/cuda/check.sh, and the data both sides train on.

    python3 bench/cuda/plain_pytorch.py make_data DIR SAMPLES
        writes DIR/x.npy (uint8 [SAMPLES, 1, 28, 28]) and DIR/y.npy (int64 labels in [0, 10)):
        random images whose label is set by their mean brightness, for `--data=npy:`.
    python3 bench/cuda/plain_pytorch.py train DIR MODEL.pt DEVICE BATCH STEPS EPOCHS
        trains MODEL.pt (TorchScript) and the same network as an eager nn.Module
        (examples/models.py's ResNetBN) the way a PyTorch user would: SGD (lr 0.05, momentum 0.9),
        each batch gathered on the CPU and moved to DEVICE, the same normalisation as dbs_worker's
        --normalize=train. Prints JSON: samples/s over the epochs after the first, per variant.
"""

import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import models  # noqa: E402


def make_data(out_dir, samples):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=samples)
    x = rng.integers(0, 64, size=(samples, 1, 28, 28)) + (y * 19)[:, None, None, None]
    np.save(os.path.join(out_dir, "x.npy"), x.astype(np.uint8))
    np.save(os.path.join(out_dir, "y.npy"), y.astype(np.int64))


def train(data_dir, model_path, device, batch, steps, epochs):
    x = torch.from_numpy(np.load(os.path.join(data_dir, "x.npy")))[:batch * steps]
    y = torch.from_numpy(np.load(os.path.join(data_dir, "y.npy")))[:batch * steps]
    scaled = x.float() / 255.0
    mean, std = scaled.mean().item(), scaled.std(unbiased=False).item()
    results = {}
    for variant in ("torchscript", "eager"):
        torch.manual_seed(0)
        model = torch.jit.load(model_path) if variant == "torchscript" else models.ResNetBN()
        model = model.to(device).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        seconds, samples = 0.0, 0
        for epoch in range(epochs):
            order = torch.randperm(x.shape[0])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            for s in range(steps):
                idx = order[s * batch:(s + 1) * batch]
                xb = ((x[idx].to(device).float() / 255.0) - mean) / std
                yb = y[idx].to(device)
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
            loss.item()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if epoch > 0:  # the first epoch warms up (cuDNN's autotuning, allocations)
                seconds += time.perf_counter() - start
                samples += steps * batch
        results[variant] = samples / seconds
    print(json.dumps({"batch": batch, "device": device, "samples_per_second": results}))


if __name__ == "__main__":
    if sys.argv[1] == "make_data":
        make_data(sys.argv[2], int(sys.argv[3]))
    else:
        train(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]),
              int(sys.argv[7]))
