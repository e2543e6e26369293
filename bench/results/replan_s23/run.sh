#!/bin/bash
# Interleaved runs of one grid cell (B128 1:1:2:4 quota): DBS, DBS without mid-epoch re-plans,
# and DBS's split held fixed, three rounds, nothing else running.
cd "$(dirname "$0")/../../.."
common="--quiet --workers=4 --model=cnn --epochs=5 --global_batch=128 --train_limit=4096 --test_limit=500 --lr=0.05 --seed=1 --cpu_quota=0.125,0.125,0.25,0.5"
out=bench/results/replan_s23
for r in 1 2 3; do
  python3 deploy/local_cluster.py $common --policy=dbs --out_dir=$out/round$r/dbs > /dev/null 2>&1
  python3 deploy/local_cluster.py $common --policy=dbs --replan_window_steps=0 --out_dir=$out/round$r/dbs_epoch_only > /dev/null 2>&1
  python3 deploy/local_cluster.py $common --policy=fixed --fixed_split=16,17,34,61 --out_dir=$out/round$r/split_dbs > /dev/null 2>&1
done
python3 - <<'PY'
import json, glob, statistics
rows = {}
for f in sorted(glob.glob('bench/results/replan_s23/round*/*/summary.json')):
    arm = f.split('/')[-2]; s = json.load(open(f))
    t = statistics.mean(e['train_seconds'] for e in s['epochs'][1:])
    rev = sum(e['revisions'] for e in s['epochs'][1:])
    last = [w['batch_size'] for w in sorted(s['epochs'][-1]['workers'], key=lambda w: w['id'])]
    comp = [round(sum(w['compute_seconds'] for w in e['workers']), 2) for e in s['epochs'][1:]]
    rows.setdefault(arm, []).append(t)
    print(f"{f.split('/')[-3]} {arm:15s} epoch {t:.3f} s, revisions in epochs 1-4: {rev}, last split {last}, summed compute {comp}")
for arm, ts in rows.items():
    print(f"{arm:15s} epochs {['%.3f' % t for t in ts]} median {statistics.median(ts):.3f}")
PY
