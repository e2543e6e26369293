"""A user's own model, end to end: TorchScript models scripted in Python (examples/models.py, at
build time) train with real processes, and the export loads back in PyTorch and, fed the raw
test inputs with no normalisation of the user's, scores the accuracy the job reported. Python
steps use Debian's /usr/bin/python3 (python3-torch).
"""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import RUNFILES, ProcessTestCase  # noqa: E402

EXAMPLES = os.path.join(RUNFILES, "examples")
EVAL = os.path.join(RUNFILES, "tests", "eval_export.py")
PYTHON = "/usr/bin/python3"
TEST_LIMIT = 1000
SMALL = ["--train_limit=3000", f"--test_limit={TEST_LIMIT}", "--log_every_s=60"]


class TorchScriptTest(ProcessTestCase):
    def train(self, workers, flags_of, epochs=2, policy="dbs"):
        return self.run_job([f"--epochs={epochs}", "--global_batch=64", f"--policy={policy}"],
                            [[*SMALL, f"--name={name}", *flags_of(name)] for name in workers])

    def evaluate_export(self, path, *files):
        """The export on raw test inputs: its accuracy (bytes and bytes / 255) and attributes."""
        out = subprocess.run([PYTHON, EVAL, path, str(TEST_LIMIT), *files], capture_output=True,
                             timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-3000:])
        return json.loads(out.stdout.decode())

    def check_export(self, path, summary, mean, std, *files):
        """Raw inputs, bytes or scaled to [0, 1], score the job's accuracy within 0.1 points, and
        the export keeps the normalisation and the class count."""
        ev = self.evaluate_export(path, *files)
        job = summary["final_test_accuracy"]
        print(f"{os.path.basename(path)}: job accuracy {job:.4f}, export on raw bytes "
              f"{ev['accuracy']:.4f}, on bytes / 255 {ev['accuracy_scaled']:.4f}", flush=True)
        self.assertAlmostEqual(ev["accuracy"], job, delta=0.001)
        self.assertAlmostEqual(ev["accuracy_scaled"], job, delta=0.001)
        self.assertEqual(ev["num_classes"], 10)
        for got, want in zip(ev["mean"] + ev["std"], mean + std):
            self.assertAlmostEqual(got, want, places=4)
        self.assertEqual(len(ev["mean"]), len(mean))
        return ev

    def test_a_batchnorm_model_trains_under_dbs_and_its_export_matches_the_job(self):
        model = os.path.join(EXAMPLES, "resnet_bn.pt")
        export = os.path.join(self.tmp, "trained.pt")

        def flags(name):
            slow = {"fast": 1, "mid": 2, "slow": 4}[name]
            extra = [f"--export_path={export}"] if name == "fast" else []
            return [f"--model={model}", f"--slowdown={slow}", *extra]

        summary, outs = self.train(["fast", "mid", "slow"], flags)
        self.assertEqual(summary["status"], "ok")
        self.assertIn("model exported to", outs[0])
        # Under DBS the three got different batches.
        batches = [w["batch_size"] for w in summary["epochs"][-1]["workers"]]
        self.assertGreater(max(batches) - min(batches), 4, batches)
        # Every worker evaluated the same parameters and BatchNorm statistics (averaged by the
        # server at every step), so the export is the model the job measured.
        ev = self.check_export(export, summary, [0.2860], [0.3530])
        self.assertIn("bn.running_mean", ev["weights"])
        # The export trains on as the network inside it (its own normalisation left out), from
        # the trained values: its first epoch's loss is far below a fresh start's.
        again, _ = self.train(["again"], lambda n: [f"--model={export}"], epochs=1)
        first, resumed = summary["epochs"][0]["train_loss"], again["epochs"][0]["train_loss"]
        print(f"train loss of a first epoch: from scratch {first:.4f}, from the export "
              f"{resumed:.4f}", flush=True)
        self.assertLess(resumed, first)

    def test_a_builtin_model_exports_a_module_that_takes_raw_inputs(self):
        export = os.path.join(self.tmp, "cnn.pt")
        summary, _ = self.train(["w0", "w1"], lambda n: [f"--export_path={export}"]
                                if n == "w0" else [], epochs=1)
        ev = self.check_export(export, summary, [0.2860], [0.3530])
        # Its weights under the built-in's names (docs/models.md loads them into nn.Sequential).
        self.assertEqual(ev["weights"], sorted(
            f"{layer}.{p}" for layer in ("conv1", "conv2", "fc1", "fc2") for p in ("weight", "bias")))

    def test_an_export_applies_the_normalisation_computed_from_the_training_data(self):
        # Three-channel images as uint8 NumPy files (channels first), which have no published
        # statistics: the workers compute them from the training inputs, and the export keeps them.
        files = self.rgb_npy(3000, TEST_LIMIT)
        model = os.path.join(EXAMPLES, "resnet_bn_rgb.pt")
        export = os.path.join(self.tmp, "rgb.pt")
        summary, outs = self.run_job(
            ["--epochs=2", "--global_batch=64", "--policy=dbs"],
            [[f"--name={n}", f"--model={model}", f"--data=npy:{','.join(files)}",
              "--log_every_s=60", *([f"--export_path={export}"] if n == "a" else [])]
             for n in ("a", "b")])
        self.assertEqual(summary["status"], "ok")
        said = [line for line in outs[0].splitlines() if "normalisation:" in line][0]
        mean = [float(v) for v in said.split("mean [")[1].split("]")[0].split(", ")]
        std = [float(v) for v in said.split("std [")[1].split("]")[0].split(", ")]
        self.assertEqual(len(mean), 3, said)
        self.check_export(export, summary, mean, std, files[2], files[3])

    def rgb_npy(self, train, test):
        """Fashion-MNIST as [N, 3, 28, 28] uint8 (a different brightness per channel) and int64
        labels: train_x, train_y, test_x, test_y .npy files."""
        script = (
            "import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import eval_export as e\n"
            "for split, img, lab, n in (('train', 'train-images-idx3-ubyte', "
            "'train-labels-idx1-ubyte', int(sys.argv[3])), ('test', 't10k-images-idx3-ubyte', "
            "'t10k-labels-idx1-ubyte', int(sys.argv[4]))):\n"
            "    x = np.frombuffer(e.read(img), np.uint8, offset=16).reshape(-1, 1, 28, 28)[:n]\n"
            "    y = np.frombuffer(e.read(lab), np.uint8, offset=8)[:n].astype(np.int64)\n"
            "    rgb = np.concatenate([x, x // 2, 255 - x], axis=1)\n"
            "    np.save(f'{sys.argv[2]}/{split}_x.npy', np.ascontiguousarray(rgb))\n"
            "    np.save(f'{sys.argv[2]}/{split}_y.npy', y)\n")
        subprocess.run([PYTHON, "-c", script, os.path.dirname(EVAL), self.tmp, str(train),
                        str(test)], check=True, timeout=120)
        return [os.path.join(self.tmp, f"{s}.npy")
                for s in ("train_x", "train_y", "test_x", "test_y")]

    def test_a_worker_with_another_model_is_refused_naming_the_difference(self):
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=64"])
        first = self.spawn(self.worker_argv(port, *SMALL, "--name=a",
                                            f"--model={os.path.join(EXAMPLES, 'plain_cnn.pt')}"))
        while b"joined as worker" not in first.stdout.readline():
            self.assertIsNone(first.poll(), "the first worker ended before joining")
        rc, _, err = self.run_cmd(self.worker_argv(
            port, *SMALL, "--name=b", f"--model={os.path.join(EXAMPLES, 'wide_cnn.pt')}"), 120)
        self.assertEqual(rc, 2, err)
        self.assertIn("tensor 'conv.weight' has shape [12, 1, 5, 5]", err)
        self.assertIn("[8, 1, 5, 5]", err)

    def test_a_file_that_is_not_torchscript_is_a_clear_error(self):
        bogus = os.path.join(self.tmp, "model.pt")
        with open(bogus, "w") as f:
            f.write("not a model")
        rc, _, err = self.run_cmd(self.worker_argv("1", *SMALL, f"--model={bogus}"), 60)
        self.assertEqual(rc, 2)
        self.assertIn(f"cannot load the TorchScript model {bogus}", err)
        self.assertIn("torch.jit.script", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
