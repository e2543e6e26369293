"""dbs.fit (this module, dbs.fitting): train any nn.Module on any map-style Dataset as a worker of a dbs job.

    import dbs
    job = dbs.fit(model, train_dataset, torch.nn.functional.cross_entropy,
                  server="127.0.0.1:50051", test_dataset=test_dataset)

`loss_fn(output, target)` returns the batch's mean loss. A sample is `dataset[i]`, an
(input, target) pair (a TensorDataset is indexed a whole batch at once). The global batch, the
epochs, the optimizer and the learning rate are the job's (dbs_ps's flags); this worker computes
the batches the server gives it, of a size that follows its speed.
"""

import json
import os
import time

import numpy as np
import torch
from torch.utils.data import TensorDataset
from torch.utils.data._utils.collate import default_collate

from dbs.client import Code, DbsError
from dbs.job import EvalResult, Job, flat_gradient, model_layout


def _batch(dataset, indices, prepare, device):
    """The samples `indices` as (inputs, targets) on `device`, `prepare` applied to the inputs."""
    if isinstance(dataset, TensorDataset):
        at = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        x, y = (t[at] for t in dataset.tensors)
    else:
        x, y = default_collate([dataset[int(i)] for i in indices])
    if prepare is not None:
        x = prepare(x)
    return x.to(device), y.to(device)


def micro_batches(b, max_batch):
    """The sizes of a batch of b computed in micro-batches of at most max_batch (0: none), as
    dbs_worker splits it."""
    k = 1 if max_batch <= 0 or b <= max_batch else -(-b // max_batch)
    return [b // k + (1 if i < b % k else 0) for i in range(k)]


def export_model(model, path, script_wrapper=None):
    """The state dict at `path` (torch.save) and, when the model scripts, TorchScript beside it
    (PATH minus .pt, then .script.pt). Returns the files written."""
    torch.save(model.state_dict(), path)
    written = [path]
    try:
        scripted = torch.jit.script(script_wrapper(model) if script_wrapper else model)
    except Exception:  # noqa: BLE001 - any model torch.jit.script cannot compile
        return written
    script_path = (path[:-3] if path.endswith(".pt") else path) + ".script.pt"
    scripted.save(script_path)
    return written + [script_path]


def compute_gradient(model, loss_fn, dataset, indices, prepare=None, max_batch=0):
    """Forward and backward over the samples `indices` (in micro-batches of at most max_batch):
    their mean gradient in the module's .grad; returns the summed loss."""
    device = next(model.parameters()).device
    model.train()
    model.zero_grad(set_to_none=False)
    b, offset, loss_sum = len(indices), 0, 0.0
    for n in micro_batches(b, max_batch):
        x, y = _batch(dataset, indices[offset:offset + n], prepare, device)
        loss = loss_fn(model(x), y)
        (loss * (n / b) if n != b else loss).backward()
        loss_sum += loss.item() * n
        offset += n
    return loss_sum


def measure_speed(model, dataset, loss_fn, samples, batch, prepare=None):
    """Standalone compute speed without a server, as dbs_worker --measure_speed_samples: the
    gradient and its flat copy over `samples` training samples in batches of `batch`, after one
    warm-up batch. Samples per second."""
    layout = model_layout(model)
    n = len(dataset)

    def step(begin):
        indices = np.arange(begin, min(n, begin + batch))
        compute_gradient(model, loss_fn, dataset, indices, prepare)
        flat_gradient(layout)
        return len(indices)

    step(0)
    seconds, done = 0.0, 0
    while done < samples:
        t = time.monotonic()
        done += step(done % n)
        seconds += time.monotonic() - t
    return done / max(seconds, 1e-12)


class _FitJob(Job):
    def __init__(self, model, train_dataset, loss_fn, test_dataset, prepare, max_batch,
                 slowdown, export_path, export_every_epochs, script_wrapper, eval_batch, epochs,
                 **job_args):
        self.train_dataset, self.test_dataset = train_dataset, test_dataset
        self.loss_fn, self.prepare, self.max_batch = loss_fn, prepare, max_batch
        self.slowdown, self.export_path = slowdown, export_path
        self.export_every_epochs, self.script_wrapper = export_every_epochs, script_wrapper
        self.eval_batch, self.expected_epochs = eval_batch, epochs
        super().__init__(model, train_samples=len(train_dataset),
                         test_samples=len(test_dataset) if test_dataset is not None else 0,
                         evaluate=self._evaluate, **job_args)
        self.target_device = next(model.parameters()).device

    def gradient(self, indices):
        """The mean gradient of the samples `indices` into the module's .grad; the summed loss."""
        slowed = self.slowdown > 1  # an emulated slower worker: f x this computation's CPU time
        began, cpu = (time.monotonic(), time.process_time()) if slowed else (0.0, 0.0)
        loss_sum = compute_gradient(self.model, self.loss_fn, self.train_dataset, indices,
                                    self.prepare, self.max_batch)
        if slowed:
            time.sleep(max(0.0, began + self.slowdown * (time.process_time() - cpu) -
                           time.monotonic()))
        return loss_sum

    def _evaluate(self, begin, end):
        result = EvalResult()
        self.model.eval()
        with torch.no_grad():
            for first in range(begin, end, self.eval_batch):
                indices = np.arange(first, min(first + self.eval_batch, end))
                x, y = _batch(self.test_dataset, indices, self.prepare, self.target_device)
                out = self.model(x)
                n = len(indices)
                result.loss_sum += self.loss_fn(out, y).item() * n
                result.classified = y.dtype == torch.int64
                if result.classified:
                    result.correct += int((out.argmax(1) == y).sum())
                result.samples += n
        return result

    def _join(self):
        super()._join()
        if self.expected_epochs and self.total_epochs and self.total_epochs != \
                self.expected_epochs:
            self.client.leave(self.worker_id)
            self.worker_id = -1
            raise DbsError(Code.FAILED_PRECONDITION,
                           f"the job at {self.client.address} trains {self.total_epochs} epochs, "
                           f"not the {self.expected_epochs} asked for (epochs are dbs_ps's "
                           "--epochs)")

    def export(self, when):
        files = export_model(self.model, self.export_path, self.script_wrapper)
        self.say(f"model exported to {' and '.join(files)} ({when})")

    def on_epoch_end(self, epoch):
        if self.export_path and self.export_every_epochs > 0 and \
                (epoch + 1) % self.export_every_epochs == 0:
            try:
                self.export(f"after epoch {epoch + 1}")
            except (OSError, RuntimeError) as e:  # a periodic copy: training goes on
                self.say(f"warning: export failed: {e}")


def fit(model, train_dataset, loss_fn, *, server, test_dataset=None, epochs=None, name=None,
        prepare=None, max_batch=0, export_path="", export_every_epochs=0, record_path="",
        log_every=5.0, job_token="", tls_ca=None, tls_cert=None, tls_key=None,
        connect_timeout=60.0, call_timeout=60.0, max_wait=0.0, eval_batch=1000, out=None,
        model_name=None, script_wrapper=None, slowdown=1.0, shared_memory=True):
    """Trains `model` as one worker of the dbs job at `server` until the job ends; returns the
    Job (its `records()` has every epoch). See the module's docstring and docs/python.md.

    prepare: applied to each batch's inputs before the model (e.g. normalisation).
    max_batch: the largest batch computed at once; a larger one is computed in micro-batches
      whose mean gradient is pushed.
    export_path: where the trained model goes at the end (and every export_every_epochs).
    epochs: when given, the job must train this many epochs (it is dbs_ps's --epochs).
    shared_memory: on dbs_ps's host, pass gradients and answers through shared memory.
    """
    job = _FitJob(model, train_dataset, loss_fn, test_dataset, prepare, max_batch, slowdown,
                  export_path, export_every_epochs, script_wrapper, eval_batch, epochs,
                  server=server, name=name, job_token=job_token, tls_ca=tls_ca,
                  tls_cert=tls_cert, tls_key=tls_key, connect_timeout=connect_timeout,
                  call_timeout=call_timeout, max_wait=max_wait, log_every=log_every, out=out,
                  model_name=model_name, shared_memory=shared_memory)
    with job:
        for epoch in job.epochs():
            for step in epoch:
                step.push(job.gradient(step.indices))
    if export_path and job.missed_the_end:
        job.say(f"not exported to {export_path}: the job finished without this run, which "
                "does not hold its final parameters")
    elif export_path:
        job.export("end of the job")
    if record_path:
        tmp = f"{record_path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(job.record(), f, indent=2)
            f.write("\n")
        os.replace(tmp, record_path)
    return job
