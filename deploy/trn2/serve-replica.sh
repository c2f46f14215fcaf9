#!/usr/bin/env bash
# One vLLM engine (one replica) of MLA-Trinity or Laplace 3B on trn2.48xlarge, through vllm-neuron.
#
#   deploy/trn2/serve-replica.sh laplace-3b  /models/laplace-3b          # port $PORT (default 8000)
#   deploy/trn2/serve-replica.sh mla-trinity /models/mla-trinity-packed
#   deploy/trn2/serve-replica.sh laplace-3b /models/laplace-3b --print   # print the command, run nothing
#   deploy/trn2/serve-replica.sh laplace-3b /models/laplace-3b --cache-key   # print its compile-cache key, run nothing
#
# NOT RUN HERE: these machines have no Trainium and vllm-neuron only installs from AWS's Neuron
# repository; the arguments are checked against the installed vLLM's `vllm serve` parser by
# tests/test_bench.py (flag names and values, not behaviour). Figures and assumptions:
# docs/serving-trn2.md. Which cores the engine uses is the caller's business: the Neuron runtime reads
# NEURON_RT_VISIBLE_CORES (set by launch-instance.sh, or by the Neuron device plugin in Kubernetes).
#
# Per instance (16 Trainium2 chips = 64 logical NeuronCores of 24 GiB at LNC=2):
#   laplace-3b : 64 engines x 1 core, 20 sequences each (source: 1,280 sequences, 11,544 output tok/s)
#   mla-trinity: 32 replicas x 2 cores (tensor parallel 2), packed MXFP4 checkpoint expanded to FP8
# Extra arguments after the checkpoint are passed to `vllm serve` unchanged (they override these).
#
# Compiled graphs (docs/serving-trn2.md, "Security"): with COMPILE_CACHE_ROOT set, the replica reads the graphs compiled
# for it from COMPILE_CACHE_ROOT/<key> (--cache-key below; filled by fill-compile-cache.sh, the only writer) and never
# writes there: they are linked into the replica's own VLLM_CACHE_ROOT (default ~/.cache/vllm). Absent, it compiles
# them itself into VLLM_CACHE_ROOT, or with REQUIRE_COMPILE_CACHE=1 stops at once (the Kubernetes engines do).
set -euo pipefail

model=${1:?usage: serve-replica.sh laplace-3b|mla-trinity CHECKPOINT [vllm serve args...] [--print|--cache-key]}
ckpt=${2:?checkpoint directory}
shift 2
print=0
print_key=0
extra=()
for a in "$@"; do
    case $a in
    --print) print=1 ;;
    --cache-key) print_key=1 ;;
    *) extra+=("$a") ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd)

common=(
    --host 0.0.0.0 --port "${PORT:-8000}"
    --dtype bfloat16
    # Every request pays its full prefill: what the source figures measure. Laplace's prefix caching (state
    # checkpoints, what chat and agent traffic wants: docs/models.md "Prefix caching") runs on the vLLM path;
    # the Beta contract adapter keeps one state page per sequence and refuses it.
    --no-enable-prefix-caching
    --served-model-name "${SERVED_NAME:-$model}"
    # SIGTERM (a rolling update, a scale-down) drains: the requests in flight finish, for up to this many seconds,
    # then the server exits; a request arriving meanwhile gets an error (vLLM stops taking input at once), so the
    # router must stop sending first (the pods' preStop). Keep terminationGracePeriodSeconds above it.
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-300}"
)
# Tool calling (tools / tool_choice in chat requests): the parser of the tool-call format the checkpoint's chat
# template asks for, e.g. TOOL_CALL_PARSER=hermes for the demo checkpoints' template. Off unless set.
if [[ -n ${TOOL_CALL_PARSER:-} ]]; then
    common+=(--enable-auto-tool-choice --tool-call-parser "$TOOL_CALL_PARSER")
fi

case $model in
laplace-3b)
    # Attention-free: no KV cache, a fixed 28.75 MB fp32 state page per sequence, so no FP8 KV cache and
    # no context-length buckets (a decode step is O(1) in context). 20 sequences per core as in the
    # source; decode widths padded to a fixed set compiled at warm-up (each new width costs ~11 s on
    # first use otherwise). A 2,048-token budget below max_model_len turns on the runner's segmented prefill: every
    # prefill step is one 2,048-token segment, and the token buckets must be exactly that (the runner refuses
    # others; vllm_trn_plugin/neuron/contract.py check_buckets says so at start).
    args=(
        --tensor-parallel-size 1
        --max-model-len 8448
        --max-num-seqs 20
        --max-num-batched-tokens 2048
        --num-gpu-blocks-override 24
        --additional-config '{"neuron_config": {"num_seqs_buckets": [1, 2, 4, 8, 16, 20], "num_batched_tokens_buckets": [2048]}}'
    )
    ;;
mla-trinity)
    # 2 logical cores (the compressed model fits in 2 x 24 GiB; 32 replicas per instance). Decode walks
    # the latent cache over a loop fixed per context bucket: 2,304 / 4,352 / 8,448 / 16,640 tokens
    # (prompts of 2k/4k/8k/16k plus 256 output tokens); the last is max_model_len itself. Prefill in 2,048-token
    # segments as above. The latent and the sliding-window layers in bf16: vLLM Neuron allocates every layer's cache
    # in the --kv-cache-dtype, and the adapter keeps the sliding layers in the model dtype, so it refuses both
    # --kv-cache-dtype fp8 and an FP8 latent (docs/trainium.md, "What is not served").
    args=(
        --tensor-parallel-size 2
        --max-model-len 16640
        --max-num-seqs 8
        --max-num-batched-tokens 2048
        --additional-config '{"neuron_config": {"num_seqs_buckets": [1, 2, 4, 8], "num_batched_tokens_buckets": [2048], "decode_context_length_buckets": [2304, 4352, 8448]}}'
    )
    ;;
*)
    echo "unknown model $model (laplace-3b or mla-trinity)" >&2
    exit 2
    ;;
esac

cmd=(vllm serve "$ckpt" "${common[@]}" "${args[@]}" "${extra[@]}")
if ((print)); then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
# The native compile route (the default since SDK 2.33) with torch's precompile cache on: vLLM Neuron turns the cache
# on only when the backend is named (unset, it compiles natively with the cache off). Compiled graphs and NEFFs live
# under VLLM_CACHE_ROOT.
export VLLM_NEURON_BACKEND=${VLLM_NEURON_BACKEND:-neuron_native}
# The LNC degree neuronx-cc compiles for and the plugin's NKI kernels launch at (Trn2's default, said explicitly: a
# kernel of another degree is refused, NCC_EVRF066).
export NEURON_LOGICAL_NC_CONFIG=${NEURON_LOGICAL_NC_CONFIG:-2}

# The compile cache's key, defined here and only here: <image>/<model>/<buckets>, each part what the graphs depend on.
#   <image>   : a hash of every installed distribution's name and version (vLLM, vllm-neuron, torch-neuronx, neuronx-cc,
#               ...) and of this plugin's source (its version does not move with the code); the same image always gives
#               the same value, a rebuilt one with other contents another (a re-pushed tag cannot reuse old graphs);
#   <model>   : laplace-3b | mla-trinity;
#   <buckets> : a hash of this `vllm serve` command line (buckets, shapes, TP, dtype, ...) less what compiles nothing
#               (--host, --port, --served-model-name, --shutdown-timeout, tool calling) and less the checkpoint path,
#               with the checkpoint's config.json and the compile environment (LNC degree, backend, NEURON_CC_FLAGS).
# An argument this does not know about goes into the hash: at worst a needless recompile, never a wrong graph.
image_hash() {
    {
        cd / || exit 1 # not the working directory's own metadata (an in-tree build's egg-info): the installed ones
        python3 - <<'PY' || exit 1
import importlib.metadata as m
print("\n".join(sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in m.distributions()})))
PY
        cd "$here/../.." || exit 1
        find vllm_trn_plugin model_executors kernels loaders -type f -name '*.py' -print0 | LC_ALL=C sort -z |
            xargs -0 -r sha256sum || exit 1
    } | sha256sum | cut -c1-16
}
buckets_hash() {
    local a skip=0 kept=()
    for a in "${cmd[@]:3}"; do  # past `vllm serve CHECKPOINT`
        if ((skip)); then skip=0; continue; fi
        case $a in
        --host | --port | --served-model-name | --shutdown-timeout | --tool-call-parser) skip=1 ;;
        --host=* | --port=* | --served-model-name=* | --shutdown-timeout=* | --tool-call-parser=*) ;;
        --enable-auto-tool-choice) ;;
        *) kept+=("$a") ;;
        esac
    done
    {
        printf '%s\n' "${kept[@]}"
        echo "NEURON_LOGICAL_NC_CONFIG=$NEURON_LOGICAL_NC_CONFIG VLLM_NEURON_BACKEND=$VLLM_NEURON_BACKEND"
        echo "NEURON_CC_FLAGS=${NEURON_CC_FLAGS:-}"
        if [[ -f $ckpt/config.json ]]; then cat "$ckpt/config.json"; fi
    } | sha256sum | cut -c1-16
}
cache_key() {
    local image buckets
    image=$(image_hash) && buckets=$(buckets_hash) || return 1
    echo "$image/$model/$buckets"
}
if ((print_key)); then
    cache_key
    exit 0
fi

export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
if [[ -n ${COMPILE_CACHE_ROOT:-} ]]; then
    key=$(cache_key)
    compiled=$COMPILE_CACHE_ROOT/$key
    if [[ -d $compiled ]]; then
        compiled=$(cd "$compiled" && pwd)
        # The shared graphs stay read-only (a read-only mount in Kubernetes). This replica's VLLM_CACHE_ROOT gets real,
        # writable directories and links to the shared files: what vLLM writes (its model-info cache, lock files) stays
        # in the replica, and nothing a replica does reaches the graphs every other replica loads.
        mkdir -p "$VLLM_CACHE_ROOT"
        cp -rs --remove-destination "$compiled/." "$VLLM_CACHE_ROOT/"
        find "$VLLM_CACHE_ROOT" -type d -exec chmod u+w {} +
        echo "compiled graphs: $compiled, linked into $VLLM_CACHE_ROOT" >&2
    elif ((${REQUIRE_COMPILE_CACHE:-0})); then
        echo "no compiled graphs at $compiled (key $key): fill the cache first with this image, model and arguments" \
            "(the compile Job of k8s/compile-cache.yaml, or fill-compile-cache.sh)" >&2
        exit 3
    else
        echo "no compiled graphs at $compiled (key $key): this replica compiles them itself, into $VLLM_CACHE_ROOT" >&2
    fi
fi
exec "${cmd[@]}"
