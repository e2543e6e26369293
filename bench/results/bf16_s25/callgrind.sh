#!/bin/bash
# cg.sh BIN_DIR WHO(ps|client) DTYPE PARAMS STEPS -> prints total instructions (Ir) of WHO
V=$1; WHO=$2; DT=$3; N=$4; STEPS=$5
D=$(mktemp -d)
PSCMD="$V/dbs_ps --host=127.0.0.1 --port=0 --workers=4 --global_batch=4 --epochs=1 --policy=fixed --metrics_port=-1 --checkpoint_dir= --max_message_mb=2047 --stall_timeout_s=600 --worker_timeout_s=600 --wire_dtype=$DT --summary_path= --shard=0/1 --port_file=$D/port"
if [ $WHO = ps ]; then valgrind --tool=callgrind --callgrind-out-file=$D/cg.out $PSCMD 2>$D/ps.err & else $PSCMD 2>$D/ps.err & fi
PID=$!
for i in $(seq 200); do [ -s $D/port ] && break; sleep 0.2; done
PORT=$(cat $D/port)
CL="$V/dataplane_client --server=127.0.0.1:$PORT --clients=4 --params=$N --warmup=3 --steps=$STEPS --server_pid=$PID --stream_chunk_kb=1024"
if [ $WHO = client ]; then valgrind --tool=callgrind --callgrind-out-file=$D/cg.out $CL >/dev/null 2>$D/c.err; else $CL > /dev/null 2>$D/c.err; fi
kill -INT $PID; wait $PID 2>/dev/null
sleep 1
callgrind_annotate $D/cg.out* 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk '{print $1}' | tr -d ,
rm -rf $D
