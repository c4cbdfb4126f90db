#!/usr/bin/env bash
# On the lent GPU machine: install Kiln without dependencies (the machine has torch and Triton), then the kernel
# correctness table (benchmarks/gpu_check.py --no-timing) and the runtime's CUDA tests (packed linears through
# kernels.gpu.packed_linear, the paged decode kernel). Writes its logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
# ../shared's stories260K and TinyStories texts, carried as .devshared (the tests look beside the checkout)
[ -d .devshared ] && mkdir -p ../shared && cp -r .devshared/* ../shared/
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "install failed"; tail -5 "$OUT/install.log"; }
python3 -c "import kiln.kernels, sys; print(\"kiln from\", kiln.kernels.__file__)" || { python3 -m pip --version; which -a python3 pip; }
timeout 200 python3 benchmarks/gpu_check.py --no-timing 2>&1 | tee "$OUT/gpu_check.log" | tail -45
python3 -c "import pytest, transformers" 2>/dev/null && \
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_device_runtime.py tests/runtime/test_packed_runtime.py 2>&1 \
    | tee "$OUT/pytest.log" | tail -15 || echo "pytest or transformers absent: runtime tests not run"
