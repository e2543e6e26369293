#!/usr/bin/env bash
# The CUDA check of docs/models.md#cuda, for a machine with an NVIDIA GPU, CUDA's PyTorch in
# python3, a C++ compiler, and no Bazel: builds dbs_worker against that PyTorch's libtorch, trains
# examples/models.py's ResNet-style network on the GPU for STEPS x EPOCHS steps against a CPU
# dbs_ps on loopback, and compares its samples/s with plain PyTorch on the same model, batch and
# data on the same GPU (target: at least 0.9x); then the same with a Python worker (python3 -m
# dbs.worker, the network as an nn.Module), when that python3 has grpcio and protobuf.
#
#   bench/cuda/make_kit.sh                     # first, on a Debian machine with the repo built
#   bench/cuda/check.sh [OUT_DIR]              # then on the GPU machine, with .cuda_kit/ copied
#
# Environment: DEVICE (cuda; cpu tries the whole script without a GPU), BATCHES ("256 1024"),
# STEPS (100 steps per epoch), EPOCHS (3; the first is a warm-up), PYTHON (python3), and
# TORCH_INCLUDE / TORCH_LIB / TORCH_LIBS to use a libtorch other than the torch package's.
# Writes OUT_DIR/cuda_check.json and prints a table.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KIT=$ROOT/.cuda_kit
OUT_DIR=${1:-${OUT:-$ROOT/out/cuda_check}}
DEVICE=${DEVICE:-cuda}
BATCHES=${BATCHES:-256 1024}
STEPS=${STEPS:-100}
EPOCHS=${EPOCHS:-3}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
PS_PID=""
trap '[ -n "$PS_PID" ] && kill "$PS_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
mkdir -p "$OUT_DIR"
[ -f "$KIT/libdbs_worker_core.a" ] || { echo "check: no $KIT; run bench/cuda/make_kit.sh first" >&2; exit 2; }
export LD_LIBRARY_PATH=$KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# 1. libtorch: the torch package's, unless given.
if [ -z "${TORCH_LIB:-}" ]; then
  TORCH=$($PYTHON -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  TORCH_INCLUDE="$TORCH/include $TORCH/include/torch/csrc/api/include"
  TORCH_LIB=$TORCH/lib
  ABI=$($PYTHON -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
  if [ "$ABI" != 1 ]; then
    echo "check: this torch uses the pre-C++11 std::string ABI; Debian's gRPC needs the C++11 one" \
         "(torch >= 2.7's wheels have it)" >&2
    exit 2
  fi
fi
if [ -z "${TORCH_LIBS:-}" ]; then
  TORCH_LIBS="-ltorch -ltorch_cpu -lc10"
  [ -e "$TORCH_LIB/libtorch_cuda.so" ] && TORCH_LIBS="-ltorch -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10"
fi
echo "check: libtorch from $TORCH_LIB ($TORCH_LIBS)"

# 2. Build dbs_worker: the two libtorch objects here, the rest from the kit.
INCLUDES=(-I"$ROOT" -I"$KIT/include")
for d in $TORCH_INCLUDE; do INCLUDES+=(-isystem "$d"); done
PIDS=()
for f in model torch_learner; do
  g++ -std=c++17 -O2 -DNDEBUG "${INCLUDES[@]}" -c "worker/$f.cc" -o "$WORK/$f.o" &
  PIDS+=($!)
done
for p in "${PIDS[@]}"; do wait "$p"; done  # a failed compile stops the script
g++ -o "$WORK/dbs_worker" "$WORK/model.o" "$WORK/torch_learner.o" "$KIT/libdbs_worker_core.a" \
  "$KIT"/lib/*.so* -L"$TORCH_LIB" -Wl,-rpath,"$TORCH_LIB" -Wl,-rpath,"$KIT/lib" \
  -Wl,--no-as-needed $TORCH_LIBS -Wl,--as-needed -lpthread
"$WORK/dbs_worker" --help >/dev/null
echo "check: built dbs_worker"

# 3. The model and the data (random images; the label sets their brightness).
$PYTHON examples/models.py "$WORK/models" >/dev/null
MAX_BATCH=0
for b in $BATCHES; do [ "$b" -gt "$MAX_BATCH" ] && MAX_BATCH=$b; done
$PYTHON bench/cuda/plain_pytorch.py make_data "$WORK/data" $((MAX_BATCH * STEPS))
DATA="npy:$WORK/data/x.npy,$WORK/data/y.npy"

# 4. For each batch: dbs (one worker on DEVICE, dbs_ps on the CPU), with dbs_worker and then with
# a Python worker (python3 -m dbs.worker, the same network as an nn.Module) when this python3 has
# gRPC for Python; then plain PyTorch (which uses every core for its CPU work; so do the workers,
# with --threads).
# run_dbs B NAME WORKER_ARGV...: one job; the worker's log in $WORK/NAME_B.log, the summary in
# $WORK/summary_NAME_B.json.
run_dbs() {
  local b=$1 name=$2
  shift 2
  rm -f "$WORK/ps.port"
  "$KIT/dbs_ps" --host=127.0.0.1 --port=0 --port_file="$WORK/ps.port" --workers=1 \
    --epochs="$EPOCHS" --global_batch="$b" --policy=fixed --lr=0.05 --momentum=0.9 \
    --summary_path="$WORK/summary_${name}_$b.json" --linger_s=1 >"$WORK/ps_${name}_$b.log" 2>&1 &
  PS_PID=$!
  for _ in $(seq 100); do [ -s "$WORK/ps.port" ] && break; sleep 0.1; done
  "$@" --server="127.0.0.1:$(cat "$WORK/ps.port")" --name="$name" --device="$DEVICE" \
    --data="$DATA" --normalize=train --train_limit=$((b * STEPS)) --threads="$(nproc)" \
    --log_every_s=30 | tee "$WORK/${name}_$b.log" | grep -E "joined|done:"
  wait "$PS_PID"
  PS_PID=""
}
PYTHON_WORKER="yes"
if ! $PYTHON -c "import grpc, google.protobuf" 2>/dev/null; then
  PYTHON_WORKER="skipped: $PYTHON has no grpcio/protobuf (pip install grpcio protobuf)"
  echo "check: the Python worker is $PYTHON_WORKER"
fi
RESULTS="[]"
for B in $BATCHES; do
  run_dbs "$B" gpu "$WORK/dbs_worker" --model="$WORK/models/resnet_bn.pt"
  if [ "$PYTHON_WORKER" = yes ]; then
    PYTHONPATH="$KIT/python:$ROOT/examples" run_dbs "$B" gpu-python \
      "$PYTHON" -m dbs.worker --model=models:resnet_bn
  fi
  PLAIN=$($PYTHON bench/cuda/plain_pytorch.py train "$WORK/data" "$WORK/models/resnet_bn.pt" \
          "$DEVICE" "$B" "$STEPS" "$EPOCHS")
  RESULTS=$($PYTHON - "$WORK" "$B" "$PLAIN" "$RESULTS" "$PYTHON_WORKER" <<'PY'
import json, os, sys
work, b, plain, results, python_worker = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \
    json.loads(sys.argv[4]), sys.argv[5]

def speed(name):  # samples/s after the first epoch, which warms up as on the plain side
    summary = json.load(open(os.path.join(work, f"summary_{name}_{b}.json")))
    later = summary["epochs"][1:]
    return (sum(e["audit"]["samples"] for e in later) / sum(e["train_seconds"] for e in later),
            summary["final_test_accuracy"])

dbs, accuracy = speed("gpu")
best = max(plain["samples_per_second"].values())
row = {"batch": plain["batch"], "device": plain["device"], "dbs_samples_per_second": dbs,
       "plain_pytorch_samples_per_second": plain["samples_per_second"],
       "ratio_to_faster_plain": dbs / best, "final_test_accuracy": accuracy}
if python_worker == "yes":
    py, _ = speed("gpu-python")
    row.update(python_worker_samples_per_second=py, python_worker_ratio_to_faster_plain=py / best)
else:
    row["python_worker"] = python_worker
results.append(row)
print(json.dumps(results))
PY
)
done
echo "$RESULTS" >"$OUT_DIR/cuda_check.json"
$PYTHON - "$OUT_DIR/cuda_check.json" <<'PY'
import json, sys
print("| batch | device | dbs samples/s | plain PyTorch samples/s (TorchScript, eager) | dbs / faster plain | Python worker samples/s, / faster plain |")
print("| --- | --- | --- | --- | --- | --- |")
for r in json.load(open(sys.argv[1])):
    p = r["plain_pytorch_samples_per_second"]
    py = ("%.0f, %.3f" % (r["python_worker_samples_per_second"],
                          r["python_worker_ratio_to_faster_plain"])
          if "python_worker_samples_per_second" in r else r["python_worker"])
    print("| %d | %s | %.0f | %.0f, %.0f | %.3f | %s |" % (r["batch"], r["device"], r["dbs_samples_per_second"],
          p["torchscript"], p["eager"], r["ratio_to_faster_plain"], py))
PY
echo "check: wrote $OUT_DIR/cuda_check.json"
