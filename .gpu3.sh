source dev/gpu_setup.sh >/dev/null 2>&1
timeout 300 python -m dev.kernel_split_probe --only "pod p256 d16x1024 g32/8 page1,pod p256 d16x1024 g32/8 page16,pod p256 d16x4096 g32/8 page16" 2>&1 | grep -v Warn | tail -80
