#!/usr/bin/env bash
# The device check behind docs/cuda-backend.md's measured figures, for a GPU machine lent
# briefly (one call). On the development machine, from the project's root:
#   bash ../shared/tools/gpu/bundle.sh          (packs this checkout's CUDA build into .gpu/)
#   cp <an older .gpu/bundle.tar.xz> .gpu/base.tar.xz    (optional: the baseline, run beside)
#   git log --oneline -1 > .gpu/commit          (the commit the log names: the machine's copy
#                                                of the tree may carry an older .git)
#   build-gpu/src/fitm mkmodel --arch gemma3 --type Q4_0 --layers 1 --dim 32 --heads 1 \
#     --head-dim 32 --ff 32 --tokenizer-from <the default model's file> -o .gpu/tokenizer.gguf
#                                               (optional, 11 MB: the default model's tokenizer,
#                                                which the generated models then carry, so that
#                                                /rerank's prompts have the default model's
#                                                lengths; the generated tokenizer spends 3.7
#                                                times the tokens on bench_rerank's documents)
# then on the GPU machine, from the root of a copy of the tree that carries .gpu/:
#   bash tests/gpu_check.sh                     (FITM_GPU_STEPS picks steps; log in $OUT)
# Steps, each under its own time limit:
#   tests   the meson `cuda` suite's executables on the device (a failing one again under
#           compute-sanitizer)
#   new     bench_forward -b cuda on a generated Gemma 3 270M shape, bf16 and f32 products
#   base    the same with the baseline bundle
#   depth   decode after a 4,096-token context of each sequence's own (1 and 8 sequences),
#           this build and the baseline
#   cpu     bench_forward -b cpu, 16 threads, on the same machine
#   rerank  tests/bench_cuda.py (prefill, decode and /rerank K = 20 against the device's limits;
#           the default model's profile's default request too, --profile)
#   ncu     every kernel's time (Nsight Compute, real clocks, caches kept) over a prompt, two
#           decode steps and a 32-sequence step (tests/ncu_summary.py)
#   steps   the same per call over 24 one-sequence decode steps from an empty cache
#   why     where the largest kernels' time goes (Nsight Compute sections: throughput, memory,
#           warp stall reasons, occupancy) for the prompt's GEMM and tiled attention, the
#           decode step's attention and matvecs, the LM head among them
#   l1b     a Llama 1B shape, this build and the baseline
# Never wait without PIDs here: a bare `wait` also waits for the log's tee and never returns.
set -u
D=$(pwd)/.gpu
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
L=/tmp/gpu-logs; rm -rf $L; mkdir -p $L
exec > >(tee "$OUT/gpu.log") 2>&1
T0=$(date +%s); step() { echo; echo "== [t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -c "import tarfile; tarfile.open('$D/bundle.tar.xz').extractall('/tmp/gpu')" || { echo "untar failed"; exit 1; }
mkdir -p /tmp/base && python3 -c "import tarfile; tarfile.open('$D/base.tar.xz').extractall('/tmp/base')" || echo "no baseline"
B=/tmp/gpu/bundle; BB=/tmp/base/bundle
CU=$(dirname "$(find /usr/local /usr/lib /opt -name 'libcublas.so.*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$B/lib:$CU:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
cat "$D/commit" 2>/dev/null || echo "commit: not recorded (.gpu/commit)"
missing=$(ldd $B/bin/fitmd | grep "not found"); [ -z "$missing" ] || { echo "libraries missing: $missing"; exit 1; }
mkdir -p /tmp/gb/src /tmp/gb/tests; ln -sf $B/bin/fitmd /tmp/gb/src/fitmd; ln -sf $B/bin/bench_forward /tmp/gb/tests/bench_forward
# Gemma 3 270M's shape (V 262,144 either way): its tokenizer when .gpu/ carries it
TOKF="--vocab-extra 261032"; [ -f "$D/tokenizer.gguf" ] && TOKF="--tokenizer-from $D/tokenizer.gguf"
echo "generated models' tokenizer: $TOKF"
$B/bin/fitm mkmodel --arch gemma3 -o /tmp/g270.gguf --type Q5_0 --layers 18 --dim 640 --heads 4 \
  --kv-heads 1 --head-dim 256 --ff 2048 --swa 512 --ctx 8192 $TOKF -q
($B/bin/fitm mkmodel --arch llama -o /tmp/l1b.gguf --type Q4_K --layers 16 --dim 2048 --heads 32 \
  --kv-heads 8 --ff 8192 --ctx 8192 --vocab-extra 127000 -q > $L/models.log 2>&1) & MP=$!
BF=$B/bin/bench_forward; G=/tmp/g270.gguf
N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
STEPS=${FITM_GPU_STEPS:-tests new base depth cpu rerank ncu steps l1b}
for s in $STEPS; do case $s in
tests)
  step "cuda suite on the device"
  pids=()
  while IFS=$'\t' read -r exe args; do
    (cd /tmp && timeout 120 $B/bin/$exe $args > $L/$exe.log 2>&1; echo "$exe exit $?" > $L/$exe.rc) &
    pids+=($!)
  done < $B/cuda-tests.tsv
  for p in "${pids[@]}"; do wait $p; done
  for f in $L/*.rc; do cat $f; t=$(basename $f .rc); grep -E "FAIL|failed|error|mismatch|differ" $L/$t.log | head -8; tail -2 $L/$t.log; done
  for f in $L/*.rc; do read -r exe _ rc < $f; if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then
    step "compute-sanitizer on $exe"
    (cd /tmp && timeout 60 compute-sanitizer --tool memcheck --print-limit 10 $B/bin/$exe > $L/$exe.san 2>&1); tail -30 $L/$exe.san; fi; done
  ;;
new)
  step "bench_forward cuda bf16 (this commit)"
  timeout 60 $BF -m $G -b cuda -p 512 -n 128 -r 3 -B 8 -B 32 2>&1 | tee $L/bench_new.log
  step "bench_forward cuda f32 (this commit)"
  timeout 40 $BF -m $G -b cuda -p 512 -n 128 -r 2 -B 32 --gpu-weights f32 2>&1 | head -8 ;;
base)
  step "bench_forward cuda bf16 (baseline bundle)"
  [ -x $BB/bin/bench_forward ] && LD_LIBRARY_PATH=$BB/lib:$CU timeout 60 $BB/bin/bench_forward -m $G -b cuda -p 512 -n 128 -r 3 -B 8 -B 32 2>&1 | head -9 ;;
depth)
  step "decode at depth 4096 (this commit, then the baseline bundle)"
  timeout 60 $BF -m $G -b cuda -p 64 -n 64 -r 2 -c 4096 -B 1 -B 8 2>&1 | grep -E "ctx|rror"
  [ -x $BB/bin/bench_forward ] && LD_LIBRARY_PATH=$BB/lib:$CU timeout 60 $BB/bin/bench_forward -m $G -b cuda -p 64 -n 64 -r 2 -c 4096 -B 1 -B 8 2>&1 | grep -E "ctx|rror" ;;
cpu)
  step "bench_forward cpu, 16 threads"
  timeout 60 $BF -m $G -b cpu -t 16 -p 512 -n 128 -r 1 -B 8 -B 32 2>&1 | head -9 ;;
rerank)
  step "bench_cuda.py"
  PYTHONUNBUFFERED=1 timeout 170 python3 tests/bench_cuda.py --model $G --build /tmp/gb --reps 2 --repeat 3 \
    --profile config/profiles/gemma3-270m-q4km.profile 2>&1 | grep -v "^|" ;;
ncu)
  step "kernel times (ncu, real clocks, caches not flushed)"
  [ -n "$N" ] || { echo "no ncu"; continue; }
  (cd /tmp && timeout 60 $N --csv --print-units base --metrics gpu__time_duration.sum --clock-control none \
     --cache-control none --launch-count 1400 --log-file $L/ncu.csv \
     $BF -m $G -b cuda -p 512 -n 2 -r 1 -B 32 > $L/ncu.out 2> $L/ncu.err); echo "ncu rc $?"; tail -2 $L/ncu.err
  cp $L/ncu.csv $OUT/ncu.csv
  python3 tests/ncu_summary.py $L/ncu.csv ;;
steps)
  step "kernel times of decode steps from an empty cache (ncu, real clocks, caches not flushed)"
  [ -n "$N" ] || { echo "no ncu"; continue; }
  (cd /tmp && timeout 75 $N --csv --print-units base --metrics gpu__time_duration.sum --clock-control none \
     --cache-control none --launch-count 4700 --log-file $L/steps.csv \
     $BF -m $G -b cuda -p 1 -n 24 -r 1 > $L/steps.out 2> $L/steps.err); echo "ncu rc $?"; tail -2 $L/steps.err
  cp $L/steps.csv $OUT/steps.csv
  python3 tests/ncu_summary.py --steps $L/steps.csv ;;
why)
  step "why the largest kernels take their time (ncu sections, real clocks, caches not flushed)"
  [ -n "$N" ] || { echo "no ncu"; continue; }
  (cd /tmp && timeout 120 $N --clock-control none --cache-control none --section SpeedOfLight \
     --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
     --kernel-name-base function --kernel-name regex:'fitm_(gemm_bf16_tiles|attention_bf16_tiles|attention_tiles|attention_rows_many|matvec_rows|matvec_rows3)' \
     --launch-count 24 $BF -m $G -b cuda -p 512 -n 2 -r 1 > $L/why.txt 2> $L/why.err); echo "ncu rc $?"; tail -2 $L/why.err
  cp $L/why.txt $OUT/why.txt
  grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Grid Size|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|stalled|One or More Eligible" $L/why.txt | head -240 ;;
l1b)
  step "Llama 1B shape"
  wait $MP; cat $L/models.log
  timeout 45 $BF -m /tmp/l1b.gguf -b cuda -p 512 -n 128 -r 2 -B 8 2>&1 | head -8
  [ -x $BB/bin/bench_forward ] && LD_LIBRARY_PATH=$BB/lib:$CU timeout 40 $BB/bin/bench_forward -m /tmp/l1b.gguf -b cuda -p 512 -n 128 -r 2 -B 8 2>&1 | head -8 ;;
esac; done
kill $MP 2>/dev/null
step "done"
tar -czf "$OUT/logs.tgz" -C /tmp gpu-logs
