"""Does an AOTInductor package load on this GPU machine at all? (run on the GPU machine:
``python3 -m dev.gpu_aoti_probe``). Builds a package of a plain two-layer MLP on CUDA, with
no compiled_attn import anywhere, and loads and runs it in a fresh process. A crash here puts
the compiled_attn demo's AOTInductor load failure on the torch build, not on our ops."""

import subprocess
import sys
import tempfile

import torch

LOAD = """
import sys, torch
runner = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.randn(8, 64, device="cuda")
print("loaded and ran:", tuple(runner(x).shape))
"""


def main() -> int:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16)).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    with tempfile.TemporaryDirectory() as d:
        pkg = torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/mlp.pt2")
        res = subprocess.run([sys.executable, "-c", LOAD, pkg], capture_output=True, text=True)
    print(f"torch {torch.__version__}: plain-MLP AOTInductor package load exit code "
          f"{res.returncode}; stdout: {res.stdout.strip()[:200]!r}; "
          f"stderr tail: {res.stderr.strip()[-300:]!r}")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
