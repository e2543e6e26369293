"""Client: the dbs wire API (proto/dbs.proto) over one gRPC channel, with the retry rules of
dbs_worker: a call that answers at once is retried with backoff while the server is unreachable
(for at most `connect_timeout`); a call that waits on the other workers (a step's push, the next
epoch's plan) is re-issued after each `call_timeout` (for at most `max_wait`, 0: no limit).
Errors are DbsError, carrying the gRPC status code, with the server's address in the message.

Flat values are numpy float32 arrays in the model's layout order. Not thread-safe: one client
per worker.
"""

import queue
import random
import secrets
import sys
import time

import grpc
import numpy as np

from dbs import shared_memory, wire

try:
    from dbs._proto import dbs_pb2 as pb
    from dbs._proto import dbs_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - an uninstalled checkout
    raise ImportError(
        "dbs's gRPC stubs are missing: install the package (pip install ./python), which "
        "generates them from proto/dbs.proto with protoc and grpc_python_plugin") from e

WORKER_TOKEN_KEY = "x-dbs-token"
JOB_TOKEN_KEY = "x-dbs-job-token"
RETRY_AFTER_MS_KEY = "x-dbs-retry-after-ms"
Code = grpc.StatusCode


class DbsError(Exception):
    """A call the server refused or could not answer: `code` is its grpc.StatusCode."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class Backoff:
    """Delays that grow geometrically to `maximum`, each scaled by a factor within `jitter`."""

    def __init__(self, initial=0.1, maximum=2.0, multiplier=2.0, jitter=0.2, seed=None):
        self.next_delay, self.maximum, self.multiplier, self.jitter = (initial, maximum,
                                                                       multiplier, jitter)
        self.random = random.Random(seed)

    def next(self):
        delay = self.next_delay
        self.next_delay = min(self.next_delay * self.multiplier, self.maximum)
        return delay * self.random.uniform(1 - self.jitter, 1 + self.jitter)


def _details(error):
    return error.details() if hasattr(error, "details") else str(error)


def _retry_code(error):
    """The code a failed call is retried by. gRPC's transport, short of memory under dbs_ps's
    --memory_quota_mb while other large calls are in flight, resets streams with
    ENHANCE_YOUR_CALM, which arrives as RESOURCE_EXHAUSTED "Received RST_STREAM with error code
    11": the server is up and takes the call once that memory is freed, so it counts as
    UNAVAILABLE. The server's own RESOURCE_EXHAUSTED answers (its limits on workers and on
    waiting calls) and gRPC's message-size refusals say otherwise and are final."""
    if not isinstance(error, grpc.RpcError):
        return Code.UNAVAILABLE
    code = error.code()
    if code == Code.RESOURCE_EXHAUSTED and "RST_STREAM" in _details(error):
        return Code.UNAVAILABLE
    return code


def _retry_after_s(error):
    try:
        for key, value in error.trailing_metadata() or ():
            if key == RETRY_AFTER_MS_KEY:
                return min(max(int(value), 0), 1000) / 1000.0
    except (AttributeError, ValueError):
        pass
    return 0.0


class _PushSession:
    """One PushGradientSession stream: pushes written one at a time, each answered in turn."""
    _END = object()

    def __init__(self, stub, token, timeout):
        self.requests = queue.SimpleQueue()
        self.opened = time.monotonic()
        self.token = token
        self.replies = stub.PushGradientSession(iter(self.requests.get, self._END),
                                                metadata=[(WORKER_TOKEN_KEY, token)],
                                                timeout=timeout)

    def push(self, request):
        self.requests.put(request)
        try:
            return next(self.replies)
        except StopIteration:
            raise _SessionEnded() from None

    def close(self):
        self.requests.put(self._END)
        self.replies.cancel()


class _SessionEnded(Exception):
    """The server ended the push session without answering (it is shutting down)."""


class Client:
    def __init__(self, address, connect_timeout=60.0, call_timeout=60.0, max_wait=0.0,
                 job_token="", tls_ca=None, tls_cert=None, tls_key=None, max_message_mb=512,
                 log=None, shared_memory=True):
        self.address = address
        self.connect_timeout, self.call_timeout, self.max_wait = (connect_timeout, call_timeout,
                                                                  max_wait)
        self.job_token = job_token
        self.max_message_mb = max_message_mb
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        options = [
            ("grpc.max_receive_message_length", max_message_mb << 20),
            ("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.min_reconnect_backoff_ms", 20000),
            ("grpc.keepalive_time_ms", 20000),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls_ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca,
                                                       private_key=tls_key,
                                                       certificate_chain=tls_cert)
            self.channel = grpc.secure_channel(address, credentials, options)
        else:
            self.channel = grpc.insecure_channel(address, options)
        self.scheduler = pb_grpc.SchedulerServiceStub(self.channel)
        self.parameters = pb_grpc.ParameterServiceStub(self.channel)
        self.incarnation = secrets.token_hex(16)
        self.token = ""
        self.wire_dtype = wire.WIRE_FP32
        self.layout = None  # [(name, shape, buffer)] once the model is registered
        self.model_size = 0
        self.reconnected = False
        self.session = None
        self.sessions_opened = 0
        self.share_memory = shared_memory  # try; self.shm once attached
        self.shm = None  # (GradientRegion, ParameterSlots)
        self._shm_tried = self._shm_told = False

    def close(self):
        self._close_session()
        self._detach()
        self.channel.close()

    # --- helpers -----------------------------------------------------------------------------

    def _error(self, error, what):
        code = error.code() if hasattr(error, "code") else Code.UNKNOWN
        return DbsError(code, f"{what} at dbs_ps {self.address}: {_details(error)}")

    def _with_retry(self, what, rpc, waits=False):
        """rpc(timeout, metadata) with dbs_worker's retry rules (see the module's docstring)."""
        backoff, soon = Backoff(), None
        start = time.monotonic()
        deadline = start + self.connect_timeout
        while True:
            try:
                return rpc(self.call_timeout, [(WORKER_TOKEN_KEY, self.token)])
            except (grpc.RpcError, _SessionEnded) as e:
                code = _retry_code(e)
                # A server shutting down cancels the calls in flight: it may come back.
                if code == Code.CANCELLED:
                    code = Code.UNAVAILABLE
                now = time.monotonic()
                if code == Code.DEADLINE_EXCEEDED and waits:
                    if self.max_wait > 0 and now - start >= self.max_wait:
                        raise DbsError(Code.DEADLINE_EXCEEDED,
                                       f"{what} at dbs_ps {self.address}: no answer after "
                                       f"waiting {now - start:.0f} s (--max_wait_s)") from None
                    backoff, deadline = Backoff(), now + self.connect_timeout
                    continue
                if code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                    raise self._error(e, what) from None
                after = _retry_after_s(e) if isinstance(e, grpc.RpcError) else 0.0
                if code == Code.UNAVAILABLE and after > 0:
                    soon = soon or Backoff(initial=after)
                    delay = soon.next()
                else:
                    delay = backoff.next()
                    if not self.reconnected:
                        self.log(f"dbs_ps at {self.address} is unavailable ({_details(e)}); "
                                 f"retrying for up to {self.connect_timeout:.0f} s")
                    self.reconnected = True
                if now + delay >= deadline:
                    raise DbsError(code, f"{what} at dbs_ps {self.address}: {_details(e)}") \
                        from None
                time.sleep(delay)

    def take_reconnected(self):
        """True (once) when a call had to wait for the server since the last check: it may have
        restarted from a checkpoint behind this worker."""
        r, self.reconnected = self.reconnected, False
        return r

    # --- the scheduler -----------------------------------------------------------------------

    def register_worker(self, name, train_samples, test_samples, device="cpu",
                        cpu_limit_cores=0.0):
        """Joins the job (idempotent by name); retries while the server is unreachable."""
        req = pb.RegisterWorkerRequest(name=name, train_samples=train_samples,
                                       test_samples=test_samples, device=device,
                                       incarnation=self.incarnation,
                                       cpu_limit_cores=cpu_limit_cores)
        metadata = [(JOB_TOKEN_KEY, self.job_token)] if self.job_token else []
        backoff = Backoff(seed=hash(name))
        start = time.monotonic()
        deadline = start + self.connect_timeout
        attempts = 0
        while True:
            attempts += 1
            try:
                reply = self.scheduler.RegisterWorker(
                    req, metadata=metadata,
                    timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                break
            except grpc.RpcError as e:
                if e.code() == Code.UNIMPLEMENTED:
                    raise DbsError(Code.FAILED_PRECONDITION,
                                   f"dbs_ps at {self.address} does not serve the scheduler: it is "
                                   "a follower shard (dbs_ps --shard=i/k with i > 0). Give "
                                   "shard 0, the leader, as --server") from None
                if _retry_code(e) not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                    raise self._error(e, "registration refused") from None
                last = _details(e)
            delay = backoff.next()
            if time.monotonic() + delay >= deadline:
                raise DbsError(
                    Code.UNAVAILABLE,
                    f"could not reach dbs_ps at {self.address} after {attempts} attempts over "
                    f"{time.monotonic() - start:.1f} s (last error: {last}). Is dbs_ps running "
                    "there, and are --server and the port right?")
            time.sleep(delay)
        if reply.wire_dtype not in wire.WIRE_NAMES:
            raise DbsError(Code.INVALID_ARGUMENT,
                           f"dbs_ps at {self.address} asks for an unknown wire dtype "
                           f"{reply.wire_dtype} (a newer server?)")
        self.token = reply.token
        self.wire_dtype = reply.wire_dtype
        return reply

    def get_epoch_plan(self, worker_id, epoch):
        """The worker's plan (proto EpochPlan) for `epoch`; returns once it exists."""
        req = pb.GetEpochPlanRequest(worker_id=worker_id, epoch=epoch)
        return self._with_retry("GetEpochPlan", lambda t, m: self.scheduler.GetEpochPlan(
            req, timeout=t, metadata=m), waits=True)

    def report_epoch(self, **fields):
        """Reports an epoch (the fields of proto EpochReport)."""
        req = pb.EpochReport(**fields)
        self._with_retry("ReportEpoch", lambda t, m: self.scheduler.ReportEpoch(
            req, timeout=t, metadata=m))

    def leave(self, worker_id):
        try:
            self.scheduler.Leave(pb.LeaveRequest(worker_id=worker_id), timeout=5.0,
                                 metadata=[(WORKER_TOKEN_KEY, self.token)])
        except grpc.RpcError as e:
            raise self._error(e, "Leave") from None

    # --- the parameters ----------------------------------------------------------------------

    def _decode_parameters(self, message):
        """The values of a Parameters message: its flat values, else its tensors (fp32)."""
        if message.HasField("values"):
            flat = message.values
            if flat.in_shared_memory:
                raise DbsError(Code.INTERNAL, "the server answered in shared memory, which a "
                               "Python worker never asks for")
            return wire.decode_values(flat.values, flat.wire_dtype, self.model_size)
        by_name = {t.name: t for t in message.parameters}
        out = []
        for name, shape, _ in self.layout:
            t = by_name.get(name)
            if t is None or list(t.shape) != list(shape):
                raise DbsError(Code.INVALID_ARGUMENT, f"the server's parameters lack {name} "
                               f"{list(shape)}")
            out.append(wire.decode_values(t.data, wire.WIRE_FP32, int(np.prod(shape))))
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def register_model(self, worker_id, layout, initial):
        """Registers the model: `layout` is [(name, shape, buffer)], `initial` its flat values.
        Returns the job's parameters (the first worker's values) as a flat array."""
        self.layout = [(n, tuple(s), b) for n, s, b in layout]
        self.model_size = int(sum(int(np.prod(s)) for _, s, _ in self.layout))
        largest = self.model_size * 4 + (1 << 20)
        if largest > self.max_message_mb << 20:
            raise DbsError(Code.INVALID_ARGUMENT,
                           f"the model ({self.model_size} values) does not fit in a message of "
                           f"--max_message_mb={self.max_message_mb}: raise it, on dbs_ps and on "
                           f"every worker, to at least {(largest >> 20) + 1}")

        def tensors(with_values):
            out, offset = [], 0
            for name, shape, buffer in self.layout:
                n = int(np.prod(shape))
                t = pb.Tensor(name=name, shape=list(shape), buffer=buffer)
                if with_values:
                    t.data = np.ascontiguousarray(initial[offset:offset + n], "<f4").tobytes()
                out.append(t)
                offset += n
            return out

        backoff = Backoff(initial=0.005, maximum=0.2)
        start = time.monotonic()
        deadline = start + self.connect_timeout + self.call_timeout
        call = self.parameters.RegisterModel
        while True:
            layout_only = pb.RegisterModelRequest(worker_id=worker_id, layout_only=True,
                                                  parameters=tensors(False))
            try:
                reply = self._with_retry("RegisterModel", lambda t, m: call(
                    layout_only, timeout=t, metadata=m))
                break
            except DbsError as e:
                if e.code == Code.FAILED_PRECONDITION:  # ours to send the values
                    full = pb.RegisterModelRequest(worker_id=worker_id, parameters=tensors(True))
                    try:
                        reply = self._with_retry("RegisterModel", lambda t, m: call(
                            full, timeout=t, metadata=m))
                        break
                    except DbsError as again:
                        e = again
                if e.code != Code.ABORTED:  # ABORTED: another worker is sending its values
                    raise
                delay = backoff.next()
                if time.monotonic() + delay >= deadline:
                    raise DbsError(Code.DEADLINE_EXCEEDED,
                                   f"RegisterModel at dbs_ps {self.address}: waited "
                                   f"{time.monotonic() - start:.0f} s for another worker to "
                                   f"register the model (last answer: {e})") from None
                time.sleep(delay)
        return self._decode_parameters(reply)

    def pull_parameters(self, worker_id):
        """(version, flat values) of the job's current parameters."""
        req = pb.PullParametersRequest(worker_id=worker_id)
        reply = self._with_retry("PullParameters", lambda t, m: self.parameters.PullParameters(
            req, timeout=t, metadata=m))
        return reply.version, self._decode_parameters(reply)

    def resume(self, worker_id):
        """Where the job stands for this worker: (proto ResumeReply, flat parameters)."""
        req = pb.ResumeRequest(worker_id=worker_id)
        reply = self._with_retry("Resume", lambda t, m: self.parameters.Resume(
            req, timeout=t, metadata=m))
        return reply, self._decode_parameters(reply.parameters)

    def _close_session(self):
        if self.session is not None:
            self.session.close()
            self.session = None

    def _push_attempt(self, request, timeout, metadata):
        now = time.monotonic()
        if self.session is not None and (now - self.session.opened > self.call_timeout / 2 or
                                         self.session.token != self.token):
            self._close_session()
        if self.session is None:
            self.session = _PushSession(self.parameters, self.token, self.call_timeout)
            self.sessions_opened += 1
        try:
            return self.session.push(request)
        except BaseException:
            self._close_session()
            raise

    def push_gradient(self, worker_id, epoch, step, num_samples, loss_sum, compute_seconds,
                      gradient):
        """Pushes the mean gradient (flat float32, None when num_samples is 0) of a step and
        waits for the step: (proto PushGradientReply without its values, (version, flat
        parameters after the step)). On dbs_ps's own host the gradient and the answer pass
        through shared memory (see dbs.shared_memory) unless the client was made without it."""
        req = pb.PushGradientRequest(worker_id=worker_id, epoch=epoch, step=step,
                                     num_samples=num_samples, loss_sum=loss_sum,
                                     compute_seconds=compute_seconds)
        if num_samples > 0:
            if gradient is None or gradient.size != self.model_size:
                raise DbsError(Code.INTERNAL, "the gradient does not match the model")
            req.wire_dtype = self.wire_dtype
        self._maybe_attach(worker_id)
        if self.shm is not None:
            try:
                return self._push_shared(req, gradient)
            except DbsError:
                if self.shm is not None:
                    raise
                # The server forgot this worker's memory (a restart): this push goes over the
                # socket, the next one attaches again.
        if num_samples > 0:
            req.gradient = wire.encode_values(gradient, self.wire_dtype)
        reply = self._with_retry("PushGradient", lambda t, m: self._push_attempt(req, t, m),
                                 waits=True)
        return reply, (reply.values.version, self._answered_values(reply))

    def _answered_values(self, reply):
        """The flat parameters a push's answer carries."""
        try:
            return wire.decode_values(reply.values.values, reply.values.wire_dtype,
                                      self.model_size)
        except ValueError as e:
            raise DbsError(Code.INVALID_ARGUMENT,
                           f"PushGradient at dbs_ps {self.address}: {e}") from None

    # --- shared memory -----------------------------------------------------------------------

    def _maybe_attach(self, worker_id):
        """Shares memory with the server, unless shared already, refused before or tried since
        the server last forgot it."""
        if not self.share_memory or self._shm_tried or self.model_size == 0:
            return
        self._shm_tried = True
        try:
            mine = shared_memory.GradientRegion(self.model_size *
                                                wire.bytes_per_value(self.wire_dtype))
        except shared_memory.RegionError as e:
            return self._refused(str(e))
        pid, fd, nbytes = mine.location()
        req = pb.AttachSharedMemoryRequest(
            worker_id=worker_id, gradient=pb.SharedMemoryRegion(pid=pid, fd=fd, bytes=nbytes))
        try:
            reply = self._with_retry("AttachSharedMemory", lambda t, m:
                                     self.parameters.AttachSharedMemory(req, timeout=t,
                                                                        metadata=m))
            theirs = reply.parameters
            slots = shared_memory.ParameterSlots(shared_memory.open_region(
                theirs.pid, theirs.fd, theirs.bytes, shared_memory.PARAMETER_REGION),
                self.model_size)
        except DbsError as e:
            mine.close()
            if e.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED):
                self._shm_tried = False  # trouble on the way: the push meets and reports it
                return None
            return self._refused(str(e))
        except shared_memory.RegionError as e:
            mine.close()
            return self._refused(str(e))
        self.shm = (mine, slots)
        if not self._shm_told:
            self._shm_told = True
            self.log(f"dbs_ps at {self.address} shares memory with this worker: each step's "
                     "gradient and parameters pass through it, not the socket")
        return None

    def _refused(self, why):
        self.log(f"dbs_ps at {self.address} shares no memory with this worker ({why}): pushing "
                 "over gRPC")

    def _detach(self):
        if self.shm is not None:
            for part in self.shm:
                part.close()
            self.shm = None

    def _push_shared(self, req, gradient):
        mine, slots = self.shm
        req.gradient_in_shared_memory = True
        req.answer_in_shared_memory = True
        if req.num_samples > 0:  # the server reads it until it answers; a retry pushes the same
            mine.write(gradient, self.wire_dtype)
        try:
            reply = self._with_retry("PushGradient", lambda t, m: self._push_attempt(req, t, m),
                                     waits=True)
        except DbsError as e:
            if e.code == Code.FAILED_PRECONDITION and "no shared memory attached" in str(e):
                self._detach()
                self._shm_tried = False
                self.log(f"dbs_ps at {self.address} no longer shares memory with this worker "
                         "(restarted?): this push goes over gRPC, the next attaches again")
                req.gradient_in_shared_memory = req.answer_in_shared_memory = False
            raise
        version = reply.values.version
        if not reply.values.in_shared_memory:  # the server shares no slot with it this step
            return reply, (version, self._answered_values(reply))
        values = np.empty(self.model_size, np.float32)
        if not slots.read(version, values, self.wire_dtype):
            # The slot moved on or was never written: the values come over gRPC.
            version, values = self.pull_parameters(req.worker_id)
        return reply, (version, values)
