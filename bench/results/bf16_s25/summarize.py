import json,statistics,sys,glob,os
base=sys.argv[1] if len(sys.argv)>1 else 'bench/results/bf16_s25'
rows={}
for d in sorted(glob.glob(base+'/*/dataplane.json')):
    name=os.path.basename(os.path.dirname(d))
    for r in json.load(open(d))['results']:
        key=(r['params'],r['wire_dtype'])
        med=lambda k: statistics.median(x[k] for x in r['dbs'])
        rows.setdefault(key,[]).append((name,med('step_ms_median'),med('server_cpu_ms_per_step'),med('client_cpu_ms_per_step'),max(x['server_peak_rss_bytes'] for x in r['dbs'])/2**20))
for key in sorted(rows):
    print(key)
    for name,s,c,cl,rss in rows[key]:
        print(f"  {name:6s} step {s:6.1f} ms  server CPU {c:6.1f}  client CPU {cl:5.1f}  rss {rss:4.0f}")
