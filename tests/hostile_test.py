"""A hostile peer on the network while a real job trains.

dbs_ps runs with a job secret and two real dbs_worker processes train Fashion-MNIST; in the last two
tests dbs_ps is two shards and the attack goes to the follower, then to the leader. Meanwhile
tests/hostile_client (no secret, no token) sends every kind of bad call, round after round:
random bytes to every method, malformed, overflowing and oversized tensors, wrong steps and
epochs, unknown and forged ids, floods of registrations and of waiting calls, push sessions
with forged tokens, unread answers and sessions walked away from, Leave for the real workers. The
test checks that the server never died, every bad call was refused with a clear code, the job completed with every epoch's sample audit clean, the accuracy is that of an
undisturbed run of the same job, and dbs_ps's peak memory stayed under PEAK_RSS_BOUND_MIB.
"""

import json
import os
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import RUNFILES, ProcessTestCase  # noqa: E402

HOSTILE = os.path.join(RUNFILES, "tests", "hostile_client")
JOB = ["--workers=2", "--epochs=2", "--global_batch=64", "--policy=fixed", "--linger_s=2",
       "--job_token=the-job-secret", "--max_message_mb=64", "--memory_quota_mb=256"]
# --slowdown stretches the steps with sleeps (no CPU), so the attack runs through the training
# (at 5, a fast machine finished the training within two rounds of the attack). Under
# AddressSanitizer (the suite sets ASAN_OPTIONS) the steps' CPU, which the factor multiplies, is
# several times larger: at 10 the training outlasted 17 rounds of the attack and the test took
# 5 minutes; 3 keeps several rounds.
SLOWDOWN = 3 if "ASAN_OPTIONS" in os.environ else 10
WORKER = ["--train_limit=3000", "--test_limit=1000", "--log_every_s=60", f"--slowdown={SLOWDOWN}",
          "--connect_timeout_s=20", "--job_token=the-job-secret"]
# What the attack may add to dbs_ps's peak resident memory (VmHWM) over the undisturbed run's:
# the 80 MiB pushes are read before the 64 MiB message limit refuses them, within the 256 MiB
# quota. (Measured: 22 -> 239-253 MiB.) Under AddressSanitizer (the suite sets ASAN_OPTIONS),
# whose quarantine keeps up to 256 MiB of freed memory mapped, the attacked peak was 690 MiB
# both before and after the copy-free data plane, but the undisturbed run's fell from 282 to
# 105 MiB: the quarantine is allowed on top.
ASAN_QUARANTINE_MIB = 256 if "ASAN_OPTIONS" in os.environ else 0
PEAK_EXTRA_BOUND_MIB = 512 + ASAN_QUARANTINE_MIB
# The default policy splits each run's batches by the speeds it measures, so the two runs train
# on different splits (each step's sum itself is deterministic).
ACCURACY_TOLERANCE = 0.01


def peak_rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


class HostileTest(ProcessTestCase):
    def run_job(self, tag, attack, shards=1, at=-1):
        """The job, attacked or not. The attack goes to shard `at` (the last: with shards > 1,
        a follower, which serves only ParameterService) and its memory is the one watched."""
        summary = os.path.join(self.tmp, f"{tag}.json")
        servers, server = self.start_shards(JOB + [f"--summary_path={summary}"], tag, shards)
        target, address = servers[at], server.split(",")[at]
        peak = [0.0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                m = peak_rss_mib(target.pid)
                if m is not None:
                    peak[0] = max(peak[0], m)
                time.sleep(0.1)

        # A daemon: a failed assertion below must fail the test, not leave it waiting on this.
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        hostile = None
        if attack:
            argv = [HOSTILE, f"--server={address}", "--rounds=0"]
            if target is not servers[0]:
                argv.append("--follower")
            hostile = self.spawn(argv)
            # The attack is under way before the workers join.
            first = hostile.stdout.readline()
            self.assertTrue(first, "the hostile client ended before its first round")
        workers = [self.spawn(self.worker_argv(server, *WORKER, f"--name=w{i}"))
                   for i in range(2)]
        for w in workers:
            out, err = w.communicate(timeout=600)
            self.assertEqual(w.returncode, 0, err.decode()[-3000:])
        rounds = []
        if attack:
            self.assertIsNone(hostile.poll(), "the hostile client stopped early")
            hostile.send_signal(signal.SIGTERM)
            out, err = hostile.communicate(timeout=60)
            rounds = [json.loads(line) for line in (first + out).decode().splitlines() if line]
        self.streams_continued = 0
        for ps in servers:
            ps_out, ps_err = ps.communicate(timeout=120)
            self.assertEqual(ps.returncode, 0, ps_err.decode()[-3000:])
            self.streams_continued += ps_err.decode().count("follows again from event")
        stop.set()
        watcher.join()
        with open(summary) as f:
            record = json.load(f)
        return record, peak[0], rounds

    def check_attack(self, shards, at=-1):
        calm, calm_peak, _ = self.run_job(f"calm{shards}", attack=False, shards=shards, at=at)
        hostile, peak, rounds = self.run_job(f"hostile{shards}", attack=True, shards=shards,
                                             at=at)
        last = rounds[-1]
        print(f"{shards} shard(s), undisturbed: accuracy {calm['final_test_accuracy']:.4f}, "
              f"dbs_ps peak {calm_peak:.0f} MiB; attacked: accuracy "
              f"{hostile['final_test_accuracy']:.4f}, dbs_ps peak {peak:.0f} MiB; {len(rounds)} "
              f"attack rounds, {last['calls']} bad calls: {json.dumps(last['by_method'])}; "
              f"follower streams continued: {self.streams_continued}", flush=True)
        # The first round ended before the workers started; the next began as they did, and
        # the client was still attacking when they finished (asserted in run_job): at least one
        # whole round overlapped the training.
        self.assertGreaterEqual(len(rounds), 2, "the attack ran through the training")
        # Calls forged for the live workers' ids were refused as such (not as unknown ids).
        denied = sum(codes.get("7", 0) for codes in last["by_method"].values())
        self.assertGreater(denied, 0, "the attack reached the workers' ids while they trained")
        self.assertEqual(last["findings"], [], "every bad call is refused with a clear code")
        self.assertEqual(hostile["status"], "ok")
        self.assertEqual(hostile["epochs_completed"], 2)
        self.assertEqual(len(hostile["worker_info"]), 2, "no intruder joined")
        for e in hostile["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], (e["epoch"], e["audit"]))
            self.assertEqual(e["dead_workers"], [], "no real worker was evicted")
        self.assertAlmostEqual(hostile["final_test_accuracy"], calm["final_test_accuracy"],
                               delta=ACCURACY_TOLERANCE)
        self.assertLess(peak - calm_peak, PEAK_EXTRA_BOUND_MIB)

    def test_a_hostile_peer_changes_nothing(self):
        self.check_attack(shards=1)

    def test_a_worker_with_the_secret_harms_only_itself(self):
        # It joins the running job, reports an epoch it was not in, asks the others to leave,
        # pushes a loss of 1e308 and floods registrations from its host (the honest workers'
        # too), then never trains: its idle registrations are dropped before they are planned.
        summary = os.path.join(self.tmp, "insider.json")
        ps, port = self.start_ps(JOB + [f"--summary_path={summary}", "--max_workers_per_host=8",
                                        "--registration_idle_s=0.5", "--worker_timeout_s=20"],
                                 "insider")
        workers = [self.spawn(self.worker_argv(port, *WORKER, f"--name=w{i}")) for i in range(2)]
        # It joins once the first epoch is planned (the first of two, several seconds long).
        log = []
        while not any("epoch 1/2 planned" in line for line in log):
            line = ps.stderr.readline().decode()
            self.assertTrue(line, "dbs_ps ended before the job started")
            log.append(line)
        rc, out, err = self.run_cmd([HOSTILE, f"--server=127.0.0.1:{port}", "--insider",
                                     "--job_token=the-job-secret"], 300)
        self.assertEqual(rc, 0, err[-2000:])
        codes = json.loads(out.strip().splitlines()[-1])
        print(f"insider: {json.dumps(codes)}", flush=True)
        failed_precondition, permission_denied, invalid_argument, exhausted = 9, 7, 3, 8
        self.assertEqual(codes["report_unplanned"], failed_precondition, codes)
        self.assertEqual(set(codes["leave_for_others"]), {str(permission_denied)}, codes)
        self.assertEqual(codes["push_huge_loss"], invalid_argument, codes)
        # 8 places for the host: the two workers, the insider, and 5 of its 100 names.
        self.assertEqual(codes["flood"].get("0", 0), 5, codes)
        self.assertEqual(codes["flood"].get(str(exhausted), 0), 95, codes)
        for w in workers:
            _, err = w.communicate(timeout=600)
            self.assertEqual(w.returncode, 0, err.decode()[-3000:])
        _, ps_err = ps.communicate(timeout=120)
        ps_err = "".join(log) + ps_err.decode()
        self.assertEqual(ps.returncode, 0, ps_err[-3000:])
        self.assertIn("its registration is dropped", ps_err)
        with open(summary) as f:
            record = json.load(f)
        self.assertEqual((record["status"], record["epochs_completed"]), ("ok", 2))
        names = {w["id"]: w["name"] for w in record["worker_info"]}
        for e in record["epochs"]:
            self.assertTrue(e["audit"]["every_sample_once"], (e["epoch"], e["audit"]))
            self.assertEqual(e["dead_workers"], [], "nobody was planned who did not train")
            self.assertEqual(sorted(names[w["id"]] for w in e["workers"]), ["w0", "w1"],
                             "only the honest workers trained, and neither was removed")

    def test_a_hostile_peer_at_a_follower_changes_nothing(self):
        # The follower checks each made-up token against the leader's signature at once
        # (common/secrets.h) instead of waiting for the leader to announce the worker.
        self.check_attack(shards=2)

    def test_a_hostile_peer_at_a_sharded_jobs_leader_changes_nothing(self):
        # The flood fills the leader's memory quota, under which gRPC may reset the follower's
        # stream from the leader: the follower continues it (ShardLog::Join with its key).
        self.check_attack(shards=2, at=0)


if __name__ == "__main__":
    unittest.main()
