"""A module's parameters and their gradients as views of flat float32 storage, as DDP's
gradient_as_bucket_view: a push reads the gradients where backward accumulated them, and an
answer is written into the parameters with one copy, where gathering and scattering tensor by
tensor costs a Python worker tens of microseconds per tensor at every step.

Backward accumulates into a gradient that is defined in place, so the views stay the module's
gradients as long as they are zeroed rather than set to None; a parameter or gradient that user
code replaced anyway is copied back into its view before the storage is read or written.

Floating-point buffers (batch norm's running statistics) keep storage of their own and are
gathered and written one by one: the views of one tensor share a version counter, and a
running statistic that batch norm saved for its backward must not look changed when the next
layer updates its own.
"""

import numpy as np
import torch


class FlatModel:
    """Flat views over the parameters of `layout` ([(name, tensor, buffer)], dbs.job's
    model_layout: the parameters, then the buffers). Use `applies(layout)` first: it needs
    every tensor float32 and on one device, which must not change during the job."""

    @staticmethod
    def applies(layout):
        tensors = [t for _, t, _ in layout]
        return bool(tensors) and all(t.dtype == torch.float32 for t in tensors) and \
            len({t.device for t in tensors}) == 1

    def __init__(self, layout):
        self.params = [[t, None] for _, t, buffer in layout if not buffer]
        self.buffers = [t for _, t, buffer in layout if buffer]
        self.size = sum(t.numel() for _, t, _ in layout)
        device = layout[0][1].device
        count = sum(p.numel() for p, _ in self.params)
        self.grads = torch.zeros(count, dtype=torch.float32, device=device)
        self.values = torch.empty(count, dtype=torch.float32, device=device)
        self._spans, offset = [], 0
        for p, _ in self.params:
            self._spans.append((offset, offset + p.numel()))
            offset += p.numel()
        for i in range(len(self.params)):
            self._attach(i)

    def _attach(self, i):
        """Parameter i's value and gradient (zeros when it has none) into their views."""
        p = self.params[i][0]
        begin, end = self._spans[i]
        with torch.no_grad():
            self.values[begin:end].copy_(p.detach().reshape(-1))
            grad = self.grads[begin:end]
            if p.grad is None:
                grad.zero_()
            else:
                grad.copy_(p.grad.reshape(-1))
        p.data = self.values[begin:end].view_as(p)
        p.grad = grad.view_as(p)
        self.params[i][1] = (p.data_ptr(), p.grad.data_ptr())

    def _reattach(self):
        for i, (p, ptrs) in enumerate(self.params):
            if p.grad is None or (p.data_ptr(), p.grad.data_ptr()) != ptrs:
                self._attach(i)

    def gradient(self):
        """What this worker pushes now, flat (numpy float32): the gradients, then the buffers.
        On CPU without buffers, the gradients' storage itself, which the caller must not keep
        past the step."""
        self._reattach()
        if not self.buffers:
            return self.grads.cpu().numpy()
        with torch.no_grad():  # one gather of the gradients and the buffers, one copy
            return torch.cat([self.grads] + [b.reshape(-1) for b in self.buffers]).cpu().numpy()

    def current(self):
        """The module's exchanged values now, flat (a numpy float32 copy, layout order)."""
        self._reattach()
        with torch.no_grad():
            return torch.cat([self.values] + [b.reshape(-1) for b in self.buffers]).cpu().numpy()

    def load(self, flat):
        """Writes flat values (float32, layout order) into the module; ValueError when there
        are not exactly as many as the layout holds."""
        if flat.size != self.size:
            raise ValueError(f"{flat.size} values for a model of {self.size}")
        self._reattach()
        count = self.values.numel()
        if self.values.device.type == "cpu":
            self.values.numpy()[:] = flat[:count]
        else:
            with torch.no_grad():
                self.values.copy_(torch.from_numpy(np.require(flat[:count], np.float32,
                                                              ["C", "W"])))
        if self.buffers:
            rest = torch.from_numpy(np.require(flat[count:], np.float32, ["C", "W"]))
            offset = 0
            with torch.no_grad():
                for b in self.buffers:
                    b.copy_(rest[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
