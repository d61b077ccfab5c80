source dev/gpu_setup.sh >/dev/null 2>&1
timeout 250 python -m pytest -q -n 12 -m "gpu and not gpu_solo" tests/test_api_gpu.py tests/test_decode_chunks_gpu.py tests/test_fx_gpu.py tests/test_graph_dispatch_gpu.py tests/test_pod_gluon_gpu.py tests/test_launch_gpu.py 2>&1 | tail -4
timeout 120 python -m pytest -q -n 8 -m "gpu and not gpu_solo" tests/test_prefill_kernel_gpu.py -k "compile or opcheck" 2>&1 | tail -2
timeout 220 python -m benchmarks.host --rounds 7 --out $OUT/host_h200.json 2>&1 | tail -30
