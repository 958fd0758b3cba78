#!/bin/sh
# Everything issue 36 asks of a GPU, in one call from the checkout's root, each part bounded so that one
# slow part cannot take the others' figures with it (about 8 minutes at most): the figures
# (benchmarks/gpu/gpu_bench.py, its JSON written after every section), the no-host-sync test and the NCCL
# equivalence test, the host-work benchmark on the GPU and on the GPU machine's CPU.
# Results under $OUT (default bench-results/gpu).
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
timeout -k 10 ${GPU_BENCH_S:-330} python benchmarks/gpu/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log"
timeout -k 10 ${GPU_TESTS_S:-120} python -m pytest -q -s -p no:cacheprovider tests/ranks/test_ddp_host_sync.py \
    tests/ranks/test_ddp_gpu.py 2>&1 | tee "$OUT/tests.log"
timeout -k 5 ${GPU_OVERHEAD_S:-60} python -m phalanx.tools.bench --overhead --device cuda --rounds 200 \
    --out "$OUT/overhead_cuda.json" 2>&1 | tee "$OUT/overhead_cuda.log"
OMP_NUM_THREADS=1 timeout -k 5 ${CPU_OVERHEAD_S:-60} python -m phalanx.tools.bench --overhead --rounds 300 \
    --out "$OUT/overhead_cpu.json" 2>&1 | tee "$OUT/overhead_cpu.log"
