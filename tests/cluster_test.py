"""End-to-end tests: real dbs_ps and dbs_worker processes on loopback ports chosen at run time.

Every process started here is stopped in tearDown (the launcher runs in its own session and is
killed as a group), so a failing test leaves nothing behind.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", "dbs"))
if not os.path.isdir(RUNFILES):
    RUNFILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PS = os.path.join(RUNFILES, "server", "dbs_ps")
WORKER = os.path.join(RUNFILES, "worker", "dbs_worker")
REPLAY = os.path.join(RUNFILES, "bench", "dbs_replay")
LAUNCHER = os.path.join(RUNFILES, "deploy", "local_cluster.py")
DATA_DIR = "/usr/share/datasets/fashion-mnist"
# Under AddressSanitizer (the suite's --config=asan sets ASAN_OPTIONS) the tests that judge what
# the share policy decides repeat the server's and the workers' code paths the others run; they
# run in the plain suite only, where their timings mean something.
UNDER_ASAN = "ASAN_OPTIONS" in os.environ
policy_outcome = unittest.skipIf(
    UNDER_ASAN, "judges the share policy's decisions: run in the plain suite, where the "
    "same code paths run under ASan in the other tests")


def step_spread(epoch):
    """Max/min over an epoch's workers of the step time the server measured."""
    steps = [w["step_seconds"] for w in epoch["workers"]]
    return max(steps) / min(steps)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not running; /proc says so.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# A worker's progress line (`epoch 1/5 step 3/469 | loss ...`): it is training.
CHECKPOINT_NAME = re.compile(r"ckpt-(\d+)\.dbs$")


def checkpoints(directory):
    """The complete checkpoints in `directory`, oldest first (a dbs_ps killed while writing one
    leaves a temporary beside them)."""
    names = [n for n in os.listdir(directory) if CHECKPOINT_NAME.match(n)]
    return sorted(names, key=lambda n: int(CHECKPOINT_NAME.match(n).group(1)))


PROGRESS_LINE = re.compile(rb"epoch \d+/\d+ step \d+/\d+ ")


def is_progress(line):
    """True for a worker's progress line (bytes or str)."""
    return PROGRESS_LINE.search(line if isinstance(line, bytes) else line.encode()) is not None


def gist(out, err, limit=1500):
    """What a process printed on stdout and stderr (bytes), for a failure message: progress lines
    left out, a line repeated on end written once with its count, the last `limit` characters of
    each stream. (A worker resuming again and again said why only on stdout.)"""
    def squeeze(data):
        lines = []
        for line in data.decode(errors="replace").splitlines():
            if is_progress(line):
                continue
            if lines and lines[-1][0] == line:
                lines[-1][1] += 1
            else:
                lines.append([line, 1])
        text = "\n".join(line if n == 1 else f"{line} (x{n})" for line, n in lines)
        return text[-limit:]
    return squeeze(out) + "\n-- stderr --\n" + squeeze(err)



class DelayingProxy:
    """A TCP proxy on a loopback port of its own that holds every new connection for `delay_s`
    before relaying it to 127.0.0.1:`upstream`: a server slow to finish a handshake, as a loaded
    machine or a distant one is. `downstream_bytes` counts what it relayed back from upstream;
    cut() breaks every open connection, as a network fault does, and freeze() silences them
    (what arrives is dropped, nothing is closed), as a partition does. Threads are daemons;
    close() stops accepting."""

    def __init__(self, upstream, delay_s):
        self.upstream, self.delay_s, self.connections = int(upstream), delay_s, 0
        self.downstream_bytes = 0
        self.open, self.frozen = [], set()
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        time.sleep(self.delay_s)
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            conn.close()
            return
        with self.lock:
            self.open += [conn, up]
        threading.Thread(target=self._pipe, args=(conn, up, False), daemon=True).start()
        threading.Thread(target=self._pipe, args=(up, conn, True), daemon=True).start()

    def _pipe(self, a, b, downstream):
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                if a in self.frozen:
                    continue
                b.sendall(data)
                if downstream:
                    with self.lock:
                        self.downstream_bytes += len(data)
        except OSError:
            pass
        self._shut(a, b)

    @staticmethod
    def _shut(*socks):
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self):
        with self.lock:
            socks, self.open = self.open, []
        self._shut(*socks)

    def freeze(self):
        with self.lock:
            self.frozen.update(self.open)
            self.open = []

    def close(self):
        self.sock.close()


class ProcessTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dbs_test_", dir=os.environ.get("TEST_TMPDIR"))
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()

    def spawn(self, argv, **kw):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def check_replay(self, summary_path, min_replans):
        """dbs_replay computes every decision of the run again from its summary: the summary holds
        the controller's whole input. Returns the decisions (JSON)."""
        out_json = os.path.join(self.tmp, "replay.json")
        r = subprocess.run([REPLAY, f"--summary={summary_path}", f"--json_out={out_json}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, f"replay differs or failed:\n{r.stdout}\n{r.stderr}")
        with open(out_json) as f:
            decisions = json.load(f)["decisions"]
        with open(summary_path) as f:
            epochs = len(json.load(f)["epochs"])
        plans = [d for d in decisions if d["from_step"] == 0]
        replans = [d for d in decisions if d["from_step"] > 0]
        self.assertEqual(len(plans), epochs, r.stdout)
        self.assertGreaterEqual(len(replans), min_replans, r.stdout)
        self.assertTrue(all(d["same"] and d["recorded"] == d["replayed"] for d in decisions))
        self.assertIn(f"{len(decisions)} of {len(decisions)} decisions replayed the same", r.stdout)
        return decisions

    def start_ps(self, flags, tag="ps"):
        """Starts dbs_ps on a free loopback port it picks itself; returns (process, port)."""
        port_file = os.path.join(self.tmp, f"{tag}.port")
        if os.path.exists(port_file):  # an earlier server's, in the same test
            os.remove(port_file)
        ps = self.spawn([PS, "--host=127.0.0.1", "--port=0", f"--port_file={port_file}"] + flags)
        deadline = time.time() + 30
        while not os.path.exists(port_file) and time.time() < deadline and ps.poll() is None:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(port_file), "dbs_ps did not start listening")
        with open(port_file) as f:
            return ps, f.read().strip()

    @staticmethod
    def worker_argv(port, *flags):
        server = str(port) if ":" in str(port) else f"127.0.0.1:{port}"
        return [WORKER, f"--server={server}", f"--data_dir={DATA_DIR}", *flags]

    def start_shards(self, flags, tag, shards, proxy=False):
        """dbs_ps as `shards` processes (shard 0 leads); returns (processes, --server value).
        With `proxy`, the followers reach the leader through a DelayingProxy (self.proxy)."""
        if shards == 1:
            ps, port = self.start_ps(flags, tag)
            return [ps], f"127.0.0.1:{port}"
        leader, port = self.start_ps(flags + [f"--shard=0/{shards}"], tag)
        procs, servers = [leader], [f"127.0.0.1:{port}"]
        leader_port = port
        if proxy:
            self.proxy = DelayingProxy(port, delay_s=0)
            self.addCleanup(self.proxy.close)
            leader_port = self.proxy.port
        for i in range(1, shards):
            p, shard_port = self.start_ps(
                [f for f in flags if not f.startswith("--summary_path")]
                + [f"--shard={i}/{shards}", f"--leader=127.0.0.1:{leader_port}"],
                f"{tag}-shard{i}")
            procs.append(p)
            servers.append(f"127.0.0.1:{shard_port}")
        return procs, ",".join(servers)

    def run_fixed_job(self, tag, ps_flags, worker_flags, timeout=180, shards=1, faults=()):
        """A 2-epoch job with the fixed split (deterministic), one worker per entry of
        `worker_flags`; waits for every process to exit 0 and returns the summary. `faults`
        are (bytes, "cut" or "freeze"): the followers' connections to the leader are cut or
        frozen (DelayingProxy) once the leader has sent them that many bytes."""
        summary = os.path.join(self.tmp, f"{tag}.json")
        servers, server = self.start_shards(
            [f"--workers={len(worker_flags)}", "--epochs=2", "--policy=fixed",
             f"--summary_path={summary}"] + ps_flags, tag, shards, proxy=bool(faults))
        procs = [self.spawn(self.worker_argv(server, f"--name={tag}-{i}", "--log_every_s=30",
                                             *flags))
                 for i, flags in enumerate(worker_flags)]
        self.faults = 0
        for at, fault in faults:
            while self.proxy.downstream_bytes < at and servers[0].poll() is None:
                time.sleep(0.01)
            if servers[0].poll() is None:
                getattr(self.proxy, fault)()
                self.faults += 1
        self.shard_outs, self.shard_errs = [], []
        for ps in servers:
            out, err = ps.communicate(timeout=timeout)
            self.assertEqual(ps.returncode, 0, err.decode()[-2000:])
            self.shard_outs.append(out.decode())
            self.shard_errs.append(err.decode())
        self.worker_errs = []
        for p in procs:
            _, werr = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, werr.decode()[-2000:])
            self.worker_errs.append(werr.decode())
        with open(summary) as f:
            return json.load(f)

    def run_job(self, ps_flags, worker_flags, timeout=600):
        """Runs one job to its end, one worker per entry of `worker_flags` (each a list of
        flags); asserts that every process exits 0; returns (summary, the workers' outputs)."""
        summary = os.path.join(self.tmp, "summary.json")
        ps, port = self.start_ps([f"--workers={len(worker_flags)}", f"--summary_path={summary}",
                                  "--linger_s=1", *ps_flags])
        procs = [self.spawn(self.worker_argv(port, *flags)) for flags in worker_flags]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            self.assertEqual(p.returncode, 0, err.decode()[-3000:])
            outs.append(out.decode())
        ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        with open(summary) as f:
            return json.load(f), outs

    def restart_job_flags(self, workers):
        """dbs_ps's flags for a 3-epoch job of `workers` that checkpoints every 10 steps:
        (flags, its checkpoint folder, its summary's path)."""
        ckpt = os.path.join(self.tmp, "ckpt")
        summary = os.path.join(self.tmp, "summary.json")
        return ([f"--workers={workers}", "--epochs=3", "--global_batch=64",
                 f"--checkpoint_dir={ckpt}", "--checkpoint_every_steps=10",
                 f"--summary_path={summary}"], ckpt, summary)

    def start_restart_workers(self, server):
        """Three MLP workers for the restart tests; w2 pushes over the socket, the others through
        shared memory with a single dbs_ps. Returns
        once worker 0 is at step 25 or later of epoch 2 (of 3): two periodic checkpoints (every
        10 steps) are written by then. (Killing at its first progress line raced the first one:
        under ASan it came before it.)"""
        common = self.worker_argv(server, "--train_limit=6000", "--test_limit=500",
                                  "--model=mlp", "--log_every_s=0.2")
        procs = [self.spawn(common + [f"--name=w{i}"] +
                            (["--shared_memory=false"] if i == 2 else []))
                 for i in range(3)]

        def epoch2_step(text):
            m = re.search(r"epoch 2/3 step (\d+)/", text)
            return int(m.group(1)) if m else 0
        line = procs[0].stdout.readline().decode()
        while line and epoch2_step(line) < 25:
            line = procs[0].stdout.readline().decode()
        self.assertGreaterEqual(epoch2_step(line), 25, line)
        return procs

    def check_restarted_job(self, procs, summary, resumed, server_log=""):
        """The workers of start_restart_workers finished without a restart, one of them saying
        `resumed`, and the job's 3 epochs trained every sample once. `server_log` (the restarted
        server's) goes with a worker's failure, without its re-plan lines."""
        results = [p.communicate(timeout=60) for p in procs]
        outs = [out.decode() for out, _ in results]
        self.restarted_worker_errs = [err.decode() for _, err in results]
        events = "\n".join(line for line in server_log.splitlines() if "re-planned" not in line)
        for p, (wout, werr) in zip(procs, results):
            # Its progress and resume lines are on stdout, its last error on stderr.
            self.assertEqual(p.returncode, 0, wout.decode()[-2000:] + werr.decode()[-2000:] +
                             "\n--- the restarted server ---\n" + events[-2500:])
        self.assertTrue(any(resumed in o for o in outs), outs[0][-2000:])
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["status"], "ok")
        self.assertEqual(s["epochs_completed"], 3)
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], (e["epoch"], e["audit"]))
        self.assertGreaterEqual(s["final_test_accuracy"], 0.7)

    def check_ended_ok(self, ps, summary, epochs):
        """dbs_ps exits 0 and its summary says the job ended ok after `epochs`; returns it."""
        ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        with open(summary) as f:
            record = json.load(f)
        self.assertEqual(record["status"], "ok")
        self.assertEqual(record["epochs_completed"], epochs)
        return record

    def run_cmd(self, argv, timeout):
        p = self.spawn(argv)
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode(), err.decode()

    def launch(self, name, *extra, timeout=240):
        out_dir = os.path.join(self.tmp, name)
        rc, out, err = self.run_cmd(
            [sys.executable, LAUNCHER, f"--ps_bin={PS}", f"--worker_bin={WORKER}",
             f"--out_dir={out_dir}", "--quiet", f"--data_dir={DATA_DIR}", *extra], timeout)
        return rc, out, err, out_dir


class ClusterTest(ProcessTestCase):
    """One dbs_ps and three dbs_workers train the CNN for 2 epochs, one worker slowed 3x."""

    COMMON = ["--workers=3", "--slowdown=1,1,3", "--epochs=2", "--global_batch=64",
              "--train_limit=6000", "--test_limit=2000", "--model=cnn", "--lr=0.05"]
    # The stated target for 2 epochs on 6000 images (observed 0.79-0.83). The two policies split
    # the batches differently, so they land near, not on, each other.
    MIN_ACCURACY = 0.72

    def check_step_trace(self, path, summary):
        """dbs_ps's step trace (the launcher's --step_trace_path): a line per step, in order,
        whose workers' samples and step times add up to the summary's, epoch by epoch."""
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        self.assertEqual([(l["epoch"], l["step"]) for l in lines],
                         [(e["epoch"], s) for e in summary["epochs"] for s in range(e["steps"])])
        for e in summary["epochs"]:
            steps = [l for l in lines if l["epoch"] == e["epoch"]]
            self.assertTrue(all(l["samples"] == summary["global_batch"] for l in steps[:-1]))
            self.assertEqual(sum(l["samples"] for l in steps),
                             sum(w["samples"] for w in e["workers"]))
            for w in e["workers"]:
                mine = [x for l in steps for x in l["workers"] if x["id"] == w["id"]]
                self.assertEqual(len(mine), len(steps), "every worker in every step")
                self.assertEqual(sum(x["samples"] for x in mine), w["samples"])
                self.assertAlmostEqual(sum(x["step_seconds"] for x in mine), w["step_seconds"],
                                       delta=1e-9 * len(mine))

    def check_summary(self, summary):
        self.assertEqual(summary["status"], "ok")
        self.assertEqual(summary["epochs_completed"], 2)
        for e in summary["epochs"]:
            ws = e["workers"]
            self.assertEqual(len(ws), 3)
            self.assertEqual(sum(w["samples"] for w in ws), 6000, "every sample exactly once")
            self.assertEqual(sum(w["batch_size"] for w in ws), 64, "batches sum to B")
            self.assertEqual(sum(w["test_samples"] for w in ws), 2000)
            self.assertGreater(min(w["compute_seconds"] for w in ws), 0)
            self.assertEqual(e["steps"], 94)  # ceil(6000 / 64)

    @policy_outcome
    def test_dbs_rebalances_the_slow_worker_and_beats_the_fixed_split(self):
        runs = {}
        # Without a lower bound the controller gives a worker whose fixed per-step work alone
        # outlasts the others' whole step no samples at all (it still takes part in every step):
        # seen once under AddressSanitizer on CI's loaded 2 cores, where it had been at batch 1.
        # That is the right plan there, and BalancingPolicyTest covers it; this test is about
        # rebalancing a worker that still computes, so it keeps every batch at 1 or more.
        for policy in ("fixed", "dbs"):
            rc, out, err, out_dir = self.launch(policy, f"--policy={policy}", "--min_batch=1",
                                                *self.COMMON)
            self.assertEqual(rc, 0, f"{policy} run failed:\n{out}\n{err}")
            with open(os.path.join(out_dir, "summary.json")) as f:
                runs[policy] = json.load(f)
            self.check_summary(runs[policy])
            self.check_step_trace(os.path.join(out_dir, "steps.jsonl"), runs[policy])
            for i in range(3):
                self.assertTrue(os.path.exists(os.path.join(out_dir, f"worker-{i}.json")))

        dbs, fixed = runs["dbs"], runs["fixed"]
        # Every plan of both runs replays from the summary; the fixed split's are all equal.
        for policy in ("fixed", "dbs"):
            decisions = self.check_replay(
                os.path.join(self.tmp, policy, "summary.json"), 0)
            if policy == "fixed":
                self.assertEqual({tuple(d["recorded"]) for d in decisions}, {(22, 21, 21)})
        self.assertGreaterEqual(dbs["final_test_accuracy"], self.MIN_ACCURACY)
        self.assertGreaterEqual(fixed["final_test_accuracy"], self.MIN_ACCURACY)
        # Same global batches at every step: DBS converges like S-SGD.
        self.assertLess(abs(dbs["final_test_accuracy"] - fixed["final_test_accuracy"]), 0.05)

        # Worker ids follow registration order; the launcher names worker i "worker-i" and
        # slows "worker-2".
        slow_id = [w["id"] for w in dbs["worker_info"] if w["name"] == "worker-2"][0]
        e2 = dbs["epochs"][1]["workers"]
        slow = e2[slow_id]["batch_size"]
        others = sum(w["batch_size"] for w in e2 if w["id"] != slow_id) / 2
        ratio = slow / others
        fixed_compute = fixed["epochs"][1]["compute_seconds_max_over_min"]
        fixed_steps, dbs_steps = (step_spread(r["epochs"][1]) for r in (fixed, dbs))
        print(f"epoch 2: slow worker batch {slow} vs others {others:.1f} (ratio {ratio:.2f}); "
              f"step time max/min fixed {fixed_steps:.2f}, dbs {dbs_steps:.2f} (compute fixed "
              f"{fixed_compute:.2f}, dbs {dbs['epochs'][1]['compute_seconds_max_over_min']:.2f}); "
              f"accuracy fixed {fixed['final_test_accuracy']:.4f}, "
              f"dbs {dbs['final_test_accuracy']:.4f}")
        # A third of the others' batch by speed alone; less, since the slowdown also triples the
        # worker's fixed per-step work, which the dbs controller models (observed 0.09-0.37; batch
        # 1 under AddressSanitizer, whose overhead is per-step work too). What must hold: it
        # still trains at every step, well below the others.
        self.assertGreaterEqual(slow, 1, "the slow worker is not starved")
        self.assertLess(ratio, 0.5, "well below the others' batch, not starved")
        # Fixed: the 3x worker computes 2.1-2.6x as long as the others (the fast workers'
        # compute stretches when three workers and the server share two cores).
        self.assertGreater(fixed_compute, 1.5)
        # DBS balances the step time the server measures (compute plus the worker's own
        # communication, docs/benchmark.md), not compute alone: on two shared cores two workers
        # at the same batch differ in compute alone by up to 1.35x, and a slow worker at a small
        # batch computes for less than the others while its steps take as long. It must take
        # away at least half of the fixed split's excess over 1 (observed: fixed 1.94-2.29,
        # dbs 1.04-1.15).
        self.assertLess(dbs_steps - 1, (fixed_steps - 1) / 2)
        for e in fixed["epochs"]:
            self.assertEqual([w["batch_size"] for w in e["workers"]], [22, 21, 21])


class BadInputTest(ProcessTestCase):
    def test_missing_data_set_names_the_apt_command(self):
        rc, _, err = self.run_cmd([WORKER, "--data_dir=/nonexistent/fmnist",
                                   f"--server=127.0.0.1:{free_port()}"], 30)
        self.assertEqual(rc, 2, "a missing data set is a configuration error")
        self.assertIn("apt-get install dataset-fashion-mnist", err)

    def test_unreachable_server_is_retried_with_backoff_then_reported(self):
        port = free_port()  # nothing listens there
        start = time.time()
        rc, _, err = self.run_cmd([WORKER, f"--server=127.0.0.1:{port}", "--connect_timeout_s=2",
                                   f"--data_dir={DATA_DIR}", "--train_limit=100",
                                   "--test_limit=100"], 60)
        elapsed = time.time() - start
        self.assertEqual(rc, 200, "unreachable: worth a restart")
        self.assertIn(f"could not reach dbs_ps at 127.0.0.1:{port}", err)
        attempts = int(err.split(" after ")[1].split(" attempts")[0])
        self.assertGreaterEqual(attempts, 3, err)
        self.assertGreaterEqual(elapsed, 1.0, "it kept retrying for about the timeout")

    def test_a_server_slow_to_answer_a_connection_is_still_reached(self):
        # Every connection to dbs_ps is held 2 s before its first byte gets through: each attempt
        # needs longer than the 100 ms-1.2 s that gRPC gave one when the worker set
        # GRPC_ARG_MIN_RECONNECT_BACKOFF_MS (which gRPC uses as the least time a connection
        # attempt gets), so the worker never connected and gave up after --connect_timeout_s;
        # this is what a TLS handshake on a loaded 2-core CI machine ran into.
        summary = os.path.join(self.tmp, "slow.json")
        ps, port = self.start_ps(["--workers=1", "--epochs=1", "--global_batch=32",
                                  f"--summary_path={summary}"])
        proxy = DelayingProxy(port, delay_s=2.0)
        self.addCleanup(proxy.close)
        rc, _, err = self.run_cmd([WORKER, f"--server=127.0.0.1:{proxy.port}", "--name=far",
                                   f"--data_dir={DATA_DIR}", "--train_limit=300",
                                   "--test_limit=100", "--connect_timeout_s=30"], 120)
        self.assertEqual(rc, 0, err[-2000:])
        self.check_ended_ok(ps, summary, epochs=1)
        self.assertLessEqual(proxy.connections, 3, "one connection, not one per retry")

    def test_bad_flags_are_refused_with_a_message(self):
        rc, _, err = self.run_cmd([PS, "--policy=bogus", "--port=0"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("unknown policy 'bogus'", err)
        rc, _, err = self.run_cmd([PS, "--workers=0", "--port=0"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("at least one worker", err)
        rc, _, err = self.run_cmd([PS, "--optimizer=adam", "--lr=-1", "--port=0"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("adam needs lr > 0", err)
        rc, _, err = self.run_cmd([WORKER, "--slowdown=0.5"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("slowdown must be >= 1", err)
        rc, _, err = self.run_cmd([WORKER, "--model=resnet", f"--data_dir={DATA_DIR}",
                                   "--train_limit=10", "--test_limit=10"], 60)
        self.assertEqual(rc, 2)
        self.assertIn("unknown model 'resnet'", err)

    def test_replay_refuses_what_is_not_a_summary(self):
        not_json = os.path.join(self.tmp, "x.json")
        with open(not_json, "w") as f:
            f.write("{not json")
        old = os.path.join(self.tmp, "old.json")
        with open(old, "w") as f:
            json.dump({"format": "dbs.run_summary.v1", "epochs": []}, f)
        for argv, message in (([], "--summary is required"),
                              ([f"--summary={self.tmp}/none.json"], "cannot read"),
                              ([f"--summary={not_json}"], "is not JSON"),
                              ([f"--summary={old}"], "written before decisions were recorded")):
            r = subprocess.run([REPLAY] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=30)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)

    def test_help_lists_the_flags_of_each_binary(self):
        rc, out, err = self.run_cmd([PS, "--help"], 30)
        self.assertEqual(rc, 0)
        for flag in ("--policy", "--replan_window_steps", "--checkpoint_dir", "--global_batch"):
            self.assertIn(flag, out)
        self.assertNotIn("No flags matched", out + err)
        rc, out, err = self.run_cmd([WORKER, "--help"], 30)
        self.assertEqual(rc, 0)
        for flag in ("--server", "--max_batch", "--data_dir"):
            self.assertIn(flag, out)
        _, out, err = self.run_cmd([REPLAY, "--help"], 30)  # Abseil's --help exits 1
        for flag in ("--summary", "--verbose", "--noise_margin"):
            self.assertIn(flag, out + err)
        self.assertNotIn("No flags matched", out + err)

    def test_a_dry_run_checks_the_data_the_model_and_the_files_it_will_write(self):
        base = [WORKER, f"--data_dir={DATA_DIR}", "--dry_run", "--train_limit=100",
                "--test_limit=100"]
        rc, out, err = self.run_cmd(base, 60)
        self.assertEqual(rc, 0, err)
        self.assertIn("configuration ok", out)
        self.assertIn("normalisation", out, "it loaded the data")
        for flags, says in (
                (["--data=npy:/nonexistent/x.npy,/nonexistent/y.npy"],
                 "/nonexistent/x.npy cannot be opened: No such file or directory"),
                (["--model=/nonexistent/model.pt"], "cannot be read: No such file or directory"),
                (["--export_path=/nonexistent/out/trained.pt"],
                 "--export_path=/nonexistent/out/trained.pt: cannot write in /nonexistent/out: "
                 "No such file or directory"),
                ([f"--export_path={self.tmp}"], "is a folder"),
                (["--job_token_file=/nonexistent/token"],
                 "cannot read /nonexistent/token: No such file or directory")):
            rc, _, err = self.run_cmd(base + flags, 60)
            self.assertEqual(rc, 2, f"{flags}: {err}")
            self.assertIn(says, err)
        rc, _, err = self.run_cmd([PS, "--dry_run", "--checkpoint_dir=/proc/dbs/ckpt"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("--checkpoint_dir=/proc/dbs/ckpt: cannot write in /proc", err)
        rc, _, err = self.run_cmd([PS, "--dry_run", "--summary_path=/nonexistent/s.json"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("--summary_path=/nonexistent/s.json: cannot write in /nonexistent", err)
        rc, _, err = self.run_cmd([PS, "--dry_run", "--step_trace_path=/nonexistent/t.jsonl"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("--step_trace_path=/nonexistent/t.jsonl: cannot write in /nonexistent", err)

    def test_a_worker_refused_for_its_model_is_not_a_member(self):
        # The job waits for two workers that can train in it: one with another model is refused,
        # leaves, and does not count; the job starts when a second right one comes, without
        # waiting for the worker timeout.
        summary = os.path.join(self.tmp, "refused.json")
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=64",
                                  "--worker_timeout_s=300", f"--summary_path={summary}"])
        common = self.worker_argv(port, "--train_limit=640", "--test_limit=100",
                                  "--log_every_s=60")
        first = self.spawn(common + ["--name=a"])
        while b"joined as worker" not in first.stdout.readline():
            self.assertIsNone(first.poll(), "the first worker ended before joining")
        rc, _, err = self.run_cmd(common + ["--name=b", "--model=mlp"], 120)
        self.assertEqual(rc, 2, err)
        self.assertIn("this worker's model has 6 tensors where the job's model has 8", err)
        start = time.time()
        rc, _, err = self.run_cmd(common + ["--name=c"], 120)
        self.assertEqual(rc, 0, err[-2000:])
        self.assertLess(time.time() - start, 100, "the job did not wait for the refused worker")
        first.communicate(timeout=60)
        self.assertEqual(first.returncode, 0)
        record = self.check_ended_ok(ps, summary, epochs=1)
        trained = sorted(record["worker_info"][w["id"]]["name"]
                         for w in record["epochs"][0]["workers"])
        self.assertEqual(trained, ["a", "c"])

    def test_cuda_request_without_cuda_says_why(self):
        if os.environ.get("LIBTORCH_DIR"):
            self.skipTest("built against a custom libtorch that may have CUDA")
        rc, _, err = self.run_cmd([WORKER, "--device=cuda"], 30)
        self.assertEqual(rc, 2)
        self.assertIn("--device=cuda", err)
        self.assertIn("--device=cpu", err)


class WorkerDeathTest(ProcessTestCase):
    def start_job(self, tag, workers, extra_ps):
        summary = os.path.join(self.tmp, f"{tag}.json")
        ps, port = self.start_ps([f"--workers={workers}", "--global_batch=64",
                                  f"--summary_path={summary}"] + extra_ps, tag)
        common = self.worker_argv(port, "--train_limit=6000", "--test_limit=1000", "--model=mlp",
                                  "--log_every_s=0.5", "--connect_timeout_s=5")
        procs = [self.spawn(common + [f"--name={tag}-{i}"]) for i in range(workers)]
        return ps, procs, summary

    @staticmethod
    def wait_for_training(proc):
        line = proc.stdout.readline().decode()
        while not is_progress(line) and line:
            line = proc.stdout.readline().decode()
        return line

    def test_killed_worker_is_removed_and_every_sample_is_still_used_once(self):
        # The same job twice: undisturbed, and with one of 4 workers killed -9 mid-epoch.
        ps, procs, summary = self.start_job("clean", 4, ["--epochs=2"])
        _, err = ps.communicate(timeout=120)
        self.assertEqual(ps.returncode, 0, err.decode()[-2000:])
        with open(summary) as f:
            clean = json.load(f)

        # The timeout is long against a step (~20 ms) so that a worker starved of CPU by other
        # tests on a 2-core machine is not declared dead before the victim is killed.
        ps, procs, summary = self.start_job("kill", 4, ["--epochs=2", "--worker_timeout_s=5"])
        victim = procs[1]
        line = self.wait_for_training(victim)
        if not is_progress(line):
            victim.kill()
            out, err = victim.communicate(timeout=30)
            self.fail("the victim stopped before its first step:\n" + (out + err).decode()[-3000:])
        victim.kill()
        _, err = ps.communicate(timeout=120)
        log = err.decode()
        self.assertEqual(ps.returncode, 0, log[-3000:])
        self.assertIn("removed; the step completes with the other gradients", log)
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["status"], "ok")
        self.assertEqual(s["epochs_completed"], 2)
        self.assertEqual(len(s["epochs"][0]["dead_workers"]), 1)
        self.assertGreaterEqual(s["epochs"][0]["steps"], 94)
        self.assertEqual(len(s["epochs"][1]["workers"]), 3, "epoch 2 runs on the survivors")
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["audit"])
            self.assertEqual(e["audit"]["used_once"], 6000)
        for p in procs:
            if p is not victim:
                p.communicate(timeout=60)
                self.assertEqual(p.returncode, 0)
        print(f"accuracy with a worker killed: {s['final_test_accuracy']:.4f}, "
              f"without: {clean['final_test_accuracy']:.4f}")
        self.assertLess(abs(s["final_test_accuracy"] - clean["final_test_accuracy"]), 0.05)

    def test_a_worker_cut_off_until_the_job_ended_is_told_so_and_exits_0(self):
        # Stopped (SIGSTOP: cut off, not dead) at its first step until the job has ended without
        # it. Its next call finds it removed; registering again says the job is done, and it
        # exits 0: an orchestrator that restarts failed workers has nothing to restart.
        ps, procs, summary = self.start_job("cut", 2, ["--epochs=2", "--worker_timeout_s=5"])
        victim = procs[1]
        line = self.wait_for_training(victim)
        self.assertTrue(is_progress(line), "the victim stopped before its first step")
        victim.send_signal(signal.SIGSTOP)
        deadline = time.time() + 180
        while not os.path.exists(summary) and time.time() < deadline and ps.poll() is None:
            time.sleep(0.1)
        victim.send_signal(signal.SIGCONT)
        self.assertTrue(os.path.exists(summary), "the job did not end without the victim")
        out, err = victim.communicate(timeout=60)
        self.assertEqual(victim.returncode, 0, (out + err).decode()[-3000:])
        self.assertIn("it has finished meanwhile, so there is nothing left to join", out.decode())
        _, err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0, err.decode()[-3000:])
        procs[0].communicate(timeout=60)
        self.assertEqual(procs[0].returncode, 0)

    def test_without_a_worker_timeout_a_stall_is_reported_instead_of_hanging(self):
        ps, procs, summary = self.start_job(
            "stall", 2, ["--epochs=20", "--worker_timeout_s=0", "--stall_timeout_s=3"])
        self.assertTrue(is_progress(self.wait_for_training(procs[1])))
        procs[1].kill()
        _, ps_err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 202, "a stall: restart with --restore")
        self.assertIn("no progress for 3s", ps_err.decode())
        with open(summary) as f:
            self.assertIn("DEADLINE_EXCEEDED", json.load(f)["status"])
        # The survivor is released with an error instead of waiting forever: the server is gone
        # (it retries for --connect_timeout_s, in case it comes back).
        _, w_err = procs[0].communicate(timeout=60)
        self.assertEqual(procs[0].returncode, 200, w_err.decode()[-2000:])


class DeterministicAggregationTest(ProcessTestCase):
    """The same job twice, the workers' speeds (so the order in which their
    pushes arrive) changed, ends with bit-identical parameters: the server sums each step in
    worker order."""

    def run_job(self, tag, slowdowns):
        exports = [os.path.join(self.tmp, f"{tag}-{i}.pt") for i in range(len(slowdowns))]
        s = self.run_fixed_job(tag, ["--global_batch=48"], [
            ["--train_limit=3000", "--test_limit=600", "--model=mlp", f"--slowdown={slow}",
             f"--export_path={export}"] for slow, export in zip(slowdowns, exports)])
        with open(exports[0], "rb") as f:
            return s, f.read()

    def test_other_arrival_orders_give_bit_identical_parameters(self):
        a, wa = self.run_job("fast_first", ["1", "2", "4"])
        b, wb = self.run_job("slow_first", ["4", "2", "1"])
        self.assertEqual([e["train_loss"] for e in a["epochs"]],
                         [e["train_loss"] for e in b["epochs"]])
        self.assertEqual(a["final_test_accuracy"], b["final_test_accuracy"])
        self.assertEqual(wa, wb, "the exported parameters differ")
        print(f"two arrival orders, train losses {[e['train_loss'] for e in a['epochs']]}, "
              f"{len(wa)} exported bytes identical")


class SharedMemoryPushTest(ProcessTestCase):
    """Workers that push through memory shared with dbs_ps train exactly as the same job whose
    workers push over the socket, bit for bit, whatever order their pushes arrive in."""

    def run_job(self, tag, slowdowns, shared_memory):
        exports = [os.path.join(self.tmp, f"{tag}-{i}.pt") for i in range(len(slowdowns))]
        s = self.run_fixed_job(tag, ["--global_batch=48"], [
            ["--train_limit=3000", "--test_limit=600", "--model=mlp", f"--slowdown={slow}",
             f"--export_path={export}", f"--shared_memory={str(shared_memory).lower()}"]
            for slow, export in zip(slowdowns, exports)])
        with open(exports[0], "rb") as f:
            return s, f.read()

    def test_shared_memory_trains_bit_identically_to_the_socket(self):
        socket, w_socket = self.run_job("socket", ["1", "2", "4"], shared_memory=False)
        for err in self.worker_errs:
            self.assertNotIn("shares memory with this worker:", err)
        shared, w_shared = self.run_job("shared", ["4", "2", "1"], shared_memory=True)
        for err in self.worker_errs:
            self.assertIn("shares memory with this worker", err)
        self.assertEqual([e["train_loss"] for e in socket["epochs"]],
                         [e["train_loss"] for e in shared["epochs"]])
        self.assertEqual(socket["final_test_accuracy"], shared["final_test_accuracy"])
        self.assertEqual(w_socket, w_shared, "the exported parameters differ")
        print(f"socket and shared memory: train losses "
              f"{[e['train_loss'] for e in shared['epochs']]}, {len(w_shared)} exported bytes "
              f"identical")


class ShardedJobTest(ProcessTestCase):
    """The model split across several dbs_ps processes (--shard=i/k) trains
    exactly as one server does, re-plans included."""

    def run_job(self, tag, shards, faults=()):
        exports = [os.path.join(self.tmp, f"{tag}-{i}.pt") for i in range(3)]
        # (At --worker_timeout_s=24 a follower pings its leader every 6 s.)
        s = self.run_fixed_job(tag, ["--global_batch=48", "--worker_timeout_s=24"], [
            ["--train_limit=3000", "--test_limit=600", "--model=mlp", f"--slowdown={slow}",
             f"--export_path={export}"]
            for slow, export in zip(["1", "2", "4"], exports)], shards=shards, faults=faults)
        exported = []
        for e in exports:
            with open(e, "rb") as f:
                exported.append(f.read())
        return s, exported

    def test_two_and_three_shards_train_bit_identically_to_one(self):
        """One, two and three shards train bit-identically, even with the two-shard
        follower's link to the leader cut, then silenced (of the 5.6 kB the leader sends it,
        after 1.5 and 3.5 kB): the follower notices, continues its stream from where it
        stands, and the leader sends on from there."""
        one, w_one = self.run_job("one", 1)
        two, w_two = self.run_job("two", 2, faults=((1500, "cut"), (3500, "freeze")))
        self.assertEqual(self.faults, 2, "the job ended before both faults")
        self.assertEqual(self.shard_errs[1].count("broke after event"), 2, self.shard_errs[1])
        self.assertIn("keepalive", self.shard_errs[1])
        self.assertEqual(self.shard_errs[0].count("shard 1/2 follows again from event"), 2,
                         self.shard_errs[0])
        self.assertIn("dbs_ps shard 1/2: the job finished; parameter version 126",
                      self.shard_outs[1])
        for line in self.shard_errs[1].splitlines():
            if "broke after event" in line:
                print(line[line.index("the stream"):])
        three, w_three = self.run_job("three", 3)
        for s in (two, three):
            self.assertEqual([e["train_loss"] for e in one["epochs"]],
                             [e["train_loss"] for e in s["epochs"]])
            self.assertEqual(one["final_test_accuracy"], s["final_test_accuracy"])
        for w in w_two + w_three:
            self.assertEqual(w, w_one[0], "the exported parameters differ")
        print(f"1, 2 and 3 shards: train losses {[e['train_loss'] for e in one['epochs']]}, "
              f"{len(w_one[0])} exported bytes identical on every worker")

    def test_dbs_re_plans_reach_every_shard(self):
        # Uneven workers and a short re-plan window: the plan changes between and within
        # epochs, and the followers' barriers must expect the new batches at once.
        rc, out, err, out_dir = self.launch(
            "sharded", "--workers=3", "--ps_shards=3", "--slowdown=1,2,6", "--epochs=3",
            "--global_batch=48", "--train_limit=3000", "--test_limit=600", "--model=mlp",
            "--replan_window_steps=4")
        self.assertEqual(rc, 0, out + err)
        with open(os.path.join(out_dir, "summary.json")) as f:
            s = json.load(f)
        self.assertEqual(s["status"], "ok")
        batches = [sorted(w["batch_size"] for w in e["workers"]) for e in s["epochs"]]
        self.assertNotEqual(batches[0], batches[-1], "DBS never moved the split")
        with open(os.path.join(out_dir, "ps.log")) as f:
            self.assertIn("re-planned after step", f.read())
        for i in (1, 2):
            with open(os.path.join(out_dir, f"ps-{i}.log")) as f:
                self.assertIn(f"dbs_ps shard {i}/3: the job finished", f.read())
        self.assertGreater(s["final_test_accuracy"], 0.6)

    def test_a_killed_worker_is_removed_on_every_shard(self):
        # The leader evicts the dead worker; the follower must evict it at the same step and
        # expect the survivors' new batches from then on.
        summary = os.path.join(self.tmp, "kill.json")
        servers, server = self.start_shards(
            ["--workers=4", "--global_batch=64", "--epochs=2", "--worker_timeout_s=5",
             f"--summary_path={summary}"], "kill", 2)
        procs = [self.spawn(self.worker_argv(
            server, "--train_limit=6000", "--test_limit=1000", "--model=mlp",
            "--log_every_s=0.5", "--connect_timeout_s=5", f"--name=kill-{i}"))
            for i in range(4)]
        victim = procs[1]
        line = WorkerDeathTest.wait_for_training(victim)
        self.assertTrue(is_progress(line), line)
        victim.kill()
        try:
            outs = [p.communicate(timeout=120) for p in servers]
        except subprocess.TimeoutExpired:
            # Say where each server stood.
            tails = []
            for k, p in enumerate(servers):
                p.kill()
                _, err = p.communicate()
                tails.append(f"--- shard {k}:\n" + err.decode()[-4000:])
            self.fail("the sharded job did not end within 120 s:\n" + "\n".join(tails))
        for p, (out, err) in zip(servers, outs):
            self.assertEqual(p.returncode, 0, err.decode()[-3000:])
        # Killed between its pushes to the two shards, it is removed from the step after (or
        # from the epoch's reports) once the follower says its step waits for it.
        self.assertRegex(outs[0][1].decode(),
                         r"removed; the (step completes with the other gradients|epoch completes)")
        self.assertIn("dbs_ps shard 1/2: the job finished", outs[1][0].decode())
        with open(summary) as f:
            s = json.load(f)
        self.assertEqual(s["status"], "ok")
        self.assertEqual(len(s["epochs"][0]["dead_workers"]), 1)
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["audit"])
        for p in procs:
            if p is not victim:
                _, err = p.communicate(timeout=60)
                self.assertEqual(p.returncode, 0, err.decode()[-2000:])
        self.assertGreater(s["final_test_accuracy"], 0.7)

    def test_a_follower_gone_for_the_worker_timeout_stops_the_leader(self):
        # The leader holds a follower's place for --worker_timeout_s after its stream ends (it
        # may only have lost its link); a follower that does not come back is lost.
        servers, server = self.start_shards(
            ["--workers=2", "--global_batch=64", "--epochs=2", "--worker_timeout_s=5",
             "--summary_path="], "gone", 2)
        procs = [self.spawn(self.worker_argv(
            server, "--train_limit=6000", "--test_limit=500", "--model=mlp",
            "--log_every_s=0.5", f"--name=gone-{i}")) for i in range(2)]
        self.assertTrue(is_progress(WorkerDeathTest.wait_for_training(procs[0])))
        servers[1].kill()
        servers[1].wait()
        killed = time.monotonic()
        try:
            _, err = servers[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            servers[0].kill()
            self.fail("the leader did not stop: " + gist(*servers[0].communicate()))
        waited = time.monotonic() - killed
        log = err.decode()
        self.assertEqual(servers[0].returncode, 200, log[-3000:])
        self.assertIn("shard 1/2's stream ended: the job waits up to 5s", log)
        self.assertIn("shard 1/2 stopped following", log)
        self.assertGreaterEqual(waited, 4.5, "it stopped before the grace was over")
        print(f"the leader stopped {waited:.1f} s after its follower was killed")

    def test_a_follower_with_other_settings_is_refused(self):
        leader, port = self.start_ps(["--workers=1", "--shard=0/2", "--lr=0.05",
                                      "--summary_path="], "leader")
        rc, out, err = self.run_cmd(
            [PS, "--host=127.0.0.1", "--port=0", "--workers=1", "--shard=1/2", "--lr=0.1",
             "--summary_path=",
             f"--leader=127.0.0.1:{port}"], timeout=60)
        self.assertNotEqual(rc, 0)
        self.assertIn("other training settings than the leader", err)
        self.assertIn("lr 0.1 (leader: 0.05)", err)
        # A worker that lists the follower first is told to list the leader first.
        follower, fport = self.start_ps(["--workers=1", "--shard=1/2", "--lr=0.05",
                                         "--summary_path=", f"--leader=127.0.0.1:{port}"],
                                        "follower")
        rc, out, err = self.run_cmd(
            self.worker_argv(f"127.0.0.1:{fport},127.0.0.1:{port}", "--name=backwards",
                             "--train_limit=500", "--model=mlp"), timeout=60)
        self.assertEqual(rc, 2, err)
        self.assertIn("List shard 0, the leader, first in --server", err)
        follower.kill()
        follower.wait()
        # Workers may not register while a shard is missing: the leader says which.
        rc, out, err = self.run_cmd(
            self.worker_argv(port, "--name=early", "--connect_timeout_s=2", "--train_limit=500",
                             "--model=mlp"), timeout=60)
        self.assertNotEqual(rc, 0)
        self.assertIn("waiting for shard(s) 1 of 2 to connect", err)
        self.assertIsNone(leader.poll())


class WireDtypeTest(ProcessTestCase):
    """Gradients and parameters in bf16 on the wire train the CNN as well as
    fp32 (same job, same seed, fixed split so only the wire differs)."""

    def run_job(self, dtype):
        return self.run_fixed_job(dtype, ["--global_batch=64", f"--wire_dtype={dtype}"], [
            ["--train_limit=6000", "--test_limit=2000", "--model=cnn"]] * 3, timeout=300)

    def test_bf16_on_the_wire_reaches_the_accuracy_of_fp32(self):
        fp32 = self.run_job("fp32")
        bf16 = self.run_job("bf16")
        a, b = fp32["final_test_accuracy"], bf16["final_test_accuracy"]
        print(f"CNN, 2 epochs on 6000 images: accuracy fp32 {a:.4f}, bf16 {b:.4f}")
        self.assertGreaterEqual(b, ClusterTest.MIN_ACCURACY)
        # 2000 test images: one image is 0.05 pp. The full-data figures are in docs/dataplane.md.
        self.assertLess(abs(a - b), 0.02)
        self.assertNotEqual(a, b, "bf16 must really have travelled (the runs are deterministic)")


class MidEpochReplanTest(ProcessTestCase):
    @policy_outcome
    def test_a_worker_slowed_mid_epoch_is_replanned_within_the_window(self):
        window, slowed_from = 4, 30
        summary = os.path.join(self.tmp, "summary.json")
        ps, port = self.start_ps(["--workers=3", "--epochs=1", "--global_batch=64",
                                  f"--replan_window_steps={window}", f"--summary_path={summary}"])
        common = self.worker_argv(port, "--train_limit=6000", "--test_limit=500", "--model=cnn")
        procs = [self.spawn(common + [f"--name=w{i}"] +
                            ([f"--slow_windows=s{slowed_from}:100000:3"] if i == 2 else []))
                 for i in range(3)]
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
        _, err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0, err.decode()[-2000:])
        # "[w2] epoch 1 re-planned at step N (revision R): ..." -- N is 1-based.
        steps = [int(line.split("re-planned at step ")[1].split()[0])
                 for line in outs[2].splitlines() if "re-planned at step" in line]
        after = [n for n in steps if n > slowed_from]
        self.assertTrue(after, f"no re-plan after step {slowed_from}: {steps}")
        delay = after[0] - slowed_from
        print(f"worker slowed 3x from step {slowed_from + 1}: re-planned after {delay} steps "
              f"(window {window}); all re-plans at steps {steps}")
        # Usually one window suffices (2-3 steps measured), but with three processes on two cores
        # (and bazel running another test beside this one) the others' compute times are noisy
        # too: 6 and 10 have been seen. The bound, three windows, still needs a re-plan
        # from a window of the epoch, long before its end (64 more steps).
        self.assertLessEqual(delay, 3 * window)
        with open(summary) as f:
            s = json.load(f)
        self.assertTrue(s["epochs"][0]["audit"]["every_sample_once"])
        self.assertGreaterEqual(s["epochs"][0]["revisions"], 1)
        # The re-plans replay from the summary too (their windows are recorded).
        replans = [d for d in self.check_replay(summary, 1) if d["from_step"] > 0]
        self.assertGreaterEqual(len([d for d in replans if d["applied"]]),
                                s["epochs"][0]["revisions"])


class ElasticJoinTest(ProcessTestCase):
    def test_a_fifth_worker_started_mid_training_gets_a_share_and_its_pushes_count(self):
        summary = os.path.join(self.tmp, "summary.json")
        ps, port = self.start_ps(["--workers=4", "--epochs=4", "--global_batch=64",
                                  f"--summary_path={summary}"])
        common = self.worker_argv(port, "--train_limit=6000", "--test_limit=500", "--model=mlp")
        procs = [self.spawn(common + [f"--name=w{i}"]) for i in range(4)]
        # Start the fifth once the first epoch is done.
        line = procs[0].stdout.readline().decode()
        while line and "epoch 1/4 done" not in line:
            line = procs[0].stdout.readline().decode()
        self.assertIn("epoch 1/4 done", line)
        late = self.spawn(common + ["--name=late"])
        out, _ = late.communicate(timeout=120)
        self.assertEqual(late.returncode, 0)
        self.assertIn("joining a running job", out.decode())
        for p in procs:
            p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0)
        _, err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0, err.decode()[-2000:])
        with open(summary) as f:
            s = json.load(f)
        late_id = [w["id"] for w in s["worker_info"] if w["name"] == "late"][0]
        joined = [e for e in s["epochs"] if any(w["id"] == late_id for w in e["workers"])]
        self.assertTrue(joined, "the late worker never got a plan")
        self.assertGreaterEqual(joined[0]["epoch"], 1)
        for e in joined:
            mine = [w for w in e["workers"] if w["id"] == late_id][0]
            self.assertGreater(mine["samples"], 0, "its pushes count")
            self.assertEqual(len(e["workers"]), 5)
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"])
        print(f"late worker joined at epoch {joined[0]['epoch'] + 1} with batch "
              f"{[w for w in joined[-1]['workers'] if w['id'] == late_id][0]['batch_size']}")


class ServerRestartTest(ProcessTestCase):
    def test_killed_server_restores_from_the_newest_valid_checkpoint_and_workers_continue(self):
        flags, ckpt, summary = self.restart_job_flags(3)
        ps, port = self.start_ps(flags)
        # Kill -9 the server in the middle of epoch 2 (both kinds of push resume).
        procs = self.start_restart_workers(port)
        ps.kill()
        ps.wait()
        files = checkpoints(ckpt)
        self.assertGreaterEqual(len(files), 2)
        # Damage the newest checkpoint: it must be refused and the one before used.
        newest = os.path.join(ckpt, files[-1])
        with open(newest, "rb") as f:
            data = f.read()
        with open(newest, "wb") as f:
            f.write(data[: len(data) // 2])
        restarted = self.spawn([PS, "--host=127.0.0.1", f"--port={port}", "--restore"] + flags)
        _, err = restarted.communicate(timeout=120)
        log = err.decode()
        self.assertEqual(restarted.returncode, 0, log[-3000:])
        self.assertIn(f"refusing checkpoint {newest}: corrupt checkpoint", log)
        self.assertIn(f"restored {os.path.join(ckpt, files[-2])}: epoch 2", log)
        self.check_restarted_job(procs, summary, "resuming at epoch 2", log)
        left = [n for n in os.listdir(ckpt) if ".tmp." in n]
        self.assertEqual(left, [], "the restarted dbs_ps removed what the killed one half wrote")
        # The workers that pushed through shared memory attached again to the new dbs_ps.
        for err in self.restarted_worker_errs[:2]:
            self.assertIn("shares memory with this worker", err)
            self.assertIn("no longer shares memory with this worker (restarted?)", err)


class ShardedRestartTest(ProcessTestCase):
    FLAGS = ["--workers=3", "--epochs=3", "--global_batch=64", "--checkpoint_every_steps=10"]

    def setUp(self):
        super().setUp()
        self.ckpt = [os.path.join(self.tmp, f"ckpt{i}") for i in range(2)]
        self.summary = os.path.join(self.tmp, "summary.json")

    def shard_argv(self, shard, port, leader_port):
        """dbs_ps as shard `shard` of 2 on `port`, checkpointing into its own directory and
        restoring from it."""
        argv = [PS, "--host=127.0.0.1", f"--port={port}", "--restore",
                f"--checkpoint_dir={self.ckpt[shard]}", f"--shard={shard}/2"] + self.FLAGS
        if shard == 0:
            return argv + [f"--summary_path={self.summary}"]
        return argv + [f"--leader=127.0.0.1:{leader_port}"]

    def start_training(self):
        """Two shards and the restart workers, until checkpoints exist (start_restart_workers);
        returns (leader, port, follower, fport, workers)."""
        leader, port = self.start_ps(self.FLAGS + [f"--checkpoint_dir={self.ckpt[0]}",
                                                   "--shard=0/2",
                                                   f"--summary_path={self.summary}"], "leader")
        follower, fport = self.start_ps(self.FLAGS + [f"--checkpoint_dir={self.ckpt[1]}",
                                                      "--shard=1/2",
                                                      f"--leader=127.0.0.1:{port}"], "follower")
        procs = self.start_restart_workers(f"127.0.0.1:{port},127.0.0.1:{fport}")
        return leader, port, follower, fport, procs

    def wait_for(self, proc, timeout, others, what):
        """proc's stderr once it exits; kills everything and fails if it does not in time."""
        try:
            return proc.communicate(timeout=timeout)[1].decode()
        except subprocess.TimeoutExpired:
            everyone = [proc] + others
            for p in everyone:
                p.kill()
            self.fail(what + ": " + "\n | ".join(gist(*p.communicate()) for p in everyone))

    def test_killed_shards_restore_the_same_step_and_workers_continue(self):
        """Each shard checkpoints its own range at the leader's checkpoints;
        after both are killed, the restarted leader restores its newest and the follower its
        own checkpoint of the same step.

        Both are killed a step or so after the leader begins its next checkpoint (the leader
        first, the follower 5 ms later): the workers then often hold the follower's answer to
        the step but not the leader's, and retry their pushes into the restarted leader, which
        must have them resume and redo the step on both shards first (TrainingJob::AdmitPush;
        taking the retried pushes stalled the restored follower)."""
        leader, port, follower, fport, procs = self.start_training()
        held = set(os.listdir(self.ckpt[0]))
        deadline = time.monotonic() + 60
        while set(os.listdir(self.ckpt[0])) <= held and leader.poll() is None:
            self.assertLess(time.monotonic(), deadline, "the leader wrote no further checkpoint")
            time.sleep(0.0005)
        # A step or so later (here, without the resume rule, 15 ms failed 3 runs of 6).
        time.sleep(0.015)
        leader.kill()
        time.sleep(0.005)  # time for the follower to answer a step the leader did not
        follower.kill()
        leader.wait()
        follower.wait()
        for d in self.ckpt:  # epoch 1's end and at least one periodic checkpoint in epoch 2
            self.assertGreaterEqual(len(checkpoints(d)), 2, d)
        restarted = self.spawn(self.shard_argv(0, port, port))
        refollower = self.spawn(self.shard_argv(1, fport, port))
        log = self.wait_for(restarted, 120, [refollower] + procs, "the restarted job did not end")
        self.assertEqual(restarted.returncode, 0, log[-3000:])
        m = re.search(r"restored \S+: epoch (\d+), step (\d+), parameter version (\d+)", log)
        self.assertIsNotNone(m, log[-3000:])
        _, ferr = refollower.communicate(timeout=60)
        flog = ferr.decode()
        self.assertEqual(refollower.returncode, 0, flog[-3000:])
        self.assertIn(f"shard 1/2 restored {self.ckpt[1]}", flog)
        self.assertIn(f"epoch {m.group(1)}, step {m.group(2)}, parameter version {m.group(3)}",
                      flog)
        self.check_restarted_job(procs, self.summary, "resuming at epoch", log)

    def check_restarted_shards(self, restarted, refollower, procs):
        """The restarted leader and follower end the job ok, the follower restored, and the
        workers carry on (check_restarted_job)."""
        log = self.wait_for(restarted, 120, [refollower] + procs, "the restarted job did not end")
        self.assertEqual(restarted.returncode, 0, log[-3000:])
        _, err = refollower.communicate(timeout=60)
        self.assertEqual(refollower.returncode, 0, err.decode()[-3000:])
        self.assertIn("shard 1/2 restored", err.decode())
        self.check_restarted_job(procs, self.summary, "resuming at epoch", log)

    def test_a_leader_restarted_alone_has_its_follower_restart_too(self):
        """The leader alone killed and restarted with --restore: its follower, still running,
        cannot continue its stream on the new leader, which holds no place for it. It stops
        with the restart exit code (200, which an orchestrator restarts; not 2, a bad
        configuration), and restarted, the shards continue the job from their newest common
        checkpoint."""
        leader, port, follower, fport, procs = self.start_training()
        leader.kill()
        leader.wait()
        restarted = self.spawn(self.shard_argv(0, port, port))
        ferr = self.wait_for(follower, 90, [restarted] + procs, "the old follower did not stop")
        self.assertEqual(follower.returncode, 200, ferr[-3000:])
        self.assertIn("holds no place for shard 1/2", ferr)
        refollower = self.spawn(self.shard_argv(1, fport, port))
        self.check_restarted_shards(restarted, refollower, procs)

    def test_a_lost_follower_stops_the_leader_and_the_restarted_shards_continue(self):
        """A follower killed mid-job takes its range of the model with it: restarted at once,
        it comes back without its stream, so the leader stops with a restart exit code instead
        of stalling, the restarted follower retries until the leader is back, and the restarted
        shards continue the job from their newest common checkpoint while the workers wait."""
        leader, port, follower, fport, procs = self.start_training()
        follower.kill()
        follower.wait()
        # Restarted at once, as an orchestrator would: the old leader may still be stopping.
        refollower = self.spawn(self.shard_argv(1, fport, port))
        log = self.wait_for(leader, 60, [refollower] + procs,
                            "the leader did not stop after losing its follower")
        self.assertEqual(leader.returncode, 200, log[-3000:])
        self.assertIn("shard 1/2 stopped following", log)
        restarted = self.spawn(self.shard_argv(0, port, port))
        self.check_restarted_shards(restarted, refollower, procs)

    def test_shards_without_a_common_checkpoint_refuse_to_restore(self):
        ckpt = [os.path.join(self.tmp, f"ckpt{i}") for i in range(2)]
        flags = ["--workers=1", "--epochs=2", "--global_batch=64", "--summary_path="]
        leader, port = self.start_ps(flags + [f"--checkpoint_dir={ckpt[0]}", "--shard=0/2"],
                                     "leader")
        follower, fport = self.start_ps(flags + [f"--checkpoint_dir={ckpt[1]}", "--shard=1/2",
                                                 f"--leader=127.0.0.1:{port}"], "follower")
        rc, out, err = self.run_cmd(self.worker_argv(
            f"127.0.0.1:{port},127.0.0.1:{fport}", "--name=w", "--train_limit=640",
            "--test_limit=100", "--model=mlp"), timeout=120)
        self.assertEqual(rc, 0, err[-2000:])
        for p in (leader, follower):
            p.communicate(timeout=60)
        # The follower's checkpoints are lost; the leader's are not. The restarted leader waits
        # for its follower to say what it holds, finds no step both hold, and says so. (The job
        # had finished: without the record of that, as after a crash, it restores.)
        os.remove(os.path.join(ckpt[0], "finished.json"))
        shutil.rmtree(ckpt[1])
        port = free_port()
        restarted = self.spawn([PS, "--host=127.0.0.1", f"--port={port}", "--restore",
                                f"--checkpoint_dir={ckpt[0]}", "--shard=0/2"] + flags)
        refollower = self.spawn([PS, "--host=127.0.0.1", "--port=0", "--restore",
                                 f"--checkpoint_dir={ckpt[1]}", "--shard=1/2",
                                 f"--leader=127.0.0.1:{port}"] + flags)
        _, err = restarted.communicate(timeout=60)
        self.assertNotEqual(restarted.returncode, 0)
        self.assertIn("no checkpoint of the same step is held by every shard", err.decode())
        self.assertIn("shard 1 holds none", err.decode())
        _, ferr = refollower.communicate(timeout=60)
        self.assertNotEqual(refollower.returncode, 0, ferr.decode()[-2000:])


class FinishedJobTest(ProcessTestCase):
    """A finished job stays finished (docs/fault_tolerance.md#a-finished-job-stays-finished)."""

    def test_a_restart_on_a_finished_jobs_checkpoints_exits_at_once_and_keeps_the_summary(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        summary = os.path.join(ckpt, "summary.json")
        flags = ["--workers=1", "--epochs=1", "--global_batch=64", f"--checkpoint_dir={ckpt}",
                 f"--summary_path={summary}", "--restore_if_present", "--linger_s=1"]
        ps, port = self.start_ps(flags)
        rc, _, err = self.run_cmd(self.worker_argv(port, "--train_limit=640", "--test_limit=100",
                                                   "--model=mlp"), 120)
        self.assertEqual(rc, 0, err[-2000:])
        self.check_ended_ok(ps, summary, epochs=1)
        with open(os.path.join(ckpt, "finished.json")) as f:
            record = json.load(f)
        self.assertEqual((record["status"], record["epochs_completed"]), ("ok", 1))
        with open(summary, "rb") as f:
            before = f.read()
        for restore in ("--restore_if_present", "--restore"):
            start = time.time()
            rc, out, err = self.run_cmd([PS, "--host=127.0.0.1", "--port=0", restore] +
                                        flags[:-2], 30)
            self.assertEqual(rc, 0, err)
            self.assertLess(time.time() - start, 10, "at once")
            self.assertIn(f"the job in {ckpt} has finished (1 epochs", out)
            self.assertIn("there is nothing left to train", out)
            with open(summary, "rb") as f:
                self.assertEqual(f.read(), before, "the summary is left as it was")
        rc, out, _ = self.run_cmd([PS, "--dry_run"] + flags, 30)
        self.assertEqual(rc, 0)
        self.assertIn("has finished", out)
        self.assertIn("would exit 0 at once", out)
        # A new job in the same folder (no restore) takes the record away.
        ps, _ = self.start_ps([f for f in flags if f != "--restore_if_present"], "again")
        self.assertFalse(os.path.exists(os.path.join(ckpt, "finished.json")))
        ps.kill()
        ps.wait()


class OtherModelTest(ProcessTestCase):
    def test_mlp_with_adam_trains_on_one_worker(self):
        rc, out, err, out_dir = self.launch(
            "mlp", "--workers=1", "--slowdown=1", "--epochs=2", "--model=mlp",
            "--optimizer=adam", "--lr=0.001", "--global_batch=32", "--train_limit=3000",
            "--test_limit=1000")
        self.assertEqual(rc, 0, out + err)
        with open(os.path.join(out_dir, "summary.json")) as f:
            s = json.load(f)
        self.assertIn("adam", s["optimizer"])
        self.assertEqual(s["epochs_completed"], 2)
        self.assertGreater(s["epochs"][0]["train_loss"], s["epochs"][1]["train_loss"])
        self.assertGreaterEqual(s["final_test_accuracy"], 0.7)


class CpuQuotaTest(ProcessTestCase):
    def setUp(self):
        super().setUp()
        sys.path.insert(0, os.path.join(RUNFILES, "deploy"))
        import hetero
        self.hetero = hetero
        why = hetero.quota_unavailable_reason()
        if why is not None:
            self.skipTest(f"CPU quotas unavailable here: {why}")

    def check_quota_run(self, name, periods, *flags):
        rc, out, err, out_dir = self.launch(
            name, "--workers=2", "--cpu_quota=0.5,0.25", "--epochs=1", "--train_limit=640",
            "--test_limit=100", "--global_batch=32", *flags)
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"CPU quota 0.5,0.25 cores over periods of {periods} ms", out)
        # Each worker found its quota in its cgroup and told the server (--cpu_limit=auto).
        with open(os.path.join(out_dir, "summary.json")) as f:
            limits = {w["name"]: w["cpu_limit_cores"] for w in json.load(f)["worker_info"]}
        self.assertEqual(limits, {"worker-0": 0.5, "worker-1": 0.25})
        with open(os.path.join(out_dir, "worker-1.log")) as f:
            self.assertIn("running under a CPU limit of 0.25 cores", f.read())
        # The launcher names its cgroups dbs_<its pid>_w<i> and removes them when done.
        launcher_pid = self.procs[-1].pid
        left = [d for d in os.listdir(self.hetero.CGROUP_CPU)
                if d.startswith(f"dbs_{launcher_pid}_")]
        self.assertEqual(left, [])

    def test_cpu_quotas_run_and_their_cgroups_are_removed(self):
        # The shortest periods a 1 ms quota allows: 2 ms for half a core, 4 ms for a quarter.
        self.check_quota_run("quota", "2,4")

    def test_the_kernels_default_period_as_kubernetes_keeps_it(self):
        self.check_quota_run("quota_k8s", "100", "--cpu_period_ms=100")

    def test_workers_told_to_ignore_their_quota_report_none(self):
        rc, out, err, out_dir = self.launch(
            "quota_ignored", "--workers=2", "--cpu_quota=0.5,0.25", "--cpu_limit=none",
            "--epochs=1", "--train_limit=640", "--test_limit=100", "--global_batch=32")
        self.assertEqual(rc, 0, out + err)
        with open(os.path.join(out_dir, "summary.json")) as f:
            limits = [w["cpu_limit_cores"] for w in json.load(f)["worker_info"]]
        self.assertEqual(limits, [0, 0])

    def test_a_period_too_short_for_the_quota_is_refused_and_leaves_no_cgroup(self):
        rc, out, err, _ = self.launch("quota_bad", "--workers=2", "--cpu_quota=0.5,0.25",
                                      "--cpu_period_ms=2", "--epochs=1")
        self.assertEqual(rc, 2, out + err)
        self.assertIn("cannot hold a quota of 0.25 cores", err)
        launcher_pid = self.procs[-1].pid
        left = [d for d in os.listdir(self.hetero.CGROUP_CPU)
                if d.startswith(f"dbs_{launcher_pid}_")]
        self.assertEqual(left, [], "the first worker's cgroup was made before the refusal")


class PolicyTest(ProcessTestCase):
    def run_policy(self, name, *flags):
        rc, out, err, out_dir = self.launch(
            name, "--workers=2", "--slowdown=1,3", "--epochs=3", "--global_batch=32",
            "--train_limit=1600", "--test_limit=400", "--model=mlp", *flags)
        self.assertEqual(rc, 0, out + err)
        with open(os.path.join(out_dir, "summary.json")) as f:
            s = json.load(f)
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"])
        slow_id = [w["id"] for w in s["worker_info"] if w["name"] == "worker-1"][0]
        return s, slow_id

    @policy_outcome
    def test_the_papers_rule_trains_and_rebalances(self):
        s, slow_id = self.run_policy("proportional", "--policy=proportional")
        self.assertEqual(s["policy"], "proportional")
        last = {w["id"]: w["batch_size"] for w in s["epochs"][-1]["workers"]}
        self.assertLess(last[slow_id], 16, "the 3x slower worker gets less than half of B")
        self.assertEqual(sum(e["revisions"] for e in s["epochs"]), 0,
                         "the paper's rule re-plans at epoch boundaries only")

    @policy_outcome
    def test_dbs_keeps_the_batch_bounds(self):
        # The fast worker would get about 24 of 32; --max_batch=20 holds it at 20.
        s, slow_id = self.run_policy("bounded", "--policy=dbs", "--max_batch=20")
        self.assertEqual(s["policy"], "dbs")
        for e in s["epochs"][1:]:
            batches = {w["id"]: w["batch_size"] for w in e["workers"]}
            self.assertLessEqual(max(batches.values()), 20)
            self.assertEqual(batches[slow_id], 12)

    @policy_outcome
    def test_a_worker_over_its_memory_keeps_its_share_in_micro_batches(self):
        # The fast worker holds only 8 samples at once (dbs_worker --max_batch=8, through the
        # launcher's --worker_max_batch): it computes its batch as micro-batches, and DBS, which
        # is not told of the limit, still gives it the share its speed earns (about 24 of 32).
        s, slow_id = self.run_policy("micro", "--policy=dbs", "--worker_max_batch=8,0")
        with open(os.path.join(self.tmp, "micro", "worker-0.log")) as f:
            log = f.read()
        self.assertRegex(log, r"batch \d+ is over --max_batch=8: computed as [3-5] micro-batches")
        for e in s["epochs"][1:]:
            batches = {w["id"]: w["batch_size"] for w in e["workers"]}
            self.assertLess(batches[slow_id], 12, e["epoch"])
            self.assertGreater(32 - batches[slow_id], 16, "the fast worker's share is not capped")


class LauncherTest(ProcessTestCase):
    def test_a_failing_worker_stops_the_whole_cluster(self):
        rc, _, err, out_dir = self.launch("fail", "--workers=2", "--data_dir=/nonexistent",
                                          timeout=60)
        self.assertEqual(rc, 1)
        self.assertIn("FAILED", err)
        with open(os.path.join(out_dir, "pids.json")) as f:
            pids = json.load(f)
        self.assertIn("ps", pids)
        for label, pid in pids.items():
            self.assertFalse(alive(pid), f"{label} (pid {pid}) still running")

    def test_a_worker_the_job_removes_does_not_stop_the_others(self):
        # The last worker's gradients go bad at its step 10: dbs_ps quarantines it, the worker
        # exits 1, and the launcher lets the job finish with the other two, as dbs_ps does.
        rc, out, err, out_dir = self.launch(
            "removed", "--workers=3", "--epochs=2", "--global_batch=64", "--train_limit=3000",
            "--test_limit=500", "--corrupt_gradient=nan@10", timeout=240)
        self.assertEqual(rc, 0, err[-3000:])
        self.assertIn("worker-2 exited with code 1 (see worker-2.log); the job goes on", err)
        self.assertIn("1 worker(s) quarantined", out)
        with open(os.path.join(out_dir, "summary.json")) as f:
            record = json.load(f)
        self.assertEqual((record["status"], record["epochs_completed"]), ("ok", 2))
        self.assertEqual(len(record["quarantined"]), 1)
        for e in record["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["epoch"])

    @policy_outcome
    def test_the_noise_margin_reaches_the_server(self):
        # --noise_margin is passed to dbs_ps as is: a value dbs_ps refuses stops the launch
        # with dbs_ps's own message, before any worker starts.
        rc, _, err, out_dir = self.launch("margin", "--workers=2", "--noise_margin=5",
                                          timeout=60)
        self.assertEqual(rc, 1)
        self.assertIn("dbs_ps exited with code 2 before listening", err)
        with open(os.path.join(out_dir, "ps.log")) as f:
            self.assertIn("noise_margin must be in [0, 4] standard deviations", f.read())

    def test_ctrl_c_stops_every_process(self):
        out_dir = os.path.join(self.tmp, "interrupt")
        p = self.spawn([sys.executable, LAUNCHER, f"--ps_bin={PS}", f"--worker_bin={WORKER}",
                        f"--out_dir={out_dir}", "--quiet", "--workers=2", "--epochs=50",
                        f"--data_dir={DATA_DIR}", "--train_limit=6000", "--test_limit=500"])
        pids_file = os.path.join(out_dir, "pids.json")
        deadline = time.time() + 60
        pids = {}
        while time.time() < deadline and len(pids) < 3:
            time.sleep(0.2)
            try:
                with open(pids_file) as f:
                    pids = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        self.assertEqual(len(pids), 3, "the launcher started dbs_ps and two workers")
        # Let training get going, then interrupt as a user would.
        time.sleep(2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 1)
        self.assertIn("interrupted", err.decode())
        for label, pid in pids.items():
            self.assertFalse(alive(pid), f"{label} (pid {pid}) still running")


if __name__ == "__main__":
    unittest.main(verbosity=2)
