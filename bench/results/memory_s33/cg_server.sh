#!/bin/bash
# $1 bin dir, $2 params, $3 steps, $4 extra ps flag
bin=$1; n=$2; steps=$3
d=$(mktemp -d)
valgrind --tool=callgrind --callgrind-out-file=$d/cg.out $bin/dbs_ps --host=127.0.0.1 --port=0 --workers=4 --global_batch=4 --epochs=1 --policy=fixed --metrics_port=-1 --checkpoint_dir= --stall_timeout_s=600 --worker_timeout_s=600 --summary_path= --port_file=$d/port $4 > $d/ps.log 2>&1 &
ps=$!
while [ ! -s $d/port ]; do sleep 0.1; done
port=$(cat $d/port)
$bin/dataplane_client --server=127.0.0.1:$port --clients=4 --params=$n --warmup=3 --steps=$steps > $d/c.log 2>&1
kill -INT $ps; wait $ps 2>/dev/null
grep -m1 "^summary\|^totals" $d/cg.out | awk '{print $2}'
rm -rf $d
