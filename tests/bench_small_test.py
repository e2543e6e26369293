"""The benchmark harness in its small mode (CI): every system runs on a tiny subset, and the
report is complete and self-consistent; the consistency check itself catches a broken record."""

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import unittest

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", "dbs"))
PYTHON = "/usr/bin/python3"  # Debian's, with python3-torch and python3-matplotlib


class BenchSmallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out = tempfile.mkdtemp(prefix="bench_", dir=os.environ.get("TEST_TMPDIR"))
        r = subprocess.run(
            [PYTHON, os.path.join(RUNFILES, "bench", "run_bench.py"), "--small",
             f"--out_dir={cls.out}", f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')}",
             f"--worker_bin={os.path.join(RUNFILES, 'worker', 'dbs_worker')}",
             f"--simulator_bin={os.path.join(RUNFILES, 'bench', 'dbs_simulator')}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        cls.output = r.stdout
        cls.returncode = r.returncode

    def test_harness_succeeds_and_report_is_complete(self):
        self.assertEqual(self.returncode, 0, self.output)
        for name in ("report.md", "report.json", "results.json", "worker_times.png",
                     "accuracy_vs_time.png", "disturbance.png"):
            self.assertTrue(os.path.getsize(os.path.join(self.out, name)) > 0, name)
        with open(os.path.join(self.out, "report.json")) as f:
            rep = json.load(f)
        for key in ("ideal_epoch_seconds", "sgd_epoch_seconds", "dbs_epoch_seconds",
                    "dbs_over_ideal", "dbs_over_sgd", "ddp_epoch_seconds",
                    "disturbance_added_ratio", "max_barrier_wait_fraction", "accuracy_gap_pp"):
            self.assertIn(key, rep)
        self.assertEqual(len(rep["standalone_speeds"]), 4)
        self.assertEqual({t["figure"] for t in rep["targets"]},
                         {"dbs_over_ideal", "dbs_over_sgd", "dbs_time_to_ddp_accuracy_ratio",
                          "max_barrier_wait_fraction", "disturbance_added_ratio",
                          "accuracy_gap_pp"})
        md = open(os.path.join(self.out, "report.md")).read()
        self.assertIn("## Targets", md)
        self.assertIn("![worker_times.png]", md)
        # The simulator's table for 4 ... 256 workers is in the report.
        self.assertEqual([r["workers"] for r in rep["simulation"]], [4, 8, 16, 64, 256])
        self.assertIn("## Beyond one machine (simulation)", md)
        # The mid-epoch scenario: DBS re-planned within its window after the slowdown began.
        self.assertIsNotNone(rep["midepoch_replan_delay_steps"])
        self.assertLessEqual(rep["midepoch_replan_delay_steps"], 2 * rep["midepoch_window"])

    def test_consistency_check_passes_and_catches_a_broken_record(self):
        self.assertEqual(self.returncode, 0, self.output)
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        import report
        self.assertEqual(report.check(self.out), [])
        broken = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        shutil.rmtree(broken)
        shutil.copytree(self.out, broken)
        path = os.path.join(broken, "runs", "dbs", "summary.json")
        with open(path) as f:
            s = json.load(f)
        s["epochs"][1]["workers"].pop()  # a worker missing from an epoch
        s["epochs"][0]["workers"][0]["samples"] += 1  # a sample counted twice
        with open(path, "w") as f:
            json.dump(s, f)
        problems = report.check(broken)
        self.assertTrue(any("workers" in p for p in problems), problems)
        self.assertTrue(any("samples do not add up" in p for p in problems), problems)


class GridSmallTest(unittest.TestCase):
    """bench/run_bench.py --grid --small --grid_oracles: two tiny cells, three policies and
    two fixed splits by weight each."""

    def test_grid_runs_every_policy_and_reports_every_cell(self):
        out = tempfile.mkdtemp(prefix="grid_", dir=os.environ.get("TEST_TMPDIR"))
        r = subprocess.run(
            [PYTHON, os.path.join(RUNFILES, "bench", "run_bench.py"), "--grid", "--small",
             "--grid_oracles", f"--out_dir={out}", f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')}",
             f"--worker_bin={os.path.join(RUNFILES, 'worker', 'dbs_worker')}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout)
        grid_dir = os.path.join(out, "grid")
        with open(os.path.join(grid_dir, "grid.json")) as f:
            grid = json.load(f)
        cells = grid["cells"]
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        import grid as grid_module
        import report
        self.assertEqual([c["name"] for c in cells],
                         ["B64_1-1-2-4_slowdown", "B64_1-1-1-8_slowdown"])
        for c in cells:
            for key in ("dbs_over_sgd", "dbs_over_ideal", "dbs_over_best", "proportional_over_sgd",
                        "dbs_settled_spread", "dbs_settled_compute_spread", "dbs_batches",
                        "proportional_batches", "best_split_epoch_seconds"):
                self.assertIn(key, c)
            self.assertEqual(c["fixed_batches"], [[16, 16, 16, 16]] * 3)
            # What communication costs each worker, from the workers' own records: some CPU
            # every step, well under a step's compute; the ideal with it is longer.
            self.assertEqual(len(c["dbs_comm_cpu_ms_per_step"]), 4)
            for ms in c["dbs_comm_cpu_ms_per_step"]:
                self.assertGreater(ms, 0.0)
                self.assertLess(ms, 50.0)
            self.assertGreater(c["ideal_with_comm_epoch_seconds"], c["ideal_epoch_seconds"])
            self.assertLess(c["dbs_over_ideal_with_comm"], c["dbs_over_ideal"])
            # The slowest worker (launch index 0) gets less than its equal share from epoch 1.
            self.assertLess(c["dbs_batches"][1][0], 16)
            self.assertLess(c["proportional_batches"][1][0], 16)
            # The oracles ran the splits they name, from epoch 0 on (dbs_ps --fixed_split):
            # the best split of the curves, and the samples of DBS's last epoch as weights.
            best = grid_module.best_split_batches(c["standalone_curves"], 64)
            self.assertEqual(c["split_best_batches"], [best] * 3)
            dbs_samples = [w["samples"] for w in report.by_launch_index(json.load(open(
                os.path.join(grid_dir, c["runs"]["dbs"]["summary"]))))[-1]]
            for b, w in zip(c["split_dbs_batches"][0], dbs_samples):
                self.assertAlmostEqual(b, 64 * w / sum(dbs_samples), delta=1.0)
            for key in ("dbs_over_split_best", "dbs_over_split_dbs", "split_best_over_ideal"):
                self.assertGreater(c[key], 0.0)
        summary = grid["summary"]
        self.assertEqual(summary["cells_run"], 2)
        self.assertEqual({t["figure"] for t in summary["targets"]},
                         {"dbs_over_sgd", "dbs_over_ideal", "dbs_over_best",
                          "dbs balance from epoch 2"})
        for c in cells:  # a standalone curve per worker, at B/n first
            self.assertEqual(len(c["standalone_curves"]), 4)
            for curve in c["standalone_curves"]:
                self.assertEqual(curve[0][0], 16)
                self.assertGreaterEqual(len(curve), 5)
        # The slowdown cells' workers run as slower cores of their own: a wait for a core
        # counts inside the slowdown (dbs_worker --slowdown_of=cpu), under every policy.
        for policy in ("dbs", "proportional", "fixed"):
            log = open(os.path.join(grid_dir, "B64_1-1-1-8_slowdown", policy,
                                    "worker-0.log")).read()
            self.assertIn("a step's computation takes 11 x its CPU time (a wait for a core "
                          "counts inside it)", log)
        md = open(os.path.join(grid_dir, "grid.md")).read()
        self.assertIn("## Worst and median cell", md)
        self.assertIn("B64_1-1-1-8_slowdown", md)
        self.assertIn("## DBS against fixed splits run in the same cell", md)
        self.assertIn("The linear ideal against splits run for real", md)
        # Every cell ran the splits: each DBS/ideal miss is classed by what they gave.
        self.assertEqual(summary["ideal_missed_without_splits_run"], [])
        missing = next(t for t in summary["targets"] if t["figure"] == "dbs_over_ideal")
        self.assertEqual(sorted(summary["ideal_missed_by_every_split_run"]
                                + summary["ideal_met_by_a_split_run"]),
                         sorted(missing["cells_missing"]))
        self.assertTrue(os.path.getsize(os.path.join(grid_dir, "grid.csv")) > 0)
        self.assertEqual(grid_module.check(grid_dir), [])
        for c in cells:
            self.assertGreaterEqual(c["noise_floor"], 1.0)
        # The noise floor of a static split: worker 0 steady, worker 1 twice as slow in one
        # epoch of three (from epoch 2 on): normalized 1.5 / 0.75, against 1.0 for worker 0.
        def epoch(t0, t1):
            return {"workers": [{"id": 0, "samples": 8, "step_seconds": t0},
                                {"id": 1, "samples": 8, "step_seconds": t1}]}
        run = {"epochs": [epoch(9, 9), epoch(9, 9), epoch(1, 1), epoch(1, 1), epoch(1, 2)]}
        self.assertAlmostEqual(grid_module.noise_floor(run), 1.5)
        # The check catches batches that do not sum to B.
        cells[0]["dbs_batches"][2][0] += 1
        with open(os.path.join(grid_dir, "grid.json"), "w") as f:
            json.dump(grid, f)
        self.assertTrue(any("sum to" in p for p in grid_module.check(grid_dir)))


class GridRoundsTest(unittest.TestCase):
    """bench/run_bench.py --grid --grid_rounds=2 on one tiny cell: the policies run twice, in
    alternating order; each policy's figures come from its median run, and DBS/S-SGD is also
    given round by round."""

    def test_rounds_alternate_and_the_median_run_is_reported(self):
        out = tempfile.mkdtemp(prefix="rounds_", dir=os.environ.get("TEST_TMPDIR"))
        r = subprocess.run(
            [PYTHON, os.path.join(RUNFILES, "bench", "run_bench.py"), "--grid",
             "--grid_batches=64", "--grid_speeds=1:1:1:8", "--grid_emulations=slowdown",
             "--grid_steps=12", "--grid_epochs=3", "--grid_test_limit=128",
             "--grid_speed_samples=128", "--grid_curve_samples=64", "--grid_rounds=2",
             f"--out_dir={out}", f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')}",
             f"--worker_bin={os.path.join(RUNFILES, 'worker', 'dbs_worker')}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout)
        grid_dir = os.path.join(out, "grid")
        with open(os.path.join(grid_dir, "grid.json")) as f:
            (cell,) = json.load(f)["cells"]
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        import grid as grid_module
        self.assertEqual([(x["round"], x["policy"]) for x in cell["rounds"]],
                         [(1, "fixed"), (1, "proportional"), (1, "dbs"),
                          (2, "dbs"), (2, "proportional"), (2, "fixed")])
        for policy in ("fixed", "proportional", "dbs"):
            runs = [x for x in cell["rounds"] if x["policy"] == policy]
            for x in runs:
                with open(os.path.join(grid_dir, x["summary"])) as f:
                    self.assertAlmostEqual(x["epoch_seconds"],
                                           grid_module.steady_epoch_seconds(json.load(f)))
            # Of two runs, the faster one is the median reported.
            faster = min(runs, key=lambda x: x["epoch_seconds"])
            self.assertEqual(cell["runs"][policy]["summary"], faster["summary"])
            self.assertAlmostEqual(cell[f"{policy}_epoch_seconds"], faster["epoch_seconds"])
        by_round = {(x["round"], x["policy"]): x["epoch_seconds"] for x in cell["rounds"]}
        expected = [by_round[(k, "dbs")] / by_round[(k, "fixed")] for k in (1, 2)]
        for got, want in zip(cell["dbs_over_sgd_by_round"], expected):
            self.assertAlmostEqual(got, want)
        self.assertAlmostEqual(cell["dbs_over_sgd_paired"], statistics.median(expected))
        # The workers' CPU outside compute is read from DBS's median run's own records.
        self.assertEqual(len(cell["dbs_comm_cpu_ms_per_step"]), 4)
        md = open(os.path.join(grid_dir, "grid.md")).read()
        self.assertIn("## Rounds", md)
        self.assertEqual(grid_module.check(grid_dir), [])
        self.assertEqual(grid_module.median_run([{"epoch_seconds": t} for t in (3, 1, 2)]),
                         {"epoch_seconds": 2})
        # --combine: one report over several grid runs' cells; a cell found twice is refused.
        combined = os.path.join(out, "combined")
        summary = grid_module.combine(combined, [grid_dir])
        self.assertEqual(summary["cells_run"], 1)
        self.assertAlmostEqual(summary["dbs_over_sgd"]["worst"], cell["dbs_over_sgd"])
        self.assertAlmostEqual(summary["dbs_over_ideal"]["median"], cell["dbs_over_ideal"])
        md = open(os.path.join(combined, "grid_combined.md")).read()
        self.assertIn(f"| {cell['name']} | {cell['dbs_over_sgd']:.3f} |", md)
        with self.assertRaises(SystemExit):
            grid_module.combine(combined, [grid_dir, grid_dir])


class OracleModesTest(unittest.TestCase):
    """--grid_oracles=all|misses|none, and the DBS/ideal misses classed by the splits run."""

    def setUp(self):
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        sys.path.insert(0, os.path.join(RUNFILES, "deploy"))
        import grid as grid_module
        self.grid = grid_module

    def test_misses_runs_the_splits_only_where_dbs_missed_the_ideal(self):
        wants = self.grid.wants_oracles
        limit = self.grid.TARGETS["dbs_over_ideal"]
        self.assertTrue(wants("misses", {"dbs_over_ideal": limit + 0.01}))
        self.assertFalse(wants("misses", {"dbs_over_ideal": limit}))
        self.assertTrue(wants("all", {}))
        self.assertFalse(wants("none", {}))
        self.assertTrue(wants(True, {}))  # records from before the modes: a plain flag
        self.assertFalse(wants(False, {}))

    def test_misses_are_classed_by_the_best_split_run_beside_dbs(self):
        limit = self.grid.TARGETS["dbs_over_ideal"]
        cells = [
            {"name": "met", "dbs_over_ideal": limit - 0.1, "split_best_over_ideal": 2.0},
            {"name": "both_missed", "dbs_over_ideal": 1.5, "split_best_over_ideal": 1.4,
             "split_dbs_over_ideal": 1.6},
            {"name": "one_met", "dbs_over_ideal": 1.5, "split_best_over_ideal": 1.6,
             "split_dbs_over_ideal": limit - 0.01},
            {"name": "unrun", "dbs_over_ideal": 1.5},
        ]
        self.assertEqual(self.grid.ideal_misses_against_splits(cells),
                         (["both_missed"], ["one_met"], ["unrun"]))


class DisturbanceMeasureTest(unittest.TestCase):
    """bench/disturbance.py's reading of a step trace: when the disturbed worker is back within
    10% of the others, counted in steps from an event."""

    def setUp(self):
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        sys.path.insert(0, os.path.join(RUNFILES, "deploy"))
        import disturbance
        self.d = disturbance

    @staticmethod
    def trace(times):
        """A step trace whose step i ended at second i, each worker's step its time there."""
        return [{"time": float(i), "workers": [{"id": w, "step_seconds": t} for w, t in
                                                enumerate(step)]}
                for i, step in enumerate(times)]

    def test_steps_are_counted_from_the_event_to_a_window_within_tolerance(self):
        # Worker 2 balanced for 10 steps, twice as slow for 6 (the burst), then balanced.
        times = [[1.0, 1.0, 1.0]] * 10 + [[1.0, 1.1, 2.0]] * 6 + [[1.0, 1.0, 1.05]] * 20
        rows = self.d.step_table(self.trace(times), [0, 1, 2])
        self.assertEqual(len(rows), 36)
        # From step 10 on, the windows of 4 from steps 10-15 hold a slow step; 16 is clear.
        self.assertEqual(self.d.steps_to_recover(rows, 2, 10.0, 4, 0.1), 6)
        self.assertEqual(self.d.steps_to_recover(rows, 2, 15.5, 4, 0.1), 0)
        # The median of the others (1.0 and 1.1): worker 2 at 1.05 is within 10%.
        self.assertTrue(self.d.within(rows, 2, 20, 4, 0.1))
        self.assertAlmostEqual(self.d.balanced_fraction(rows[16:], 2, 4, 0.1), 1.0)
        self.assertIsNone(self.d.steps_to_recover(rows, 2, 99.0, 4, 0.1), "no step after it")

    def test_a_worker_never_back_within_tolerance_has_no_count(self):
        rows = self.d.step_table(self.trace([[1.0, 1.0, 3.0]] * 20), [0, 1, 2])
        self.assertIsNone(self.d.steps_to_recover(rows, 2, 0.0, 4, 0.1))
        self.assertEqual(self.d.balanced_fraction(rows, 2, 4, 0.1), 0.0)

    def test_steps_a_worker_was_not_timed_in_are_left_out_and_ids_give_the_order(self):
        trace = self.trace([[1.0, 2.0]] * 3)
        del trace[1]["workers"][1]["step_seconds"]  # the first step after a restore
        rows = self.d.step_table(trace, [1, 0])
        self.assertEqual(rows, [(0.0, [2.0, 1.0]), (2.0, [2.0, 1.0])])


class BestSplitTest(unittest.TestCase):
    """bench/grid.py's best split of standalone step-time curves."""

    def setUp(self):
        import sys
        sys.path.insert(0, os.path.join(RUNFILES, "bench"))
        sys.path.insert(0, os.path.join(RUNFILES, "deploy"))
        import grid as grid_module
        self.grid = grid_module
        self.best = grid_module.best_split_step

    def test_linear_workers_split_in_proportion(self):
        # 1 and 3 samples per second: 2 and 6 of 8 samples, 2 s each.
        self.assertAlmostEqual(self.best([[[1, 1], [4, 4]], [[3, 1], [6, 2]]], 8), 2.0)

    def test_a_per_step_overhead_moves_samples_to_the_other_worker(self):
        # 1 s + 1 s per sample against 0.5 s per sample: 3 and 7 of 10 (4 s), not the 5 and 5
        # of equal speeds at the measured batches.
        self.assertAlmostEqual(self.best([[[1, 2], [4, 5]], [[2, 1], [8, 4]]], 10), 4.0)

    def test_a_curve_that_bends_is_read_between_its_points(self):
        # Worker 0 is cheap up to 4 samples and 0.9 s a sample beyond (a quota's knee); worker 1
        # takes 0.25 s a sample. 5 and 5: 1.3 s (4 and 6 would be 1.5 s; 6 and 4, 2.2 s).
        knee = [[1, 0.1], [4, 0.4], [8, 4.0]]
        self.assertAlmostEqual(self.best([knee, [[4, 1.0], [8, 2.0]]], 10), 1.3)


    def test_the_best_split_batches_reach_the_best_step(self):
        curves = [[[1, 2], [4, 5]], [[2, 1], [8, 4]]]  # the per-step overhead case above
        split = self.grid.best_split_batches(curves, 10)
        self.assertEqual(sum(split), 10)
        self.assertAlmostEqual(max(self.grid.best_split_time(c, b)
                                   for c, b in zip(curves, split)), 4.0)
        # Curves that fit more than B under the best step: the excess comes off the slowest.
        knee = [[1, 0.1], [4, 0.4], [8, 4.0]]
        split = self.grid.best_split_batches([knee, [[4, 1.0], [8, 2.0]]], 10)
        self.assertEqual(split, [5, 5])
        # A worker whose one sample costs more than the others' whole step gets none.
        self.assertEqual(self.grid.best_split_batches([[[1, 10.0], [2, 11.0]],
                                                       [[4, 1.0], [8, 2.0]]], 8), [0, 8])

    def test_the_ideal_with_communication_pays_each_worker_its_step_cost(self):
        step = self.grid.ideal_with_communication_step
        # 1 and 3 samples/s, no communication: 8 samples in 2 s, as the linear ideal.
        self.assertAlmostEqual(step([1, 3], [0, 0], 8), 2.0, places=6)
        # 1 s of communication each: 1 * (T - 1) + 3 * (T - 1) = 8, T = 3.
        self.assertAlmostEqual(step([1, 3], [1, 1], 8), 3.0, places=6)
        # A worker whose communication alone is longer than the step contributes nothing:
        # 4 * (T - 0) = 8 with T = 2 < 5.
        self.assertAlmostEqual(step([1, 4], [5, 0], 8), 2.0, places=6)


class InterleaveTest(unittest.TestCase):
    """bench/interleave.py: every arm once per round, in the order given, and their medians."""

    def run_tool(self, *args):
        return subprocess.run([PYTHON, os.path.join(RUNFILES, "bench", "interleave.py"), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)

    def test_arms_alternate_round_by_round(self):
        out = tempfile.mkdtemp(prefix="interleave_", dir=os.environ.get("TEST_TMPDIR"))
        common = (f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')} "
                  f"--worker_bin={os.path.join(RUNFILES, 'worker', 'dbs_worker')} "
                  "--workers=2 --epochs=2 --global_batch=32 --train_limit=320 --test_limit=64")
        r = self.run_tool(f"--out_dir={out}", "--rounds=2", f"--common={common}",
                          "--arm=even=--policy=fixed", "--arm=three_to_one=--policy=fixed "
                          "--fixed_split=3,1")
        self.assertEqual(r.returncode, 0, r.stdout)
        runs = [line.split()[:2] for line in r.stdout.splitlines() if line.startswith("round")]
        self.assertEqual(runs, [["round1", "even"], ["round1", "three_to_one"],
                                ["round2", "even"], ["round2", "three_to_one"]])
        self.assertIn("last split by worker id [16, 16]", r.stdout)
        with open(os.path.join(out, "round2", "three_to_one", "summary.json")) as f:
            last = json.load(f)["epochs"][-1]["workers"]
        self.assertEqual(sorted(w["batch_size"] for w in last), [8, 24])
        medians = [line for line in r.stdout.splitlines() if "median" in line]
        self.assertEqual([m.split()[0] for m in medians], ["even", "three_to_one"])
        self.assertIn("run 4/4, ETA 0 s", r.stdout)
        # The record: every run of each arm, in round order, and the median of its epoch times.
        with open(os.path.join(out, "interleave.json")) as f:
            record = json.load(f)
        self.assertEqual([a["name"] for a in record["arms"]], ["even", "three_to_one"])
        self.assertEqual(record["arms"][1]["flags"], ["--policy=fixed", "--fixed_split=3,1"])
        for arm in record["arms"]:
            self.assertEqual([run["round"] for run in arm["runs"]], [1, 2])
            times = [run["epoch_seconds"] for run in arm["runs"]]
            self.assertAlmostEqual(arm["median_epoch_seconds"], statistics.median(times))
            for run in arm["runs"]:
                with open(os.path.join(out, run["summary"])) as f:
                    summary = json.load(f)
                self.assertAlmostEqual(run["epoch_seconds"], statistics.mean(
                    e["train_seconds"] for e in summary["epochs"][1:]))
        self.assertEqual(sorted(record["arms"][1]["runs"][1]["last_split"]), [8, 24])

    def test_an_arm_without_a_name_is_refused(self):
        r = self.run_tool("--out_dir=/nonexistent", "--arm=--policy=dbs")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--arm must be NAME=FLAGS", r.stdout)


class DataplaneSmallTest(unittest.TestCase):
    """bench/dataplane.py at one small size: dbs_ps with the C++ client, gloo beside it, in fp32
    summed in worker order, bf16 summed on arrival across 2 shards (modes combine) and fp32
    through shared memory; the table, the record and the plot."""

    def test_every_variant_and_gloo_report_their_figures(self):
        out = tempfile.mkdtemp(prefix="dataplane_small_")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        p = subprocess.run(
            [PYTHON, os.path.join(RUNFILES, "bench", "dataplane.py"), "--sizes=46730",
             "--variants=fp32,bf16/arrival/2shards,fp32/shm", "--rounds=1", "--warmup=1",
             "--steps=5",
             f"--out_dir={out}", f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')}",
             f"--client_bin={os.path.join(RUNFILES, 'bench', 'dataplane_client')}"],
            capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
        with open(os.path.join(out, "dataplane.json")) as f:
            record = json.load(f)
        rows = {r["wire_dtype"]: r for r in record["summary"]}
        self.assertEqual(set(rows), {"fp32", "bf16/arrival/2shards", "fp32/shm"})
        for r in rows.values():
            self.assertEqual(r["params"], 46730)
            self.assertGreater(r["dbs_step_ms"], 0)
            self.assertGreater(r["gloo_step_ms"], 0)
            self.assertGreater(r["server_peak_rss_mib"], 1)
            self.assertGreaterEqual(r["server_faults_per_step"], 0)
            # The second half's 3 of the 5 timed steps fault at most what all 5 did.
            self.assertGreaterEqual(r["server_faults_per_step_second_half"], 0)
            self.assertLessEqual(3 * r["server_faults_per_step_second_half"],
                                 5 * r["server_faults_per_step"])
            self.assertGreater(r["client_cpu_ms_per_step"], 0)
        # Through shared memory the server maps the clients' 4 gradient regions and its slots
        # (in fp32 the store's snapshots: shared even over the socket); its own memory is the
        # peak less the clients' regions.
        shm = rows["fp32/shm"]
        regions = 4 * 46730 * 4 / 2**20
        self.assertAlmostEqual(shm["client_regions_mib"], regions)
        self.assertAlmostEqual(shm["server_own_peak_mib"], shm["server_peak_rss_mib"] - regions)
        self.assertGreater(shm["server_shared_rss_mib"], regions)
        self.assertEqual(rows["fp32"]["client_regions_mib"], 0)
        self.assertGreater(rows["fp32"]["server_shared_rss_mib"], 0)
        self.assertTrue(os.path.exists(os.path.join(out, "dataplane.png")))
        with open(os.path.join(out, "dataplane.md")) as f:
            text = f.read()
        self.assertIn("| 46,730 | bf16/arrival/2shards |", text)
        self.assertRegex(text, r"\| 46,730 \| fp32/shm \| .* \[shared \d+; own \d+\]")

    def test_a_mode_given_twice_or_unknown_is_refused_before_anything_runs(self):
        for variant in ("fp32/shm/shm", "fp32/fast", "fp32/0shards", "fp32/whole", "int8"):
            p = subprocess.run(
                [PYTHON, os.path.join(RUNFILES, "bench", "dataplane.py"), "--sizes=46730",
                 f"--variants={variant}", "--out_dir=/nonexistent/dataplane",
                 f"--ps_bin={os.path.join(RUNFILES, 'server', 'dbs_ps')}",
                 f"--client_bin={os.path.join(RUNFILES, 'bench', 'dataplane_client')}"],
                capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0, variant)
            self.assertIn(f"unknown variant '{variant}'", p.stderr, variant)

if __name__ == "__main__":
    unittest.main(verbosity=2)
