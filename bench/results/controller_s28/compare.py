"""Old against new dbs_ps in interleaved runs: epoch time and balance from epoch 2 per arm, and the
new/old epoch-time ratio paired by round. Usage: compare.py DIR (a directory of interleave.py
runs, one per cell)."""
import json, os, sys, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import grid
root = sys.argv[1]
arms = ("old", "new")
tot = {a: [] for a in arms}
for cell in sorted(os.listdir(root)):
    d = os.path.join(root, cell)
    if not os.path.isdir(d): continue
    rows = {a: [] for a in arms}
    rounds = sorted(x for x in os.listdir(d) if x.startswith("round"))
    pairs = []
    for r in rounds:
        got = {}
        for a in arms:
            p = os.path.join(d, r, a, "summary.json")
            if not os.path.exists(p): continue
            s = json.load(open(p))
            t = grid.steady_epoch_seconds(s)
            bal = max(grid.balance(e)[1] for e in s["epochs"][grid.SETTLE_EPOCH:])
            replans = sum(len([x for x in e.get("decisions", []) if x["from_step"] > 0 and x["applied"]]) for e in s["epochs"])
            rows[a].append((t, bal, replans))
            got[a] = t
        if len(got) == 2: pairs.append(got["new"] / got["old"])
    print(f"{cell}: rounds {len(rounds)}")
    for a in arms:
        if not rows[a]: continue
        ts = [x[0] for x in rows[a]]; bs = [x[1] for x in rows[a]]; rp = [x[2] for x in rows[a]]
        print(f"  {a}: epoch s median {statistics.median(ts):.3f} [{' '.join(f'{x:.3f}' for x in ts)}]  balance>=ep2 median {statistics.median(bs):.2f} worst {max(bs):.2f} [{' '.join(f'{x:.2f}' for x in bs)}]  applied re-plans {rp}")
        tot[a] += bs
    if pairs:
        print(f"  new/old paired: median {statistics.median(pairs):.3f} [{' '.join(f'{x:.3f}' for x in pairs)}]")
for a in arms:
    if tot[a]:
        print(f"{a}: balance over all runs: median {statistics.median(tot[a]):.3f}, worst {max(tot[a]):.3f}, runs > 1.15: {sum(b > 1.15 for b in tot[a])}/{len(tot[a])}")
