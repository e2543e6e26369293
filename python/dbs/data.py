"""The data sets dbs_worker reads (docs/data.md), for Python workers: `--data` names a reader
  fashion-mnist[:DIR]  Fashion-MNIST's IDX files (the default; Debian's copy without DIR)
  idx:DIR              any MNIST-family IDX files (gzipped or not)
  cifar10:DIR          the CIFAR-10 binary version (data_batch_*.bin, test_batch.bin)
  npy:X,Y[,TX,TY]      NumPy .npy files
and each comes back as a Data: raw inputs and targets as tensors, the class count, and the data
set's published normalisation when it has one. `prepare` turns a raw batch into what the network
sees exactly as dbs_worker does (bytes scaled to [0, 1], then standardised per channel), so that
Python and C++ workers compute the same gradients from the same samples.
"""

import glob
import gzip
import os

import numpy as np
import torch

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


class DataError(ValueError):
    """A data set that is missing or malformed; the message says which file and what to do."""


class Normalization:
    def __init__(self, mean=(), std=(), source="none"):
        self.mean, self.std, self.source = list(mean), list(std), source


class Data:
    def __init__(self, spec, train_x, train_y, test_x, test_y, num_classes, published=None):
        self.spec = spec
        self.train_x, self.train_y, self.test_x, self.test_y = train_x, train_y, test_x, test_y
        self.num_classes = num_classes
        self.published = published

    def limit(self, train_limit=0, test_limit=0):
        if train_limit > 0:
            self.train_x, self.train_y = self.train_x[:train_limit], self.train_y[:train_limit]
        if test_limit > 0:
            self.test_x, self.test_y = self.test_x[:test_limit], self.test_y[:test_limit]
        return self


def _read(path):
    if not os.path.exists(path):
        raise DataError(f"{path} does not exist")
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return f.read()


def _gz_or_plain(folder, name):
    plain = os.path.join(folder, name)
    return plain + ".gz" if os.path.exists(plain + ".gz") else plain


def parse_idx(images, labels, where):
    if len(images) < 8 or (int.from_bytes(images[:4], "big") & 0xFFFFFF00) != 0x800:
        raise DataError(f"{where}: not an IDX file of unsigned bytes (magic 0x000008NN expected)")
    if len(labels) < 8 or int.from_bytes(labels[:4], "big") != 0x801:
        raise DataError(f"{where}: not an IDX label file (magic 0x00000801 expected)")
    dims = images[3]
    shape = [int.from_bytes(images[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    n, row = shape[0], int(np.prod(shape[1:]))
    if int.from_bytes(labels[4:8], "big") != n:
        raise DataError(f"{where}: the image file has {n} images, the label file "
                        f"{int.from_bytes(labels[4:8], 'big')} labels")
    header = 4 + 4 * dims
    if len(images) != header + n * row or len(labels) != 8 + n:
        raise DataError(f"{where}: IDX file is truncated or has trailing bytes")
    if dims == 3:
        shape.insert(1, 1)  # [N, H, W] images get a channel
    x = torch.frombuffer(bytearray(images[header:]), dtype=torch.uint8).view(shape)
    y = torch.frombuffer(bytearray(labels[8:]), dtype=torch.uint8).to(torch.int64)
    return x, y


def _idx(spec, files):
    x, y = parse_idx(_read(files[0]), _read(files[1]), files[0])
    tx, ty = parse_idx(_read(files[2]), _read(files[3]), files[2])
    classes = 1 + int(max(y.max(), ty.max())) if len(y) else 0
    return Data(spec, x, y, tx, ty, classes)


def load_fashion_mnist(folder):
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"]
    files = [_gz_or_plain(folder, n) for n in names]
    for f in files:
        if not os.path.exists(f):
            raise DataError(
                f"Fashion-MNIST not found: {f}(.gz) is missing. Install Debian's copy with "
                f"'sudo apt-get install dataset-fashion-mnist' (files land in "
                f"{FASHION_MNIST_DIR}), or point --data_dir (or --data=fashion-mnist:DIR) at a "
                "folder holding the IDX files.")
    data = _idx(f"fashion-mnist:{folder}", files)
    data.num_classes = 10
    data.published = Normalization([0.2860], [0.3530], "Fashion-MNIST's own")
    return data


def _find_idx(folder, kind, prefixes):
    for p in prefixes:
        found = sorted(glob.glob(os.path.join(folder, f"{p}*{kind}*")))
        if found:
            return found[0]
    raise DataError(f"no {'/'.join(prefixes)} *{kind}* file in {folder}")


def load_cifar10(folder):
    if (not os.path.exists(os.path.join(folder, "test_batch.bin")) and
            os.path.exists(os.path.join(folder, "cifar-10-batches-bin", "test_batch.bin"))):
        folder = os.path.join(folder, "cifar-10-batches-bin")
    train = [os.path.join(folder, f"data_batch_{i}.bin") for i in range(1, 6)]
    test = os.path.join(folder, "test_batch.bin")
    for p in train + [test]:
        if not os.path.exists(p):
            raise DataError(f"cifar10: {p} does not exist (the folder needs data_batch_1.bin to "
                            "data_batch_5.bin and test_batch.bin of the CIFAR-10 binary version, "
                            "cifar-10-binary.tar.gz)")

    def records(paths):
        raw = b"".join(_read(p) for p in paths)
        if len(raw) % 3073:
            raise DataError(f"{paths[0]}: not whole CIFAR-10 records of 3073 bytes")
        a = np.frombuffer(raw, np.uint8).reshape(-1, 3073)
        if len(a) and a[:, 0].max() > 9:
            raise DataError(f"{paths[0]}: a label above 9 in a CIFAR-10 file")
        return (torch.from_numpy(a[:, 1:].reshape(-1, 3, 32, 32).copy()),
                torch.from_numpy(a[:, 0].astype(np.int64)))

    x, y = records(train)
    tx, ty = records([test])
    return Data(f"cifar10:{folder}", x, y, tx, ty, 10,
                Normalization([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616],
                              "CIFAR-10's own"))


def _npy(path):
    if not os.path.exists(path):
        raise DataError(f"{path} does not exist")
    a = np.load(path, mmap_mode="r")
    if a.dtype == np.float64:
        return torch.from_numpy(np.asarray(a, np.float32))
    if a.dtype == np.int32:
        return torch.from_numpy(np.asarray(a, np.int64))
    return torch.from_numpy(np.array(a))


def load_npy(files):
    paths = files.split(",")
    if len(paths) not in (2, 4):
        raise DataError("npy: takes X,Y or X,Y,TEST_X,TEST_Y")
    x, y = _npy(paths[0]), _npy(paths[1])
    tx, ty = (_npy(paths[2]), _npy(paths[3])) if len(paths) == 4 else (x[:0], y[:0])
    classes = 1 + int(max(y.max(), ty.max() if len(ty) else 0)) if y.dtype == torch.int64 else 0
    return Data(f"npy:{files}", x, y, tx, ty, classes)


def load(spec="fashion-mnist", data_dir=FASHION_MNIST_DIR):
    """The data set `spec` names (see the module's docstring)."""
    reader, _, arg = spec.partition(":")
    if reader == "fashion-mnist":
        return load_fashion_mnist(arg or data_dir)
    if reader == "idx":
        return _idx(spec, [_find_idx(arg, "images-idx", ["train"]),
                           _find_idx(arg, "labels-idx", ["train"]),
                           _find_idx(arg, "images-idx", ["t10k", "test"]),
                           _find_idx(arg, "labels-idx", ["t10k", "test"])])
    if reader == "cifar10":
        return load_cifar10(arg)
    if reader == "npy":
        return load_npy(arg)
    raise DataError(f"unknown data set '{spec}': use fashion-mnist[:DIR], idx:DIR, cifar10:DIR "
                    "or npy:X,Y[,TX,TY]")


def channels(row_shape):
    """Channels of an input row for standardisation (as dbs_worker counts them)."""
    if len(row_shape) >= 3 or len(row_shape) == 1:
        return max(int(row_shape[0]), 1)
    return 1


def choose_normalization(flag, data):
    """--normalize: auto, none, train or 'M1,M2,.../S1,S2,...' (as dbs_worker's)."""
    c = channels(list(data.train_x.shape[1:]))
    if flag == "none":
        return Normalization()
    if flag == "auto" and data.published is not None and len(data.published.mean) == c:
        return data.published
    if flag in ("train", "auto"):
        if flag == "auto" and data.train_x.dtype != torch.uint8:
            return Normalization()
        x = data.train_x.to(torch.float64)
        if data.train_x.dtype == torch.uint8:
            x = x / 255.0
        per = x.reshape(x.shape[0], c, -1).transpose(0, 1).reshape(c, -1)
        return Normalization(per.mean(1).tolist(), per.std(1, unbiased=False).tolist(),
                             "the training inputs")
    try:
        mean, std = flag.split("/")
        mean = [float(v) for v in mean.split(",")]
        std = [float(v) for v in std.split(",")]
    except ValueError:
        raise DataError(f"--normalize={flag}: use auto, none, train or M1,.../S1,...") from None
    if len(mean) != len(std) or len(mean) not in (1, c) or min(std) <= 0:
        raise DataError(f"--normalize={flag}: one mean and std, or one per channel ({c})")
    return Normalization(mean, std, "--normalize")


def prepare(raw, norm):
    """A raw batch as the network sees it (dbs_worker's PrepareInputs, step for step)."""
    x = raw.to(torch.float32)
    if raw.dtype == torch.uint8:
        x = x.div(255.0)
    if len(norm.mean) == 1:
        return (x - norm.mean[0]) / norm.std[0]
    if not norm.mean:
        return x
    shape = [1, len(norm.mean)] + [1] * (x.dim() - 2)
    mean = torch.tensor(norm.mean, dtype=torch.float32).view(shape)
    std = torch.tensor(norm.std, dtype=torch.float32).view(shape)
    return (x - mean.to(x.device)) / std.to(x.device)
