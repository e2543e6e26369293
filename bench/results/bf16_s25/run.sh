#!/bin/bash
cd /work/main
for i in 1 2 3; do
  for v in old new; do
    /usr/bin/python3 bench/dataplane.py --sizes=10000000,25000000 --variants=bf16,fp32 --rounds=2 --no_gloo \
      --ps_bin=/tmp/$v/dbs_ps --client_bin=/tmp/$v/dataplane_client --out_dir=bench/results/bf16_s25/$v$i > /tmp/ab/$v$i.log 2>&1
  done
done
