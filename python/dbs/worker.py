"""python3 -m dbs.worker: a Python worker of a dbs job, from the command line.

    python3 -m dbs.worker --server=HOST:PORT --model=cnn
    python3 -m dbs.worker --server=HOST:PORT --model=my_pkg.models:make_net --data=cifar10:DIR

--model is a built-in (cnn, mlp: the same networks as dbs_worker's) or MODULE:FACTORY, a
function that takes (row_shape, num_classes) and returns an nn.Module. Flags mean what
dbs_worker's do; each can also come from DBS_<FLAG> (the command line wins). Exit codes are
dbs_worker's: 0 done, 1 failed, 2 bad configuration, 200 server unavailable (restart), 201
removed from the job, 130/143 stopped by SIGINT/SIGTERM.
"""

import argparse
import importlib
import json
import os
import signal
import sys
from typing import List

import numpy as np
import torch

from dbs import data as dbs_data
from dbs import models
from dbs.client import Code, DbsError
from dbs.fitting import fit, measure_speed
from dbs.job import Stopped, load_values, model_layout
from dbs.wire import PlanError

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_UNAVAILABLE, EXIT_REMOVED = 0, 1, 2, 200, 201
EXIT_CODES = {
    Code.INVALID_ARGUMENT: EXIT_BAD_CONFIG, Code.UNAUTHENTICATED: EXIT_BAD_CONFIG,
    Code.FAILED_PRECONDITION: EXIT_BAD_CONFIG, Code.OUT_OF_RANGE: EXIT_BAD_CONFIG,
    Code.UNAVAILABLE: EXIT_UNAVAILABLE, Code.DEADLINE_EXCEEDED: EXIT_UNAVAILABLE,
    Code.RESOURCE_EXHAUSTED: EXIT_UNAVAILABLE, Code.ALREADY_EXISTS: EXIT_UNAVAILABLE,
    Code.NOT_FOUND: EXIT_REMOVED, Code.PERMISSION_DENIED: EXIT_REMOVED,
}


def parser():
    ap = argparse.ArgumentParser(
        prog="python3 -m dbs.worker", description=__doc__.split("\n\n")[0],
        epilog="Every flag can also come from the environment variable DBS_<FLAG> (upper case); "
               "the command line wins.")
    ap.add_argument("--server", default="127.0.0.1:50051", help="address of dbs_ps (host:port)")
    ap.add_argument("--name", default="", help="worker name, unique in the job (default "
                    "host:pid)")
    ap.add_argument("--model", default="cnn", help="cnn, mlp, or MODULE:FACTORY, a function of "
                    "(row_shape, num_classes) returning an nn.Module")
    ap.add_argument("--loss", default="auto", choices=["auto", "cross_entropy", "nll", "mse"],
                    help="auto: cross_entropy for class labels, mse for real-valued targets")
    ap.add_argument("--data", default="fashion-mnist",
                    help="fashion-mnist[:DIR], idx:DIR, cifar10:DIR or npy:X,Y[,TX,TY]")
    ap.add_argument("--data_dir", default=dbs_data.FASHION_MNIST_DIR,
                    help="folder of --data=fashion-mnist")
    ap.add_argument("--normalize", default="auto", help="auto, none, train or MEAN/STD")
    ap.add_argument("--train_limit", type=int, default=0, help="use only the first N training "
                    "samples (0: all)")
    ap.add_argument("--test_limit", type=int, default=0, help="use only the first N test "
                    "samples (0: all)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    ap.add_argument("--threads", type=int, default=1, help="PyTorch intra-op threads on CPU")
    ap.add_argument("--max_batch", type=int, default=0, help="largest batch computed at once; "
                    "larger ones are computed as micro-batches (0: no limit)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the initial parameters (the "
                    "first worker's are used)")
    ap.add_argument("--init_params", default="", help="file of raw float32 initial parameters "
                    "in the model's order (the same start as another run)")
    ap.add_argument("--slowdown", type=float, default=1.0, help="emulate a slower worker: each "
                    "step's compute takes this many times its CPU time (>= 1)")
    ap.add_argument("--dry_run", action="store_true",
                    help="check the flags and variables, the files they name, the data and the "
                    "model (run on two samples) and that --export_path can be written; say "
                    "whether the configuration is valid and exit (0 or 2) without connecting")
    ap.add_argument("--measure_speed_samples", type=int, default=0,
                    help="if > 0, do not train: measure standalone compute speed over this many "
                    "samples, print it as JSON and exit")
    ap.add_argument("--measure_batch", type=int, default=32,
                    help="the batch of --measure_speed_samples")
    ap.add_argument("--export_path", default="", help="write the trained model here at the end "
                    "(a state dict; TorchScript beside it, .script.pt, when the model scripts)")
    ap.add_argument("--export_every_epochs", type=int, default=0, help="also export every N "
                    "epochs (0: only at the end)")
    ap.add_argument("--record_path", default="", help="JSON record of this worker's epochs")
    ap.add_argument("--log_every_s", type=float, default=5.0, help="seconds between progress "
                    "lines")
    ap.add_argument("--connect_timeout_s", type=float, default=60.0, help="how long to keep "
                    "retrying while dbs_ps is unreachable")
    ap.add_argument("--call_timeout_s", type=float, default=60.0, help="deadline of one attempt "
                    "of a call to dbs_ps")
    ap.add_argument("--max_wait_s", type=float, default=0.0, help="longest total wait for a step "
                    "or a plan (0: no limit)")
    ap.add_argument("--shared_memory", type=_flag_bool, nargs="?", const=True, default=True,
                    help="on dbs_ps's own host, push each step's gradient and read its answer "
                    "through memory shared with dbs_ps instead of the socket (fewer copies; "
                    "checked with the server at the first push, and pushes go over gRPC where "
                    "it cannot be shared). false: always over gRPC")
    ap.add_argument("--job_token", default="", help="the job's secret (prefer --job_token_file)")
    ap.add_argument("--job_token_file", default="", help="a file holding the job's secret")
    ap.add_argument("--tls_ca", default="", help="PEM CA certificate of the server's: use TLS")
    ap.add_argument("--tls_cert", default="", help="PEM certificate of this worker (mutual TLS)")
    ap.add_argument("--tls_key", default="", help="PEM private key of --tls_cert")
    return ap


def _flag_bool(text):
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not true or false")
    return value


def args_with_environment(ap, argv, environ):
    """argv with the DBS_* variables folded in before it (so the command line wins); a DBS_*
    variable that names no flag is an error."""
    flags = {a.dest for a in ap._actions if a.dest != "help"}
    extra = []
    for key, value in sorted(environ.items()):
        if not key.startswith("DBS_"):
            continue
        flag = key[4:].lower()
        if flag not in flags:
            ap.error(f"environment variable {key} names no flag of this worker")
        extra.append(f"--{flag}={value}")
    return extra + list(argv)


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: {e}") from None


def make_model(spec, row_shape, num_classes):
    if spec in models.BUILTIN:
        return models.BUILTIN[spec](row_shape, max(num_classes, 1))
    module, _, factory = spec.partition(":")
    if not factory:
        raise ValueError(f"--model={spec}: use cnn, mlp or MODULE:FACTORY")
    try:
        return getattr(importlib.import_module(module), factory)(row_shape, num_classes)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model={spec}: {e}") from None


def check_model(model, data, norm, loss_fn, device):
    """The model takes two of the data's samples and its outputs fit the targets; ValueError
    naming the mismatch otherwise."""
    x = dbs_data.prepare(data.train_x[:2], norm).to(device)
    try:
        with torch.no_grad():
            loss_fn(model(x), data.train_y[:2].to(device))
    except (RuntimeError, ValueError, IndexError) as e:
        raise ValueError(f"the model does not fit the data {data.spec} (inputs "
                         f"{list(data.train_x.shape[1:])}, {data.num_classes} classes): "
                         f"{str(e).splitlines()[0]}") from None


def loss_of(name, num_classes):
    f = torch.nn.functional
    if name == "auto":
        name = "cross_entropy" if num_classes > 0 else "mse"
    return {"cross_entropy": f.cross_entropy, "nll": f.nll_loss, "mse": f.mse_loss}[name]


class Normalized(torch.nn.Module):
    """The trained network (submodule `model`) behind the input transform, for a TorchScript
    export that takes inputs as the data set holds them, like dbs_worker's export: integer
    inputs are scaled to [0, 1], floats taken as they are, then standardised per channel.
    Attributes mean, std and num_classes say what it does."""
    mean: List[float]
    std: List[float]
    num_classes: int
    dbs_input_transform: str

    def __init__(self, model, norm, rank, num_classes):
        super().__init__()
        self.model = model
        shape = [len(norm.mean)] + [1] * max(rank - 2, 0)
        mean, std = torch.tensor(norm.mean or [0.0]), torch.tensor(norm.std or [1.0])
        self.register_buffer("input_mean", mean.reshape(shape if len(norm.mean) > 1 else []))
        self.register_buffer("input_std", std.reshape(shape if len(norm.std) > 1 else []))
        self.mean, self.std, self.num_classes = list(norm.mean), list(norm.std), num_classes
        self.dbs_input_transform = (
            "uint8 inputs are scaled to [0, 1], then every input x becomes (x - mean[c]) / "
            "std[c] for its channel c (dim 1), then goes through the submodule model")

    def forward(self, x):
        if x.is_floating_point():
            x = x.float()
        else:
            x = x.float() / 255.0
        return self.model((x - self.input_mean) / self.input_std)


def run(args, out=sys.stdout):
    if "," in args.server:
        raise ValueError(f"--server={args.server}: a Python worker joins one dbs_ps; a sharded "
                         "job's workers (several addresses) are dbs_worker processes")
    if args.slowdown < 1:
        raise ValueError("--slowdown must be >= 1")
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    data = dbs_data.load(args.data, args.data_dir).limit(args.train_limit, args.test_limit)
    norm = dbs_data.choose_normalization(args.normalize, data)
    torch.manual_seed(args.seed)
    model = make_model(args.model, list(data.train_x.shape[1:]), data.num_classes).to(device)
    if args.init_params:
        raw = _read(args.init_params, "--init_params")
        try:
            load_values(model_layout(model), np.frombuffer(raw, "<f4"))
        except ValueError as e:
            raise ValueError(f"--init_params={args.init_params}: {e}") from None
    job_token = args.job_token
    if args.job_token_file:
        job_token = _read(args.job_token_file, "--job_token_file").decode().strip()
    tls = {k: _read(getattr(args, k), f"--{k}") if getattr(args, k) else None
           for k in ("tls_ca", "tls_cert", "tls_key")}
    train = torch.utils.data.TensorDataset(data.train_x, data.train_y)
    test = torch.utils.data.TensorDataset(data.test_x, data.test_y)
    check_model(model, data, norm, loss_of(args.loss, data.num_classes), device)
    for path, flag in ((args.export_path, "--export_path"), (args.record_path, "--record_path")):
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise ValueError(f"{flag}={path}: its folder cannot be written")
    if args.dry_run:
        print(f"dbs.worker: configuration ok; data {data.spec}: {len(train)} train / "
              f"{len(test)} test samples, normalisation {norm.source}", file=out, flush=True)
        return
    if args.measure_speed_samples > 0:
        speed = measure_speed(model, train, loss_of(args.loss, data.num_classes),
                              args.measure_speed_samples, args.measure_batch,
                              lambda x: dbs_data.prepare(x, norm))
        print(json.dumps({"samples_per_second": round(speed, 2), "batch": args.measure_batch,
                          "threads": args.threads}), file=out, flush=True)
        return
    print(f"[{args.name or 'worker'}] data {data.spec}: {len(train)} train / {len(test)} test "
          f"samples, normalisation {norm.source}", file=out, flush=True)
    fit(model, train, loss_of(args.loss, data.num_classes), server=args.server,
        test_dataset=test, name=args.name or None, prepare=lambda x: dbs_data.prepare(x, norm),
        max_batch=args.max_batch, export_path=args.export_path,
        export_every_epochs=args.export_every_epochs, record_path=args.record_path,
        log_every=args.log_every_s, job_token=job_token, connect_timeout=args.connect_timeout_s,
        call_timeout=args.call_timeout_s, max_wait=args.max_wait_s, out=out,
        model_name=args.model, slowdown=args.slowdown, shared_memory=args.shared_memory,
        script_wrapper=lambda m: Normalized(m, norm, data.train_x.dim(), data.num_classes),
        **tls)


def main(argv=None, environ=None):
    ap = parser()
    args = ap.parse_args(args_with_environment(ap, sys.argv[1:] if argv is None else argv,
                                               os.environ if environ is None else environ))

    def stop(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        run(args)
    except (Stopped, KeyboardInterrupt) as e:
        return 143 if isinstance(e, Stopped) else 130
    except DbsError as e:
        print(f"dbs.worker: {e}", file=sys.stderr, flush=True)
        return EXIT_CODES.get(e.code, EXIT_FAILED)
    except (ValueError, dbs_data.DataError, PlanError) as e:
        print(f"dbs.worker: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
