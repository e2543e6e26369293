"""The process contract orchestrators rely on (docs/deploying.md), with real processes:
DBS_* environment variables, torchrun's MASTER_ADDR/MASTER_PORT, exit codes, SIGTERM (a worker
leaves and the job goes on; dbs_ps writes a final checkpoint), and the health probe.
"""

import glob
import json
import os
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import (DATA_DIR, PS, RUNFILES, WORKER, ProcessTestCase,  # noqa: E402
                          free_port, is_progress)

PROBE = os.path.join(RUNFILES, "server", "dbs_health_probe")
SMALL = ["--train_limit=1200", "--test_limit=200", "--log_every_s=1", "--connect_timeout_s=3"]


def env_with(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBS_")}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env.update(extra)
    return env


class ProcessContractTest(ProcessTestCase):
    def summary(self, path):
        with open(path) as f:
            return json.load(f)

    def test_settings_come_from_the_environment_and_torchrun_variables(self):
        summary = os.path.join(self.tmp, "env.json")
        port_file = os.path.join(self.tmp, "env.port")
        # Every setting of dbs_ps by environment; the command line only names the port file.
        ps = self.spawn([PS, f"--port_file={port_file}"], env=env_with(
            DBS_PORT="0", DBS_WORKERS="2", DBS_EPOCHS="1", DBS_GLOBAL_BATCH="96",
            DBS_SUMMARY_PATH=summary, DBS_LINGER_S="1"))
        deadline = time.time() + 30
        while not os.path.exists(port_file) and time.time() < deadline:
            time.sleep(0.05)
        port = open(port_file).read().strip()
        # The probe runs in dbs_ps's container: dbs_ps's variables there are not its own.
        probe = self.spawn([PROBE, f"--server=127.0.0.1:{port}"], env=env_with(
            DBS_CHECKPOINT_DIR="/checkpoints", DBS_PORT="50051", DBS_WORKERS="2"))
        out, err = probe.communicate(timeout=30)
        self.assertEqual(probe.returncode, 0, out.decode() + err.decode())
        self.assertIn("SERVING", out.decode())
        # One worker by DBS_*, one by torchrun's variables only.
        w0 = self.spawn([WORKER, *SMALL], env=env_with(
            DBS_SERVER=f"127.0.0.1:{port}", DBS_NAME="w0", DBS_DATA_DIR=DATA_DIR))
        w1 = self.spawn([WORKER, f"--data_dir={DATA_DIR}", "--name=w1", *SMALL],
                        env=env_with(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for w in (w0, w1):
            _, err = w.communicate(timeout=300)
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])
        ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        s = self.summary(summary)
        self.assertEqual(s["global_batch"], 96)
        self.assertEqual(sum(w["batch_size"] for w in s["epochs"][0]["workers"]), 96)
        self.assertEqual(sorted(w["name"] for w in s["worker_info"]), ["w0", "w1"])

    def test_bad_configuration_exits_2_naming_the_problem(self):
        for binary in (PS, WORKER):
            p = self.spawn([binary], env=env_with(DBS_GLOBAL_BACH="96"))
            _, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 2, binary)
            self.assertIn("unknown environment variable DBS_GLOBAL_BACH", err.decode())
            p = self.spawn([binary, "--no_such_flag=1"], env=env_with())
            p.communicate(timeout=30)
            self.assertEqual(p.returncode, 2, binary)
        p = self.spawn([PS, "--port=0"], env=env_with(DBS_WORKERS="0"))
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertIn("at least one worker", err.decode())
        # The worker checks its flags before it loads any data; the environment maps too.
        for value in ("lots", "-1", "0"):
            p = self.spawn([WORKER, "--dry_run"], env=env_with(DBS_CPU_LIMIT=value))
            _, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 2, value)
            self.assertIn("--cpu_limit must be 'auto', 'none' or a number of cores > 0", err.decode())
        for value in ("auto", "none", "0.5"):
            p = self.spawn([WORKER, "--dry_run", f"--cpu_limit={value}"], env=env_with())
            out, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 0, value + err.decode())

    def test_help_exits_0(self):
        for binary, flag in ((PS, "--global_batch"), (WORKER, "--call_timeout_s"),
                             (PROBE, "--timeout_s")):
            rc, out, _ = self.run_cmd([binary, "--help"], 30)
            self.assertEqual(rc, 0, binary)
            self.assertIn(flag, out)
            if binary == PROBE:  # its flags come from its command line alone
                self.assertNotIn("[DBS_", out)
            else:
                self.assertIn("[DBS_", out)

    def test_the_processes_run_on_the_allocator_their_build_links(self):
        # //common:malloc: tcmalloc, except in sanitizer builds and with --define=dbs_malloc=system.
        expected = os.environ["EXPECTED_MALLOC"]
        ps, port = self.start_ps(["--workers=1", "--global_batch=8", "--epochs=1"])
        worker = self.spawn(self.worker_argv(port, "--train_limit=100", "--test_limit=100"))
        for proc in (ps, worker):
            deadline = time.time() + 30
            while True:  # the dynamic loader maps every library before main runs
                with open(f"/proc/{proc.pid}/maps") as f:
                    maps = f.read()
                if "libc.so" in maps or time.time() > deadline:
                    break
                time.sleep(0.05)
            self.assertIn("libc.so", maps)
            if expected == "tcmalloc":
                self.assertIn("libtcmalloc_minimal.so", maps, proc.args[0])
            else:
                self.assertNotIn("libtcmalloc", maps, proc.args[0])

    def test_an_unreachable_server_exits_with_a_restartable_code(self):
        rc, _, err = self.run_cmd(
            [WORKER, f"--server=127.0.0.1:{free_port()}", f"--data_dir={DATA_DIR}",
             "--train_limit=100", "--test_limit=100", "--connect_timeout_s=1"], 60)
        self.assertEqual(rc, 200, err)

    def test_sigterm_on_a_worker_leaves_the_job_and_the_others_finish(self):
        summary = os.path.join(self.tmp, "leave.json")
        ps, port = self.start_ps(["--workers=3", "--epochs=2", "--global_batch=48",
                                  f"--summary_path={summary}", "--linger_s=1"])
        workers = [self.spawn(self.worker_argv(port, *SMALL, f"--name=w{i}", "--slowdown=3"))
                   for i in range(3)]
        # Wait until w2 trains, then stop it as an orchestrator would.
        while not is_progress(workers[2].stdout.readline()):
            self.assertIsNone(workers[2].poll(), "w2 ended before training")
        workers[2].send_signal(signal.SIGTERM)
        out, _ = workers[2].communicate(timeout=60)
        self.assertEqual(workers[2].returncode, 143)
        self.assertIn(b"left the job", out)
        for w in workers[:2]:
            _, err = w.communicate(timeout=300)
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])
        ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        s = self.summary(summary)
        self.assertEqual(s["status"], "ok")
        for e in s["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], e["audit"])

    def test_sigterm_on_the_server_writes_a_final_checkpoint(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        ps, port = self.start_ps(["--workers=2", "--epochs=5", "--global_batch=48",
                                  f"--checkpoint_dir={ckpt}", "--checkpoint_every_steps=100000"])
        workers = [self.spawn(self.worker_argv(port, *SMALL, f"--name=w{i}", "--slowdown=3"))
                   for i in range(2)]
        while not is_progress(workers[0].stdout.readline()):
            self.assertIsNone(workers[0].poll(), "w0 ended before training")
        self.assertEqual(glob.glob(os.path.join(ckpt, "*")), [], "no periodic checkpoint yet")
        ps.send_signal(signal.SIGTERM)
        _, err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 143, err.decode()[-2000:])
        self.assertIn(b"final checkpoint written", err)
        self.assertTrue(glob.glob(os.path.join(ckpt, "*")), "a checkpoint exists")
        for w in workers:
            w.communicate(timeout=120)
            self.assertEqual(w.returncode, 200, "the server went away: restart")
        # A restart continues from it.
        ps2, _ = self.start_ps(["--workers=2", "--epochs=5", "--global_batch=48",
                                f"--checkpoint_dir={ckpt}", "--restore"], tag="restored")
        ps2.send_signal(signal.SIGTERM)
        _, err = ps2.communicate(timeout=60)
        self.assertIn(b"restored", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
