#!/usr/bin/env bash
# A whole trn2.48xlarge without Kubernetes: N replicas, each pinned to its own NeuronCores, behind
# vllm-router (PyPI `vllm-router`, the vLLM project's Rust load balancer) on one port.
#
#   deploy/trn2/launch-instance.sh laplace-3b  /models/laplace-3b            # 64 engines x 1 core
#   deploy/trn2/launch-instance.sh mla-trinity /models/mla-trinity-packed    # 32 replicas x 2 cores
#   REPLICAS=4 deploy/trn2/launch-instance.sh laplace-3b /models/laplace-3b  # fewer, e.g. to try it
#   deploy/trn2/launch-instance.sh laplace-3b /models/laplace-3b --dry-run   # print the commands only
#
# Replica i listens on 127.0.0.1:$((BASE_PORT + i)) (8001, 8002, ...), the router on 0.0.0.0:$PORT
# (8000) and its Prometheus metrics on :29000; every replica's own /metrics stays on its port.
# Replica 0 starts first and compiles every bucket into VLLM_CACHE_ROOT; the others start
# when it is healthy and load the compiled graphs. Logs: $LOG_DIR/replica-<i>.log, router.log.
# NOT RUN HERE (no Trainium); the same router was tried with two CPU replicas: router_cpu_trial.py.
set -euo pipefail

model=${1:?usage: launch-instance.sh laplace-3b|mla-trinity CHECKPOINT [--dry-run]}
ckpt=${2:?checkpoint directory}
dry=0
[[ ${3:-} == --dry-run ]] && dry=1
here=$(cd "$(dirname "$0")" && pwd)

case $model in
laplace-3b) cores_per=1 default_replicas=64 ;;
mla-trinity) cores_per=2 default_replicas=32 ;;
*) echo "unknown model $model" >&2; exit 2 ;;
esac
replicas=${REPLICAS:-$default_replicas}
total_cores=${NEURON_CORES:-64}  # logical NeuronCores at LNC=2
if ((replicas * cores_per > total_cores)); then
    echo "$replicas replicas x $cores_per cores > $total_cores cores" >&2
    exit 2
fi
base=${BASE_PORT:-8000}
log_dir=${LOG_DIR:-/var/log/vllm-trn}
mkdir -p "$log_dir"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/var/cache/vllm-neuron/$model}

pids=()
cleanup() { ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

start_replica() {
    local i=$1 first=$(($1 * cores_per)) last=$(($1 * cores_per + cores_per - 1))
    local cores=$first
    ((last > first)) && cores=$first-$last
    local cmd=(env NEURON_RT_VISIBLE_CORES="$cores" PORT=$((base + 1 + i)) SERVED_NAME="$model"
        "$here/serve-replica.sh" "$model" "$ckpt" --host 127.0.0.1)
    if ((dry)); then echo "${cmd[*]}"; return; fi
    "${cmd[@]}" >"$log_dir/replica-$i.log" 2>&1 &
    pids+=($!)
}

wait_healthy() {
    local url=$1
    for _ in $(seq 3600); do
        curl -sf "$url/health" >/dev/null && return 0
        sleep 1
    done
    echo "$url did not become healthy" >&2
    return 1
}

start_replica 0
((dry)) || wait_healthy "http://127.0.0.1:$((base + 1))"
urls=("http://127.0.0.1:$((base + 1))")
for ((i = 1; i < replicas; i++)); do
    start_replica "$i"
    urls+=("http://127.0.0.1:$((base + 1 + i))")
done
if ! ((dry)); then
    for u in "${urls[@]:1}"; do wait_healthy "$u"; done
fi

# power_of_two: of two random replicas, the one with fewer requests in flight. Prefix caching is off,
# so cache-aware routing has nothing to exploit. Retries/circuit breaker: the router's defaults.
router=(vllm-router --host 0.0.0.0 --port "${PORT:-$base}" --worker-urls "${urls[@]}"
    --policy "${ROUTER_POLICY:-power_of_two}" --prometheus-host 0.0.0.0 --prometheus-port 29000
    --request-timeout-secs 3600)
if ((dry)); then echo "${router[*]}"; exit 0; fi
"${router[@]}" >"$log_dir/router.log" 2>&1 &
pids+=($!)
wait -n "${pids[@]}"
echo "a replica or the router exited; stopping the others (logs in $log_dir)" >&2
exit 1
