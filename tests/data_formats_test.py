"""The data readers end to end (docs/data.md): files in each format, made by the test itself,
train with real dbs_ps/dbs_worker processes; bad files are refused before training with the file
and the fault named. Python steps that need NumPy or torch use Debian's /usr/bin/python3.
"""

import gzip
import os
import random
import struct
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import RUNFILES, WORKER, ProcessTestCase  # noqa: E402

EXAMPLES = os.path.join(RUNFILES, "examples")
PYTHON = "/usr/bin/python3"


def write_npy(path, descr, shape, data):
    """A .npy file (format 1.0) as NumPy writes it."""
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}"
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data)


def write_idx(path, shape, data):
    magic = 0x800 | len(shape)
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">" + "I" * (1 + len(shape)), magic, *shape) + data)


def noisy(rng, base, n):
    return bytes(min(255, base + b % 40) for b in rng.randbytes(n))


def cifar_records(rng, n):
    """Learnable: class c brightens channel c % 3 by an amount set by c // 3."""
    out = bytearray()
    for _ in range(n):
        c = rng.randrange(10)
        out.append(c)
        for ch in range(3):
            out += noisy(rng, 60 + 45 * (c // 3) if ch == c % 3 else 30, 1024)
    return bytes(out)


def idx_letters(rng, n, side=26):
    """26 classes: class c is a bright row c on a dark, noisy image."""
    images, labels = bytearray(), bytearray()
    for _ in range(n):
        c = rng.randrange(26)
        labels.append(c)
        for row in range(side):
            images += noisy(rng, 200 if row == c else 20, side)
    return bytes(images), bytes(labels)


class DataFormatsTest(ProcessTestCase):
    def train(self, workers, *flags, epochs=2, lr=0.05):
        """Trains one job (`workers`: one slowdown each); returns (summary, worker outputs)."""
        return self.run_job([f"--epochs={epochs}", "--global_batch=64", f"--lr={lr}"],
                            [[f"--name=w{i}", f"--slowdown={s}", "--log_every_s=60", *flags]
                             for i, s in enumerate(workers)])

    def refused(self, *flags):
        """Runs a worker that must stop before training; returns its error message."""
        rc, out, err = self.run_cmd([WORKER, "--server=127.0.0.1:1", "--connect_timeout_s=1",
                                     *flags], timeout=120)
        self.assertEqual(rc, 2, out + err)
        return err

    def regression_files(self):
        data = os.path.join(self.tmp, "regression")
        subprocess.run([PYTHON, os.path.join(EXAMPLES, "regression_data.py"), data, "8000"],
                       check=True, capture_output=True, timeout=120)
        return [os.path.join(data, f"{n}.npy") for n in ("train_x", "train_y", "test_x",
                                                         "test_y")]

    def test_npy_regression_trains_under_dbs_and_the_export_scores_the_jobs_loss(self):
        files = self.regression_files()
        export = os.path.join(self.tmp, "trained.pt")
        model = os.path.join(EXAMPLES, "mlp_regression.pt")
        summary, outs = self.train([1, 2, 3], f"--model={model}", f"--data=npy:{','.join(files)}",
                                   f"--export_path={export}", epochs=3)
        self.assertEqual(summary["status"], "ok")
        self.assertIn("real-valued targets [1]", outs[0])
        self.assertIn("loss on its test slice", outs[0])
        job = summary["final_test_loss"]
        # The targets' variance is about 0.5 and the noise's 0.01: the model learned the function.
        self.assertLess(job, 0.1, summary["epochs"])
        script = ("import sys, numpy as np, torch\n"
                  "m = torch.jit.load(sys.argv[1]).eval()\n"
                  "x, y = (torch.from_numpy(np.load(p)) for p in sys.argv[2:4])\n"
                  "with torch.no_grad(): print(float(((m(x) - y) ** 2).mean()))\n")
        out = subprocess.run([PYTHON, "-c", script, export, files[2], files[3]],
                             capture_output=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-2000:])
        exported = float(out.stdout.decode())
        print(f"npy regression: job test loss {job:.6f}, exported module {exported:.6f}",
              flush=True)
        self.assertAlmostEqual(exported, job, delta=1e-4 * job + 1e-7)

    def test_the_builtin_mlp_regresses_npy_targets_with_mse(self):
        files = self.regression_files()
        summary, outs = self.train([1], "--model=mlp", f"--data=npy:{','.join(files)}")
        self.assertIn("real-valued targets [1]", outs[0])
        print(f"built-in mlp on npy: test loss {summary['final_test_loss']:.4f}", flush=True)
        self.assertLess(summary["final_test_loss"], 0.15, summary["epochs"])

    def test_cifar10_binary_trains_the_builtin_cnn_on_three_channels(self):
        rng = random.Random(1)
        data = os.path.join(self.tmp, "cifar-10-batches-bin")
        os.makedirs(data)
        for b in range(1, 6):
            with open(os.path.join(data, f"data_batch_{b}.bin"), "wb") as f:
                f.write(cifar_records(rng, 600))
        with open(os.path.join(data, "test_batch.bin"), "wb") as f:
            f.write(cifar_records(rng, 400))
        # The parent folder works too: the reader looks into cifar-10-batches-bin.
        summary, outs = self.train([1, 2], "--model=cnn", f"--data=cifar10:{self.tmp}",
                                   epochs=3, lr=0.003)
        self.assertIn("3000 training and 400 test samples of uint8 [3, 32, 32], 10 classes",
                      outs[0])
        self.assertIn("CIFAR-10's own mean [0.4914, 0.4822, 0.4465]", outs[0])
        print(f"cifar10: accuracy per epoch {[e['test_accuracy'] for e in summary['epochs']]}",
              flush=True)
        self.assertGreater(summary["final_test_accuracy"], 0.5, summary["epochs"])

    def test_idx_files_of_26_classes_train_the_builtin_mlp(self):
        rng = random.Random(2)
        data = os.path.join(self.tmp, "letters")
        os.makedirs(data)
        for split, n in (("train", 2000), ("test", 500)):
            images, labels = idx_letters(rng, n)
            write_idx(os.path.join(data, f"emnist-letters-{split}-images-idx3-ubyte.gz"),
                      (n, 26, 26), images)
            write_idx(os.path.join(data, f"emnist-letters-{split}-labels-idx1-ubyte.gz"),
                      (n,), labels)
        summary, outs = self.train([1], "--model=mlp", f"--data=idx:{data}")
        self.assertIn("26 classes", outs[0])
        self.assertIn("the training inputs' mean", outs[0])  # no published figures: computed
        print(f"idx: accuracy per epoch {[e['test_accuracy'] for e in summary['epochs']]}",
              flush=True)
        self.assertGreater(summary["final_test_accuracy"], 0.5, summary["epochs"])

    def test_bad_files_are_refused_before_training_naming_the_file(self):
        files = self.regression_files()
        with open(files[0], "rb") as f:
            good = f.read()
        cut = os.path.join(self.tmp, "cut_x.npy")
        with open(cut, "wb") as f:
            f.write(good[:-100])
        err = self.refused("--model=mlp", f"--data=npy:{cut},{files[1]}")
        self.assertIn("cut_x.npy: truncated", err)

        # Images the model takes, but labels beyond its 10 outputs.
        n = 8
        images, labels = os.path.join(self.tmp, "img.npy"), os.path.join(self.tmp, "lab.npy")
        write_npy(images, "|u1", (n, 1, 28, 28), bytes(n * 784))
        write_npy(labels, "<i8", (n,), struct.pack(f"<{n}q", *range(4, 4 + n)))
        plain_cnn = os.path.join(EXAMPLES, "plain_cnn.pt")
        err = self.refused(f"--model={plain_cnn}", f"--data=npy:{images},{labels}")
        self.assertIn("labels go up to 11 (12 classes) but the model gives 10 outputs", err)
        write_npy(labels, "<i8", (n,), struct.pack(f"<{n}q", 0, 1, 2, -3, 4, 5, 6, 7))
        err = self.refused(f"--model={plain_cnn}", f"--data=npy:{images},{labels}")
        self.assertIn("lab.npy: label -3 of sample 3 is negative", err)

        # Inputs of another shape than the model takes.
        write_npy(images, "|u1", (n, 3, 32, 32), bytes(n * 3072))
        write_npy(labels, "<i8", (n,), struct.pack(f"<{n}q", *range(n)))
        err = self.refused(f"--model={plain_cnn}", f"--data=npy:{images},{labels}")
        self.assertIn("the model cannot take the data's inputs (a batch of shape [2, 3, 32, 32])",
                      err)
        self.assertNotIn("channels-last", err)
        # Images stored channels last, as NumPy and TensorFlow keep them: said so, with the fix.
        write_npy(images, "|u1", (n, 28, 28, 1), bytes(n * 784))
        err = self.refused(f"--model={plain_cnn}", f"--data=npy:{images},{labels}")
        self.assertIn("The samples look channels-last ([H, W, C] = [28, 28, 1]); PyTorch models "
                      "take [C, H, W]", err)
        self.assertIn("x.transpose(0, 3, 1, 2)", err)
        # Class labels saved as floats are real-valued targets: said so, with the fix.
        write_npy(images, "|u1", (n, 1, 28, 28), bytes(n * 784))
        write_npy(labels, "<f4", (n,), struct.pack(f"<{n}f", *range(n)))
        err = self.refused(f"--model={plain_cnn}", f"--data=npy:{images},{labels}")
        self.assertIn("the model outputs [2, 10] but the targets of that batch are [2]", err)
        self.assertIn("if they are class labels, save them as integers", err)
        # A file that cannot be opened, with the reason.
        err = self.refused("--model=mlp", f"--data=npy:{self.tmp}/none_x.npy,{labels}")
        self.assertIn("none_x.npy cannot be opened: No such file or directory", err)

        # A CIFAR-10 file with a label of 10, a missing batch, an unknown reader.
        data = os.path.join(self.tmp, "cifar")
        os.makedirs(data)
        rng = random.Random(3)
        for name in [f"data_batch_{b}.bin" for b in range(1, 6)] + ["test_batch.bin"]:
            with open(os.path.join(data, name), "wb") as f:
                f.write(cifar_records(rng, 2))
        with open(os.path.join(data, "data_batch_3.bin"), "r+b") as f:
            f.seek(3073)
            f.write(b"\x0a")
        err = self.refused(f"--data=cifar10:{data}")
        self.assertIn("label 10 of sample 1 is out of range (10 classes", err)
        os.remove(os.path.join(data, "data_batch_5.bin"))
        self.assertIn("data_batch_5.bin does not exist", self.refused(f"--data=cifar10:{data}"))
        self.assertIn("names no reader", self.refused("--data=csv:/tmp/x.csv"))
        self.assertIn("--normalize='0.5'", self.refused("--normalize=0.5"))


if __name__ == "__main__":
    unittest.main()
