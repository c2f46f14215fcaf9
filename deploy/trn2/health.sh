# shellcheck shell=bash
# Sourced by launch-instance.sh and fill-compile-cache.sh (not run by itself).
#
# wait_healthy URL PID LOG: poll URL/health until it answers 2xx. Give up, returning 1, as soon as the replica's process
# PID has exited (a replica that died at start would otherwise be polled for the whole timeout), or after HEALTH_TIMEOUT
# seconds (default 3600: a first start compiles every bucket); either way print the last LOG_TAIL lines (30) of its
# log LOG, which says why. PID must be a child of the calling shell (started with &), so that its status can be read.

_replica_alive() {
    local pid=$1 st
    kill -0 "$pid" 2>/dev/null || return 1
    # An exited child that bash has not reaped yet is a zombie: kill -0 still succeeds on it.
    if [[ -r /proc/$pid/stat ]] && read -r st <"/proc/$pid/stat" 2>/dev/null; then
        st=${st##*) }
        [[ ${st:0:1} != Z ]] || return 1
    fi
    return 0
}

_replica_log_tail() {
    local log=$1
    echo "--- last lines of $log ---" >&2
    tail -n "${LOG_TAIL:-30}" "$log" >&2 2>/dev/null || echo "(no log)" >&2
    echo "---" >&2
}

wait_healthy() {
    local url=$1 pid=$2 log=$3 timeout=${HEALTH_TIMEOUT:-3600} status=0
    local deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        if curl -sf --max-time 5 -o /dev/null "$url/health"; then
            return 0
        fi
        if ! _replica_alive "$pid"; then
            wait "$pid" 2>/dev/null || status=$?
            echo "$url: its process (pid $pid) exited with status $status before it became healthy" >&2
            _replica_log_tail "$log"
            return 1
        fi
        sleep "${HEALTH_POLL_S:-1}"
    done
    echo "$url did not become healthy in $timeout s (pid $pid still running)" >&2
    _replica_log_tail "$log"
    return 1
}
