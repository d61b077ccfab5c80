source dev/gpu_setup.sh >/dev/null 2>&1
timeout 400 python -m benchmarks.pod --only "pod p256 d16x1024 g32/8 page1,pod p256 d16x1024 g64/8 page16,pod p256 d16x4096 g32/8 page16" --rounds 3 --out $OUT/pod_p256.json 2>&1 | grep -v "^\s*\[" | tail -40
python - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/pod_p256.json"))
for r in d["rows"]:
    if r["provider"] in ("ours_pod", "fi_pod", "ours_decode", "fi_decode", "copy", "ours_prefill", "fi_prefill"):
        print(f'{r["case"]:38s} {r["provider"]:12s} {r["mode"]:5s} {r.get("median_us") or r.get("error","")}  fi_diff={r.get("max_abs_diff_vs_ours")} diff={r.get("max_abs_diff_vs_apart")}')
P
