"""dbs for Python: a worker of a dbs job (Dynamic Batch Size synchronous training) written in
PyTorch, beside or instead of dbs_worker. docs/python.md says how to use it.

    dbs.fit(model, train_dataset, loss_fn, server=..., test_dataset=...)   the training loop
    dbs.Job(model, server=..., train_samples=..., test_samples=...)        the low-level API
    python3 -m dbs.worker --server=... --model=pkg.module:factory          the worker CLI
"""

from dbs.client import Client, DbsError
from dbs.fitting import export_model, fit
from dbs.job import EvalResult, Job, Stopped, model_layout

__all__ = ["Client", "DbsError", "EvalResult", "Job", "Stopped", "export_model", "fit",
           "model_layout"]
__version__ = "1.0.0"
