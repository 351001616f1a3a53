#!/usr/bin/env bash
# The hybrid path on a GPU, in one device call: `kvconnector run --device cuda`
# with cpu_offload on the gpt-oss-20b (full + sliding-window groups) and Llama-3-8B presets,
# each against its no-connector baseline, then the CUDA tests of the offload connector.
#
# Run from the repository root on the GPU machine, with the wheels of msgspec, pluggy,
# tqdm, pytest (and its needs), hypothesis and kvconnector itself in .whl/ (the machine
# has torch but not these; see /work/.library/device/README.md). Writes to $OUT.
set -u
OUT=${OUT:-/tmp/kvc-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
for model in gpt-oss-20b llama-3-8b; do
    timeout 65 python3 -c "import sys; from kvconnector_core.cli import main; sys.exit(main(sys.argv[1:]))" \
        run --device cuda --model "$model" --workload documents \
        > "$OUT/run_$model.txt" 2> "$OUT/run_$model.err"
    echo "exit status $?" >> "$OUT/run_$model.txt"
    cat "$OUT/run_$model.txt"
done
timeout 85 python3 -m pytest -q -p no:cacheprovider -m cuda \
    tests/connectors/offload/test_offload_transfer.py \
    tests/connectors/offload/test_offload_connector.py tests/core/test_model.py 2>&1 \
    | tee "$OUT/pytest_cuda.txt"
