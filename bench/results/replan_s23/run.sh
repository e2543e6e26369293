#!/bin/bash
# Interleaved runs of one grid cell (B128 1:1:2:4 quota): DBS, DBS without mid-epoch re-plans,
# and DBS's split held fixed, three rounds, nothing else running.
cd "$(dirname "$0")/../../.."
exec python3 bench/interleave.py --out_dir=bench/results/replan_s23 --rounds=3 \
  --common="--workers=4 --model=cnn --epochs=5 --global_batch=128 --train_limit=4096 --test_limit=500 --lr=0.05 --seed=1 --cpu_quota=0.125,0.125,0.25,0.5" \
  --arm="dbs=--policy=dbs" \
  --arm="dbs_epoch_only=--policy=dbs --replan_window_steps=0" \
  --arm="split_dbs=--policy=fixed --fixed_split=16,17,34,61"
