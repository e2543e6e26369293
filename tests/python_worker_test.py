"""Python workers (python/dbs) beside C++ workers in real jobs: every step of a mixed job is the
single-process gradient, its loss curve is the all-C++ job's, it trains as well under DBS, the
package installs offline into a fresh virtual environment, and a Python worker follows a
restarted server, leaves when stopped and answers bad configuration as dbs_worker does. The
Python workers run under Debian's /usr/bin/python3 (python3-torch, python3-grpcio)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import (DATA_DIR, LAUNCHER, PS, RUNFILES, ProcessTestCase,  # noqa: E402
                          checkpoints)
from security_test import make_ca, make_cert  # noqa: E402

PYTHON = "/usr/bin/python3"
PACKAGE = os.path.join(RUNFILES, "python")
EXACTNESS = os.path.join(RUNFILES, "tests", "python_exactness_worker.py")
EVAL = os.path.join(RUNFILES, "tests", "eval_export.py")
ENV = dict(os.environ, PYTHONPATH=PACKAGE)
SMALL = ["--train_limit=3000", "--test_limit=1000", "--log_every_s=60"]


class PythonWorkerCase(ProcessTestCase):
    def python_worker(self, port, *flags, python=PYTHON, env=None):
        return self.spawn([python, "-m", "dbs.worker", f"--server=127.0.0.1:{port}",
                           f"--data_dir={DATA_DIR}", *flags], env=env or ENV)

    def cpp_worker(self, port, *flags):
        return self.spawn(self.worker_argv(port, *flags))

    def finish(self, ps, workers, timeout=300):
        """Waits for every worker, then dbs_ps, each to exit 0; returns the workers' stdout."""
        outs = []
        for p in workers:
            out, err = p.communicate(timeout=timeout)
            self.assertEqual(p.returncode, 0, out.decode()[-2000:] + err.decode()[-3000:])
            outs.append(out.decode())
        _, err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0, err.decode()[-2000:])
        return outs

    def write_init(self, model="cnn"):
        """Initial parameters both kinds of worker load (--init_params), so that which one
        registers the model first does not matter."""
        path = os.path.join(self.tmp, f"{model}.init")
        code = ("import sys, torch; from dbs import models, model_layout; "
                "from dbs.job import layout_values; "
                f"torch.manual_seed(3); m = models.{model}(); "
                "open(sys.argv[1], 'wb').write(layout_values(model_layout(m)).tobytes())")
        subprocess.run([PYTHON, "-c", code, path], check=True, env=ENV, timeout=120)
        return path


class ExactnessTest(PythonWorkerCase):
    def check(self, transport):
        # Plain SGD with lr 8 (a power of two: the update lr * g is exact in float32, and large
        # against the rounding of the parameters it is read back from).
        ps, port = self.start_ps(["--workers=2", "--epochs=2", "--global_batch=64",
                                  "--policy=fixed", "--momentum=0", "--lr=8", "--linger_s=1"],
                                 transport)
        cpp = self.cpp_worker(port, "--name=cpp", "--train_limit=1280", "--test_limit=100",
                              "--log_every_s=60")
        py = self.spawn([PYTHON, EXACTNESS, f"127.0.0.1:{port}", "8", "1280", transport],
                        env=ENV)
        out = self.finish(ps, [cpp, py])[1]
        shared = "shares memory with this worker" in out
        self.assertEqual(shared, transport == "shared", out[-2000:])
        errors = [json.loads(line)["error"] for line in out.splitlines()
                  if line.startswith("{")]
        self.assertEqual(len(errors), 40, out[-2000:])  # 2 epochs of 20 steps
        print(f"1 C++ + 1 Python worker ({transport}): relative error of each step's aggregate "
              f"against the float64 single-process gradient: max {max(errors):.2e}, median "
              f"{sorted(errors)[20]:.2e}")
        self.assertLessEqual(max(errors), 1e-6)

    def test_each_step_of_a_cpp_and_python_job_is_the_single_process_gradient(self):
        self.check("shared")

    def test_so_it_is_when_the_python_worker_pushes_over_the_socket(self):
        self.check("socket")


class LossCurveTest(PythonWorkerCase):
    def run_fixed(self, tag, python, init):
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=64",
                                  "--policy=fixed", "--linger_s=1"], tag)
        flags = ["--train_limit=6400", "--test_limit=500", "--log_every_s=60",
                 f"--init_params={init}"]
        records = [os.path.join(self.tmp, f"{tag}-{i}.json") for i in range(2)]
        a = self.cpp_worker(port, "--name=a", f"--record_path={records[0]}", *flags)
        b = (self.python_worker(port, "--name=b", f"--record_path={records[1]}", *flags)
             if python else
             self.cpp_worker(port, "--name=b", f"--record_path={records[1]}", *flags))
        self.finish(ps, [a, b])
        curves = []
        for r in records:
            with open(r) as f:
                curves.append(json.load(f)["epochs"][0]["step_losses"])
        self.assertEqual(curves[0], curves[1], "both workers see the same step losses")
        return curves[0]

    def test_a_fixed_split_mixed_job_follows_the_all_cpp_loss_curve(self):
        init = self.write_init()
        cpp = self.run_fixed("cpp", False, init)
        mixed = self.run_fixed("mixed", True, init)
        self.assertEqual(len(cpp), 100)
        self.assertEqual(len(mixed), 100)
        gap = max(abs(a - b) for a, b in zip(cpp, mixed))
        print(f"100 steps, fixed split: largest gap between the mixed and the all-C++ loss "
              f"curves {gap:.2e} (losses {cpp[0]:.4f} -> {cpp[-1]:.4f})")
        self.assertLessEqual(gap, 1e-5)
        self.assertLess(cpp[-1], cpp[0] - 1.0, "it trained")


class DbsMixedJobTest(PythonWorkerCase):
    def launch(self, tag, python_workers, init):
        out_dir = os.path.join(self.tmp, tag)
        export = os.path.join(self.tmp, f"{tag}.pt")
        p = self.spawn([sys.executable, LAUNCHER, "--workers=4",
                        f"--python_workers={python_workers}", "--slowdown=1,2,1,2",
                        "--epochs=2", "--global_batch=64", "--train_limit=6000",
                        "--test_limit=2000", f"--data_dir={DATA_DIR}", "--quiet",
                        f"--out_dir={out_dir}", f"--bin_dir={RUNFILES}",
                        f"--export_path={export}", f"--init_params={init}"], env=ENV)
        out, err = p.communicate(timeout=600)
        self.assertEqual(p.returncode, 0, out.decode()[-2000:] + err.decode()[-3000:])
        with open(os.path.join(out_dir, "summary.json")) as f:
            summary = json.load(f)
        for e in summary["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"])
        return summary, export

    def test_under_dbs_a_mixed_job_trains_as_well_as_an_all_cpp_one(self):
        init = self.write_init()
        cpp, _ = self.launch("cpp", 0, init)
        # Workers 2 and 3 (speeds 1 and 1/2) are Python workers; worker 0 exports.
        mixed, _ = self.launch("mixed", 2, init)
        a, b = cpp["final_test_accuracy"], mixed["final_test_accuracy"]

        def balance(s):
            times = [w["compute_seconds"] for w in s["epochs"][-1]["workers"]]
            return max(times) / min(times)
        print(f"DBS, 4 workers of speeds 1, 1/2, 1, 1/2 from the same start: accuracy all-C++ "
              f"{a:.4f}, with 2 Python workers {b:.4f}; last epoch's compute max/min "
              f"{balance(cpp):.2f} and {balance(mixed):.2f}")
        # The same global batches either way; the splits, which follow the measured speeds,
        # change the rounding of each worker's mean, and 188 steps carry that into the
        # accuracy: three runs of each spread over 1.4 points (docs/python.md).
        self.assertAlmostEqual(a, b, delta=0.03)
        self.assertGreater(b, 0.7)

    def test_a_python_workers_export_scores_the_jobs_accuracy_on_raw_inputs(self):
        out_dir = os.path.join(self.tmp, "export")
        export = os.path.join(self.tmp, "py.pt")
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=64",
                                  f"--summary_path={out_dir}.json", "--linger_s=1"])
        cpp = self.cpp_worker(port, "--name=cpp", *SMALL)
        py = self.python_worker(port, "--name=py", f"--export_path={export}", *SMALL)
        self.finish(ps, [cpp, py])
        with open(f"{out_dir}.json") as f:
            job = json.load(f)["final_test_accuracy"]
        r = subprocess.run([PYTHON, EVAL, os.path.join(self.tmp, "py.script.pt"), "1000"],
                           capture_output=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr.decode()[-2000:])
        ev = json.loads(r.stdout.decode())
        self.assertAlmostEqual(ev["accuracy"], job, delta=0.001)
        self.assertAlmostEqual(ev["accuracy_scaled"], job, delta=0.001)
        self.assertEqual((ev["mean"], ev["std"], ev["num_classes"]), ([0.286], [0.353], 10))
        # The state dict loads into the same network.
        code = ("import sys, torch; from dbs import models; m = models.cnn(); "
                "m.load_state_dict(torch.load(sys.argv[1])); print('loaded')")
        r = subprocess.run([PYTHON, "-c", code, export], capture_output=True, env=ENV,
                           timeout=120)
        self.assertEqual(r.stdout.decode().strip(), "loaded", r.stderr.decode()[-2000:])


class ExampleTest(PythonWorkerCase):
    def test_the_unscriptable_resnet_trains_with_two_python_and_two_cpp_workers(self):
        out = subprocess.run([PYTHON, os.path.join(RUNFILES, "examples", "python_resnet.py"),
                              f"--out_dir={self.tmp}", "--epochs=1",
                              f"--launcher_args=--bin_dir={RUNFILES}"],
                             capture_output=True, timeout=600, env=ENV)
        text = out.stdout.decode()
        self.assertEqual(out.returncode, 0, text[-2000:] + out.stderr.decode()[-2000:])
        self.assertIn("torch.jit.script cannot compile it", text)
        result = json.loads(text.strip().splitlines()[-1])
        print(f"examples/python_resnet.py, 1 epoch: job accuracy {result['job_accuracy']:.4f}, "
              f"the export reloaded into the Python module {result['reloaded_accuracy']:.4f}")
        self.assertGreater(result["job_accuracy"], 0.5)
        self.assertAlmostEqual(result["reloaded_accuracy"], result["job_accuracy"], delta=0.001)
        logs = [open(os.path.join(self.tmp, "cluster", f"worker-{i}.log")).read()
                for i in range(4)]
        self.assertTrue(all("epoch 1/1 done" in log for log in logs))
        self.assertIn("model python_resnet:make_model", logs[2], "worker 2 is a Python worker")


class PackageTest(PythonWorkerCase):
    def test_pip_installs_the_package_offline_into_a_fresh_venv_that_trains(self):
        # The checkout's python/ and proto/ as a user has them (the runfiles are symlinks).
        src = os.path.join(self.tmp, "src")
        for d in ("python", "proto"):
            shutil.copytree(os.path.join(RUNFILES, d), os.path.join(src, d), symlinks=False,
                            ignore=shutil.ignore_patterns("_proto", "BUILD", "__pycache__"))
        env_dir = os.path.join(self.tmp, "venv")
        subprocess.run([PYTHON, "-m", "venv", "--system-site-packages", env_dir], check=True,
                       timeout=300)
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        pip = subprocess.run([os.path.join(env_dir, "bin", "pip"), "install", "./python"],
                             cwd=src, capture_output=True, timeout=600, env=clean)
        self.assertEqual(pip.returncode, 0, pip.stdout.decode()[-2000:] +
                         pip.stderr.decode()[-2000:])
        python = os.path.join(env_dir, "bin", "python")
        where = subprocess.run([python, "-c", "import dbs.client; print(dbs.client.__file__)"],
                               capture_output=True, env=clean, cwd=self.tmp, timeout=120)
        self.assertTrue(where.stdout.decode().startswith(env_dir), where.stderr.decode())
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=64",
                                  "--linger_s=1"])
        cpp = self.cpp_worker(port, "--name=cpp", *SMALL)
        py = self.python_worker(port, "--name=venv", *SMALL, python=python, env=clean)
        outs = self.finish(ps, [cpp, py])
        self.assertIn("[venv] epoch 1/1 done", outs[1])


class FailureTest(PythonWorkerCase):
    def test_a_python_worker_resumes_from_a_restarted_server(self):
        flags, ckpt, summary = self.restart_job_flags(2)
        ps, port = self.start_ps(flags)
        common = ["--train_limit=6000", "--test_limit=500", "--model=mlp", "--log_every_s=0.2"]
        cpp = self.cpp_worker(port, "--name=cpp", *common)
        py = self.python_worker(port, "--name=py", *common)
        line = py.stdout.readline().decode()
        while line and not re.search(r"epoch 2/3 step (2\d|[3-9]\d)/", line):
            line = py.stdout.readline().decode()
        self.assertTrue(line, "the Python worker never reached epoch 2's step 20")
        ps.kill()
        ps.wait()
        self.assertGreaterEqual(len(checkpoints(ckpt)), 2)
        restarted = self.spawn([PS, "--host=127.0.0.1", f"--port={port}", "--restore"] + flags)
        rest, _ = py.communicate(timeout=300)
        self.assertEqual(py.returncode, 0, rest.decode()[-3000:])
        self.assertIn("resuming at epoch", rest.decode())
        # The restarted server shares no memory with it until it attaches again.
        self.assertIn("no longer shares memory with this worker", rest.decode())
        cpp.communicate(timeout=120)
        self.assertEqual(cpp.returncode, 0)
        restarted.communicate(timeout=60)
        self.assertEqual(restarted.returncode, 0)
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual((s["status"], s["epochs_completed"]), ("ok", 3))
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["epoch"])

    def test_a_python_worker_cut_off_past_the_timeout_is_removed_and_rejoins(self):
        summary = os.path.join(self.tmp, "summary.json")
        # 4 epochs, the C++ worker 3x slowed: the job outlasts the cut by epochs.
        ps, port = self.start_ps(["--workers=2", "--epochs=4", "--global_batch=64",
                                  "--worker_timeout_s=2", f"--summary_path={summary}",
                                  "--linger_s=1"])
        common = ["--train_limit=6000", "--test_limit=500", "--model=mlp", "--log_every_s=0.2"]
        cpp = self.cpp_worker(port, "--name=cpp", "--slowdown=3", *common)
        py = self.python_worker(port, "--name=py", *common)
        line = py.stdout.readline().decode()
        while line and not re.search(r"epoch 1/4 step", line):
            line = py.stdout.readline().decode()
        self.assertTrue(line, "the Python worker never trained")
        py.send_signal(signal.SIGSTOP)  # cut off, not dead: longer than the worker timeout
        time.sleep(4)
        py.send_signal(signal.SIGCONT)
        out = self.finish(ps, [cpp, py])[1]
        self.assertRegex(out, r"removed from the job \(.*\); joined again as worker \d+ from "
                              r"epoch [234]")
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual((s["status"], s["epochs_completed"]), ("ok", 4))
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["epoch"])
        ids = [w["id"] for w in s["worker_info"] if w["name"] == "py"]
        last = {w["id"]: w["samples"] for w in s["epochs"][-1]["workers"]}
        self.assertTrue(any(last.get(i, 0) > 0 for i in ids), "it trained again after rejoining")

    def test_a_stopped_python_worker_leaves_and_the_others_finish(self):
        summary = os.path.join(self.tmp, "summary.json")
        ps, port = self.start_ps(["--workers=3", "--epochs=2", "--global_batch=64",
                                  f"--summary_path={summary}", "--linger_s=1"])
        common = ["--train_limit=6000", "--test_limit=500", "--model=mlp", "--log_every_s=0.2"]
        cpps = [self.cpp_worker(port, f"--name=cpp{i}", *common) for i in range(2)]
        py = self.python_worker(port, "--name=py", *common)
        line = py.stdout.readline().decode()
        while line and " step " not in line:
            line = py.stdout.readline().decode()
        py.send_signal(signal.SIGTERM)
        out, _ = py.communicate(timeout=60)
        self.assertEqual(py.returncode, 143)
        self.assertIn("stopped: left the job; the others go on", out.decode())
        self.finish(ps, cpps)
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["status"], "ok")
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["epoch"])

    def test_under_mutual_tls_and_a_job_secret_a_python_worker_trains_and_strangers_do_not(self):
        d = self.tmp
        make_ca(d, "ca")
        make_cert(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
        make_cert(d, "worker", "ca")
        secret = os.path.join(d, "job.secret")
        with open(secret, "w") as f:
            f.write("s3cret-job-token\n")
        ps, port = self.start_ps([
            "--workers=2", "--epochs=1", "--global_batch=32", "--linger_s=1",
            f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key",
            f"--tls_client_ca={d}/ca.pem", f"--job_token_file={secret}"])
        tls = [f"--tls_ca={d}/ca.pem", f"--tls_cert={d}/worker.pem",
               f"--tls_key={d}/worker.key"]
        small = ["--train_limit=600", "--test_limit=200", "--log_every_s=60"]
        code, out = self.run_cli(f"--server=127.0.0.1:{port}", *small, *tls,
                                 "--job_token=guess", "--connect_timeout_s=90")
        self.assertEqual(code, 2, out)
        self.assertIn("not this job's", out)
        code, out = self.run_cli(f"--server=127.0.0.1:{port}", *small, "--connect_timeout_s=3",
                                 f"--job_token_file={secret}")
        self.assertEqual(code, 200, "plaintext never gets through: " + out)
        cpp = self.cpp_worker(port, "--name=cpp", *small, *tls, f"--job_token_file={secret}")
        py = self.python_worker(port, "--name=py", *small, *tls, f"--job_token_file={secret}")
        outs = self.finish(ps, [cpp, py])
        self.assertIn("[py] epoch 1/1 done", outs[1])

    def run_cli(self, *flags, env=None):
        r = subprocess.run([PYTHON, "-m", "dbs.worker", *flags], capture_output=True,
                           timeout=120, env=env or ENV)
        return r.returncode, r.stdout.decode() + r.stderr.decode()

    def test_the_command_line_answers_as_dbs_workers_does(self):
        code, out = self.run_cli("--help")
        self.assertEqual(code, 0)
        for flag in ("--server", "--model", "--data", "--max_batch", "--export_path",
                     "--job_token_file", "DBS_<FLAG>"):
            self.assertIn(flag, out)
        code, out = self.run_cli("--data_dir=/nonexistent")
        self.assertEqual(code, 2)
        self.assertIn("apt-get install dataset-fashion-mnist", out)
        code, out = self.run_cli(env=dict(ENV, DBS_NO_SUCH_FLAG="1"))
        self.assertEqual(code, 2)
        self.assertIn("DBS_NO_SUCH_FLAG names no flag", out)
        code, out = self.run_cli("--server=127.0.0.1:1,127.0.0.1:2")
        self.assertEqual(code, 2)
        self.assertIn("a Python worker joins one dbs_ps", out)
        code, out = self.run_cli("--model=no_such_module:f")
        self.assertEqual(code, 2)
        self.assertIn("No module named 'no_such_module'", out)
        code, out = self.run_cli("--server=127.0.0.1:1", "--connect_timeout_s=1",
                                 "--train_limit=100", "--test_limit=100")
        self.assertEqual(code, 200, out)
        self.assertIn("could not reach dbs_ps at 127.0.0.1:1", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
