"""Job: a Python worker's part of a dbs job, the low-level API.

    with dbs.Job(model, server="127.0.0.1:50051", train_samples=len(train),
                 test_samples=len(test), evaluate=my_eval) as job:
        for epoch in job.epochs():
            for step in epoch:                  # the steps this worker computes
                model.zero_grad()
                loss = loss_fn(model(x_of(step.indices)), y_of(step.indices))
                loss.backward()                 # the batch's mean loss
                step.push(loss.item() * len(step.indices))
    # the module now holds the job's final parameters

It joins the job, registers the module's parameters (the first worker's values become every
worker's), then for each epoch fetches this worker's plan and yields, step by step, the data set
indices it must compute. `push` sends the module's gradients (and its floating-point buffers'
values, such as BatchNorm's running statistics) and writes the step's new parameters back into the
module. After an epoch's last step, `evaluate(begin, end)` scores the worker's slice of the test
set and the epoch is reported. The loop follows the server as dbs_worker does: mid-epoch
revisions of the plan, removal and rejoining, a restarted server (resume from its checkpoint),
and leaving at the end, or on any error inside the `with` block (KeyboardInterrupt, or
dbs.Stopped raised by a signal handler, included).
"""

import os
import socket
import sys
import time

import numpy as np
import torch

from dbs import wire
from dbs.client import Client, Code, DbsError
from dbs.flat import FlatModel

_GO_ON, _RESYNCED = "go on", "resynced"
MAX_REJOINS = 10


class Stopped(Exception):
    """Raised (from a signal handler) to stop the worker: it leaves the job, the others go on."""


class EvalResult:
    """A test slice's evaluation: samples, correct (argmax hits, for class labels), loss_sum."""

    def __init__(self, samples=0, correct=0, loss_sum=0.0, classified=True):
        self.samples, self.correct, self.loss_sum, self.classified = (samples, correct, loss_sum,
                                                                      classified)


def model_layout(model):
    """[(name, tensor, buffer)] of what a worker exchanges: the parameters that require grad,
    then the floating-point buffers, in the module's order (as dbs_worker lays out a module)."""
    out = [(n, p, False) for n, p in model.named_parameters() if p.requires_grad]
    out += [(n, b, True) for n, b in model.named_buffers() if b.is_floating_point()]
    return out


def flat_gradient(layout):
    """What a worker pushes, flat (numpy float32): each parameter's .grad (zeros where the loss
    did not reach it) and each buffer's value, in layout order."""
    parts = []
    with torch.no_grad():
        for _, t, buffer in layout:
            g = t if buffer else t.grad
            parts.append(torch.zeros(t.numel()) if g is None else
                         g.detach().reshape(-1).to("cpu", torch.float32))
    return torch.cat(parts).numpy()


def layout_values(layout):
    """The layout's tensors now, flat (numpy float32, layout order)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32)
                          for _, t, _ in layout]).numpy()


def load_values(layout, values):
    """Overwrites the layout's tensors with flat float32 values (layout order); ValueError when
    there are not exactly as many."""
    size = sum(t.numel() for _, t, _ in layout)
    flat = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    if flat.numel() != size:
        raise ValueError(f"{flat.numel()} values for a model of {size}")
    offset = 0
    with torch.no_grad():
        for _, t, _ in layout:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _min_sec(seconds):
    s = int(seconds + 0.5)
    return f"{s // 60}:{s % 60:02d}"


class Step:
    """One step this worker computes: `indices` (numpy int64) are data set indices."""

    def __init__(self, epoch, index, num_steps, indices, push):
        self.epoch, self.index, self.num_steps, self.indices = epoch, index, num_steps, indices
        self._push = push
        self.pushed = False
        self.global_loss = None

    def push(self, loss_sum):
        """Sends the module's gradients (the mean over `indices`) with the summed loss over
        them; writes the step's new parameters into the module. Returns the step's mean loss
        over every worker's samples."""
        if self.pushed:
            raise RuntimeError(f"step {self.index + 1} was pushed already")
        self.pushed = True
        self.global_loss = self._push(self, float(loss_sum))
        return self.global_loss


class Epoch:
    """The steps of one epoch for this worker (iterate it once, pushing each step)."""

    def __init__(self, job, number):
        self.job, self.number = job, number
        self.outcome = None  # _GO_ON when every step ran, _RESYNCED when the job moved on

    @property
    def batch_size(self):
        return self.job._plan.batch_size

    @property
    def share(self):
        return self.job._plan.share

    def __iter__(self):
        return self.job._run_epoch(self)


class Job:
    def __init__(self, model, *, server, train_samples, test_samples, name=None, device=None,
                 evaluate=None, job_token="", tls_ca=None, tls_cert=None, tls_key=None,
                 connect_timeout=60.0, call_timeout=60.0, max_wait=0.0, log_every=5.0,
                 out=None, model_name=None, shared_memory=True):
        if test_samples > 0 and evaluate is None:
            raise ValueError("a job with a test set needs evaluate(begin, end) -> EvalResult: "
                             "the server counts on each worker's score of its test slice")
        self.model = model
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.train_samples, self.test_samples = int(train_samples), int(test_samples)
        self.device = str(device or next(model.parameters()).device)
        self.evaluate = evaluate
        self.log_every = log_every
        self.out = out or sys.stdout
        self.model_name = model_name or type(model).__name__
        self.client = Client(server, connect_timeout=connect_timeout, call_timeout=call_timeout,
                             max_wait=max_wait, job_token=job_token, tls_ca=tls_ca,
                             tls_cert=tls_cert, tls_key=tls_key, log=self.say,
                             shared_memory=shared_memory)
        self.layout = model_layout(model)
        # Flat views when the module allows (float32 on one device); it stays on that device.
        self.flat = FlatModel(self.layout) if FlatModel.applies(self.layout) else None
        self.worker_id = -1
        self.finished = False
        self.missed_the_end = False  # the job ended without this run: its values are not final
        self.records = []  # one dict per reported epoch (the JSON record's "epochs")
        self.epoch = 0
        self.total_epochs = 0
        self._need_plan = True
        self._pull_before_training = False
        self._rejoins = 0
        self._left = False
        self._plan = None
        self._schedule = []
        self._num_steps = 0
        self._test_range = (0, 0)
        self._first_step = 0
        self._global_step = 0
        self._job_start = time.monotonic()

    # --- output ------------------------------------------------------------------------------

    def say(self, line):
        print(f"[{self.name}] {line}", file=self.out, flush=True)

    # --- the module's values -----------------------------------------------------------------

    @property
    def plan(self):
        """The current epoch's plan (proto EpochPlan: batch_size, share, global_batch,
        permutation_seed, ...), once one was fetched."""
        return self._plan

    def values(self):
        """The module's exchanged values now, flat (numpy float32, layout order)."""
        return self.flat.current() if self.flat else layout_values(self.layout)

    def _set_values(self, values):
        if self.flat:
            self.flat.load(values)
        else:
            load_values(self.layout, values)

    # --- the job -----------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None:
            self.leave("stopped" if issubclass(kind, (Stopped, KeyboardInterrupt)) else
                       f"failed ({error})")
        return False

    def leave(self, why="stopped"):
        """Leaves the job before its end, so the others re-split this worker's samples at once
        instead of waiting for its timeout (`with Job(...) as job:` does it on any error)."""
        if self.worker_id < 0 or self._left:
            return
        self._left = True
        try:
            self.client.leave(self.worker_id)
            self.say(f"{why}: left the job; the others go on")
        except DbsError as e:
            self.say(f"{why}; leaving the job failed: {e}")

    def epochs(self):
        """Yields each epoch this worker trains (see the module's docstring); leaves the job at
        the end, or when stopped while it waits on the server."""
        try:
            self._join()
            while not self.finished:
                if self._need_plan and (self._fetch_plan() == _RESYNCED or self.finished):
                    continue
                self._need_plan = True
                epoch = Epoch(self, self.epoch)
                yield epoch
                if epoch.outcome is None:
                    raise RuntimeError("an epoch's steps must all be run before the next epoch")
                if epoch.outcome == _GO_ON and self._end_epoch(epoch) == _GO_ON:
                    self.epoch += 1
            self._finish()
        except (Stopped, KeyboardInterrupt):
            self.leave()
            raise

    def _registration(self):
        return self.client.register_worker(self.name, self.train_samples, self.test_samples,
                                           self.device)

    def _join(self):
        joined = self._registration()
        if joined.job_finished:
            self.say(f"the job has already finished ({joined.epochs} epochs): nothing to train")
            self.finished = self.missed_the_end = True
            return
        self.worker_id = joined.worker_id
        self.total_epochs = joined.epochs
        size = sum(t.numel() for _, t, _ in self.layout)
        self.say(f"joined as worker {self.worker_id} on {self.device}: {self.train_samples} train "
                 f"/ {self.test_samples} test samples, model {self.model_name} ({size} "
                 f"parameters), policy {joined.policy}, {joined.epochs} epochs, global batch "
                 f"{joined.global_batch}")
        try:
            values = self.client.register_model(
                self.worker_id, [(n, tuple(t.shape), b) for n, t, b in self.layout],
                self.values())
        except DbsError:
            # Refused (another model than the job's): leave, so the job does not wait for it.
            try:
                self.client.leave(self.worker_id)
            except DbsError:
                pass
            raise
        self._set_values(values)
        self.epoch = joined.start_epoch
        self._pull_before_training = joined.start_epoch > 0
        if joined.start_epoch > 0:
            self.say(f"joining a running job: training from epoch {joined.start_epoch + 1} on, "
                     "from the current parameters")

    def _pull(self):
        _, values = self.client.pull_parameters(self.worker_id)
        self._set_values(values)
        self._pull_before_training = False

    def _fetch_plan(self):
        try:
            plan = self.client.get_epoch_plan(self.worker_id, self.epoch)
        except DbsError as e:
            if e.code == Code.FAILED_PRECONDITION and self._resync(e):
                return _RESYNCED
            if e.code == Code.NOT_FOUND and self._rejoin(e):
                return _RESYNCED
            raise
        wire.validate_plan(plan, self.train_samples, self.test_samples)
        self._plan = plan
        if plan.finished:
            self.finished = True
            if self._pull_before_training:  # rejoined with nothing left: the final values
                self._pull()
            return _GO_ON
        self.total_epochs = plan.total_epochs
        self._schedule = wire.expand_steps(plan)
        self._num_steps = plan.num_steps
        self._test_range = (plan.test_range.begin, plan.test_range.end)
        self._first_step = 0
        if self._pull_before_training:  # joined a running job: the others trained meanwhile
            self._pull()
        return _GO_ON

    def _run_epoch(self, epoch):
        perm = wire.epoch_permutation(self.train_samples, self._plan.permutation_seed)
        timing = {"samples": 0, "compute_seconds": 0.0, "wait_seconds": 0.0}
        resumed = sum(wire.count_samples(s) for s in self._schedule[:self._first_step])
        self._epoch_start = time.monotonic()
        self._next_log = self._epoch_start + self.log_every
        self._step_losses = []
        self._cpu_mark = None
        self._outside_cpu = [0.0, 0]
        step = self._first_step
        while step < self._num_steps:
            if step >= len(self._schedule):
                raise wire.PlanError(f"the plan has {len(self._schedule)} steps of samples but "
                                     f"{self._num_steps} steps")
            for begin, end in self._schedule[step]:
                if not 0 <= begin <= end <= self.train_samples:
                    raise wire.PlanError("the plan's sample range is outside the data set")
            indices = (np.concatenate([perm[b:e] for b, e in self._schedule[step]])
                       if self._schedule[step] else np.zeros(0, np.int64))
            s = Step(self.epoch, step, self._num_steps, indices, self._push)
            s.timing = timing
            s.began = time.monotonic()
            s.cpu_began = time.process_time()
            if len(indices) > 0:
                yield s
                if not s.pushed:
                    raise RuntimeError(f"step {step + 1} of epoch {self.epoch + 1} was not "
                                       "pushed (call step.push(loss_sum))")
            else:
                s.push(0.0)
            if s.outcome == _RESYNCED:
                epoch.outcome = _RESYNCED
                return
            step += 1
        if self.client.take_reconnected() and self._resync(
                DbsError(Code.UNAVAILABLE, "the server restarted during the epoch")):
            epoch.outcome = _RESYNCED
            return
        if resumed > 0 and timing["samples"] > 0:  # part of the epoch timed: scale to the whole
            timing["compute_seconds"] *= (timing["samples"] + resumed) / timing["samples"]
        timing["samples"] += resumed
        self._timing = timing
        epoch.outcome = _GO_ON

    def _push(self, s, loss_sum):
        b = len(s.indices)
        gradient = None if b == 0 else (self.flat.gradient() if self.flat else
                                        flat_gradient(self.layout))
        compute = time.monotonic() - s.began
        now_cpu = time.process_time()
        if self._cpu_mark is not None and self._cpu_mark[0] == s.index - 1:
            self._outside_cpu[0] += max(0.0, now_cpu - self._cpu_mark[1] -
                                        (now_cpu - s.cpu_began))
            self._outside_cpu[1] += 1
        self._cpu_mark = (s.index, now_cpu)
        self._global_step += 1
        t1 = time.monotonic()
        try:
            reply, (_, values) = self.client.push_gradient(self.worker_id, self.epoch, s.index, b,
                                                           loss_sum, compute, gradient)
        except DbsError as e:
            restarted_elsewhere = (e.code == Code.INVALID_ARGUMENT and
                                   self.client.take_reconnected())
            if (e.code == Code.FAILED_PRECONDITION or restarted_elsewhere) and self._resync(e):
                s.outcome = _RESYNCED
                return None
            if e.code == Code.NOT_FOUND and self._rejoin(e):
                s.outcome = _RESYNCED
                return None
            raise
        t2 = time.monotonic()
        self._set_values(values)
        timing = s.timing
        timing["compute_seconds"] += compute + (time.monotonic() - t2)
        timing["wait_seconds"] += t2 - t1
        timing["samples"] += b
        self._step_losses.append(reply.global_loss)
        if reply.HasField("revision"):
            self._apply_revision(reply.revision, s.index)
        self._log_progress(s.index, b, reply.global_loss, timing)
        s.outcome = _GO_ON
        return reply.global_loss

    def _apply_revision(self, rev, step):
        if (rev.epoch != self.epoch or rev.from_step != step + 1 or
                rev.num_steps != rev.from_step + len(rev.steps)):
            raise wire.PlanError("the server sent an inconsistent plan revision")
        wire.validate_revision(rev, self.train_samples, self.test_samples)
        self._schedule = self._schedule[:rev.from_step] + wire.steps_of(rev.steps)
        self._num_steps = rev.num_steps
        self._test_range = (rev.test_range.begin, rev.test_range.end)
        first = wire.count_samples(self._schedule[rev.from_step]) if rev.steps else 0
        self.say(f"epoch {self.epoch + 1} re-planned at step {step + 1} (revision "
                 f"{rev.revision}): {self._num_steps} steps, my next batch {first}")

    def _log_progress(self, step, batch, loss, timing):
        now = time.monotonic()
        if now < self._next_log and step != self._num_steps - 1:
            return
        self._next_log = now + self.log_every
        elapsed = now - self._epoch_start
        per_step = elapsed / (step - self._first_step + 1)
        epoch_eta = per_step * (self._num_steps - step - 1)
        job_eta = epoch_eta + per_step * self._num_steps * (self.total_epochs - self.epoch - 1)
        self.say(f"epoch {self.epoch + 1}/{self.total_epochs} step {step + 1}/{self._num_steps} "
                 f"| loss {loss:.4f} | batch {batch} | "
                 f"{timing['samples'] / max(elapsed, 1e-9):.0f} samples/s | epoch ETA "
                 f"{_min_sec(epoch_eta)} | job ETA {_min_sec(job_eta)}")

    def _end_epoch(self, epoch):
        begin, end = self._test_range
        if not 0 <= begin <= end <= self.test_samples:
            raise wire.PlanError("the plan's test range is outside the test set")
        t = time.monotonic()
        result = self.evaluate(begin, end) if self.evaluate and end > begin else EvalResult()
        timing = dict(self._timing, eval_seconds=time.monotonic() - t,
                      test_samples=result.samples, test_correct=result.correct,
                      test_loss_sum=result.loss_sum)
        try:
            self.client.report_epoch(worker_id=self.worker_id, epoch=self.epoch, **timing)
        except DbsError as e:
            if (e.code in (Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT) and
                    self.client.take_reconnected() and self._resync(e)):
                return _RESYNCED
            if e.code == Code.NOT_FOUND and self._rejoin(e):
                return _RESYNCED
            raise
        n = max(result.samples, 1)
        if result.samples == 0:
            score = "no test slice"
        elif result.classified:
            score = f"accuracy on its test slice {100.0 * result.correct / n:.2f}%"
        else:
            score = f"loss on its test slice {result.loss_sum / n:.6g}"
        outside = (f", CPU outside compute {1e3 * self._outside_cpu[0] / self._outside_cpu[1]:.3f}"
                   " ms/step" if self._outside_cpu[1] else "")
        self.say(f"epoch {self.epoch + 1}/{self.total_epochs} done: {timing['samples']} samples, "
                 f"batch {self._plan.batch_size} (share {self._plan.share:.3f}), compute "
                 f"{timing['compute_seconds']:.2f} s, wait {timing['wait_seconds']:.2f} s, eval "
                 f"{timing['eval_seconds']:.2f} s{outside}, {score}")
        if self.records and self.records[-1]["epoch"] == self.epoch:
            self.records.pop()  # reported again to a restarted server: one epoch
        self.records.append({
            "epoch": self.epoch, "batch_size": self._plan.batch_size, "share": self._plan.share,
            "samples": timing["samples"], "compute_seconds": timing["compute_seconds"],
            "wait_seconds": timing["wait_seconds"], "eval_seconds": timing["eval_seconds"],
            "outside_compute_cpu_seconds": self._outside_cpu[0],
            "outside_compute_cpu_steps": self._outside_cpu[1],
            "test_samples": result.samples, "test_correct": result.correct,
            "step_losses": list(self._step_losses)})
        self.on_epoch_end(self.epoch)
        return _GO_ON

    def on_epoch_end(self, epoch):
        """Called after each reported epoch (a subclass or dbs.fit exports here)."""

    def _rejoin(self, why):
        if self._rejoins >= MAX_REJOINS:
            return False
        try:
            joined = self._registration()
        except DbsError:
            return False
        self._rejoins += 1
        if joined.job_finished:
            self.say(f"removed from the job ({why}); it has finished meanwhile, so there is "
                     "nothing left to join")
            self.worker_id = -1
            self.finished = self.missed_the_end = True
            return True
        self.worker_id = joined.worker_id
        self.epoch = joined.start_epoch
        self._need_plan = True
        self._pull_before_training = True
        if joined.start_epoch >= joined.epochs:
            self.say(f"removed from the job ({why}); its last epoch was already under way, so "
                     "there is nothing left to join")
        else:
            self.say(f"removed from the job ({why}); joined again as worker {self.worker_id} "
                     f"from epoch {self.epoch + 1}")
        return True

    def _resync(self, why):
        try:
            r, values = self.client.resume(self.worker_id)
        except DbsError as e:
            if e.code == Code.NOT_FOUND and self._rejoin(e):
                return True
            self.say(f"cannot resume after '{why}': {e}")
            return False
        if r.plan_ready:
            try:
                wire.validate_plan(r.plan, self.train_samples, self.test_samples)
                wire.validate_revision(r.schedule, self.train_samples, self.test_samples)
            except wire.PlanError as e:
                self.say(f"cannot resume after '{why}': {e}")
                return False
        self.client.take_reconnected()  # this resume accounts for the outage
        self._set_values(values)
        self.finished = r.finished
        self.epoch = r.epoch
        self._need_plan = not r.plan_ready
        if r.plan_ready:
            self._plan = r.plan
            self._schedule = wire.steps_of(r.schedule.steps)
            self._num_steps = r.schedule.num_steps
            self._test_range = (r.schedule.test_range.begin, r.schedule.test_range.end)
            self._first_step = r.step
        self.say(f"resuming at epoch {self.epoch + 1} step {r.step + 1} from the server's state "
                 f"({why})")
        return True

    def _finish(self):
        if self.worker_id >= 0 and not self._left:
            self._left = True
            try:
                self.client.leave(self.worker_id)
            except DbsError as e:
                self.say(f"warning: {e}")
        self.say(f"finished: {len(self.records)} epochs in "
                 f"{time.monotonic() - self._job_start:.1f} s")

    def record(self):
        """This worker's JSON record: its id, name and reported epochs."""
        return {"worker_id": self.worker_id, "name": self.name, "epochs": self.records}

