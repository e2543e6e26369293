"""Transport security end to end: real dbs_ps and dbs_worker processes with certificates made by
openssl at test time, mutual TLS and a job secret. Refused peers never get in, and the job goes on.
"""

import json
import os
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import DATA_DIR, PS, RUNFILES, ProcessTestCase  # noqa: E402

HOSTILE = os.path.join(RUNFILES, "tests", "hostile_client")

SMALL = ["--train_limit=600", "--test_limit=200", "--log_every_s=60", "--connect_timeout_s=3"]


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)


def make_cert(d, name, ca, san=None):
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = os.path.join(d, f"{name}.ext")
    with open(ext, "w") as f:
        f.write(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", ext, cwd=d)


class SecurityTest(ProcessTestCase):
    def setUp(self):
        super().setUp()
        d = self.tmp
        make_ca(d, "ca")
        make_ca(d, "rogue_ca")
        make_cert(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
        make_cert(d, "worker", "ca")
        make_cert(d, "worker2", "ca")
        make_cert(d, "rogue", "rogue_ca")
        self.secret = os.path.join(d, "job.secret")
        with open(self.secret, "w") as f:
            f.write("s3cret-job-token\n")

    def p(self, name):
        return os.path.join(self.tmp, name)

    def tls(self, who):
        return [f"--tls_ca={self.p('ca.pem')}", f"--tls_cert={self.p(who + '.pem')}",
                f"--tls_key={self.p(who + '.key')}"]

    def test_mutual_tls_and_the_job_secret_keep_strangers_out(self):
        summary = self.p("summary.json")
        ps, port = self.start_ps([
            "--workers=2", "--epochs=1", "--global_batch=32", "--linger_s=1",
            f"--summary_path={summary}", f"--tls_cert={self.p('server.pem')}",
            f"--tls_key={self.p('server.key')}", f"--tls_client_ca={self.p('ca.pem')}",
            f"--job_token_file={self.secret}"])
        worker = lambda *flags: self.worker_argv(port, *SMALL, *flags)  # noqa: E731
        token = f"--job_token_file={self.secret}"

        # Plaintext, TLS without a certificate, and a certificate from another CA: the connection
        # is refused, so registration never happens.
        for name, flags in (("plain", [token]),
                            ("nocert", [f"--tls_ca={self.p('ca.pem')}", token]),
                            ("rogue", [f"--tls_ca={self.p('ca.pem')}",
                                       f"--tls_cert={self.p('rogue.pem')}",
                                       f"--tls_key={self.p('rogue.key')}", token])):
            rc, _, err = self.run_cmd(worker(f"--name={name}", *flags), 60)
            self.assertEqual(rc, 200, name)
            self.assertIn("could not reach dbs_ps", err, name)
        # The right certificate but the wrong secret, or none: UNAUTHENTICATED, each saying
        # which. (A generous connect timeout: these must get through TLS to be refused; under a
        # loaded full-suite run a short handshake deadline cuts every TLS handshake off.)
        for name, secret, says in (("guess", ["--job_token=guess"], "not this job's"),
                                   ("nosecret", [], "sent none")):
            rc, _, err = self.run_cmd(worker(f"--name={name}", *self.tls("worker"), *secret,
                                             "--connect_timeout_s=90"),
                                      150)
            self.assertEqual(rc, 2, f"{name}: a refused secret is a configuration error: {err}")
            self.assertIn(says, err)
        self.assertIsNone(ps.poll(), "dbs_ps is still serving")

        # The real workers train the job to completion (with 60 s of retries, like a real one:
        # SMALL's 3 s is for the refused ones above and the frozen-server test).
        workers = [self.spawn(worker(f"--name=w{i}", *self.tls("worker"), token,
                                     "--connect_timeout_s=60"))
                   for i in range(2)]
        for w in workers:
            out, err = w.communicate(timeout=180)
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])
        _, ps_err = ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        with open(summary) as f:
            record = json.load(f)
        self.assertEqual((record["status"], record["epochs_completed"]), ("ok", 1))
        self.assertEqual(len(record["worker_info"]), 2, "no stranger registered")
        # dbs_ps says whom it refused, and why (one of the two refusals, at least: the log
        # keeps to a line a second).
        self.assertRegex(ps_err.decode(), r"refused a worker from ipv[46]:[\[\]0-9a-f.:]+: "
                                          r"(it sent no job secret|its job secret is not this job's)")

    def test_under_mutual_tls_a_token_works_only_with_its_certificate(self):
        # A worker with the secret hands its token to another connection (another certificate
        # of the job's CA): the token and the name are refused there, and still work at home.
        ps, port = self.start_ps([
            "--workers=2", "--epochs=1", "--global_batch=32", "--summary_path=",
            f"--tls_cert={self.p('server.pem')}", f"--tls_key={self.p('server.key')}",
            f"--tls_client_ca={self.p('ca.pem')}", f"--job_token_file={self.secret}"])
        with open(self.secret) as f:
            secret = f.read().strip()
        rc, out, err = self.run_cmd([
            HOSTILE, f"--server=127.0.0.1:{port}", "--replay_name=lender",
            f"--job_token={secret}", f"--tls_ca={self.p('ca.pem')}",
            f"--tls_cert={self.p('worker.pem')}", f"--tls_key={self.p('worker.key')}",
            f"--tls_cert2={self.p('worker2.pem')}", f"--tls_key2={self.p('worker2.key')}"], 120)
        self.assertEqual(rc, 0, err[-2000:])
        codes = json.loads(out.strip().splitlines()[-1])
        ok, permission_denied, failed_precondition = 0, 7, 9
        self.assertEqual(codes["registered"], ok, codes)
        # At home the token passes (the model is not registered yet: that is all it is told).
        self.assertIn(codes["own"], (ok, failed_precondition), codes)
        self.assertEqual(codes["replayed"], permission_denied, codes)
        self.assertIn("another client certificate", codes["replayed_message"])
        self.assertEqual(codes["reregistered"], permission_denied, codes)
        self.assertIsNone(ps.poll(), "dbs_ps is still serving")

    def test_the_shards_of_a_job_follow_only_with_the_secret_under_mutual_tls(self):
        summary = self.p("sharded.json")
        server_tls = [f"--tls_cert={self.p('server.pem')}", f"--tls_key={self.p('server.key')}",
                      f"--tls_client_ca={self.p('ca.pem')}"]
        job = ["--workers=2", "--epochs=1", "--global_batch=32", "--linger_s=1"]
        token = f"--job_token_file={self.secret}"
        leader, port = self.start_ps(job + server_tls + [token, "--shard=0/2",
                                                         f"--summary_path={summary}"], "leader")
        # Without the job's secret a process cannot take shard 1's place.
        rc, _, err = self.run_cmd([PS, "--host=127.0.0.1", "--port=0", "--shard=1/2",
                                   f"--leader=127.0.0.1:{port}", "--summary_path=", *job,
                                   *server_tls], 60)
        self.assertNotEqual(rc, 0)
        self.assertIn("refused", err)
        self.assertIn("job's secret", err)
        follower, fport = self.start_ps(job + server_tls + [
            token, "--shard=1/2", f"--leader=127.0.0.1:{port}", "--summary_path="], "follower")
        servers = f"127.0.0.1:{port},127.0.0.1:{fport}"
        # SMALL's 3 s of retries is for the frozen-server test; here a worker that gave up on a
        # shard while the machine was loaded would leave the other waiting for the job's second
        # worker, so they get 60 s, like a real one.
        workers = [self.spawn(self.worker_argv(servers, *SMALL, f"--name=w{i}",
                                               *self.tls("worker"), token,
                                               "--connect_timeout_s=60")) for i in range(2)]
        for w in workers:
            try:
                _, err = w.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                for p in workers + [leader, follower]:
                    p.kill()
                logs = [p.communicate()[1].decode()[-3000:] for p in workers + [leader, follower]]
                self.fail("a worker did not finish in 180 s; the workers', the leader's and the "
                          "follower's stderr:\n" + "\n-----\n".join(logs))
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])
        for p in (leader, follower):
            _, err = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, err.decode()[-2000:])
        with open(summary) as f:
            record = json.load(f)
        self.assertEqual(record["status"], "ok")
        self.assertEqual(len(record["worker_info"]), 2)

    def test_a_second_process_with_a_live_name_is_refused(self):
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=32",
                                  "--linger_s=1"])
        first = self.spawn(self.worker_argv(port, *SMALL, "--name=same"))
        # The first registers and waits for the second worker of the job; a second process with
        # its name must not take its place (before, it silently got the same id).
        while b"joined as worker" not in first.stdout.readline():
            self.assertIsNone(first.poll(), "the first worker exited before joining")
        rc, _, err = self.run_cmd(self.worker_argv(port, *SMALL, "--name=same"), 60)
        self.assertEqual(rc, 200, "the name may free up: worth a restart")
        self.assertIn("already in the job", err)
        other = self.spawn(self.worker_argv(port, *SMALL, "--name=other"))
        for w in (first, other):
            _, err = w.communicate(timeout=180)
            self.assertEqual(w.returncode, 0, err.decode()[-2000:])

    def test_a_frozen_server_does_not_hang_a_waiting_worker(self):
        # Keepalives: a worker waiting on a server that stopped answering (powered off,
        # partitioned; here SIGSTOP) does not wait forever.
        ps, port = self.start_ps(["--workers=2", "--epochs=1", "--global_batch=32"])
        worker = self.spawn(self.worker_argv(port, *SMALL, "--name=alone"))
        while b"joined as worker" not in worker.stdout.readline():
            self.assertIsNone(worker.poll(), "the worker exited before joining")
        # It now registers its model or waits for its plan (the job needs a second worker);
        # either call is in flight when the server freezes.
        os.kill(ps.pid, signal.SIGSTOP)
        try:
            # Keepalive pings at 20 s with 10 s to answer, then the call's retries for
            # --connect_timeout_s (3 s): it must end well within this.
            _, err = worker.communicate(timeout=90)
        finally:
            os.kill(ps.pid, signal.SIGCONT)
        self.assertNotEqual(worker.returncode, 0)
        self.assertIn(f"at dbs_ps 127.0.0.1:{port}", err.decode())


if __name__ == "__main__":
    unittest.main()
