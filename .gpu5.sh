source dev/gpu_setup.sh >/dev/null 2>&1
timeout 175 python -m pytest -q -n 12 -m "gpu and not gpu_solo" tests/test_api_gpu.py tests/test_decode_chunks_gpu.py tests/test_fx_gpu.py tests/test_graph_dispatch_gpu.py tests/test_pod_gluon_gpu.py tests/test_launch_gpu.py 2>&1 | tail -2
timeout 260 python -m pytest -q -n 14 -m "gpu and not gpu_solo" tests/test_prefill_gluon_gpu.py tests/test_prefill_kernel_gpu.py tests/test_stats_skip_split_gpu.py tests/test_head_dims_gpu.py 2>&1 | tail -2
timeout 60 python -m pytest -q -m "gpu and gpu_solo" tests 2>&1 | tail -1
