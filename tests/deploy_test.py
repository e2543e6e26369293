"""The deployment files, checked without a container engine or a cluster (tests/compose_test.py
builds the image and runs the compose cluster for real):

- the Dockerfile copies only files that exist, builds with the install script and build script
  CI uses, runs as a user of its own with a health check, its build context is the sources
  alone, and its runtime stage installs exactly the packages of the libraries the built binaries
  link;
- the compose files pass `docker-compose config -q`, and every service's command and
  environment, run as local processes (service names mapped to loopback ports), train a job to
  completion;
- every Kubernetes overlay renders with `kubectl kustomize` without deprecated fields, each
  object validates against the Kubernetes schemas (npm kubernetes-models), follows the rules a
  cluster with Pod Security "restricted" and a locally loaded image needs (manifest_problems),
  and every DBS_* setting in the manifests is a variable the binary accepts (`--help`, then
  `--dry_run` with the manifests' values).

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
# python3 (the Python worker's image runs python3 -m dbs.worker) is Debian's, with the package
# from the runfiles.
BINARIES = {"dbs_ps": PS, "dbs_worker": WORKER, "dbs_health_probe": PROBE,
            "python3": "/usr/bin/python3"}
PYTHON_PACKAGE = os.path.join(RUNFILES, "python")
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


# How each program a manifest runs is started here: the binaries, and the Python worker
# (python3 -m dbs.worker) with the package from the runfiles.
PROGRAMS = {"dbs_ps": [PS], "dbs_worker": [WORKER],
            "dbs.worker": ["/usr/bin/python3", "-m", "dbs.worker"]}


def variables_of(program):
    """The DBS_* variables a program accepts, from its --help."""
    out = subprocess.run(PROGRAMS[program] + ["--help"], capture_output=True, timeout=60,
                         check=True, env={**os.environ, "PYTHONPATH": PYTHON_PACKAGE}
                         ).stdout.decode()
    if program == "dbs.worker":  # argparse's help: each flag, DBS_<FLAG> for all
        return {"DBS_" + f.upper() for f in re.findall(r"^  --([a-z0-9_]+)", out, re.M)}
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
                self.assertIn(args[1], ("/out/bin/", "/out/lib/", "/out/python/"))
                continue
            for src in args[:-1]:
                self.assertTrue(os.path.exists(os.path.join(ROOT, src)), src)

    def test_it_builds_with_the_scripts_ci_runs(self):
        runs = " ".join(line for line in self.lines if line.startswith("RUN "))
        self.assertIn("bash deploy/install_deps.sh --build", runs)
        self.assertIn("bash deploy/build_binaries.sh /out", runs)
        self.assertIn("deploy/run_tests.sh", read(".ci/run"))
        self.assertIn("deploy/install_deps.sh", read("deploy/run_tests.sh"))
        self.assertIn("bazel build", read("deploy/build_binaries.sh"))
        for target in ("//server:dbs_ps", "//worker:dbs_worker", "//server:dbs_health_probe",
                       "//python:stubs"):
            self.assertIn(target, read("deploy/build_binaries.sh"))

    def test_it_runs_on_any_debian_base_as_a_user_of_its_own(self):
        self.assertIn("ARG BASE_IMAGE=debian:12", self.lines)
        stages = [line for line in self.lines if line.startswith("FROM ")]
        # The runtime stage last: a plain `docker build` makes it.
        self.assertEqual(stages, ["FROM ${BASE_IMAGE} AS builder",
                                  "FROM ${BASE_IMAGE} AS python-worker",
                                  "FROM ${BASE_IMAGE} AS runtime"])
        runtime = self.lines[self.lines.index("FROM ${BASE_IMAGE} AS runtime"):]
        python = self.lines[self.lines.index("FROM ${BASE_IMAGE} AS python-worker"):
                            self.lines.index("FROM ${BASE_IMAGE} AS runtime")]
        for stage in (runtime, python):
            users = [line.split()[1] for line in stage if line.startswith("USER ")]
            self.assertEqual(len(users), 1)
            self.assertNotIn(users[0].split(":")[0], ("0", "root"))
        self.assertIn('CMD ["python3", "-m", "dbs.worker"]', python)
        self.assertTrue(any(line.startswith("HEALTHCHECK ") and "dbs_health_probe" in line
                            for line in runtime))
        # Every binary refuses a DBS_* variable that is not its own: the image sets none.
        self.assertFalse([line for line in self.lines if line.startswith("ENV DBS_")])
        # Test tools stay out of the image: the builder installs the build packages alone.
        self.assertNotRegex(self.text, r"chromium|prometheus |npm|nodejs")

    def test_the_build_context_is_the_sources_alone(self):
        rules = [line.strip() for line in read(".dockerignore").splitlines()
                 if line.strip() and not line.startswith("#")]
        self.assertEqual(rules[0], "*", "everything is left out unless named")
        kept = {r[1:] for r in rules[1:] if r.startswith("!")}
        for needed in ("WORKSPACE", "BUILD", ".bazelrc", "server", "worker", "common", "proto",
                       "third_party", "python/BUILD", "python/dbs/*.py",
                       "deploy/install_deps.sh", "deploy/build_binaries.sh"):
            self.assertIn(needed, kept)
        self.assertFalse(kept & {".git", "out", "bench", "docs", "tests"}, kept)

    def test_the_runtime_stage_installs_the_linked_libraries(self):
        block = self.text.split("# runtime-packages:begin")[1].split("# runtime-packages:end")[0]
        listed = set(re.findall(r"^\s+([a-z0-9][a-z0-9.+-]+)\s*\\?$", block, re.M))
        linked = set()
        for binary in (PS, WORKER, PROBE):
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
    PYTHON_WORKER = "deploy/compose/docker-compose.python.yaml"

    def config(self):
        compose = shutil.which("docker-compose")
        if compose is None:
            self.skipTest("docker-compose is not installed (deploy/install_deps.sh installs it)")
        return compose

    def test_docker_compose_config_accepts_it(self):
        compose = self.config()
        for files in ([self.FILE], [self.FILE, self.SHARDS], [self.FILE, self.PYTHON_WORKER]):
            argv = [compose]
            for f in files:
                argv += ["-f", os.path.join(ROOT, f)]
            r = subprocess.run(argv + ["config", "-q"], capture_output=True, timeout=60)
            self.assertEqual(r.returncode, 0, f"{files}: {r.stderr.decode()}")

    def test_its_services_train_a_job_as_local_processes(self):
        services = self.train_locally([self.FILE])
        cpus = sorted(services[s]["cpus"] for s in services if s.startswith("worker-"))
        self.assertLess(cpus[0], cpus[-1], "one worker is limited to less CPU than the others")
        self.assertTrue(os.path.exists(os.path.join(self.tmp, "export", "trained.pt")),
                        "worker-0 exported the trained model")

    def test_with_the_shards_file_two_shards_train_the_job(self):
        services = self.train_locally([self.FILE, self.SHARDS])
        self.assertEqual(services["dbs-ps"]["environment"]["DBS_SHARD"], "0/2")
        self.assertEqual(services["dbs-ps-1"]["environment"]["DBS_SHARD"], "1/2")
        follower_ckpt = os.path.join(self.tmp, "checkpoints-dbs-ps-1")
        self.assertTrue(os.listdir(follower_ckpt), "the follower checkpoints into its volume")

    def test_with_the_python_file_a_python_worker_trains_beside_them(self):
        services = self.train_locally([self.FILE, self.PYTHON_WORKER])
        self.assertEqual(services["worker-python"]["command"], ["python3", "-m", "dbs.worker"])
        self.assertEqual(services["dbs-ps"]["environment"]["DBS_WORKERS"], "4")

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
        worker_names = sorted(s for s in services if s.startswith("worker-"))
        self.assertEqual(len(worker_names),
                         int(services["dbs-ps"]["environment"]["DBS_WORKERS"]))
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
                env[k] = v.replace("/checkpoints", ckpt).replace(
                    "/export", os.path.join(self.tmp, "export"))
            if name in servers:
                env.update(DBS_HOST="127.0.0.1", DBS_PORT=str(ports[name]), DBS_LINGER_S="2",
                           DBS_EPOCHS="1")  # a short job; every other setting is the file's
                if "DBS_METRICS_PORT" in env:
                    env["DBS_METRICS_PORT"] = str(metrics_port)
            else:
                env.update(DBS_TRAIN_LIMIT="2000", DBS_TEST_LIMIT="400", DBS_LOG_EVERY_S="60")
            argv = [BINARIES[svc["command"][0]], *svc["command"][1:]]
            base = {k: v for k, v in os.environ.items() if not k.startswith("DBS_")}
            if svc["command"][0] == "python3":  # the image's PYTHONPATH, made local
                base["PYTHONPATH"] = PYTHON_PACKAGE
            return argv, {**base, **env}

        os.makedirs(os.path.join(self.tmp, "export"), exist_ok=True)
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
        self.assertEqual(sorted(w["name"] for w in summary["worker_info"]), worker_names)
        self.assertTrue(os.listdir(ckpt), "checkpoints were written to the volume's directory")
        return services


# Pod Security "restricted" (Kubernetes' Pod Security Standards): the volume types it allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
DEPRECATED_KUSTOMIZE_FIELDS = {"bases", "commonLabels", "patchesStrategicMerge",
                               "patchesJson6902", "vars", "imageTags"}


def documented_secret():
    """The Secret docs/deploying.md tells the user to create: (name, key)."""
    m = re.search(r"kubectl create secret generic (\S+) --from-literal=([\w.-]+)=",
                  read("docs/deploying.md"))
    if m is None:
        raise AssertionError("docs/deploying.md shows no `kubectl create secret generic` line")
    return m.group(1), m.group(2)


def pod_specs(objects):
    """(object, its pod spec) for every workload."""
    for o in objects:
        if o["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet", "ReplicaSet"):
            yield o, o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            yield o, o["spec"]


def manifest_problems(objects, secret):
    """What in a rendered overlay a cluster would refuse, restart forever or leave open."""
    problems = []
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    secret_name, secret_key = secret
    for o in objects:
        if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Pod"):
            problems.append(f"{o['kind']} {o['metadata']['name']}: the server and the workers "
                            "run as Jobs, which end when the job does")
        if o["kind"] == "Secret":
            problems.append(f"Secret {o['metadata']['name']}: the job secret is the user's own "
                            "(kubectl create secret), never a placeholder in the manifests")
    for o, pod in pod_specs(objects):
        where = f"{o['kind']} {o['metadata']['name']}"
        labels = o["spec"]["template"]["metadata"].get("labels", {})
        ctx = pod.get("securityContext", {})
        if ctx.get("runAsNonRoot") is not True:
            problems.append(f"{where}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            problems.append(f"{where}: runs as root")
        if ctx.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: no RuntimeDefault seccompProfile")
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(host):
                problems.append(f"{where}: {host}")
        for v in pod.get("volumes", []):
            kinds = set(v) - {"name"}
            if not kinds <= RESTRICTED_VOLUMES:
                problems.append(f"{where}: volume {v['name']} of type {kinds}")
            if "secret" in v and v["secret"]["secretName"] != secret_name:
                problems.append(f"{where}: secret {v['secret']['secretName']} is not the "
                                f"documented {secret_name}")
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim is not None and claim not in by_kind.get("PersistentVolumeClaim", {}):
                problems.append(f"{where}: claim {claim} is in no PersistentVolumeClaim here")
        for c in pod.get("initContainers", []) + pod["containers"]:
            cw = f"{where} container {c['name']}"
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{cw}: allowPrivilegeEscalation is not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                problems.append(f"{cw}: capabilities not dropped (ALL)")
            if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
                problems.append(f"{cw}: adds capabilities")
            if sc.get("privileged") or sc.get("runAsUser") == 0:
                problems.append(f"{cw}: privileged or root")
            if c.get("imagePullPolicy") != "IfNotPresent":
                problems.append(f"{cw}: imagePullPolicy {c.get('imagePullPolicy')} (a locally "
                                "loaded image needs IfNotPresent)")
            if not re.fullmatch(r"[\w./:-]+:[\w.-]+", c.get("image", "")):
                problems.append(f"{cw}: image {c.get('image')} has no tag from the overlay")
            for ref in c.get("envFrom", []):
                name = ref.get("configMapRef", {}).get("name")
                if name is not None and name not in by_kind.get("ConfigMap", {}):
                    problems.append(f"{cw}: ConfigMap {name} is not in the overlay")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and (ref["name"], ref["key"]) != (secret_name, secret_key):
                    problems.append(f"{cw}: secret {ref['name']}/{ref['key']} is not the "
                                    "documented one")
        if o["kind"] == "Job":
            name = labels.get("app.kubernetes.io/name", "")
            if name.startswith("dbs-ps"):
                if pod.get("restartPolicy") != "OnFailure" or "backoffLimit" not in o["spec"]:
                    problems.append(f"{where}: the server restarts in place on failure "
                                    "(restartPolicy OnFailure) within a backoffLimit")
                services = [s for s in by_kind.get("Service", {}).values()
                            if s["spec"].get("selector")
                            and all(labels.get(k) == v
                                    for k, v in s["spec"]["selector"].items())]
                if len(services) != 1:
                    problems.append(f"{where}: {len(services)} Services select it (want one)")
                for svc in services:
                    if svc["spec"].get("clusterIP") != "None" or \
                            svc["spec"].get("publishNotReadyAddresses") is not True:
                        problems.append(f"Service {svc['metadata']['name']}: headless, with "
                                        "publishNotReadyAddresses (a restoring server is found "
                                        "before it is ready)")
            else:
                if o["spec"].get("completionMode") != "Indexed" or \
                        pod.get("restartPolicy") != "Never":
                    problems.append(f"{where}: workers are an Indexed Job of pods that are "
                                    "replaced, not restarted")
                rules = o["spec"].get("podFailurePolicy", {}).get("rules", [])
                if not any(r["action"] == "FailJob" and 2 in r["onExitCodes"]["values"]
                           for r in rules):
                    problems.append(f"{where}: exit code 2 (a bad configuration) does not fail "
                                    "the Job")
    for np in by_kind.get("NetworkPolicy", {}).values():
        where = f"NetworkPolicy {np['metadata']['name']}"
        for rule in np["spec"].get("ingress", []):
            if not rule.get("from"):
                problems.append(f"{where}: a rule admits every source")
            if not rule.get("ports"):
                problems.append(f"{where}: a rule admits every port")
            for peer in rule.get("from", []):
                if peer.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0"):
                    problems.append(f"{where}: a rule admits any address")
                if "namespaceSelector" in peer and "podSelector" not in peer:
                    problems.append(f"{where}: a rule admits every pod of some namespaces")
    return problems


class KubernetesTest(unittest.TestCase):
    OVERLAYS = ["cpu", "gpu", "hetero-demo", "sharded", "own-model", "python-worker"]

    @classmethod
    def setUpClass(cls):
        cls.kubectl = shutil.which("kubectl")
        cls.rendered = {}

    def render(self, overlay):
        if self.kubectl is None:
            self.skipTest("kubectl is not installed (deploy/install_deps.sh installs Debian's "
                          "kubernetes-client)")
        if overlay not in self.rendered:
            r = subprocess.run([self.kubectl, "kustomize",
                                os.path.join(ROOT, "deploy/k8s/overlays", overlay)],
                               capture_output=True, timeout=120)
            if r.returncode != 0 and b"invalid Kustomization" in r.stderr and \
                    b"labels" in r.stderr:
                self.skipTest("this kubectl's kustomize predates the fields the manifests use "
                              "(labels, patches): kubectl 1.21 or later is needed")
            self.assertEqual(r.returncode, 0, r.stderr.decode())
            self.assertNotIn(b"deprecated", r.stderr.lower(), r.stderr.decode())
            self.rendered[overlay] = yaml_documents(r.stdout.decode())
        return json.loads(json.dumps(self.rendered[overlay]))  # a copy to change

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
            self.assertGreaterEqual(counts.get("Job", 0), 2, overlay)
            r = self.validate(objects)
            self.assertEqual(r.returncode, 0, f"{overlay}:\n{r.stdout.decode()}")
            self.assertEqual(r.stdout.decode().count("valid "), len(objects))

    def test_every_overlay_follows_the_deployment_rules(self):
        secret = documented_secret()
        for overlay in self.OVERLAYS:
            with self.subTest(overlay):
                self.assertEqual(manifest_problems(self.render(overlay), secret), [])

    def test_the_rules_catch_what_a_cluster_would_refuse(self):
        secret = documented_secret()
        self.assertEqual(manifest_problems(self.render("cpu"), secret), [])
        for change, expected in (
                (lambda o: o[0]["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
                 "runAsNonRoot"),
                (lambda o: o[0]["spec"]["template"]["spec"]["containers"][0].update(
                    imagePullPolicy="Always"), "imagePullPolicy Always"),
                (lambda o: o[0]["spec"]["template"]["spec"]["volumes"].append(
                    {"name": "x", "secret": {"secretName": "dbs-job-token-5g7h2"}}),
                 "is not the documented"),
                (lambda o: o[0]["spec"]["template"]["spec"].update(restartPolicy="Always"),
                 "restartPolicy OnFailure"),
                (lambda o: o[1]["spec"]["ingress"][1].pop("from"), "admits every source"),
                (lambda o: o[2]["spec"].pop("publishNotReadyAddresses"),
                 "publishNotReadyAddresses")):
            objects = self.render("cpu")
            ps = [o for o in objects if o["kind"] == "Job" and o["metadata"]["name"] == "dbs-ps"]
            policy = [o for o in objects if o["kind"] == "NetworkPolicy"]
            service = [o for o in objects if o["kind"] == "Service"]
            change(ps + policy + service)
            found = manifest_problems(objects, secret)
            self.assertTrue(any(expected in p for p in found), f"{expected}: {found}")

    def test_no_kustomization_uses_deprecated_fields(self):
        for d, _, files in os.walk(os.path.join(ROOT, "deploy", "k8s")):
            if "kustomization.yaml" in files:
                fields = set(yaml_documents(open(os.path.join(d, "kustomization.yaml")).read())[0])
                self.assertFalse(fields & DEPRECATED_KUSTOMIZE_FIELDS, d)

    def test_the_overlays_wire_what_they_say(self):
        sharded = self.render("sharded")
        jobs = {o["metadata"]["name"]: o for o in sharded if o["kind"] == "Job"}
        shard_env = {name: {e["name"]: e.get("value") for e in
                            j["spec"]["template"]["spec"]["containers"][0]["env"]}
                     for name, j in jobs.items() if name.startswith("dbs-ps")}
        self.assertEqual(shard_env["dbs-ps"]["DBS_SHARD"], "0/2")
        self.assertEqual(shard_env["dbs-ps-1"]["DBS_SHARD"], "1/2")
        self.assertEqual(shard_env["dbs-ps-1"]["DBS_LEADER"], "dbs-ps:50051")
        worker_config = [o for o in sharded if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"].startswith("dbs-worker-config")][0]
        self.assertEqual(worker_config["data"]["DBS_SERVER"], "dbs-ps:50051,dbs-ps-1:50051")
        gpu = [o for o in self.render("gpu") if o["kind"] == "Job"
               and o["metadata"]["name"] == "dbs-worker"][0]
        container = gpu["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(container["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(container["image"], "dbs:cuda")
        own = [o for o in self.render("own-model") if o["kind"] == "Job"
               and o["metadata"]["name"] == "dbs-worker"][0]["spec"]["template"]["spec"]
        c = own["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        self.assertTrue(env["DBS_MODEL"].startswith("/job/"))
        self.assertIn("/job/", env["DBS_DATA"])
        self.assertIn("DBS_EXPORT_PATH=/export/", " ".join(c.get("args", [])))
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        self.assertTrue(mounts["/job"].get("readOnly"))
        self.assertIn("/export", mounts)
        jobs = {o["metadata"]["name"]: o for o in self.render("python-worker")
                if o["kind"] == "Job"}
        python = jobs["dbs-worker-python"]["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(python["command"], ["python3", "-m", "dbs.worker"])
        self.assertEqual(python["image"], "dbs-python:latest")
        self.assertEqual(jobs["dbs-worker"]["spec"]["completions"] + 1, 4,
                         "3 C++ workers and the Python one: the 4 the job waits for")

    def test_every_setting_is_one_the_binary_accepts(self):
        accepted = {b: variables_of(b) for b in PROGRAMS}
        for overlay in self.OVERLAYS:
            objects = self.render(overlay)
            config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects
                           if o["kind"] == "ConfigMap"}
            for o, pod in pod_specs(objects):
                for c in pod["containers"]:
                    # The binary, run directly or exec'd by a shell line.
                    words = " ".join(c["command"] + c.get("args", [])).replace(";", " ").split()
                    binary = [w for w in words if w in accepted][-1]
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
                                   v.replace("/checkpoints", d))
                               for k, v in env.items() if k not in ("DBS_MODEL", "DBS_DATA")}
                        # The worker's dry run loads its device: this machine has no GPU.
                        if env.get("DBS_DEVICE") == "cuda":
                            env["DBS_DEVICE"] = "cpu"
                        base = {k: v for k, v in os.environ.items() if not k.startswith("DBS_")}
                        r = subprocess.run(PROGRAMS[binary] + ["--dry_run"],
                                           env={**base, "HOSTNAME": "pod-0",
                                                "PYTHONPATH": PYTHON_PACKAGE, **env},
                                           capture_output=True, timeout=120)
                        self.assertEqual(r.returncode, 0,
                                         f"{overlay} {binary}: {r.stderr.decode()}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
