#!/bin/bash
# One run of dbs_ps (4 workers, fixed split) and bench/dataplane_client (60 warm-up steps, 20
# timed, 4 MiB chunks, push sessions) with gRPC's memory quota set; prints one line: "ok" with
# the median step (ms) and dbs_ps's peak RSS (MiB), or "FAIL rc=124" when the client had not
# finished in 90 s (a stall: the server still alive).
# $1 params, $2 quota MiB (0: default), $3 det|arr (--deterministic), $4 tag, [$5 wire dtype]
# BIN: the binaries' folder (copies, never bazel-bin); STALL: dbs_ps --stall_timeout_s (600).
n=$1; q=$2; mode=$3; tag=$4; dt=${5:-fp32}; d=${BIN:-/tmp/s34/bin}; o=/tmp/s34/qs/$tag
rm -rf $o; mkdir -p $o; cd $o
extra=""; [ "$q" != 0 ] && extra="--memory_quota_mb=$q --max_message_mb=$((q/2))"
det=true; [ $mode = arr ] && det=false
$d/dbs_ps --host=127.0.0.1 --port=0 --workers=4 --global_batch=4 --epochs=1 --policy=fixed --metrics_port=-1 --checkpoint_dir= --stall_timeout_s=${STALL:-600} --worker_timeout_s=600 --wire_dtype=$dt --deterministic=$det --port_file=$o/port $extra > ps.log 2>&1 &
pp=$!
for i in $(seq 200); do [ -s port ] && break; sleep 0.1; done
pid=$(pgrep -f "^$d/dbs_ps" | head -1)
timeout 90 $d/dataplane_client --server=127.0.0.1:$(cat port) --clients=4 --params=$n --warmup=60 --steps=20 --stream_chunk_kb=4096 --push_session=true --server_pid=$pid > client.json 2> client.log
rc=$?
alive=yes; kill -0 $pid 2>/dev/null || alive=no
if [ $rc = 0 ]; then
  python3 -c "import json;r=json.loads(open('client.json').read().strip().splitlines()[-1]);print('$tag n=$n q=$q $mode $dt ok step %.1f rss %.1f' % (r['step_ms_median'], r['server_peak_rss_bytes']/2**20))"
else
  echo "$tag n=$n q=$q $mode $dt FAIL rc=$rc server_alive=$alive"
fi
kill $pid 2>/dev/null; wait
