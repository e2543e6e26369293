"""dbs_ps's HTTP endpoint with the real tools that read it: Debian's `prometheus` scrapes a
running job and its query API returns a steps counter above zero; Debian's `chromium`, headless,
renders the status page (one row per worker) and takes a screenshot. Both are installed by
deploy/install_deps.sh; where one cannot be had, its test is skipped saying so.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_test import ProcessTestCase, free_port  # noqa: E402

# Far longer than a few scrapes and a page load take (the slowdowns stretch the steps with
# sleeps): the test ends the job with SIGTERM once it has checked what it came for, so the job
# is always still running then, whatever the machine or the build.
JOB = ["--workers=2", "--epochs=40", "--global_batch=64", "--linger_s=1"]
WORKER = ["--train_limit=6000", "--test_limit=500", "--log_every_s=60"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metrics_port(path):
    """The status page's port, from dbs_ps --metrics_port_file once it is written (the page
    starts after the gRPC port is announced, so the file may come a moment later)."""
    deadline = time.time() + 30
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    with open(path) as f:
        return f.read().strip()


class ObservabilityTest(ProcessTestCase):
    def start_job(self):
        metrics_file = os.path.join(self.tmp, "metrics.port")
        ps, port = self.start_ps(JOB + ["--metrics_port=0", f"--metrics_port_file={metrics_file}"])
        metrics = metrics_port(metrics_file)
        workers = [self.spawn(self.worker_argv(port, *WORKER, f"--name=w{i}",
                                               f"--slowdown={3 + 3 * i}")) for i in range(2)]
        return ps, workers, metrics

    def stop(self, ps, workers):
        """Ends the job as an operator would, each process with SIGTERM, and checks that each
        stops as docs/deploying.md says (exit 143): a worker leaves the job, dbs_ps writes its
        summary. The last worker goes after dbs_ps (it would retry a server that is gone):
        were it to leave first, dbs_ps would end the job itself, with no worker left. The rest
        of the job's epochs would check nothing more here, and under the sanitizers, whose cost
        the workers' slowdowns multiply, they took minutes."""
        for p in workers[:-1] + [ps, workers[-1]]:
            self.assertIsNone(p.poll(), "the job was still running when its checks were done")
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 143, err.decode()[-3000:])

    def test_prometheus_scrapes_the_steps_counter(self):
        prometheus = shutil.which("prometheus")
        if prometheus is None:
            self.skipTest("prometheus is not installed (deploy/install_deps.sh installs Debian's)")
        ps, workers, metrics = self.start_job()
        text = get(f"http://127.0.0.1:{metrics}/metrics")
        self.assertIn("# TYPE dbs_steps_total counter", text)
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                    "  - job_name: dbs\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{metrics}']\n")
        prom_port = free_port()
        self.spawn([prometheus, f"--config.file={config}",
                    f"--storage.tsdb.path={os.path.join(self.tmp, 'tsdb')}",
                    f"--web.listen-address=127.0.0.1:{prom_port}"])
        query = (f"http://127.0.0.1:{prom_port}/api/v1/query?query=dbs_steps_total")
        value, deadline = 0.0, time.time() + 90
        while value <= 0 and time.time() < deadline:
            time.sleep(1)
            try:
                result = json.loads(get(query))["data"]["result"]
            except OSError:
                continue  # prometheus still starting
            if result:
                value = float(result[0]["value"][1])
        print(f"prometheus query dbs_steps_total = {value}", flush=True)
        self.assertGreater(value, 0, "prometheus scraped a steps counter above zero")
        # Both workers run on dbs_ps's host: each has pushed by now, through shared memory.
        self.assertIn("\ndbs_shared_memory_workers 2\n", get(f"http://127.0.0.1:{metrics}/metrics"))
        self.stop(ps, workers)

    def test_the_status_page_renders_a_row_per_worker_in_chromium(self):
        chromium = shutil.which("chromium")
        if chromium is None:
            self.skipTest("chromium is not installed (deploy/install_deps.sh installs Debian's)")
        ps, workers, metrics = self.start_job()
        # Once the first epoch is done the page has compute/wait bars too.
        deadline = time.time() + 120
        while time.time() < deadline:
            status = json.loads(get(f"http://127.0.0.1:{metrics}/status.json"))
            if status["epochs_completed"] >= 1:
                break
            time.sleep(0.5)
        url = f"http://127.0.0.1:{metrics}/"
        profile = os.path.join(self.tmp, "chromium")
        dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                              "--virtual-time-budget=5000", "--dump-dom", url],
                             capture_output=True, timeout=120).stdout.decode()
        self.assertEqual(dom.count('<tr class="worker">'), 2, dom[-3000:])
        self.assertIn("w0", dom)
        self.assertIn("samples/s", dom)
        self.assertIn("- running", dom, "the headline says the job runs, not how it ended")
        self.assertEqual(status["status"], "running")
        out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR", self.tmp)
        shot = os.path.join(out_dir, "status_page.png")
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        "--virtual-time-budget=5000", "--window-size=1100,620",
                        f"--screenshot={shot}", url], capture_output=True, timeout=120)
        self.assertTrue(os.path.exists(shot))
        with open(shot, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        print(f"status page screenshot: {shot}", flush=True)
        self.stop(ps, workers)


class FinalStateTest(ProcessTestCase):
    def test_the_status_page_shows_the_end_through_the_linger(self):
        """After the job, dbs_ps keeps its status page up for --linger_s with the final state;
        while the job ran, the page said it was running."""
        metrics_file = os.path.join(self.tmp, "metrics.port")
        ps, port = self.start_ps(["--workers=1", "--epochs=1", "--global_batch=64",
                                  "--linger_s=8", "--metrics_port=0",
                                  f"--metrics_port_file={metrics_file}"])
        metrics = metrics_port(metrics_file)
        self.assertEqual(json.loads(get(f"http://127.0.0.1:{metrics}/status.json"))["state"],
                         "running")
        rc, _, err = self.run_cmd(self.worker_argv(port, "--train_limit=640", "--test_limit=100",
                                                   "--model=mlp"), 120)
        self.assertEqual(rc, 0, err[-2000:])
        ended = time.time()
        status = json.loads(get(f"http://127.0.0.1:{metrics}/status.json"))
        self.assertIsNone(ps.poll(), "dbs_ps lingers after its workers left")
        self.assertEqual((status["state"], status["status"]), ("finished", "ok"))
        self.assertEqual(status["epochs_completed"], 1)
        ps.communicate(timeout=60)
        self.assertEqual(ps.returncode, 0)
        self.assertGreater(time.time() - ended, 5, "it stayed up for about --linger_s")


if __name__ == "__main__":
    unittest.main(verbosity=2)
