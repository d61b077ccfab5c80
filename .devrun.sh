#!/bin/bash
# one round on a 2-GPU machine: CP tests beside the GPU tier's changed parts, then the CP suite
source dev/gpu_setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ' '; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
( timeout 270 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider tests/test_cp_gpu.py > $OUT/cp_tests.txt 2>&1; echo "cp tests rc=$?" >> $OUT/cp_tests.txt ) &
( timeout 100 python3 -m pytest -v -rfE --tb=short -n 12 -m "gpu and not gpu_solo" -p no:cacheprovider tests/test_launch_gpu.py tests/test_graph_dispatch_gpu.py "tests/test_head_dims_gpu.py::test_fx_rewrite_and_hf_attention" "tests/test_head_dims_gpu.py::test_pod" "tests/test_prefill_kernel_gpu.py::test_torch_compile_fullgraph_cuda" > $OUT/val1.txt 2>&1; echo "rc=$?" >> $OUT/val1.txt
  timeout 165 python3 -m pytest -v -rfE --tb=short -n 14 -m "gpu and not gpu_solo" -p no:cacheprovider tests/test_prefill_gluon_gpu.py tests/test_prefill_kernel_gpu.py tests/test_stats_skip_split_gpu.py > $OUT/val2.txt 2>&1; echo "rc=$?" >> $OUT/val2.txt ) &
wait
for f in cp_tests val1 val2; do echo "== $f: $(grep -c PASSED $OUT/$f.txt) passed, $(grep -c 'FAILED\|ERROR' $OUT/$f.txt) failed/error lines; $(tail -1 $OUT/$f.txt)"; grep -E "FAILED|ERROR " $OUT/$f.txt | head -8; done
timeout 140 python3 -m benchmarks.cp_suite --reps 3 --budget-s 90 --out $OUT/cp.json > $OUT/cp_suite.txt 2>&1; echo "cp_suite rc=$?"; tail -25 $OUT/cp_suite.txt
