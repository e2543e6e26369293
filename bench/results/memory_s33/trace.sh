#!/bin/bash
# The server's VmRSS and VmHWM (KiB) every 20 ms through one 10M run of bench/dataplane.py.
# $1: bin dir, $2: out file, $3: variant (e.g. fp32, fp32/window8). The first traces
# (traces/trace_{old,new}*.txt) came from an earlier form of it: VmRSS alone, every 50 ms.
d=$1; out=$2; : > $out
cd /work/main
/usr/bin/python3 bench/dataplane.py --sizes=10000000 --variants=$3 --rounds=1 --no_gloo --ps_bin=$d/dbs_ps --client_bin=$d/dataplane_client --out_dir=/tmp/s33/trace_out > /dev/null 2>&1 &
bp=$!
t0=$(date +%s.%N)
while kill -0 $bp 2>/dev/null; do
  pid=$(pgrep -f "^$d/dbs_ps" | head -1)
  if [ -n "$pid" ]; then
    r=$(awk '/VmRSS/{print $2}' /proc/$pid/status 2>/dev/null)
    [ -n "$r" ] && echo "$(echo "$(date +%s.%N) - $t0" | bc) $r" >> $out
  fi
  sleep 0.02
done
