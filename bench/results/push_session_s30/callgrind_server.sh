#!/bin/bash
sess=$1; steps=$2
d=$(mktemp -d)
valgrind --tool=callgrind --callgrind-out-file=$d/cg.out /work/main/bazel-bin/server/dbs_ps --host=127.0.0.1 --port=0 --workers=4 --global_batch=4 --epochs=1 --policy=fixed --metrics_port=-1 --checkpoint_dir= --stall_timeout_s=600 --worker_timeout_s=600 --summary_path= --port_file=$d/port > $d/ps.log 2>&1 &
ps=$!
while [ ! -s $d/port ]; do sleep 0.1; done
port=$(cat $d/port)
/work/main/bazel-bin/bench/dataplane_client --server=127.0.0.1:$port --clients=4 --params=46730 --warmup=3 --steps=$steps --push_session=$sess > $d/c.log 2>&1
kill -INT $ps; wait $ps 2>/dev/null
grep -m1 "^summary\|^totals" $d/cg.out
rm -rf $d
