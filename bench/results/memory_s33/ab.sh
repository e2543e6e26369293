#!/bin/bash
# Alternates old and new binaries: dataplane.py one round each, 3 pairs.
cd /work/main
for r in 1 2 3; do
  for arm in old new; do
    if [ $arm = old ]; then d=/tmp/s33; else d=/tmp/s33/new; fi
    /usr/bin/python3 bench/dataplane.py --sizes=1000000,10000000,25000000 --variants=fp32,bf16 --rounds=1 \
      --ps_bin=$d/dbs_ps --client_bin=$d/dataplane_client --out_dir=/tmp/s33/ab/r$r/$arm > /tmp/s33/ab/r$r.$arm.log 2>&1
  done
done
