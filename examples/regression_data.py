"""A regression data set as NumPy .npy files, for `dbs_worker --data=npy:...`:

    /usr/bin/python3 examples/regression_data.py OUT_DIR [TRAIN_SAMPLES]

writes OUT_DIR/train_x.npy and OUT_DIR/test_x.npy (float32 [N, 8], standard normal features)
and OUT_DIR/train_y.npy and OUT_DIR/test_y.npy (float32 [N, 1]): a smooth nonlinear function of
the features plus a little noise (variance 0.01), so the best possible test mean squared error is
about 0.01 and predicting the mean scores the targets' variance (printed). Train
examples/models.py's mlp_regression.pt on it:

    ./deploy/run_local_cluster.sh --model=MODELS/mlp_regression.pt \\
        --data=npy:OUT_DIR/train_x.npy,OUT_DIR/train_y.npy,OUT_DIR/test_x.npy,OUT_DIR/test_y.npy
"""

import os
import sys

import numpy as np

FEATURES = 8


def target(x, w):
    return np.sin(x @ w[0]) + 0.5 * (x @ w[1]) + 0.25 * (x @ w[2]) ** 2


def main(out_dir, train_samples=20000, test_samples=5000):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, FEATURES)) / np.sqrt(FEATURES)
    for split, n in (("train", train_samples), ("test", test_samples)):
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        y = (target(x, w) + 0.1 * rng.normal(size=n)).astype(np.float32).reshape(n, 1)
        np.save(os.path.join(out_dir, f"{split}_x.npy"), x)
        np.save(os.path.join(out_dir, f"{split}_y.npy"), y)
        print(f"{split}: {n} samples, target variance {y.var():.4f}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
