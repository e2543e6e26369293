"""A Python worker's side of the memory it shares with dbs_ps on the same host, as dbs_worker's
(docs/dataplane.md#shared-memory): each step's gradient goes into a region of the worker's own,
which the server reads; each answer's parameters are read from the server's two parameter
slots. Only the push's head and the answer's version travel on the socket.

A region is a sealed memory file (memfd) that the peer opens as /proc/<pid>/fd/<fd>: only a
process of the same user on the same host can, which decides whether memory is shared at all.
"""

import fcntl
import mmap
import os
import stat

import numpy as np

from dbs import wire

PAGE = 4096
GRADIENT_REGION = "dbs-gradient"
PARAMETER_REGION = "dbs-parameters"
MAX_REGION_BYTES = 1 << 40
# F_SEAL_FUTURE_WRITE (Linux 5.1; Python's fcntl does not name it).
_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class RegionError(Exception):
    """A region that cannot be created, or a peer's that is not what it must be."""


def _round_up(n, to):
    return (n + to - 1) // to * to


def slots_bytes(count):
    """The server's parameter region for a model of `count` values: a page of version stamps,
    then two page-aligned slots of fp32 values."""
    return PAGE + 2 * _round_up(count * 4, PAGE)


class GradientRegion:
    """This worker's region: `nbytes` of a new sealed memory file, mapped read-write here and
    never writable by anyone who opens the file."""

    def __init__(self, nbytes):
        if not 0 < nbytes <= MAX_REGION_BYTES:
            raise RegionError(f"a shared region of {nbytes} bytes")
        try:
            fd = os.memfd_create(GRADIENT_REGION, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as e:
            raise RegionError(f"memfd_create: {e}") from None
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except OSError:  # an older kernel: the other seals hold
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        except OSError as e:
            os.close(fd)
            raise RegionError(f"a shared region of {nbytes} bytes: {e}") from None
        self.fd, self.nbytes = fd, nbytes
        self.bytes = np.frombuffer(self.memory, np.uint8)

    def location(self):
        """(pid, fd, bytes): where the server opens it."""
        return os.getpid(), self.fd, self.nbytes

    def write(self, gradient, dtype):
        """Encodes flat float32 `gradient` into the region as the wire dtype."""
        if dtype == wire.WIRE_FP32:
            np.copyto(self.bytes.view(np.float32), gradient, casting="same_kind")
        else:
            np.copyto(self.bytes, np.frombuffer(wire.encode_values(gradient, dtype), np.uint8))

    def close(self):
        self.bytes = None
        _unmap(self.memory)
        os.close(self.fd)


def _unmap(memory):
    try:
        memory.close()
    except BufferError:  # a view of it is still alive: the mapping goes with the last one
        pass


def open_region(pid, fd, nbytes, name):
    """Maps a peer's region read-only: a sealed memory file of this user, created as `name`, of
    exactly `nbytes`; RegionError naming why for anything else."""
    if not (0 < pid <= 0x7FFFFFFF and 0 <= fd <= 0x7FFFFFFF and 0 < nbytes <= MAX_REGION_BYTES):
        raise RegionError(f"no shared region at pid {pid} fd {fd} of {nbytes} bytes")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        opened = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:  # another host, PID namespace or user, or a process gone
        raise RegionError(f"cannot open {path}: {e.strerror}") from None
    try:
        try:
            target = os.readlink(path)
        except OSError:
            target = ""
        if not target.startswith(f"/memfd:{name} "):
            raise RegionError(f'{path}: not a memory file named "{name}"')
        st = os.fstat(opened)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise RegionError(f"{path}: not a memory file of this user")
        if not fcntl.fcntl(opened, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise RegionError(f"{path}: not a memory file sealed against shrinking")
        if st.st_size != nbytes:
            raise RegionError(f"{path}: {st.st_size} bytes, not {nbytes}")
        return mmap.mmap(opened, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(opened)  # the mapping keeps the file


class ParameterSlots:
    """The server's answers (common/shared_memory.h): version v lies in slot v % 2 while the
    slot's stamp (an int64 at byte 64 * (v % 2)) reads v before and after a copy."""

    def __init__(self, memory, count):
        if len(memory) != slots_bytes(count):
            raise RegionError(f"the parameter slots are {len(memory)} bytes, not "
                              f"{slots_bytes(count)}")
        self.memory, self.count = memory, count
        slot = _round_up(count * 4, PAGE)
        self.stamps = np.frombuffer(memory, np.int64, count=16)
        self.slots = [np.frombuffer(memory, np.float32, count=count, offset=PAGE + i * slot)
                      for i in (0, 1)]

    def read(self, version, out, dtype):
        """Copies `version`'s values into `out` (a float32 numpy array of `count`), rounded as
        `dtype`'s answers on the wire are; False when its slot does not hold it before or after
        the copy (a copy that raced the server's next write is refused, never returned torn)."""
        if version < 0:
            return False
        i = version % 2
        if self.stamps[8 * i] != version:
            return False
        if dtype == wire.WIRE_FP32:
            np.copyto(out, self.slots[i])
        else:
            out[:] = wire.decode_values(wire.encode_values(self.slots[i], dtype), dtype,
                                        self.count)
        return int(self.stamps[8 * i]) == version

    def close(self):
        self.stamps = self.slots = None
        _unmap(self.memory)
