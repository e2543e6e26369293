"""A user's own model, end to end: TorchScript models scripted in Python (examples/models.py, at
build time) train with real processes, and the exported weights load back in PyTorch with the
accuracy the job reported. Python steps use Debian's /usr/bin/python3 (python3-torch).
"""

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

    def exported_accuracy(self, kind, path):
        out = subprocess.run([PYTHON, EVAL, kind, path, str(TEST_LIMIT)], capture_output=True,
                             timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-3000:])
        return float(out.stdout.decode())

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
        job = summary["final_test_accuracy"]
        exported = self.exported_accuracy("script", export)
        print(f"resnet_bn under dbs: job accuracy {job:.4f}, exported module {exported:.4f}",
              flush=True)
        # Every worker evaluated the same parameters and BatchNorm statistics (averaged by the
        # server at every step), so the export is the model the job measured.
        self.assertAlmostEqual(exported, job, delta=0.001)

    def test_a_builtin_model_exports_a_state_dict_pytorch_loads(self):
        export = os.path.join(self.tmp, "cnn.pt")
        summary, _ = self.train(["w0", "w1"], lambda n: [f"--export_path={export}"]
                                if n == "w0" else [], epochs=1)
        exported = self.exported_accuracy("cnn", export)
        self.assertAlmostEqual(exported, summary["final_test_accuracy"], delta=0.001)

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
