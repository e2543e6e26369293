#!/bin/bash
# The grid's B64 1:3:3:9 slowdown cell, the only DBS/ideal miss of run 17: DBS against run 17's
# best split, which leaves the slowest worker out (0 9 10 45, slowest first), and run 16's
# (1 10 10 43), interleaved, five rounds.
cd "$(dirname "$0")/../../.."
exec python3 bench/interleave.py --out_dir=bench/results/zero_s24 --rounds=5 \
  --common="--workers=4 --model=cnn --epochs=5 --global_batch=64 --train_limit=2048 --test_limit=500 --lr=0.05 --seed=1 --slowdown=16,5.33333,5.33333,1.77778 --slowdown_of=cpu" \
  --arm="dbs=--policy=dbs" \
  --arm="split0=--policy=fixed --fixed_split=0,9,10,45" \
  --arm="split1=--policy=fixed --fixed_split=1,10,10,43"
