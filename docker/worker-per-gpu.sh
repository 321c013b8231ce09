#!/bin/sh
# One `sweeps worker SPEC [ARGS...]` per GPU of this host, each pinned to its GPU with
# CUDA_VISIBLE_DEVICES, so a host with N GPUs runs N trials at once. (`sweeps worker` runs one
# trial at a time on the first GPU it sees; a container given every GPU would otherwise use one.)
# The GPU count is what torch sees, or SWEEPS_GPU_COUNT when set. Exits with the first non-zero
# exit code of its workers (0 when all end well); SIGTERM/SIGINT are passed on to every worker.
# Usage: sh docker/worker-per-gpu.sh studies/lr_bs_cluster.yaml --wait 900
set -u
if [ "$#" -lt 1 ]; then
    echo "usage: $0 SPEC [sweeps worker options...]" >&2
    exit 2
fi
count="${SWEEPS_GPU_COUNT:-}"
if [ -z "$count" ]; then
    count=$(python -c "import torch; print(torch.cuda.device_count())") || exit 2
fi
case "$count" in
    ''|*[!0-9]*) echo "$0: SWEEPS_GPU_COUNT=$count is not a whole number of GPUs" >&2; exit 2 ;;
esac
if [ "$count" -eq 0 ]; then
    echo "$0: no GPU visible: give the container GPUs (NVIDIA Container Toolkit), or run" \
         "one 'sweeps worker $1' without this script for a CPU worker" >&2
    exit 2
fi
pids=""
i=0
while [ "$i" -lt "$count" ]; do
    CUDA_VISIBLE_DEVICES="$i" sweeps worker "$@" &
    pids="$pids $!"
    echo "$0: sweeps worker on GPU $i (pid $!)"
    i=$((i + 1))
done
trap 'kill -TERM $pids 2>/dev/null' TERM INT
status=0
for pid in $pids; do
    wait "$pid"
    code=$?
    # wait returns >128 when a trapped signal interrupted it: wait for that worker again.
    while [ "$code" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do
        wait "$pid"
        code=$?
    done
    if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$code
    fi
done
exit "$status"
