#!/usr/bin/env bash
# The block mover on a GPU, in one device call: this checkout's mover against main's,
# side by side in the same processes.
#
# Run from this checkout's root on the GPU machine, with main's checkout at $BASE
# (default ../base) and the wheels of pytest (and its needs), msgspec and hypothesis in
# $WHEELS (default ../.whl; the machine has torch but not these). Stages, as arguments
# (default: all): tests transfer issue limits interference methods, and roundrobin (one-way
# transfers of several movers round robin, each beside the contiguous copy; $RR_VARIANTS,
# $ROUNDS, $RR_ARGS, and $TL_VARIANTS for --timeline). $METHODS (transfer variants) and $VARIANTS (interference variants besides branch
# and main) override the defaults.
# Writes to $OUT.
set -u
OUT=${OUT:-/tmp/kvc-gpu-out}
BASE=${BASE:-../base}
WHEELS=${WHEELS:-../.whl}
STAGES=${*:-tests transfer issue limits interference methods}
REPS=${REPS:-15}
STEPS=${STEPS:-160}
TRIALS=${TRIALS:-8}
IFS=';' read -r -a METHODS_LIST <<< "${METHODS:-auto;auto, per-job buffers;gather;batched}"
IFS=';' read -r -a VARIANTS_LIST <<< "${VARIANTS:-per-job buffers}"
IFS=';' read -r -a RR_LIST <<< "${RR_VARIANTS:-auto;auto, third-stage staging}"
IFS=';' read -r -a TL_LIST <<< "${TL_VARIANTS:-auto;auto, third-stage staging}"
ROUNDS=${ROUNDS:-40}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:.:benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
for stage in $STAGES; do
    echo "=== $stage $(date -u +%T)"
    case $stage in
    tests)
        T=tests/connectors/offload
        timeout 240 python3 -m pytest -q -p no:cacheprovider -x $T/test_offload_transfer.py \
            $T/test_offload_staged.py $T/test_transfer_reuse.py \
            tests/connector_api/test_transfer_stats.py \
            $T/test_offload_connector.py $T/test_transfer_failures.py \
            $T/test_offload_store_fence.py $T/test_offload_hybrid.py $T/test_offload_recency.py \
            2>&1 | tail -15 | tee "$OUT/pytest_cuda.txt" ;;
    transfer|transfer2)
        timeout 300 python3 benchmarks/bench_transfer.py --reps "$REPS" --baseline-root "$BASE" \
            --methods "${METHODS_LIST[@]}" --json "/tmp/$stage.json" > "$OUT/$stage.log" 2>&1
        grep -v '^{' "$OUT/$stage.log" ;;
    methods)
        timeout 300 python3 benchmarks/bench_interference.py --steps 96 --trials 3 \
            --methods auto batched gather "auto, inline issue" --json /tmp/methods.json > "$OUT/methods.log" 2>&1
        grep -v '^{' "$OUT/methods.log" | tail -16 ;;
    roundrobin)
        # shellcheck disable=SC2086 # RR_ARGS: extra options, split on purpose
        timeout 420 python3 benchmarks/probes/probe_roundrobin.py --kernels --baseline-root "$BASE" \
            --rounds "$ROUNDS" --variants "${RR_LIST[@]}" --timeline-variants "${TL_LIST[@]}" \
            ${RR_ARGS:-} > "$OUT/roundrobin.log" 2>&1
        grep -v '^{' "$OUT/roundrobin.log"; grep '"kernel"\|"timeline"' "$OUT/roundrobin.log" ;;
    issue)
        timeout 200 python3 benchmarks/probes/probe_issue_path.py > "$OUT/issue.log" 2>&1
        tail -9 "$OUT/issue.log" ;;
    limits)
        timeout 200 python3 benchmarks/probes/probe_transfer_limits.py --bisect > "$OUT/limits.log" 2>&1
        grep -v '^{' "$OUT/limits.log" | tail -20 ;;
    interference)
        timeout 400 python3 benchmarks/probes/probe_interference_ab.py --baseline-root "$BASE" \
            --variants "${VARIANTS_LIST[@]}" --steps "$STEPS" --trials "$TRIALS" > "$OUT/interference.log" 2>&1
        grep -v '^{' "$OUT/interference.log" | tail -12 ;;
    esac
done
