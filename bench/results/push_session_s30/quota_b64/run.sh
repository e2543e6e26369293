#!/bin/bash
# The 3 B64 quota cells, push sessions on and off, interleaved.
cd /work/main
for cell in "1-1-2-4:0.125,0.125,0.25,0.5" "1-3-3-9:0.0625,0.1875,0.1875,0.5625" "1-1-1-8:0.0909091,0.0909091,0.0909091,0.727273"; do
  name=${cell%%:*}; q=${cell#*:}
  /usr/bin/python3 bench/interleave.py --out_dir=$1/B64_${name}_quota --rounds=4 \
    --common="--workers=4 --cpu_quota=$q --policy=dbs --model=cnn --epochs=5 --global_batch=64 --train_limit=2048 --test_limit=500 --lr=0.05 --seed=1 --ps_bin=/tmp/ab30/dbs_ps" \
    --arm="sess=--worker_bin=/tmp/ab30/dbs_worker" --arm="calls=--worker_bin=/tmp/ab30/worker_nosess.sh" 2>&1 | tail -3
done
