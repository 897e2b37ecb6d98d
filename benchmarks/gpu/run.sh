#!/usr/bin/env bash
# Every GPU check of phalanx in one go: the GPU tests, then the benchmarks on the real models.
#
# Usage (from the repository root, on a machine with a CUDA GPU and a CUDA build of torch):
#
#     bash benchmarks/gpu/run.sh [OUT_DIR]        # default: $OUT, else ./gpu-results
#
# What the machine lacks travels as wheels in .whl/ (keras and the Jupyter kernel stack for
# Python 3.12; docs/gpu.md gives the download command): they are installed into a private
# directory, never over the machine's own packages. phalanx itself runs from src/.
# Each part has its own time limit so that the whole stays under 8 minutes on one H100/H200;
# everything it finds goes to OUT_DIR, 8 files and a folder per traced model (what the lending tool brings back):
#   env.txt      nvidia-smi, versions
#   tests.log    the GPU tests and their CPU twins
#   hooks.json   per model, at world size 1 in one process: raw loop, DDP over NCCL, OneDevice,
#                Mirrored without collectives, Mirrored's NCCL path with and without the guard
#                (benchmarks/hooks.py): the issue-44 targets
#   hooks.log    the same as tables
#   syncs.json   where a step makes the host wait for the GPU (the transformer LM)
#   profile.txt  the host time of each configuration's steps (cProfile)
#   trace-M/     torch's profiler over the NCCL path, with and without the guard, and DDP (per model M)
#   bench.log    phalanx bench on this GPU (separate processes)
#   bench/latest.json
# The variables GPU_*_TIMEOUT, GPU_HOOKS_MODELS, GPU_BENCH_CONFIGS, GPU_BENCH_MODELS and
# GPU_BENCH_ROUNDS size the parts.
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
nvidia-smi >>"$out/env.txt" 2>&1
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
tail -4 "$out/env.txt"
start=$(date +%s)
# The GPU tests (and their CPU twins), 4 at a time: each is a real job of its own.
timeout "${GPU_TESTS_TIMEOUT:-170}" python3 -m pytest tests/test_gpu.py tests/test_gpu_paths_on_cpu.py \
    -n 4 --dist load -p no:cacheprovider -v --timeout 160 >"$out/tests.log" 2>&1
echo "tests: exit $? after $(( $(date +%s) - start )) s"
tail -15 "$out/tests.log"
start=$(date +%s)
# The issue-44 figures: each model at world size 1, every configuration in one process,
# interleaved rounds; steps per round sized so each model takes 20-40 s.
rm -rf /tmp/phalanx-hooks && mkdir -p /tmp/phalanx-hooks
for spec in ${GPU_HOOKS_MODELS:-transformer_lm:30 resnet:30 large_mlp:200 cnn:200 seed_mlp:300}; do
    model=${spec%%:*}
    steps=${spec##*:}
    timeout "${GPU_HOOKS_TIMEOUT:-60}" python3 -m benchmarks.hooks --device cuda --model "$model" --rounds 5 \
        --steps "$steps" --out "/tmp/phalanx-hooks/$model.json" >>"$out/hooks.log" 2>&1
    echo "hooks $model: exit $? after $(( $(date +%s) - start )) s" | tee -a "$out/hooks.log"
done
python3 - "$out/hooks.json" /tmp/phalanx-hooks/*.json <<'PY'
import json, sys
merged = {}
for path in sys.argv[2:]:
    with open(path) as f:
        result = json.load(f)
    merged[result["model"]] = result
with open(sys.argv[1], "w") as f:
    json.dump(merged, f, indent=1)
for model, r in merged.items():
    if "speed_vs_ddp" in r:
        print(f"{model:16s} NCCL path / DDP {r['speed_vs_ddp']['px_ws1']:.3f}  guard {r['guard_share_of_step'] * 100:.1f} % "
              f"of a step  OneDevice / raw {r['speed_vs_raw']['px_one_device']:.3f}  Mirrored / raw {r['speed_vs_raw']['px_mirrored']:.3f}")
PY
start=$(date +%s)
# Where a step waits for the GPU, and the host time of each configuration (profile.txt).
timeout "${GPU_SYNCS_TIMEOUT:-70}" python3 -m benchmarks.gpu.syncs "$out" >"$out/syncs.log" 2>&1
echo "syncs: exit $? after $(( $(date +%s) - start )) s"
tail -8 "$out/syncs.log"
rm -f "$out/syncs.log"
start=$(date +%s)
# Where the NCCL path's and the guard's time goes (torch's profiler; counts, not timings).
for model in ${GPU_TRACE_MODELS:-transformer_lm large_mlp}; do
    timeout "${GPU_TRACE_TIMEOUT:-60}" python3 -m benchmarks.gpu.trace "$out/trace-$model" --model "$model" \
        --configs ddp_ws1,px_ws1,px_ws1_noguard,px_mirrored >/dev/null 2>"$out/trace-$model.err"
    echo "trace $model: exit $? after $(( $(date +%s) - start )) s"
done
start=$(date +%s)
# phalanx bench on this GPU: separate processes, one per configuration (a process start and CUDA
# initialisation each); latest.json is written after each section. The CPU all-reduce section
# says nothing about GPUs and is skipped.
timeout "${GPU_BENCH_TIMEOUT:-110}" python3 -m benchmarks --device cuda \
    --configs "${GPU_BENCH_CONFIGS:-px_mirrored_nccl,ddp}" \
    --models "${GPU_BENCH_MODELS:-transformer_lm,large_mlp}" --rounds "${GPU_BENCH_ROUNDS:-1}" --seconds 1 \
    --skip "${GPU_BENCH_SKIP:-allreduce,overhead}" --out "$out/bench" >"$out/bench.log" 2>&1
echo "bench: exit $? after $(( $(date +%s) - start )) s"
rm -f "$out/bench/latest.png"
tail -20 "$out/bench.log"
