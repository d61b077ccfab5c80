# Set up the GPU machine for the benchmarks. Source it from the repository root:
#     source dev/gpu_setup.sh
# - installs the wheels in .whl/ (FlashInfer 0.7.2.post1 + apache-tvm-ffi, and pytest-xdist +
#   execnet for make test-gpu; downloaded on the CPU machine and carried along: the GPU machine
#   has no network) into $CA_SITE (default /tmp/site) and puts that folder on PYTHONPATH;
# - unpacks FlashInfer's JIT builds carried in .ficache/ (run tool: carry [".whl", ".ficache"])
#   into /tmp/fiws and points FLASHINFER_WORKSPACE_BASE there, so its modules load instead of
#   compiling for minutes (the installed wheels are dated back so that ninja keeps them);
# - installs compiled_attn itself (editable, no deps, no build isolation: that would download
#   setuptools), unless compiled_attn.ops already imports.
# Idempotent: a warm machine skips what is already there. Sourced, so no `set -e` (it would leak
# into the caller's shell); each step reports its own failure instead.

CA_SITE="${CA_SITE:-/tmp/site}"
if ls .whl/*.whl >/dev/null 2>&1; then
    if [ ! -f "$CA_SITE/.compiled_attn_wheels" ]; then
        echo "gpu_setup: installing $(ls .whl/*.whl | wc -l) wheels into $CA_SITE"
        if python3 -m pip install -q --no-index --no-deps --no-compile --target "$CA_SITE" .whl/*.whl; then
            # Installed files dated "now" are newer than any carried FlashInfer build, and
            # FlashInfer leaves freshness to ninja's dependency scan (its headers are inputs):
            # every cached module would be rebuilt (POD's takes minutes). Date them back.
            find "$CA_SITE" -exec touch -h -d @1 {} + 2>/dev/null
            touch "$CA_SITE/.compiled_attn_wheels"
        else
            echo "gpu_setup: wheel install FAILED (FlashInfer rows will say why; or use --no-flashinfer)"
        fi
    fi
    case ":${PYTHONPATH:-}:" in
        *":$CA_SITE:"*) ;;
        *) export PYTHONPATH="$CA_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
else
    echo "gpu_setup: no .whl/ here (run the run tool with carry [\".whl\"]); FlashInfer will be" \
         "recorded as unavailable (or pass --no-flashinfer)"
fi

# FlashInfer's JIT builds, carried as .ficache/fi_cache.txz.part.* (an xz tar of a GPU machine's
# $FLASHINFER_WORKSPACE_BASE/.cache, 24 MB for the pod suite's modules, so that it travels with
# .whl/ within the run tool's 64 MiB; split under 16 MiB a part to come back through $OUT) or,
# as before, .ficache/fi_cache.part.* (gzip): unpacked once into /tmp/fiws, which
# FLASHINFER_WORKSPACE_BASE then names (unless set). To refresh it on the GPU machine:
#     (cd /tmp/fiws && tar cf - .cache | xz -6 -T0 | split -b 15M - $OUT/fi_cache.txz.part.)
if [ -z "${FLASHINFER_WORKSPACE_BASE:-}" ] && ls .ficache/fi_cache.*part.* >/dev/null 2>&1; then
    export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
    if [ ! -f /tmp/fiws/.unpacked ]; then
        mkdir -p /tmp/fiws
        if ls .ficache/fi_cache.txz.part.* >/dev/null 2>&1; then
            cat .ficache/fi_cache.txz.part.* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/fiws')"
        else
            cat .ficache/fi_cache.part.* | tar xzf - -C /tmp/fiws
        fi && touch /tmp/fiws/.unpacked || echo "gpu_setup: unpacking .ficache FAILED"
    fi
fi

if ! python3 -c "import compiled_attn.ops" >/dev/null 2>&1; then
    echo "gpu_setup: pip install --no-deps --no-build-isolation -e ."
    python3 -m pip install -q --no-deps --no-build-isolation -e . \
        || echo "gpu_setup: installing compiled_attn FAILED"
fi
python3 - <<'PY'
import importlib
for name in ("torch", "triton", "compiled_attn", "flashinfer", "xdist", "tqdm", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"gpu_setup: {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"gpu_setup: {name} unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
PY
