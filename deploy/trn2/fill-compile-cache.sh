#!/usr/bin/env bash
# Compile a model's graphs once into the shared compile cache, COMPILE_CACHE_ROOT/<key> (the key: serve-replica.sh
# --cache-key, <image>/<model>/<buckets>). The cache's only writer: the Kubernetes compile Job (k8s/compile-cache.yaml)
# and launch-instance.sh run it; serving replicas only read what it wrote.
#
#   COMPILE_CACHE_ROOT=/var/cache/vllm-neuron deploy/trn2/fill-compile-cache.sh laplace-3b /models/laplace-3b
#
# Extra arguments go to the replica's `vllm serve` (and into the key): give exactly those the serving replicas get.
# It starts the replica's own server (serve-replica.sh, the same command line, so the same graphs) on
# 127.0.0.1:$FILL_PORT (8000) with VLLM_CACHE_ROOT a fresh temporary directory beside the final one. vLLM Neuron
# compiles every bucket before /health answers; the server is then stopped and the directory renamed into place: one
# rename(2), so no replica ever sees a half-written cache, and of two fills racing the first rename wins and the other
# drops its copy. Already there: nothing to do. A server that dies or never becomes healthy (HEALTH_TIMEOUT, 3600 s)
# fails the fill at once with its last log lines, and leaves nothing behind. Its log: $LOG_FILE (a temporary file).
# NOT RUN HERE on Trainium (none on these machines); tests/test_deploy_security.py runs it with a fake replica.
set -euo pipefail

model=${1:?usage: fill-compile-cache.sh laplace-3b|mla-trinity CHECKPOINT [vllm serve args...]}
ckpt=${2:?checkpoint directory}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=health.sh
source "$here/health.sh"
root=${COMPILE_CACHE_ROOT:?set COMPILE_CACHE_ROOT, the compile cache directory}
port=${FILL_PORT:-8000}

key=$("$here/serve-replica.sh" "$model" "$ckpt" "$@" --cache-key)
final=$root/$key
if [[ -d $final ]]; then
    echo "compiled graphs already in place: $final"
    exit 0
fi
mkdir -p "$(dirname "$final")"
tmp=$(mktemp -d "$final.filling.XXXXXX") # beside the final directory: the same filesystem, so the rename is atomic
chmod 0755 "$tmp"
log=${LOG_FILE:-$(mktemp "${TMPDIR:-/tmp}/fill-$model.XXXXXX.log")}
server=""
placed=0
cleanup() {
    if [[ -n $server ]]; then
        kill "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    if ((!placed)); then rm -rf -- "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT

echo "compiling $model (key $key) into $tmp; log: $log"
start=$SECONDS
# COMPILE_CACHE_ROOT unset for the server: it compiles into its VLLM_CACHE_ROOT instead of reading the cache.
env -u COMPILE_CACHE_ROOT -u REQUIRE_COMPILE_CACHE VLLM_CACHE_ROOT="$tmp" PORT="$port" \
    "$here/serve-replica.sh" "$model" "$ckpt" --host 127.0.0.1 "$@" >"$log" 2>&1 &
server=$!
wait_healthy "http://127.0.0.1:$port" "$server" "$log"
# Compiled. Stop the server (SIGTERM: nothing in flight, it exits at once) and wait, so nothing writes into $tmp after.
kill -TERM "$server"
wait "$server" || true
server=""
if mv -T -- "$tmp" "$final" 2>/dev/null; then
    placed=1
    echo "compiled graphs in place after $((SECONDS - start)) s: $final"
elif [[ -d $final ]]; then
    echo "another fill put $final in place meanwhile; keeping it and dropping this copy"
else
    echo "could not rename $tmp to $final" >&2
    exit 1
fi
