#!/usr/bin/env bash
# Every GPU check of phalanx in one go: the GPU tests, then the GPU benchmark.
#
# Usage (from the repository root, on a machine with a CUDA GPU and a CUDA build of torch):
#
#     bash benchmarks/gpu/run.sh [OUT_DIR]        # default: $OUT, else ./gpu-results
#
# What the machine lacks travels as wheels in .whl/ (keras and the Jupyter kernel stack for
# Python 3.12; docs/gpu.md gives the download command): they are installed into
# a private directory, never over the machine's own packages. phalanx itself runs from src/.
# Each part has its own time limit so that the whole stays under 8 minutes on one H100;
# everything it finds goes to OUT_DIR: nvidia-smi.txt, env.txt, tests.log (+ tests.xml),
# syncs.json, profile.txt, bench.log and bench/latest.json (8 files: what the lending tool brings
# back, so no junit XML and no chart). The variables GPU_*_TIMEOUT,
# GPU_BENCH_CONFIGS, GPU_BENCH_MODELS, GPU_BENCH_ROUNDS and GPU_BENCH_SKIP size the parts.
set -u
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
here=$(pwd)
export KERAS_BACKEND=torch PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Inductor compiles in this process, as on a 2-core CI machine, rather than in a pool of worker
# processes that outlives the test (the tests fail any test that leaves a child process behind).
export TORCHINDUCTOR_COMPILE_THREADS=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/phalanx-site .whl/*.whl \
        || echo "wheel install failed" >>"$out/env.txt"
    export PYTHONPATH="/tmp/phalanx-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$here/src:$here${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
python3 - >>"$out/env.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("keras", "ipykernel", "IPython", "jupyter_client", "numpy", "phalanx"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(name, "missing:", e)
PY
cat "$out/env.txt"
start=$(date +%s)
# The GPU tests (and their CPU twins), 4 at a time: each is a real job of its own.
timeout "${GPU_TESTS_TIMEOUT:-200}" python3 -m pytest tests/test_gpu.py tests/test_gpu_paths_on_cpu.py \
    -n 4 --dist load -p no:cacheprovider -v --timeout 190 >"$out/tests.log" 2>&1
echo "tests: exit $? after $(( $(date +%s) - start )) s"
tail -25 "$out/tests.log"
start=$(date +%s)
# Where a step waits for the GPU, and the host time of each configuration (profile.txt).
timeout "${GPU_SYNCS_TIMEOUT:-90}" python3 -m benchmarks.gpu.syncs "$out" >"$out/syncs.log" 2>&1
echo "syncs: exit $? after $(( $(date +%s) - start )) s"
tail -20 "$out/syncs.log"
start=$(date +%s)
# The host time of the gradient hooks at world size 1 against DDP's (a table on stdout only: the
# lending tool brings back 8 files, all taken).
timeout 60 python3 -m benchmarks.hooks --device cuda --rounds 5 2>&1 | tail -12
echo "hooks: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
start=$(date +%s)
# One round of each configuration takes about 220 s on an H100 host (a process start and CUDA
# initialisation per run), the overhead rows about 100 s more; latest.json is written after each
# section. The CPU all-reduce section says nothing about GPUs and is skipped.
timeout "${GPU_BENCH_TIMEOUT:-360}" python3 -m benchmarks --device cuda \
    --configs "${GPU_BENCH_CONFIGS:-px_mirrored,px_mirrored_nccl,ddp,local2}" \
    --models "${GPU_BENCH_MODELS:-seed_mlp,large_mlp,cnn}" --rounds "${GPU_BENCH_ROUNDS:-1}" --seconds 1 --skip "${GPU_BENCH_SKIP:-allreduce}" \
    --out "$out/bench" >"$out/bench.log" 2>&1
echo "bench: exit $? after $(( $(date +%s) - start )) s"
rm -f "$out/bench/latest.png"
tail -30 "$out/bench.log"
