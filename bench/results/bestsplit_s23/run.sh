#!/bin/bash
# Interleaved runs of the grid's B64 1:3:3:9 slowdown cell, where DBS took 1.101x the best split
# run beside it in run 16 (and 0.935x in run 15): DBS against the best split of the standalone
# curves held fixed (run 16's, 1 10 10 43), three rounds, nothing else running. The noise_margin/
# rounds added a third arm: --arm="dbs_nm0=--policy=dbs --noise_margin=0".
cd "$(dirname "$0")/../../.."
exec python3 bench/interleave.py --out_dir=bench/results/bestsplit_s23 --rounds=3 \
  --common="--workers=4 --model=cnn --epochs=5 --global_batch=64 --train_limit=2048 --test_limit=500 --lr=0.05 --seed=1 --slowdown=16,5.33333,5.33333,1.77778 --slowdown_of=cpu" \
  --arm="dbs=--policy=dbs" \
  --arm="split_best=--policy=fixed --fixed_split=1,10,10,43"
