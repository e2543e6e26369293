"""A Python worker (dbs.Job, the low-level API) that checks every step of a fixed-split job with
plain SGD (dbs_ps --policy=fixed --momentum=0): it computes the single-process gradient of the
step's whole global batch (block [s * B, s * B + B) of the epoch's permutation) on its own, before
the step (in float64), then reads the aggregate the server applied from the parameters it answers with,
(before - after) / lr, in float64. Prints one JSON line per step: {"step", "error"} with the
relative error |aggregate - reference| / |reference|.

    python_exactness_worker.py SERVER LR TRAIN_LIMIT [socket]

With `socket`, every push and answer takes the socket, never memory shared with the server.
"""

import copy
import json
import sys

import numpy as np
import torch

import dbs
from dbs import data as dbs_data
from dbs import models, wire


def main():
    server, lr, limit = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    shared = sys.argv[4:] != ["socket"]
    torch.manual_seed(7)
    d = dbs_data.load("fashion-mnist").limit(limit, 100)
    norm = dbs_data.choose_normalization("auto", d)
    model = models.cnn()
    loss_fn = torch.nn.functional.cross_entropy

    def gradient_of(net, indices):
        at = torch.from_numpy(np.asarray(indices, np.int64))
        net.zero_grad()
        x = dbs_data.prepare(d.train_x[at], norm).to(next(net.parameters()).dtype)
        loss = loss_fn(net(x), d.train_y[at])
        loss.backward()
        return loss.item() * len(indices)

    def evaluate(begin, end):
        with torch.no_grad():
            out = model(dbs_data.prepare(d.test_x[begin:end], norm))
            y = d.test_y[begin:end]
            return dbs.EvalResult(end - begin, int((out.argmax(1) == y).sum()),
                                  loss_fn(out, y).item() * (end - begin))

    job = dbs.Job(model, server=server, train_samples=len(d.train_x),
                  test_samples=len(d.test_x), evaluate=evaluate, name="py-exact", log_every=60,
                  shared_memory=shared)
    for epoch in job.epochs():
        perm = wire.epoch_permutation(job.train_samples, job.plan.permutation_seed)
        B = job.plan.global_batch
        for step in epoch:
            reference = copy.deepcopy(model).double()
            gradient_of(reference, perm[step.index * B:(step.index + 1) * B])
            want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).double()
            before = job.values().astype(np.float64)
            step.push(gradient_of(model, step.indices))
            after = job.values().astype(np.float64)
            got = torch.from_numpy((before - after) / lr)
            error = float((got - want).norm() / want.norm())
            print(json.dumps({"epoch": step.epoch, "step": step.index, "error": error}),
                  flush=True)


if __name__ == "__main__":
    main()
