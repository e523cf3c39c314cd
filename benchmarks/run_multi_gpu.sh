#!/usr/bin/env bash
# Issue #12 on a machine with 2 GPUs: the NCCL tests, the data-parallel example and the
# data-parallel benchmark, each under torchrun --nproc_per_node 2. Run from the repository root
# with PYTHONPATH set up (see benchmarks/README.md); logs and results go to $OUT.
#   bash benchmarks/run_multi_gpu.sh
# (a CPU smoke run of the script itself: EXAMPLE_ARGS="--device cpu" BENCH_ARGS="--device cpu
#  --width 64 --layers 3 --steps 20 --methods ddp,gt_funcol" bash benchmarks/run_multi_gpu.sh;
#  the NCCL tests are skipped there)
# Expected time: about 3 minutes (the bench's torch.compile column compiles from cold caches).
set -u
OUT="${OUT:-/tmp/gt-multi-gpu}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
TR="python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
port=29600

# run NAME TIMEOUT CMD...: log to $OUT/NAME.log; note the exit status and the time from the last
# step (LAST_STEP_AT lines) to the exit of torchrun (every rank gone)
run() {
  local name=$1 limit=$2; shift 2
  port=$((port + 1))
  local t0 end rc last
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" $TR --master_port "$port" "$@" > "$OUT/$name.log" 2>&1 &
  wait $!; rc=$?
  end=$(date +%s.%N)
  last=$(grep -ho 'LAST_STEP_AT [0-9.]*' "$OUT/$name.log" | awk '{print $2}' | sort -n | tail -1)
  {
    echo "== $name: exit $rc ($( [ $rc -eq 124 ] && echo 'TIMED OUT' || echo ok)), $(python3 -c "print(f'{$end-$t0:.1f}')") s in all"
    if [ -n "$last" ]; then echo "   last step to exit of every rank: $(python3 -c "print(f'{$end-$last:.2f}')") s"; fi
  } >> "$SUMMARY"
}

run nccl_tests 150 -m pytest -q -s -rA -p no:cacheprovider -m nccl tests/test_distributed.py
grep -hE "passed|failed|skipped|error|max \|graphify|destroy_process_group took" "$OUT/nccl_tests.log" | sort | uniq | tail -30 >> "$SUMMARY"

GT_NCCL_MISMATCH=1 GTRANSFORM_COLLECTIVE_TIMEOUT=5 \
  run nccl_mismatch 90 -m pytest -q -s -rA -p no:cacheprovider -m nccl -k replay_against_recording tests/test_distributed.py
grep -hE "passed|failed|skipped|mismatch:|destroy_process_group took" "$OUT/nccl_mismatch.log" | sort | uniq | tail -10 >> "$SUMMARY"

run example_funcol 90 examples/data_parallel.py --steps 100 ${EXAMPLE_ARGS:-}
grep -hE "^rank|^OK" "$OUT/example_funcol.log" >> "$SUMMARY"
run example_c10d 90 examples/data_parallel.py --steps 100 --c10d ${EXAMPLE_ARGS:-}
grep -hE "^rank|^OK" "$OUT/example_c10d.log" >> "$SUMMARY"

run bench_ddp 180 benchmarks/bench_ddp.py --out "$OUT" ${BENCH_ARGS:-}
[ -f "$OUT/bench_ddp.md" ] && cat "$OUT/bench_ddp.md" >> "$SUMMARY"
grep -hE "destroy_process_group" "$OUT/bench_ddp.log" >> "$SUMMARY"

cat "$SUMMARY"
