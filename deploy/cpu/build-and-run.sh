#!/usr/bin/env bash
# Builds the CPU development image (deploy/cpu/Dockerfile), runs its default command (`make serve`:
# the demo Laplace checkpoint on :8000), checks that /health answers 200 and that /v1/completions
# returns the tokens asked for, then removes the container. Exits non-zero on any failure.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: deploy/cpu/build-and-run.sh [options]

  --engine podman|docker  container engine (default: podman if installed, else docker)
  --base IMAGE            base image (default python:3.11-slim-bookworm; any Debian bookworm image)
  --debootstrap           base = a Debian bookworm rootfs made by debootstrap from the apt mirror
                          ($DEBIAN_MIRROR, default http://deb.debian.org/debian), imported once as
                          localhost/vllm-trn-base:bookworm (podman, root); for hosts without a registry
  --tag TAG               image name (default localhost/vllm-trn:cpu)
  --skip-build            run an image already built as TAG
  --wheels DIR            podman: directory of wheels pip may use during the build (e.g. torch
                          2.13.0+cpu where download.pytorch.org is unreachable); implies --torch-index ''
  --torch-index URL       where torch 2.13.0+cpu comes from (default https://download.pytorch.org/whl/cpu;
                          '' for none)
  --ca-bundle FILE        podman: CA bundle pip trusts during the build (TLS-intercepting networks)
  --runtime NAME          podman: OCI runtime (e.g. runc where crun refuses hybrid cgroups)
  --ulimit SPEC           passed to build and run, repeatable (e.g. nofile=20000:20000)
  --network-host          run the container on the host's network instead of publishing the port
  --port N                host port for the server (default 8000)
  --timeout S             seconds to wait for /health (default 900)
  --make-test ARGS        afterwards, run `make test-cpu PYTEST_ARGS="ARGS"` (vLLM 0.32's part) in a fresh container
  -h, --help              this text

example (a host with no registry, podman as root):
  deploy/cpu/build-and-run.sh --debootstrap --wheels /opt/wheels --runtime runc \
      --ulimit nofile=20000:20000 --ulimit nproc=4096:4096
EOF
}

die() { echo "build-and-run.sh: $*" >&2; exit 1; }
step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

cd "$(dirname "$0")/../.."

ENGINE=""
BASE=python:3.11-slim-bookworm
DEBOOTSTRAP=0
TAG=localhost/vllm-trn:cpu
SKIP_BUILD=0
WHEELS=""
TORCH_INDEX=https://download.pytorch.org/whl/cpu
CA_BUNDLE=""
RUNTIME=""
ULIMITS=()
NETWORK_HOST=0
PORT=8000
TIMEOUT=900
MAKE_TEST=""
DEBOOTSTRAP_IMAGE=localhost/vllm-trn-base:bookworm

need_arg() { [ "$#" -ge 2 ] || die "$1 needs a value (see --help)"; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --engine) need_arg "$@"; ENGINE=$2; shift 2 ;;
    --base) need_arg "$@"; BASE=$2; shift 2 ;;
    --debootstrap) DEBOOTSTRAP=1; shift ;;
    --tag) need_arg "$@"; TAG=$2; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --wheels) need_arg "$@"; WHEELS=$2; TORCH_INDEX=""; shift 2 ;;
    --torch-index) need_arg "$@"; TORCH_INDEX=$2; shift 2 ;;
    --ca-bundle) need_arg "$@"; CA_BUNDLE=$2; shift 2 ;;
    --runtime) need_arg "$@"; RUNTIME=$2; shift 2 ;;
    --ulimit) need_arg "$@"; ULIMITS+=(--ulimit "$2"); shift 2 ;;
    --network-host) NETWORK_HOST=1; shift ;;
    --port) need_arg "$@"; PORT=$2; shift 2 ;;
    --timeout) need_arg "$@"; TIMEOUT=$2; shift 2 ;;
    --make-test) need_arg "$@"; MAKE_TEST=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

if [ -z "$ENGINE" ]; then
  if command -v podman >/dev/null; then ENGINE=podman
  elif command -v docker >/dev/null; then ENGINE=docker
  else die "no container engine: install podman or docker"; fi
fi
case "$ENGINE" in podman | docker) ;; *) die "--engine must be podman or docker, not '$ENGINE'" ;; esac
command -v "$ENGINE" >/dev/null || die "$ENGINE is not installed"
"$ENGINE" info >/dev/null 2>&1 || die "$ENGINE cannot reach its engine ('$ENGINE info' fails)"
command -v curl >/dev/null || die "curl is needed for the probes"
command -v python3 >/dev/null || die "python3 is needed to read the probes' JSON"

BUILD_OPTS=()
# vLLM passes inputs and outputs between its processes in /dev/shm; a container's default 64 MiB
# is too small (the demo alone asks for 160 MiB).
RUN_OPTS=(--shm-size 4g)
if [ -n "$RUNTIME" ]; then
  [ "$ENGINE" = podman ] || die "--runtime is a podman option"
  BUILD_OPTS+=(--runtime "$RUNTIME")
  RUN_OPTS+=(--runtime "$RUNTIME")
fi
BUILD_OPTS+=("${ULIMITS[@]}")
RUN_OPTS+=("${ULIMITS[@]}")
BUILD_OPTS+=(--build-arg "PIP_EXTRA_INDEX_URL=$TORCH_INDEX")
if [ -n "$WHEELS" ]; then
  [ "$ENGINE" = podman ] || die "--wheels needs podman (docker build cannot mount a host directory)"
  [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such directory"
  WHEELS=$(cd "$WHEELS" && pwd)
  BUILD_OPTS+=(-v "$WHEELS:/mnt/wheels:ro" --build-arg PIP_FIND_LINKS=/mnt/wheels)
fi
if [ -n "$CA_BUNDLE" ]; then
  [ "$ENGINE" = podman ] || die "--ca-bundle needs podman (docker build cannot mount a host file)"
  [ -f "$CA_BUNDLE" ] || die "--ca-bundle $CA_BUNDLE: no such file"
  BUILD_OPTS+=(-v "$(realpath "$CA_BUNDLE"):/mnt/ca-bundle.crt:ro" --build-arg PIP_CERT=/mnt/ca-bundle.crt)
fi

if [ "$DEBOOTSTRAP" = 1 ]; then
  BASE=$DEBOOTSTRAP_IMAGE
  if [ "$SKIP_BUILD" = 0 ] && ! "$ENGINE" image exists "$BASE" 2>/dev/null; then
    [ "$ENGINE" = podman ] || die "--debootstrap imports the rootfs with podman; use --engine podman"
    [ "$(id -u)" = 0 ] || die "--debootstrap needs root (debootstrap creates device nodes and chowns files)"
    command -v debootstrap >/dev/null || die "--debootstrap needs debootstrap (apt-get install debootstrap)"
    step "debootstrap bookworm -> $BASE"
    rootfs=$(mktemp -d /var/tmp/vllm-trn-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
      >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
  fi
fi

if [ "$SKIP_BUILD" = 0 ]; then
  step "build $TAG from $BASE with $ENGINE"
  t0=$SECONDS
  "$ENGINE" build -f deploy/cpu/Dockerfile -t "$TAG" --build-arg "BASE=$BASE" "${BUILD_OPTS[@]}" . \
    || die "image build failed (see the output above)"
  echo "built in $((SECONDS - t0)) s"
fi
"$ENGINE" image inspect "$TAG" >/dev/null 2>&1 || die "no image $TAG (build it: drop --skip-build)"
echo "image size: $("$ENGINE" image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1 / 1e9}')"

NAME=vllm-trn-cpu-$$
cleanup() { "$ENGINE" rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
if [ "$NETWORK_HOST" = 1 ]; then
  RUN_OPTS+=(--network host)
  SERVE=(make serve "PORT=$PORT" "SERVE_ARGS=--host 127.0.0.1")
else
  RUN_OPTS+=(-p "127.0.0.1:$PORT:8000")
  SERVE=()  # the image's default command
fi
if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; then
  die "something already answers on port $PORT; choose another with --port"
fi

step "run $TAG (container $NAME), wait for /health on :$PORT"
t0=$SECONDS
"$ENGINE" run -d --name "$NAME" "${RUN_OPTS[@]}" "$TAG" "${SERVE[@]}" >/dev/null \
  || die "$ENGINE run failed (see the output above)"
until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$PORT/health")" = 200 ]; do
  if [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
    "$ENGINE" logs --tail 60 "$NAME" >&2 || true
    die "the container exited before /health answered (its last log lines are above)"
  fi
  if [ $((SECONDS - t0)) -ge "$TIMEOUT" ]; then
    "$ENGINE" logs --tail 60 "$NAME" >&2 || true
    die "/health did not answer 200 within $TIMEOUT s"
  fi
  sleep 3
done
echo "/health: 200 after $((SECONDS - t0)) s"

step "POST /v1/completions"
body=$(curl -sS --fail-with-body --max-time 300 "http://127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "demo-laplace", "prompt": "Hello", "max_tokens": 8, "ignore_eos": true}') \
  || { echo "$body" >&2; "$ENGINE" logs --tail 40 "$NAME" >&2 || true; die "/v1/completions failed"; }
python3 - "$body" <<'PY' || die "unexpected /v1/completions answer: $body"
import json, sys
r = json.loads(sys.argv[1])
assert r["model"] == "demo-laplace", r["model"]
assert isinstance(r["choices"][0]["text"], str)
assert r["usage"]["completion_tokens"] == 8, r["usage"]
print(f"/v1/completions: 8 tokens, text {r['choices'][0]['text']!r}")
PY

step "stop"
"$ENGINE" stop -t 20 "$NAME" >/dev/null

if [ -n "$MAKE_TEST" ]; then
  step "make test-cpu PYTEST_ARGS=\"$MAKE_TEST\" in a fresh container"
  "$ENGINE" run --rm --shm-size 4g "${ULIMITS[@]}" ${RUNTIME:+--runtime "$RUNTIME"} "$TAG" make test-cpu "PYTEST_ARGS=$MAKE_TEST" \
    || die "make test-cpu failed in the container (see the output above)"
fi
echo "PASS: $TAG served the demo checkpoint and answered /health and /v1/completions${MAKE_TEST:+; make test-cpu passed}"
