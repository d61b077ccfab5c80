source dev/gpu_setup.sh >/dev/null 2>&1
timeout 200 python -m benchmarks.pod --only "pod p256 d16x1024 g32/8 page1" --rounds 3 --out $OUT/pod_check.json 2>&1 | grep -v "^\s*\[" | tail -4
python - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/pod_check.json"))
for r in d["rows"]:
    if r["mode"] == "graph" or r["provider"] in ("fi_pod", "ours_pod"):
        print(f'{r["case"][:40]:40s} {r["provider"]:15s} {r["mode"]:5s} {r.get("median_us") or r.get("error","")}')
P
