#!/bin/sh
# Everything issue 36 asks of a GPU, in one call from the checkout's root (about 5 minutes on an H100,
# estimated): the figures (benchmarks/gpu_bench.py), the no-host-sync test and the NCCL equivalence test,
# and the host-work benchmark on the GPU's host. Results under $OUT (default bench-results/gpu).
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
python benchmarks/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log"
python -m pytest -q -s -p no:cacheprovider tests/ranks/test_ddp_host_sync.py tests/ranks/test_ddp_gpu.py \
    2>&1 | tee "$OUT/tests.log"
python -m phalanx.tools.bench --overhead --device cuda --rounds 200 --out "$OUT/overhead_cuda.json" \
    2>&1 | tee "$OUT/overhead_cuda.log"
