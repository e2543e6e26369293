import json, glob, os, sys, statistics
base = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{base}/r*/*/dataplane.json")):
    r, arm = f.split("/")[-3], f.split("/")[-2]
    for s in json.load(open(f))["summary"]:
        key = (s["params"], s["wire_dtype"], arm)
        rows.setdefault(key, []).append((r, s["ratio"], s["dbs_step_ms"], s["gloo_step_ms"], s["server_peak_rss_mib"], s["server_cpu_ms_per_step"], s["server_faults_per_step_second_half"]))
print("| params | wire | arm | ratio per round | step ms | peak RSS MiB per round | server CPU ms | faults/step 2nd half |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(rows):
    v = rows[key]
    print(f"| {key[0]:,} | {key[1]} | {key[2]} | " + ", ".join(f"{x[1]:.2f}" for x in v) + " | " + ", ".join(f"{x[2]:.0f}" for x in v)
          + " | " + ", ".join(f"{x[4]:.0f}" for x in v) + " | " + ", ".join(f"{x[5]:.0f}" for x in v) + " | " + ", ".join(f"{x[6]:.0f}" for x in v) + " |")
