"""Evaluates a model dbs_worker exported (--export_path) on raw test inputs, as a user with only
the file would: no normalisation of its own. Prints a JSON line: the accuracy on the inputs as
the data set stores them (bytes), the accuracy on those bytes / 255 as floats, and the export's
attributes. Run with Debian's python3 (python3-torch):

    /usr/bin/python3 tests/eval_export.py PATH N                  # Fashion-MNIST's test set
    /usr/bin/python3 tests/eval_export.py PATH N X.npy Y.npy      # NumPy test files
"""

import gzip
import json
import os
import sys

import numpy as np
import torch

DATA = "/usr/share/datasets/fashion-mnist"


def read(name):
    for n in (name, name + ".gz"):
        path = os.path.join(DATA, n)
        if os.path.exists(path):
            with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
                return f.read()
    raise FileNotFoundError(name)


def main(path, limit, files):
    if files:
        x, y = np.load(files[0])[:limit], np.load(files[1])[:limit]
    else:
        x = np.frombuffer(read("t10k-images-idx3-ubyte"), np.uint8, offset=16)
        x = x.reshape(-1, 1, 28, 28)[:limit]
        y = np.frombuffer(read("t10k-labels-idx1-ubyte"), np.uint8, offset=8)[:limit]
    model = torch.jit.load(path)
    model.eval()
    y = torch.from_numpy(y.astype(np.int64))
    with torch.no_grad():
        raw = (model(torch.from_numpy(np.ascontiguousarray(x))).argmax(1) == y).float().mean()
        scaled = (model(torch.from_numpy(x.astype(np.float32) / 255.0)).argmax(1) == y).float()
    print(json.dumps({"accuracy": raw.item(), "accuracy_scaled": scaled.mean().item(),
                      "mean": list(model.mean), "std": list(model.std),
                      "num_classes": model.num_classes,
                      "weights": sorted(model.model.state_dict())}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
