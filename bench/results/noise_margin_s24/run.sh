#!/bin/bash
# The noise margin's cost in the grid's B64 1:3:3:9 slowdown cell, measured again (session 23:
# DBS with --noise_margin=0 3-11% faster than the default in each of three rounds): the default
# margin (1), half of it, none, and the best split held fixed, interleaved, five rounds.
cd "$(dirname "$0")/../../.."
exec python3 bench/interleave.py --out_dir=bench/results/noise_margin_s24 --rounds=5 \
  --common="--workers=4 --model=cnn --epochs=5 --global_batch=64 --train_limit=2048 --test_limit=500 --lr=0.05 --seed=1 --slowdown=16,5.33333,5.33333,1.77778 --slowdown_of=cpu" \
  --arm="nm1=--policy=dbs" --arm="nm05=--policy=dbs --noise_margin=0.5" \
  --arm="nm0=--policy=dbs --noise_margin=0" \
  --arm="split=--policy=fixed --fixed_split=1,10,10,43"
