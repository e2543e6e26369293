"""The container image built and the compose cluster run for real, on a real Docker engine.

It builds the image (deploy/docker/Dockerfile) on a Debian base made from the mirror
(deploy/docker/make_base_image.sh), then runs the shipped compose file with docker-compose,
changed only where a test must: every service on the host's network (network_mode: host, so the
traffic stays on loopback) with ports chosen at run time, host folders for the checkpoints and
the export, a short job. Three jobs:

1. to completion: status ok, every container exits 0, dbs-ps is not restarted, the summary and
   the exported model reach the host (the export, fed raw test images, scores the job's
   accuracy); then `up` again on the same folders: dbs-ps exits 0 at once, summary unchanged;
2. `docker kill` of a worker mid-epoch: the job completes, every epoch's sample audit clean;
3. SIGKILL of the dbs-ps container's process mid-epoch: Docker restarts it, it restores its
   newest checkpoint, and the workers resume and finish the job;
4. with docker-compose.python.yaml, a fourth worker from the image's python-worker stage
   (python3 -m dbs.worker) trains beside the three dbs_worker containers.

Needs a Docker engine (deploy/start_dockerd.sh starts one, as root) and docker-compose; skips,
saying why, only where none can be had. Prints the image's size, its build time and the time
from `up` to the first step.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", "dbs"))
if not os.path.isdir(RUNFILES):
    RUNFILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE_FILE = "deploy/compose/docker-compose.yaml"
PYTHON_FILE = "deploy/compose/docker-compose.python.yaml"
BASE_IMAGE = "dbs-base:bookworm"
IMAGE = "dbs:compose-test"
PYTHON_IMAGE = "dbs-python:compose-test"
PYTHON = "/usr/bin/python3"
TOKEN = "compose-test-secret"


def source_root():
    # The runfiles hold links into the source tree; follow one back (the build context).
    dockerfile = os.path.realpath(os.path.join(RUNFILES, "deploy", "docker", "Dockerfile"))
    return os.path.dirname(os.path.dirname(os.path.dirname(dockerfile)))


ROOT = source_root()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, timeout=600, check=True, **kw):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-4000:]}")
    return r


def yaml_load(text):
    r = subprocess.run([PYTHON, "-c", "import json, sys, yaml; "
                        "json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
                       input=text.encode(), capture_output=True, check=True, timeout=60)
    return json.loads(r.stdout)


def docker_unavailable():
    """Why the tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "the docker client is not installed (deploy/install_deps.sh installs docker.io)"
    if shutil.which("docker-compose") is None:
        return "docker-compose is not installed (deploy/install_deps.sh installs it)"
    r = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    if r.returncode != 0:
        return ("no Docker engine answers (deploy/start_dockerd.sh starts one as root): "
                + r.stderr.decode().strip().splitlines()[-1][:200])
    return None


class ComposeClusterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = docker_unavailable()
        if why:
            raise unittest.SkipTest(why)
        start = time.time()
        run(["bash", os.path.join(ROOT, "deploy/docker/make_base_image.sh"), BASE_IMAGE],
            timeout=900)
        base_s = time.time() - start
        start = time.time()
        run(["docker", "build", "-f", os.path.join(ROOT, "deploy/docker/Dockerfile"),
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, ROOT], timeout=3000)
        build_s = time.time() - start
        size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]).stdout)
        # The Python workers' stage (its builder is the one just built).
        start = time.time()
        run(["docker", "build", "-f", os.path.join(ROOT, "deploy/docker/Dockerfile"),
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--target=python-worker", "-t",
             PYTHON_IMAGE, ROOT], timeout=3000)
        python_s = time.time() - start
        python_size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}",
                               PYTHON_IMAGE]).stdout)
        print(f"compose_test: base image in {base_s:.0f} s; dbs image {size / 2**20:.0f} MiB "
              f"built in {build_s:.0f} s; the Python worker's {python_size / 2**20:.0f} MiB in "
              f"{python_s:.0f} s more", flush=True)
        cls.image_mib, cls.build_s = size / 2**20, build_s

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dbs-compose-")
        os.chmod(self.tmp, 0o755)
        self.project = f"dbstest{os.getpid()}{self._testMethodName[-6:].lower()}"
        self.files = []

    def tearDown(self):
        for f in self.files:
            subprocess.run(["docker-compose", "-p", self.project, "-f", f, "down", "-v",
                            "--remove-orphans", "-t", "5"], capture_output=True, timeout=120)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def folder(self, name):
        """A host folder the image's user (10001) can write."""
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o777)
        return path

    def compose(self, epochs, extra_ps=None, worker_env=None, files=(COMPOSE_FILE,)):
        """The shipped compose `files`, resolved, with the changes a test on one host needs."""
        env = {**os.environ, "DBS_CHECKPOINTS": self.folder("checkpoints"),
               "DBS_EXPORT": self.folder("export"), "DBS_JOB_TOKEN": TOKEN}
        argv = ["docker-compose"]
        for f in files:
            argv += ["-f", os.path.join(ROOT, f)]
        resolved = run(argv + ["config"], env=env).stdout
        spec = yaml_load(resolved)
        self.port, self.metrics = free_port(), free_port()
        for name, svc in spec["services"].items():
            svc.pop("build", None)
            svc.pop("ports", None)
            svc["image"] = PYTHON_IMAGE if svc["image"].startswith("dbs-python") else IMAGE
            svc["network_mode"] = "host"
            e = svc["environment"]
            if name == "dbs-ps":
                e.update(DBS_HOST="127.0.0.1", DBS_PORT=str(self.port),
                         DBS_METRICS_PORT=str(self.metrics), DBS_METRICS_HOST="127.0.0.1",
                         DBS_EPOCHS=str(epochs), DBS_LINGER_S="5", DBS_WORKER_TIMEOUT_S="5",
                         DBS_CHECKPOINT_EVERY_STEPS="10", **(extra_ps or {}))
                svc["healthcheck"]["test"] = [
                    "CMD", "dbs_health_probe", f"--server=127.0.0.1:{self.port}"]
                svc["healthcheck"]["interval"] = "1s"
            else:
                e.update(DBS_SERVER=f"127.0.0.1:{self.port}", DBS_TRAIN_LIMIT="9600",
                         DBS_TEST_LIMIT="2000", DBS_LOG_EVERY_S="10", **(worker_env or {}))
        path = os.path.join(self.tmp, f"compose-{len(self.files)}.json")
        with open(path, "w") as f:
            json.dump(spec, f)  # JSON is YAML
        self.files.append(path)
        self.services = sorted(spec["services"])
        return path

    def up(self, path):
        start = time.time()
        r = run(["docker-compose", "-p", self.project, "-f", path, "up", "-d"], check=False,
                timeout=600)
        return start, r

    def container(self, service):
        ids = run(["docker-compose", "-p", self.project, "-f", self.files[-1], "ps", "-q",
                   service]).stdout.split()
        return ids[0] if ids else None

    def state(self, service):
        cid = self.container(service)
        if cid is None:
            return None
        out = run(["docker", "inspect", "-f",
                   "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}} {{.State.Pid}}",
                   cid]).stdout.split()
        return {"status": out[0], "exit": int(out[1]), "restarts": int(out[2]),
                "pid": int(out[3]), "id": cid}

    def logs(self, service):
        return run(["docker", "logs", self.container(service)], timeout=60).stdout

    def status_json(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/status.json",
                                    timeout=5) as r:
            return json.load(r)

    def wait_for(self, what, cond, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                got = cond()
            except (OSError, ValueError, KeyError):
                got = None
            if got:
                return got
            time.sleep(0.5)
        said = "".join(f"\n{s} said:\n{self.logs(s)[-6000:]}" for s in self.services
                       if self.container(s))
        self.fail(f"{what} within {timeout} s{said}")

    def wait_for_step(self, epoch, step, timeout=300):
        """Until dbs-ps's status page shows the job at (1-based) `epoch`, `step` or later."""
        def there():
            live = self.status_json()["live"]
            return (live["epoch"], live["step"]) >= (epoch, step)
        self.wait_for(f"step {step} of epoch {epoch}", there, timeout)

    def wait_until_all_exit(self, timeout=900):
        def done():
            states = {s: self.state(s) for s in self.services}
            if all(st is not None and st["status"] == "exited" for st in states.values()):
                return states
            return None
        return self.wait_for("every container exits", done, timeout)

    def summary(self):
        with open(os.path.join(self.tmp, "checkpoints", "summary.json")) as f:
            return json.load(f)

    def check_trained(self, summary, epochs):
        self.assertEqual(summary["status"], "ok")
        self.assertEqual(summary["epochs_completed"], epochs)
        for e in summary["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], (e["epoch"], e["audit"]))

    def test_the_job_runs_to_completion_and_stays_finished(self):
        path = self.compose(epochs=2)
        start, r = self.up(path)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        self.wait_for("the first step", lambda: self.status_json()["live"]["step"] >= 1
                      or self.status_json()["live"]["epoch"] > 1, 300)
        first_step = time.time() - start
        states = self.wait_until_all_exit()
        for service, st in states.items():
            self.assertEqual(st["exit"], 0, f"{service}:\n{self.logs(service)[-2000:]}")
        self.assertEqual(states["dbs-ps"]["restarts"], 0, "dbs-ps is not restarted after success")
        for service in self.services:  # a failure is retried, a bounded number of times
            policy = run(["docker", "inspect", "-f",
                          "{{.HostConfig.RestartPolicy.Name}} "
                          "{{.HostConfig.RestartPolicy.MaximumRetryCount}}",
                          states[service]["id"]]).stdout.split()
            self.assertEqual(policy, ["on-failure", "5"], service)
        summary = self.summary()
        self.check_trained(summary, epochs=2)
        self.assertEqual(sorted(w["name"] for w in summary["worker_info"]),
                         ["worker-0", "worker-1", "worker-2"])
        limited = [w for w in summary["worker_info"] if w["name"] == "worker-2"][0]
        self.assertAlmostEqual(limited.get("cpu_limit_cores", 0), 0.25, places=2,
                               msg="worker-2 runs under its compose CPU limit and knows it")
        # The trained model reached the host, and stands alone: raw test images in, the job's
        # accuracy out.
        export = os.path.join(self.tmp, "export", "trained.pt")
        self.assertTrue(os.path.exists(export), "worker-0's export is on the host")
        ev = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "eval_export.py"), export, "2000"],
                            capture_output=True, text=True, timeout=300)
        self.assertEqual(ev.returncode, 0, ev.stderr[-3000:])
        ev = json.loads(ev.stdout)
        self.assertAlmostEqual(ev["accuracy"], summary["final_test_accuracy"], delta=0.001)
        print(f"compose_test: up to the first step {first_step:.1f} s; the job's accuracy "
              f"{100 * summary['final_test_accuracy']:.2f}% (the export on raw images "
              f"{100 * ev['accuracy']:.2f}%); image {self.image_mib:.0f} MiB built in "
              f"{self.build_s:.0f} s", flush=True)

        # `up` again on the same folders: the job is done, dbs-ps says so and exits 0 at once.
        with open(os.path.join(self.tmp, "checkpoints", "summary.json"), "rb") as f:
            before = f.read()
        self.up(path)
        self.wait_for("dbs-ps exits", lambda: self.state("dbs-ps")["status"] == "exited", 120)
        st = self.state("dbs-ps")
        self.assertEqual((st["exit"], st["restarts"]), (0, 0))
        self.assertIn("has finished", self.logs("dbs-ps"))
        with open(os.path.join(self.tmp, "checkpoints", "summary.json"), "rb") as f:
            self.assertEqual(f.read(), before, "the summary is left as it was")

    def test_a_python_worker_trains_beside_the_cpp_workers(self):
        path = self.compose(epochs=1, files=(COMPOSE_FILE, PYTHON_FILE))
        _, r = self.up(path)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        states = self.wait_until_all_exit()
        for service, st in states.items():
            self.assertEqual(st["exit"], 0, f"{service}:\n{self.logs(service)[-2000:]}")
        summary = self.summary()
        self.check_trained(summary, epochs=1)
        names = {w["id"]: w["name"] for w in summary["worker_info"]}
        self.assertEqual(sorted(names.values()),
                         ["worker-0", "worker-1", "worker-2", "worker-python"])
        python = [w for w in summary["epochs"][0]["workers"]
                  if names[w["id"]] == "worker-python"][0]
        self.assertGreater(python["samples"], 0)
        self.assertIn("[worker-python] epoch 1/1 done", self.logs("worker-python"))
        print(f"compose_test: 3 dbs_worker containers and a Python one (python3 -m dbs.worker), "
              f"which trained {python['samples']} samples; accuracy "
              f"{100 * summary['final_test_accuracy']:.2f}%", flush=True)

    def test_a_worker_killed_mid_epoch_leaves_the_job_to_the_others(self):
        path = self.compose(epochs=3)
        _, r = self.up(path)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        self.wait_for_step(2, 10)
        run(["docker", "kill", self.container("worker-1")])
        states = self.wait_until_all_exit()
        self.assertEqual(states["dbs-ps"]["exit"], 0, self.logs("dbs-ps")[-3000:])
        for service in ("worker-0", "worker-2"):
            self.assertEqual(states[service]["exit"], 0, self.logs(service)[-2000:])
        summary = self.summary()
        self.check_trained(summary, epochs=3)
        removed = [d for e in summary["epochs"] for d in e.get("dead_workers", [])]
        rejoined = states["worker-1"]["restarts"] > 0
        self.assertTrue(removed or rejoined, "worker-1 was removed or came back")
        print(f"compose_test: worker-1 killed in epoch 2; removed {removed}, restarted "
              f"{states['worker-1']['restarts']} time(s); accuracy "
              f"{100 * summary['final_test_accuracy']:.2f}%", flush=True)

    def test_a_killed_server_restarts_restores_and_the_workers_continue(self):
        path = self.compose(epochs=3)
        _, r = self.up(path)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        self.wait_for_step(2, 25)
        # A crash, not a stop: SIGKILL to the container's process from the host, which Docker's
        # restart policy answers (docker kill would count as a stop by hand).
        os.kill(self.state("dbs-ps")["pid"], signal.SIGKILL)
        states = self.wait_until_all_exit()
        ps = states["dbs-ps"]
        self.assertEqual(ps["restarts"], 1, self.logs("dbs-ps")[-3000:])
        self.assertEqual(ps["exit"], 0, self.logs("dbs-ps")[-3000:])
        for service in ("worker-0", "worker-1", "worker-2"):
            self.assertEqual(states[service]["exit"], 0, self.logs(service)[-2000:])
        self.assertIn("restored", self.logs("dbs-ps"))
        summary = self.summary()
        self.check_trained(summary, epochs=3)
        print(f"compose_test: dbs-ps killed in epoch 2 and restored; accuracy "
              f"{100 * summary['final_test_accuracy']:.2f}%", flush=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
