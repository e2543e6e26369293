"""What a worker computes from the server's messages without asking it: the epoch's permutation
of the training set, a plan's per-step sample positions, and the flat values of the model in the
job's wire dtype. Every function here gives the bytes and numbers dbs_worker (C++) gives:
common/permutation.cc, common/plan.h and common/wire_values.h are the references.
"""

import numpy as np

MASK = (1 << 64) - 1
MAX_STEPS_PER_EPOCH = 1 << 20
MAX_GLOBAL_BATCH = 1 << 24

WIRE_FP32, WIRE_BF16, WIRE_FP16 = 0, 1, 2
WIRE_NAMES = {WIRE_FP32: "fp32", WIRE_BF16: "bf16", WIRE_FP16: "fp16"}


class PlanError(ValueError):
    """A plan, revision or resume point from the server that this worker cannot use."""


def _splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def epoch_permutation(n, seed):
    """The permutation of range(n) that every worker derives from (n, seed): splitmix64 and a
    Fisher-Yates shuffle with Lemire's unbiased draw, as common/permutation.cc."""
    perm = list(range(max(n, 0)))
    state = seed & MASK
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = ((1 << 64) - bound) % bound
        while True:
            state, r = _splitmix64(state)
            if r >= threshold:
                break
        j = r % bound
        perm[i], perm[j] = perm[j], perm[i]
    return np.asarray(perm, dtype=np.int64)


def epoch_seed(job_seed, epoch):
    """The seed of `epoch`'s permutation in a job seeded with `job_seed`."""
    state = (job_seed ^ ((0x5851F42D4C957F2D * (epoch + 1)) & MASK)) & MASK
    return _splitmix64(state)[1]


def _check_ranges(ranges, size, what):
    for r in ranges:
        if r.begin < 0 or r.end > size or r.begin > r.end:
            raise PlanError(f"the server's plan names {what} range [{r.begin}, {r.end}) outside "
                            f"a data set of {size} samples")


def validate_plan(plan, train_size, test_size):
    """Raises PlanError when a plan (proto EpochPlan) cannot be used on these data sets."""
    if plan.finished:
        return
    if not 0 <= plan.num_steps <= MAX_STEPS_PER_EPOCH:
        raise PlanError(f"the server's plan has {plan.num_steps} steps")
    if (not 0 <= plan.global_batch <= MAX_GLOBAL_BATCH or
            not 0 <= plan.batch_size <= plan.global_batch or
            not 0 <= plan.final_batch_size <= plan.global_batch):
        raise PlanError(f"the server's plan has batch {plan.batch_size} (last "
                        f"{plan.final_batch_size}) of a global batch of {plan.global_batch}")
    _check_ranges(plan.train_ranges, train_size, "a training")
    _check_ranges([plan.test_range], test_size, "the test")


def validate_revision(rev, train_size, test_size):
    """Raises PlanError when a revision (proto PlanRevision) cannot be used."""
    if (not 0 <= rev.num_steps <= MAX_STEPS_PER_EPOCH or not 0 <= rev.from_step <= rev.num_steps
            or rev.num_steps - rev.from_step != len(rev.steps)):
        raise PlanError(f"the server sent a revision of {rev.num_steps} steps from step "
                        f"{rev.from_step} with {len(rev.steps)} steps of samples")
    for step in rev.steps:
        _check_ranges(step.ranges, train_size, "a training")
    _check_ranges([rev.test_range], test_size, "the test")


def expand_steps(plan):
    """A plan's positions per step: a list, one entry per step, of (begin, end) ranges (the
    batch sizes consume the plan's ranges in order, as common/plan.h ExpandSteps)."""
    if plan.finished or plan.num_steps <= 0:
        return []
    ranges = [(r.begin, r.end) for r in plan.train_ranges]
    steps, r, used = [], 0, 0
    for s in range(plan.num_steps):
        n = plan.final_batch_size if s == plan.num_steps - 1 else plan.batch_size
        out = []
        while n > 0 and r < len(ranges):
            begin, end = ranges[r]
            take = min(n, end - begin - used)
            out.append((begin + used, begin + used + take))
            used += take
            n -= take
            if used == end - begin:
                r, used = r + 1, 0
        steps.append(out)
    return steps


def steps_of(assignments):
    """A revision's or resume's StepAssignment messages as lists of (begin, end)."""
    return [[(r.begin, r.end) for r in a.ranges] for a in assignments]


def count_samples(ranges):
    return sum(end - begin for begin, end in ranges)


def bytes_per_value(dtype):
    return 4 if dtype == WIRE_FP32 else 2


def encode_values(values, dtype):
    """Flat float32 values (a numpy array) as the wire dtype's little-endian bytes; 16-bit values
    are rounded to nearest even (NaN stays NaN), as the server rounds its own."""
    values = np.ascontiguousarray(values, dtype="<f4")
    if dtype == WIRE_FP32:
        return values.tobytes()
    if dtype == WIRE_FP16:
        with np.errstate(over="ignore"):  # out of range: infinity, as the server rounds
            return values.astype("<f2").tobytes()
    if dtype == WIRE_BF16:
        bits = values.view("<u4").astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(values)
        rounded[nan] = (bits[nan] >> 16) | 0x40
        return rounded.astype("<u2").tobytes()
    raise ValueError(f"unknown wire dtype {dtype}")


def decode_values(data, dtype, count):
    """The float32 values (a numpy array of `count`) of bytes in the wire dtype; ValueError when
    there are not exactly `count` of them."""
    width = bytes_per_value(dtype)
    if dtype not in WIRE_NAMES:
        raise ValueError(f"unknown wire dtype {dtype} (a newer server?)")
    if len(data) != width * count:
        raise ValueError(f"{len(data)} bytes of {WIRE_NAMES[dtype]} values where the model has "
                         f"{count} values")
    if dtype == WIRE_FP32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32, copy=True)
    if dtype == WIRE_FP16:
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
