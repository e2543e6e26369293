"""The dbs Python package's parts that must agree with dbs_worker bit for bit (the permutation,
the plan's steps, the wire dtypes, the layout of a module) and its refusals, without a server.
Runs under Debian's /usr/bin/python3 (python3-torch, python3-grpcio): it re-executes itself
there when started by another interpreter."""

import os
import sys

try:
    import grpc  # noqa: F401
    import torch
except ImportError:
    if sys.executable != "/usr/bin/python3":
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

import fcntl  # noqa: E402
import io  # noqa: E402
import mmap  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import unittest  # noqa: E402

import numpy as np  # noqa: E402

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", "dbs"))
sys.path.insert(0, os.path.join(RUNFILES, "python"))

import dbs  # noqa: E402
from dbs import client as dbs_client  # noqa: E402
from dbs import fitting as dbs_fit  # noqa: E402
from dbs import shared_memory  # noqa: E402
from dbs.flat import FlatModel  # noqa: E402
from dbs.job import flat_gradient, layout_values  # noqa: E402
from dbs import models  # noqa: E402
from dbs import wire  # noqa: E402
from dbs import worker as dbs_worker  # noqa: E402
from dbs._proto import dbs_pb2 as pb  # noqa: E402


class PermutationTest(unittest.TestCase):
    def test_known_values_are_the_cpp_generators(self):
        # The values tests/permutation_test.cc pins for common/permutation.cc.
        self.assertEqual(list(wire.epoch_permutation(10, 123)), [7, 3, 4, 9, 8, 2, 1, 0, 6, 5])
        self.assertEqual(wire.epoch_seed(1, 0), 13957987245808512451)

    def test_is_a_permutation(self):
        for n in (0, 1, 2, 1000):
            self.assertEqual(sorted(wire.epoch_permutation(n, 42)), list(range(n)))
        self.assertNotEqual(list(wire.epoch_permutation(100, 1)),
                            list(wire.epoch_permutation(100, 2)))


def plan(**fields):
    ranges = fields.pop("ranges", [])
    p = pb.EpochPlan(**fields)
    for b, e in ranges:
        p.train_ranges.add(begin=b, end=e)
    return p


class PlanTest(unittest.TestCase):
    def test_batches_consume_the_ranges_in_order(self):
        p = plan(num_steps=3, batch_size=3, final_batch_size=2, global_batch=8,
                 ranges=[(0, 4), (10, 14)])
        self.assertEqual(wire.expand_steps(p), [[(0, 3)], [(3, 4), (10, 12)], [(12, 14)]])

    def test_a_plan_outside_the_data_is_refused(self):
        p = plan(num_steps=1, batch_size=4, final_batch_size=4, global_batch=8, ranges=[(0, 4)])
        wire.validate_plan(p, 4, 0)
        with self.assertRaisesRegex(wire.PlanError, "outside"):
            wire.validate_plan(p, 3, 0)
        with self.assertRaisesRegex(wire.PlanError, "steps"):
            wire.validate_plan(plan(num_steps=-1), 4, 0)
        with self.assertRaisesRegex(wire.PlanError, "batch"):
            wire.validate_plan(plan(num_steps=1, batch_size=9, global_batch=8), 4, 0)
        rev = pb.PlanRevision(num_steps=3, from_step=1)
        rev.steps.add()
        with self.assertRaisesRegex(wire.PlanError, "revision"):
            wire.validate_revision(rev, 4, 0)


class WireTest(unittest.TestCase):
    def test_sixteen_bit_values_round_to_nearest_even_as_the_server(self):
        v = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.nan, np.inf, 70000.0],
                     np.float32)
        bf16 = wire.decode_values(wire.encode_values(v, wire.WIRE_BF16), wire.WIRE_BF16, 7)
        self.assertEqual(list(bf16[:4]), [1.0, 1.0, 1 + 2**-6, -2.5])
        self.assertTrue(np.isnan(bf16[4]))
        self.assertEqual(bf16[5], np.inf)
        fp16 = wire.decode_values(wire.encode_values(v, wire.WIRE_FP16), wire.WIRE_FP16, 7)
        self.assertEqual(list(fp16[:4]), [1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5])
        self.assertEqual(fp16[6], np.inf, "out of fp16's range: infinity")
        fp32 = wire.decode_values(wire.encode_values(v, wire.WIRE_FP32), wire.WIRE_FP32, 7)
        self.assertEqual(fp32.tobytes(), v.tobytes())

    def test_values_of_another_length_are_refused(self):
        with self.assertRaisesRegex(ValueError, "8 bytes of fp32 values where the model has 3"):
            wire.decode_values(b"\0" * 8, wire.WIRE_FP32, 3)
        with self.assertRaisesRegex(ValueError, "unknown wire dtype"):
            wire.decode_values(b"", 7, 0)


class ModelTest(unittest.TestCase):
    def test_layout_is_parameters_then_floating_buffers(self):
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        names = [(n, b) for n, _, b in dbs.model_layout(net)]
        self.assertEqual(names, [("0.weight", False), ("0.bias", False), ("1.weight", False),
                                 ("1.bias", False), ("1.running_mean", True),
                                 ("1.running_var", True)])

    def test_builtins_have_dbs_workers_names_and_shapes(self):
        cnn = models.cnn()
        self.assertEqual([(n, tuple(t.shape)) for n, t, _ in dbs.model_layout(cnn)],
                         [("conv1.weight", (16, 1, 5, 5)), ("conv1.bias", (16,)),
                          ("conv2.weight", (32, 16, 5, 5)), ("conv2.bias", (32,)),
                          ("fc1.weight", (64, 512)), ("fc1.bias", (64,)),
                          ("fc2.weight", (10, 64)), ("fc2.bias", (10,))])
        with self.assertRaisesRegex(ValueError, "at least 16x16"):
            models.cnn((3, 8, 8))

    def test_micro_batches_split_as_dbs_worker(self):
        self.assertEqual(dbs_fit.micro_batches(10, 4), [4, 3, 3])
        self.assertEqual(dbs_fit.micro_batches(10, 0), [10])
        self.assertEqual(dbs_fit.micro_batches(3, 4), [3])

    def test_a_test_set_needs_an_evaluation(self):
        with self.assertRaisesRegex(ValueError, "evaluate"):
            dbs.Job(torch.nn.Linear(2, 1), server="127.0.0.1:1", train_samples=4,
                    test_samples=2)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 3))


class FlatModelTest(unittest.TestCase):
    """The flat views push and load exactly what the tensor-by-tensor path does, whatever user
    code does to the module's gradients and parameters."""

    def setUp(self):
        self.net, self.ref = _net(), _net()
        self.flat = FlatModel(dbs.model_layout(self.net))
        torch.manual_seed(1)
        self.x, self.y = torch.randn(8, 1, 12, 12), torch.randint(0, 3, (8,))

    def backward(self, set_to_none=False, parts=1):
        for n in (self.net, self.ref):
            n.zero_grad(set_to_none=set_to_none)
            for x, y in zip(self.x.chunk(parts), self.y.chunk(parts)):
                (torch.nn.functional.cross_entropy(n(x), y) / parts).backward()

    def assert_same_push(self):
        got, want = self.flat.gradient(), flat_gradient(dbs.model_layout(self.ref))
        self.assertEqual(got.dtype, np.float32)
        np.testing.assert_array_equal(got, want)

    def test_the_push_is_the_gradients_then_the_buffers(self):
        self.backward()
        self.assert_same_push()
        # Backward accumulated where the push reads: no copy on CPU without buffers.
        base = self.flat.grads.data_ptr()
        for p in self.net.parameters():
            self.assertTrue(base <= p.grad.data_ptr() < base + 4 * self.flat.grads.numel())

    def test_micro_batches_accumulate_in_place(self):
        self.backward(parts=2)
        self.assert_same_push()

    def test_gradients_set_to_none_or_replaced_are_copied_back(self):
        self.backward(set_to_none=True)
        self.assert_same_push()
        self.backward()
        self.net[0].weight.grad = torch.ones_like(self.net[0].weight)
        self.ref[0].weight.grad = torch.ones_like(self.ref[0].weight)
        self.assert_same_push()

    def test_loading_writes_every_parameter_and_buffer(self):
        values = np.random.default_rng(2).standard_normal(self.flat.size).astype(np.float32)
        self.flat.load(values)
        np.testing.assert_array_equal(layout_values(dbs.model_layout(self.net)), values)
        np.testing.assert_array_equal(self.flat.current(), values)
        self.net[0].weight.data = torch.full_like(self.net[0].weight, 2.0)  # replaced by user code
        self.assertEqual(self.flat.current()[:36].tolist(), [2.0] * 36)
        self.flat.load(values)
        np.testing.assert_array_equal(layout_values(dbs.model_layout(self.net)), values)
        with self.assertRaisesRegex(ValueError, "values for a model of"):
            self.flat.load(values[:-1])

    def test_a_module_of_mixed_dtypes_keeps_the_tensor_by_tensor_path(self):
        self.assertTrue(FlatModel.applies(dbs.model_layout(self.net)))
        self.assertFalse(FlatModel.applies(dbs.model_layout(_net().double())))
        mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
        self.assertFalse(FlatModel.applies(dbs.model_layout(mixed)))


class SharedMemoryTest(unittest.TestCase):
    """The worker's side of the memory it shares with dbs_ps: it opens only a sealed memory
    file of the expected name and size, and reads a slot only while it holds the version."""

    def slots_region(self, count, name=shared_memory.PARAMETER_REGION):
        """A server-like parameter region (sealed, read-write here) and its location."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.addCleanup(os.close, fd)
        size = shared_memory.slots_bytes(count)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return mmap.mmap(fd, size), (os.getpid(), fd, size)

    def test_a_slot_is_read_only_while_it_holds_the_version(self):
        count = 1000
        server, (pid, fd, size) = self.slots_region(count)
        slots = shared_memory.ParameterSlots(
            shared_memory.open_region(pid, fd, size, shared_memory.PARAMETER_REGION), count)
        self.addCleanup(slots.close)
        stamps = np.frombuffer(server, np.int64, count=16)
        values = np.frombuffer(server, np.float32, count=count, offset=shared_memory.PAGE +
                               4096)  # slot 1: 1000 floats round up to one page
        values[:] = np.arange(count, dtype=np.float32) + 0.5
        stamps[8] = 7  # version 7 lies in slot 1
        out = np.zeros(count, np.float32)
        self.assertTrue(slots.read(7, out, wire.WIRE_FP32))
        np.testing.assert_array_equal(out, values)
        self.assertFalse(slots.read(5, out, wire.WIRE_FP32), "slot 1 holds 7, not 5")
        self.assertFalse(slots.read(8, out, wire.WIRE_FP32), "slot 0 is empty")
        self.assertTrue(slots.read(7, out, wire.WIRE_BF16))
        np.testing.assert_array_equal(out, wire.decode_values(
            wire.encode_values(values, wire.WIRE_BF16), wire.WIRE_BF16, count))
        del stamps, values
        server.close()

    def test_only_a_sealed_memory_file_of_the_name_and_size_is_opened(self):
        server, (pid, fd, size) = self.slots_region(10)
        server.close()
        with self.assertRaisesRegex(shared_memory.RegionError, "not a memory file named"):
            shared_memory.open_region(pid, fd, size, shared_memory.GRADIENT_REGION)
        with self.assertRaisesRegex(shared_memory.RegionError, "bytes, not"):
            shared_memory.open_region(pid, fd, size + 4096, shared_memory.PARAMETER_REGION)
        with self.assertRaisesRegex(shared_memory.RegionError, "cannot open"):
            shared_memory.open_region(pid, 100000, size, shared_memory.PARAMETER_REGION)
        with self.assertRaisesRegex(shared_memory.RegionError, "no shared region"):
            shared_memory.open_region(-1, fd, size, shared_memory.PARAMETER_REGION)
        unsealed = os.memfd_create(shared_memory.PARAMETER_REGION, os.MFD_CLOEXEC)
        self.addCleanup(os.close, unsealed)
        os.ftruncate(unsealed, size)
        with self.assertRaisesRegex(shared_memory.RegionError, "not a memory file sealed"):
            shared_memory.open_region(pid, unsealed, size, shared_memory.PARAMETER_REGION)
        with self.assertRaisesRegex(shared_memory.RegionError, "slots are"):
            shared_memory.ParameterSlots(shared_memory.open_region(
                pid, fd, size, shared_memory.PARAMETER_REGION), 5000)

    def test_the_gradient_region_is_sealed_and_holds_the_encoded_push(self):
        region = shared_memory.GradientRegion(2 * 6)
        self.addCleanup(region.close)
        pid, fd, size = region.location()
        self.assertEqual((pid, size), (os.getpid(), 12))
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        self.assertTrue(seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and
                        seals & fcntl.F_SEAL_SEAL)
        g = np.array([1.0, -2.5, 3.0e-3, 1e30, -0.0, 7.0], np.float32)
        region.write(g, wire.WIRE_BF16)
        self.assertEqual(bytes(region.memory[:12]), wire.encode_values(g, wire.WIRE_BF16))
        with self.assertRaises(ValueError):
            region.write(np.zeros(7, np.float32), wire.WIRE_BF16)
        reader = shared_memory.open_region(pid, fd, size, shared_memory.GRADIENT_REGION)
        self.assertEqual(bytes(reader[:12]), wire.encode_values(g, wire.WIRE_BF16))
        reader.close()


class CommandLineTest(unittest.TestCase):
    def test_variables_fold_in_and_the_command_line_wins(self):
        ap = dbs_worker.parser()
        argv = dbs_worker.args_with_environment(
            ap, ["--name=cli"], {"DBS_NAME": "env", "DBS_THREADS": "3", "HOME": "/"})
        args = ap.parse_args(argv)
        self.assertEqual((args.name, args.threads), ("cli", 3))
        self.assertTrue(args.shared_memory)
        for text, value in (("false", False), ("0", False), ("true", True)):
            argv = dbs_worker.args_with_environment(ap, [], {"DBS_SHARED_MEMORY": text})
            self.assertIs(ap.parse_args(argv).shared_memory, value)

    def test_a_variable_that_names_no_flag_is_a_configuration_error(self):
        ap = dbs_worker.parser()
        stderr = io.StringIO()
        sys_stderr, sys.stderr = sys.stderr, stderr
        try:
            with self.assertRaises(SystemExit) as e:
                dbs_worker.args_with_environment(ap, [], {"DBS_NO_SUCH_FLAG": "1"})
        finally:
            sys.stderr = sys_stderr
        self.assertEqual(e.exception.code, 2)
        self.assertIn("DBS_NO_SUCH_FLAG names no flag", stderr.getvalue())


class ResetEveryStream:
    """A bare HTTP/2 endpoint that resets every stream it is sent with ENHANCE_YOUR_CALM, as
    gRPC's transport does under a memory quota's pressure; counts the streams."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.streams = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self):
        self.listener.close()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        def read(n):
            data = b""
            while len(data) < n:
                more = conn.recv(n - len(data))
                if not more:
                    raise EOFError
                data += more
            return data

        def send(kind, flags, stream, payload=b""):
            conn.sendall(struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) +
                         struct.pack(">I", stream) + payload)

        SETTINGS, PING, HEADERS, RST_STREAM, ACK, ENHANCE_YOUR_CALM = 4, 6, 1, 3, 1, 11
        with conn:
            try:
                read(24)  # the client's connection preface
                send(SETTINGS, 0, 0)
                while True:
                    head = read(9)
                    kind, flags = head[3], head[4]
                    stream = struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
                    payload = read(int.from_bytes(head[:3], "big"))
                    if kind in (SETTINGS, PING) and not flags & ACK:
                        send(kind, ACK, 0, payload if kind == PING else b"")
                    elif kind == HEADERS:
                        self.streams += 1
                        send(RST_STREAM, 0, stream, struct.pack(">I", ENHANCE_YOUR_CALM))
            except (EOFError, OSError):
                pass


class ClientTest(unittest.TestCase):
    def test_streams_reset_under_memory_pressure_are_retried(self):
        server = ResetEveryStream()
        self.addCleanup(server.close)
        c = dbs_client.Client(f"127.0.0.1:{server.port}", connect_timeout=1.0,
                              log=lambda line: None)
        with self.assertRaises(dbs.DbsError) as e:
            c.register_worker("w", 10, 0)
        self.assertGreater(server.streams, 1, "the reset registration was retried")
        self.assertEqual(e.exception.code, dbs_client.Code.UNAVAILABLE)
        self.assertIn("RST_STREAM with error code 11", str(e.exception))
        c.token, before = "a-token", server.streams
        with self.assertRaises(dbs.DbsError) as e:
            c.report_epoch(worker_id=0, epoch=0)
        self.assertGreater(server.streams - before, 1, "a reset call was retried")
        self.assertEqual(e.exception.code, dbs_client.Code.UNAVAILABLE)

    def test_an_unreachable_server_is_retried_then_named(self):
        c = dbs_client.Client("127.0.0.1:1", connect_timeout=1.0, log=lambda line: None)
        t = time.monotonic()
        with self.assertRaises(dbs.DbsError) as e:
            c.register_worker("w", 10, 0)
        self.assertGreater(time.monotonic() - t, 0.5, "it retried for the connect timeout")
        self.assertEqual(e.exception.code, dbs_client.Code.UNAVAILABLE)
        self.assertRegex(str(e.exception), r"could not reach dbs_ps at 127\.0\.0\.1:1 after \d+ "
                                           r"attempts")

    def test_backoff_grows_to_its_bound(self):
        b = dbs_client.Backoff(initial=0.1, maximum=0.4, jitter=0.0)
        self.assertEqual([round(b.next(), 3) for _ in range(4)], [0.1, 0.2, 0.4, 0.4])


if __name__ == "__main__":
    unittest.main(verbosity=2)
