#!/usr/bin/env bash
# One GPU, one call (a lent GPU comes for minutes): everything that needs a GPU, in the order it matters.
#  1. steadylm's step against a plain PyTorch loop on the same model=small (bf16-mixed, compiled, context 1024), paired,
#     at micro-batch 16, 32 and 64, chunked and plain head+loss: tokens/s, MFU, peak memory, ratios with intervals.
#  2. model=small's default recipe against experiment=fast, 300 steps each: steps and time to the default's val loss.
#  3. the divergence bench's fp16-overflow scenario (fp16 needs CUDA; on a CPU Lightning runs 16-mixed as bf16).
# FULL=1 adds the older rows: the stability read at the step itself against deferred, and model=llama_small;
# and data.pack=doc's kernels (FlexAttention's block mask, the explicit mask) against unmasked packing.
# CPU form of each part (tests/test_perf.py, tests/test_gpu_bench.py): python benchmarks/gpu.py --cpu [...].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# An image with torch and lightning but without Hydra, and no network (a lent GPU): `make gpu-wheels` here first.
if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels hydra-core omegaconf
fi
"$PY" benchmarks/gpu.py --side-by-side --steps ${STEPS:-40} "$@"
"$PY" benchmarks/gpu.py --to-loss --steps 300 "$@"
"$PY" benchmarks/divergence_bench.py --device cuda --steps 200 --jobs 1 --only "fp16 mixed precision, lr 30x, no QK-norm"
if [ -n "${FULL:-}" ]; then
  "$PY" benchmarks/gpu.py --compare-defer "$@"
  "$PY" benchmarks/gpu.py model=llama_small "$@"
  "$PY" benchmarks/pack_bench.py --trainer gpu --context 1024 --batch 16 --steps 300
fi
