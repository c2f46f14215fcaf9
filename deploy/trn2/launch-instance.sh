#!/usr/bin/env bash
# A whole trn2.48xlarge without Kubernetes: N replicas, each pinned to its own NeuronCores, behind
# vllm-router (PyPI `vllm-router`, the vLLM project's Rust load balancer) on one port.
#
#   deploy/trn2/launch-instance.sh laplace-3b  /models/laplace-3b            # 64 engines x 1 core
#   deploy/trn2/launch-instance.sh mla-trinity /models/mla-trinity-packed    # 32 replicas x 2 cores
#   REPLICAS=4 deploy/trn2/launch-instance.sh laplace-3b /models/laplace-3b  # fewer, e.g. to try it
#   deploy/trn2/launch-instance.sh laplace-3b /models/laplace-3b --dry-run   # print the commands only
#
# Replica i listens on 127.0.0.1:$((BASE_PORT + 1 + i)) (8001, 8002, ...), the router on 0.0.0.0:$PORT (8000) and its
# Prometheus metrics on 127.0.0.1:29000 (METRICS_HOST to publish them); every replica's own /metrics stays on its port.
# The replicas require VLLM_API_KEY (clients send `Authorization: Bearer $VLLM_API_KEY`; the router passes it through);
# it is read from the environment, never put on a command line. Unset, the script refuses to start
# (ALLOW_NO_API_KEY=1 to serve without one).
# Compiled graphs: fill-compile-cache.sh compiles every bucket once into $COMPILE_CACHE_ROOT/<key> (the key: image,
# model, buckets; skipped when there), then every replica starts from it read-only, each with its own writable
# VLLM_CACHE_ROOT (a temporary directory). A replica that exits while the others wait for health stops the launch at
# once, with its last log lines. Logs: $LOG_DIR/replica-<i>.log, compile.log, router.log.
# NOT RUN HERE (no Trainium); the same router was tried with two CPU replicas: router_cpu_trial.py.
set -euo pipefail

model=${1:?usage: launch-instance.sh laplace-3b|mla-trinity CHECKPOINT [--dry-run]}
ckpt=${2:?checkpoint directory}
dry=0
[[ ${3:-} == --dry-run ]] && dry=1
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=health.sh
source "$here/health.sh"

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
if ((!dry)) && [[ -z ${VLLM_API_KEY:-} ]] && ((!${ALLOW_NO_API_KEY:-0})); then
    echo "VLLM_API_KEY is not set: the replicas would answer anyone without a key." \
        "Set it (e.g. export VLLM_API_KEY=\$(openssl rand -hex 32)), or ALLOW_NO_API_KEY=1 to serve without one." >&2
    exit 2
fi
base=${BASE_PORT:-8000}
log_dir=${LOG_DIR:-/var/log/vllm-trn}
mkdir -p "$log_dir"
export COMPILE_CACHE_ROOT=${COMPILE_CACHE_ROOT:-/var/cache/vllm-neuron}

pids=()
replica_pids=()
run_dir=RUN_DIR # each replica's writable VLLM_CACHE_ROOT goes under it (a fresh temporary directory when not dry)
((dry)) || run_dir=$(mktemp -d "${TMPDIR:-/tmp}/vllm-trn-$model.XXXXXX")
cleanup() {
    if ((${#pids[@]})); then kill "${pids[@]}" 2>/dev/null || true; fi
    if ((!dry)); then rm -rf -- "$run_dir"; fi
}
trap cleanup EXIT INT TERM

cores_of() {
    local first=$(($1 * cores_per)) last=$(($1 * cores_per + cores_per - 1))
    if ((last > first)); then echo "$first-$last"; else echo "$first"; fi
}

# The compiled graphs, once, on replica 0's cores and port (free until the replicas start).
fill_env=(NEURON_RT_VISIBLE_CORES="$(cores_of 0)" FILL_PORT=$((base + 1)) LOG_FILE="$log_dir/compile.log")
if ((dry)); then
    echo "${fill_env[*]} $here/fill-compile-cache.sh $model $ckpt"
else
    (export "${fill_env[@]}" && exec "$here/fill-compile-cache.sh" "$model" "$ckpt")
fi

start_replica() {
    local i=$1
    local cmd=(env NEURON_RT_VISIBLE_CORES="$(cores_of "$i")" PORT=$((base + 1 + i)) SERVED_NAME="$model"
        REQUIRE_COMPILE_CACHE=1 VLLM_CACHE_ROOT="$run_dir/replica-$i"
        "$here/serve-replica.sh" "$model" "$ckpt" --host 127.0.0.1)
    if ((dry)); then echo "${cmd[*]}"; return; fi
    "${cmd[@]}" >"$log_dir/replica-$i.log" 2>&1 &
    pids+=($!)
    replica_pids[i]=$!
}

urls=()
for ((i = 0; i < replicas; i++)); do
    start_replica "$i"
    urls+=("http://127.0.0.1:$((base + 1 + i))")
done
if ((!dry)); then
    for ((i = 0; i < replicas; i++)); do
        wait_healthy "${urls[i]}" "${replica_pids[i]}" "$log_dir/replica-$i.log" || exit 1
    done
fi

# power_of_two: of two random replicas, the one with fewer requests in flight. Prefix caching is off (the Neuron
# adapter serves Laplace without it), so no replica holds a conversation's history. Replicas that cache prefixes want
# ROUTER_POLICY=consistent_hash: one replica per OpenAI `user` / X-Session-Id (deploy/bench_laplace_routing.py:
# 82% of a chat's prompt tokens cached against 68-70%, TTFT 1.35-1.57x lower, on two CPU replicas).
# Retries/circuit breaker: the router's defaults.
router=(vllm-router --host "${ROUTER_HOST:-0.0.0.0}" --port "${PORT:-$base}" --worker-urls "${urls[@]}"
    --policy "${ROUTER_POLICY:-power_of_two}" --prometheus-host "${METRICS_HOST:-127.0.0.1}" --prometheus-port 29000
    --request-timeout-secs 3600)
if ((dry)); then echo "${router[*]}"; exit 0; fi
"${router[@]}" >"$log_dir/router.log" 2>&1 &
pids+=($!)
wait -n "${pids[@]}"
echo "a replica or the router exited; stopping the others (logs in $log_dir)" >&2
exit 1
