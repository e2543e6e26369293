"""The deployment files, checked as far as this machine allows (no Docker engine, no cluster):

- the Dockerfile copies only files that exist, builds with the install script and build script
  CI uses, and its runtime stage installs exactly the packages of the libraries the built
  binaries link;
- the compose file passes `docker-compose config -q`, and every service's command and
  environment, run as local processes (service names mapped to loopback ports), train a job to
  completion;
- every Kubernetes overlay renders with `kubectl kustomize`, each object validates against the
  Kubernetes schemas (npm kubernetes-models), and every DBS_* setting in the manifests is a
  variable the binary accepts (`--help`, then `--dry_run` with the manifests' values).

A tool that cannot be had skips its test, saying so.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import PS, RUNFILES, WORKER, ProcessTestCase, free_port  # noqa: E402

PROBE = os.path.join(RUNFILES, "server", "dbs_health_probe")
BINARIES = {"dbs_ps": PS, "dbs_worker": WORKER, "dbs_health_probe": PROBE}
# In debian:bookworm-slim already.
BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}
VALIDATOR = "/usr/local/lib/dbs-k8s-validator/node_modules"


def repo_root():
    # The runfiles hold links into the source tree; follow one back.
    dockerfile = os.path.realpath(os.path.join(RUNFILES, "deploy", "docker", "Dockerfile"))
    return os.path.dirname(os.path.dirname(os.path.dirname(dockerfile)))


ROOT = repo_root()


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def yaml_documents(text):
    """The YAML documents in `text`: with PyYAML here, or Debian's python3-yaml."""
    try:
        import yaml
    except ImportError:
        out = subprocess.run(
            ["/usr/bin/python3", "-c",
             "import json, sys, yaml; json.dump(list(yaml.safe_load_all(sys.stdin)), sys.stdout)"],
            input=text.encode(), capture_output=True, check=True, timeout=60).stdout
        return [d for d in json.loads(out) if d]
    return [d for d in yaml.safe_load_all(text) if d]


def variables_of(binary):
    """The DBS_* variables a binary accepts, from its --help."""
    out = subprocess.run([BINARIES[binary], "--help"], capture_output=True, timeout=30,
                         check=True).stdout.decode()
    return set(re.findall(r"\[(DBS_[A-Z0-9_]+)\]", out))


def linked_packages(binary):
    """The Debian packages of the shared libraries `binary` links directly (readelf NEEDED)."""
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        subprocess.run(["readelf", "-d", binary], capture_output=True,
                                       check=True).stdout.decode())
    paths = {}
    for line in subprocess.run(["ldd", binary], capture_output=True,
                               check=True).stdout.decode().splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m:
            paths[m.group(1)] = m.group(2)
        m = re.match(r"\s*(/\S+) \(", line)  # the loader: listed by its path alone
        if m:
            paths[os.path.basename(m.group(1))] = m.group(1)
    packages = set()
    for lib in needed:
        self_path = os.path.realpath(paths[lib])
        owner = subprocess.run(["dpkg", "-S", self_path], capture_output=True).stdout.decode()
        if not owner:  # merged /usr: dpkg knows the /lib path
            owner = subprocess.run(["dpkg", "-S", self_path.replace("/usr/lib/", "/lib/", 1)],
                                   capture_output=True).stdout.decode()
        packages.add(owner.split(":")[0])
    return packages


class DockerfileTest(unittest.TestCase):
    def setUp(self):
        self.text = read("deploy/docker/Dockerfile")
        # One line per instruction: continuation lines joined.
        self.lines = [line.strip() for line in self.text.replace("\\\n", " ").splitlines()]

    def test_it_copies_only_files_that_exist(self):
        copies = [line.split()[1:] for line in self.lines if line.startswith("COPY ")]
        self.assertTrue(copies)
        for args in copies:
            if args[0].startswith("--from="):
                # From the builder: what build_binaries.sh writes into /out.
                self.assertIn(args[1], ("/out/bin/", "/out/lib/"))
                continue
            for src in args[:-1]:
                self.assertTrue(os.path.exists(os.path.join(ROOT, src)), src)

    def test_it_builds_with_the_scripts_ci_runs(self):
        runs = " ".join(line for line in self.lines if line.startswith("RUN "))
        self.assertIn("bash deploy/install_deps.sh", runs)
        self.assertIn("bash deploy/build_binaries.sh /out", runs)
        ci = read(".ci/run")
        self.assertIn("deploy/build_binaries.sh", ci)
        self.assertIn("deploy/run_tests.sh", ci)
        self.assertIn("deploy/install_deps.sh", read("deploy/run_tests.sh"))
        self.assertIn("bazel build", read("deploy/build_binaries.sh"))
        for target in ("//server:dbs_ps", "//worker:dbs_worker", "//server:dbs_health_probe"):
            self.assertIn(target, read("deploy/build_binaries.sh"))

    def test_the_runtime_stage_installs_the_linked_libraries(self):
        block = self.text.split("# runtime-packages:begin")[1].split("# runtime-packages:end")[0]
        listed = set(re.findall(r"^\s+([a-z0-9][a-z0-9.+-]+)\s*\\?$", block, re.M))
        linked = set()
        for binary in BINARIES.values():
            linked |= linked_packages(binary)
        # A sanitizer build (deploy/run_sanitizers.sh) also links the sanitizers' runtimes.
        linked = {p for p in linked if not re.match(r"lib(asan|ubsan|tsan)\d", p)}
        # The image builds the default way (deploy/build_binaries.sh), which links tcmalloc
        # (//common:malloc); a sanitizer build keeps the sanitizer's allocator instead.
        if os.environ["EXPECTED_MALLOC"] != "tcmalloc":
            linked.add("libtcmalloc-minimal4")
        print(f"linked packages: {sorted(linked)}", flush=True)
        self.assertEqual(listed - {"dataset-fashion-mnist"}, linked - BASE_PACKAGES)
        self.assertIn("dataset-fashion-mnist", listed)


class ComposeTest(ProcessTestCase):
    FILE = "deploy/compose/docker-compose.yaml"
    SHARDS = "deploy/compose/docker-compose.shards.yaml"

    def config(self):
        compose = shutil.which("docker-compose")
        if compose is None:
            self.skipTest("docker-compose is not installed (deploy/install_deps.sh installs it)")
        return compose

    def test_docker_compose_config_accepts_it(self):
        compose = self.config()
        for files in ([self.FILE], [self.FILE, self.SHARDS]):
            argv = [compose]
            for f in files:
                argv += ["-f", os.path.join(ROOT, f)]
            r = subprocess.run(argv + ["config", "-q"], capture_output=True, timeout=60)
            self.assertEqual(r.returncode, 0, f"{files}: {r.stderr.decode()}")

    def test_its_services_train_a_job_as_local_processes(self):
        services = self.train_locally([self.FILE])
        self.assertEqual(len({services[s]["cpus"] for s in services if s != "dbs-ps"}), 4,
                         "the workers' CPU limits differ")

    def test_with_the_shards_file_two_shards_train_the_job(self):
        services = self.train_locally([self.FILE, self.SHARDS])
        self.assertEqual(services["dbs-ps"]["environment"]["DBS_SHARD"], "0/2")
        self.assertEqual(services["dbs-ps-1"]["environment"]["DBS_SHARD"], "1/2")
        follower_ckpt = os.path.join(self.tmp, "checkpoints-dbs-ps-1")
        self.assertTrue(os.listdir(follower_ckpt), "the follower checkpoints into its volume")

    def train_locally(self, files):
        """Runs every service of the resolved compose `files` as a local process (its command
        and environment, with host names, ports and volume paths made local), one short epoch,
        and checks the job; returns the resolved services."""
        compose = self.config()
        argv = [compose]
        for f in files:
            argv += ["-f", os.path.join(ROOT, f)]
        resolved = subprocess.run(argv + ["config"], capture_output=True, timeout=60,
                                  check=True).stdout.decode()
        services = yaml_documents(resolved)[0]["services"]
        self.assertEqual(len([s for s in services if s.startswith("worker-")]), 4)
        servers = sorted(s for s in services if s.startswith("dbs-ps"))
        ports = {name: free_port() for name in servers}
        hosts = {f"{name}:50051": f"127.0.0.1:{ports[name]}" for name in servers}
        metrics_port = free_port()

        def local(name):
            """A service's command and environment, with its names and paths made local."""
            svc = services[name]
            env = {k: str(v) for k, v in svc["environment"].items()}
            ckpt = os.path.join(self.tmp, "checkpoints" if name == "dbs-ps"
                                else f"checkpoints-{name}")
            for k, v in env.items():
                for host, address in hosts.items():
                    v = ",".join(address if part == host else part for part in v.split(","))
                env[k] = v.replace("/checkpoints", ckpt)
            if name in servers:
                env.update(DBS_HOST="127.0.0.1", DBS_PORT=str(ports[name]), DBS_LINGER_S="2",
                           DBS_EPOCHS="1")  # a short job; every other setting is the file's
                if "DBS_METRICS_PORT" in env:
                    env["DBS_METRICS_PORT"] = str(metrics_port)
            else:
                env.update(DBS_TRAIN_LIMIT="2000", DBS_TEST_LIMIT="400", DBS_LOG_EVERY_S="60")
            argv = [BINARIES[svc["command"][0]], *svc["command"][1:]]
            base = {k: v for k, v in os.environ.items() if not k.startswith("DBS_")}
            return argv, {**base, **env}

        procs = {}
        for name in servers:
            argv, env = local(name)
            procs[name] = self.spawn(argv, env=env)
        # depends_on: service_healthy -- each file's own health check, made local.
        for name in servers:
            check = services[name]["healthcheck"]["test"][1:]  # after "CMD"
            probe = [BINARIES[check[0]]] + [
                a.replace("127.0.0.1:50051", f"127.0.0.1:{ports[name]}") for a in check[1:]]
            deadline = time.time() + 60
            while subprocess.run(probe, capture_output=True).returncode != 0:
                self.assertLess(time.time(), deadline, f"{name} never became healthy")
                self.assertIsNone(procs[name].poll(), f"{name} exited")
                time.sleep(0.5)
        workers = []
        for name in sorted(s for s in services if s.startswith("worker-")):
            argv, env = local(name)
            workers.append(self.spawn(argv, env=env))
        for w in workers:
            _, err = w.communicate(timeout=600)
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])
        for name in servers:
            _, err = procs[name].communicate(timeout=60)
            self.assertEqual(procs[name].returncode, 0, f"{name}: {err.decode()[-2000:]}")
        ckpt = os.path.join(self.tmp, "checkpoints")
        with open(os.path.join(ckpt, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["status"], "ok")
        self.assertEqual(sorted(w["name"] for w in summary["worker_info"]),
                         ["worker-0", "worker-1", "worker-2", "worker-3"])
        self.assertTrue(os.listdir(ckpt), "checkpoints were written to the volume's directory")
        return services


class KubernetesTest(unittest.TestCase):
    OVERLAYS = ["cpu", "gpu", "hetero-demo", "sharded"]

    def render(self, overlay):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed (deploy/install_deps.sh installs Debian's "
                          "kubernetes-client)")
        r = subprocess.run([kubectl, "kustomize", os.path.join(ROOT, "deploy/k8s/overlays",
                                                               overlay)],
                           capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        return yaml_documents(r.stdout.decode())

    def validate(self, objects):
        node = shutil.which("node")
        if node is None or not os.path.isdir(os.path.join(VALIDATOR, "kubernetes-models")):
            self.skipTest("node or the npm package kubernetes-models is missing "
                          "(deploy/install_deps.sh installs it)")
        return subprocess.run([node, os.path.join(ROOT, "deploy/k8s/validate.js")],
                              input=json.dumps(objects).encode(), capture_output=True,
                              env={**os.environ, "NODE_PATH": VALIDATOR}, timeout=120)

    def test_every_overlay_renders_and_validates_against_the_schemas(self):
        for overlay in self.OVERLAYS:
            objects = self.render(overlay)
            counts = {}
            for o in objects:
                counts[o["kind"]] = counts.get(o["kind"], 0) + 1
            print(f"overlay {overlay}: {len(objects)} objects {counts}", flush=True)
            self.assertEqual(counts.get("StatefulSet"), 1, overlay)
            self.assertGreaterEqual(counts.get("Job", 0), 1, overlay)
            r = self.validate(objects)
            self.assertEqual(r.returncode, 0, f"{overlay}:\n{r.stdout.decode()}")
            self.assertEqual(r.stdout.decode().count("valid "), len(objects))
        sharded = {o["kind"]: o for o in self.render("sharded")}
        self.assertEqual(sharded["StatefulSet"]["spec"]["replicas"], 2)
        self.assertEqual(sharded["StatefulSet"]["spec"]["podManagementPolicy"], "Parallel")
        worker_config = [o for o in self.render("sharded") if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"].startswith("dbs-worker-config")][0]
        self.assertEqual(worker_config["data"]["DBS_SERVER"],
                         "dbs-ps-0.dbs-ps:50051,dbs-ps-1.dbs-ps:50051")
        gpu = {o["kind"]: o for o in self.render("gpu")}
        container = gpu["Job"]["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(container["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(container["image"], "dbs:cuda")

    def test_the_validator_catches_a_broken_object(self):
        objects = self.render("cpu")
        broken = [o for o in objects if o["kind"] == "StatefulSet"]
        broken[0]["spec"]["replicas"] = "one"
        r = self.validate(broken)
        self.assertEqual(r.returncode, 1, r.stdout.decode())
        self.assertIn("INVALID", r.stdout.decode())

    def test_every_setting_is_one_the_binary_accepts(self):
        accepted = {b: variables_of(b) for b in ("dbs_ps", "dbs_worker")}
        for overlay in self.OVERLAYS:
            objects = self.render(overlay)
            config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects
                           if o["kind"] == "ConfigMap"}
            for o in objects:
                if o["kind"] not in ("StatefulSet", "Job"):
                    continue
                for c in o["spec"]["template"]["spec"]["containers"]:
                    binary = c["command"][0]
                    self.assertIn(binary, accepted, f"{overlay}: {binary}")
                    env = {}
                    for ref in c.get("envFrom", []):
                        env.update(config_maps[ref["configMapRef"]["name"]])
                    for e in c.get("env", []):
                        env[e["name"]] = e.get("value", "from-the-pod")
                    unknown = {k for k in env if k.startswith("DBS_")} - accepted[binary]
                    self.assertEqual(unknown, set(), f"{overlay} {o['metadata']['name']}")
                    # The values too: the binary checks them (files named are stand-ins).
                    with tempfile.TemporaryDirectory() as d:
                        token = os.path.join(d, "job-token")
                        with open(token, "w") as f:
                            f.write("secret\n")
                        env = {k: (token if k.endswith("_FILE") else
                                   d if k == "DBS_CHECKPOINT_DIR" else v)
                               for k, v in env.items()}
                        base = {k: v for k, v in os.environ.items() if not k.startswith("DBS_")}
                        # Each pod of a StatefulSet, by its name (--shard=ordinal/k reads it).
                        pods = [f"{o['metadata']['name']}-{i}"
                                for i in range(o["spec"].get("replicas", 1))]
                        for pod in pods if o["kind"] == "StatefulSet" else ["worker-0"]:
                            r = subprocess.run([BINARIES[binary], "--dry_run"],
                                               env={**base, "HOSTNAME": pod, **env},
                                               capture_output=True, timeout=30)
                            self.assertEqual(r.returncode, 0,
                                             f"{overlay} {binary} {pod}: {r.stderr.decode()}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
