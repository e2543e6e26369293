#!/bin/bash
# Interleaved runs of the grid's B64 1:3:3:9 slowdown cell, where DBS took 1.101x the best split
# run beside it in run 16 (and 0.935x in run 15): DBS against the best split of the standalone
# curves held fixed (run 16's, 1 10 10 43), three rounds, nothing else running.
cd "$(dirname "$0")/../../.."
common="--quiet --workers=4 --model=cnn --epochs=5 --global_batch=64 --train_limit=2048 --test_limit=500 --lr=0.05 --seed=1 --slowdown=16,5.33333,5.33333,1.77778 --slowdown_of=cpu"
out=bench/results/bestsplit_s23
for r in 1 2 3; do
  python3 deploy/local_cluster.py $common --policy=dbs --out_dir=$out/round$r/dbs > /dev/null 2>&1
  python3 deploy/local_cluster.py $common --policy=fixed --fixed_split=1,10,10,43 --out_dir=$out/round$r/split_best > /dev/null 2>&1
done
python3 - <<'PY'
import json, glob, statistics
rows = {}
for f in sorted(glob.glob('bench/results/bestsplit_s23/round*/*/summary.json')):
    arm = f.split('/')[-2]; s = json.load(open(f))
    t = statistics.mean(e['train_seconds'] for e in s['epochs'][1:])
    rev = sum(e['revisions'] for e in s['epochs'][1:])
    last = [w['batch_size'] for w in sorted(s['epochs'][-1]['workers'], key=lambda w: w['id'])]
    rows.setdefault(arm, []).append(t)
    print(f"{f.split('/')[-3]} {arm:11s} epoch {t:.3f} s, revisions in epochs 1-4: {rev}, last split by id {last}")
for arm, ts in rows.items():
    print(f"{arm:11s} epochs {['%.3f' % t for t in ts]} median {statistics.median(ts):.3f}")
PY
