"""What a security review of deploy/trn2/ looks for, checked statically on the files (no cluster, no Docker, no Trainium
here) and, for the scripts, by running them with real bash and real processes (a fake replica stands in for
`vllm serve`):

- every image stage runs as a fixed non-root UID/GID (the manifests' runAsUser/runAsGroup);
- every container of every pod runs restricted (non-root, no privilege escalation, no capabilities, read-only root
  filesystem with emptyDirs for what must be writable, seccomp RuntimeDefault);
- the compile cache is written only by its Job, under a key of image, model and buckets (serve-replica.sh
  --cache-key), into a temporary directory renamed into place; serving pods mount it read-only and mount nothing else
  writable but emptyDirs;
- every serving container takes the API key from a Secret; a NetworkPolicy admits only the router (and Prometheus) to
  the engines and only the router's ports to the router;
- probes on /health; launch-instance.sh's wait_healthy gives up as soon as the replica's process has exited, with its
  last log lines."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import TRN2

K8S = TRN2 / "k8s"
DOCKERFILE = TRN2 / "Dockerfile"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


# --- manifests ---------------------------------------------------------------------------------------------------


def _manifests() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def _workloads() -> list[tuple[str, dict]]:
    return [(f, d) for f, d in _manifests() if d["kind"] in WORKLOADS]


def _pod(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def _labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"]["labels"]


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _serving() -> list[tuple[str, dict]]:
    """The Deployments: engines and routers, the pods that answer requests."""
    return [(f, w) for f, w in _workloads() if w["kind"] == "Deployment"]


def _by_component(component: str) -> list[dict]:
    return [w for _, w in _serving() if _labels(w).get("component") == component]


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector with matchLabels only (the manifests use nothing else) that selects `labels`."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


CONTAINERS = [
    pytest.param(f, w, c, id=f"{f}:{w['kind']}/{w['metadata']['name']}/{c['name']}")
    for f, w in _workloads()
    for c in _containers(_pod(w))
]


def test_the_manifests_hold_engines_router_and_compile_jobs() -> None:
    assert {_labels(w)["app"] for w in _by_component("engine")} == {"laplace-3b", "mla-trinity"}
    assert _by_component("router")
    assert {_labels(w)["app"] for _, w in _workloads() if w["kind"] == "Job"} == {"laplace-3b", "mla-trinity"}


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, arguments)]}, line continuations joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        instr, _, args = line.strip().partition(" ")
        if instr.upper() == "FROM":
            m = re.search(r"\bAS\s+(\S+)", args, re.IGNORECASE)
            current = m.group(1) if m else f"stage{len(stages)}"
            stages[current] = []
        elif current is not None:
            stages[current].append((instr.upper(), args.strip()))
    return stages


def _image_user() -> tuple[int, int]:
    """The UID:GID every image stage ends with (one for all stages)."""
    users = {[a for i, a in ins if i == "USER"][-1] for ins in _dockerfile_stages().values() if "USER" in dict(ins)}
    assert len(users) == 1, users
    uid, gid = users.pop().split(":")
    return int(uid), int(gid)


@pytest.mark.parametrize("stage", sorted(_dockerfile_stages()))
def test_every_image_stage_runs_as_a_fixed_non_root_user(stage: str) -> None:
    ins = _dockerfile_stages()[stage]
    users = [a for i, a in ins if i == "USER"]
    assert users, f"stage {stage} has no USER: it runs as root"
    # Numeric, so that the kubelet can check runAsNonRoot against the image itself.
    m = re.fullmatch(r"(\d+):(\d+)", users[-1])
    assert m and int(m.group(1)) != 0 and int(m.group(2)) != 0, users[-1]
    uid, gid = m.groups()
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert re.search(rf"groupadd\b[^&;]*--gid {gid}\b", runs) and re.search(rf"useradd\b[^&;]*--uid {uid}\b", runs), (
        f"stage {stage} does not create the user {uid}:{gid}"
    )
    # What the server writes goes under its home, which useradd creates and the user owns.
    home = re.search(r"\bHOME=(\S+)", " ".join(a for i, a in ins if i == "ENV"))
    assert home, f"stage {stage} sets no HOME for the user"
    assert re.search(rf"useradd\b[^&;]*--create-home\b[^&;]*--home-dir {re.escape(home.group(1))}\b", runs)


@pytest.mark.parametrize(("f", "w", "c"), CONTAINERS)
def test_every_container_runs_restricted(f: str, w: dict, c: dict) -> None:
    # The pod's settings a container inherits, overridden by the container's own.
    pod_sc = _pod(w).get("securityContext", {})
    sc = {k: pod_sc[k] for k in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile") if k in pod_sc}
    sc.update(c.get("securityContext", {}))
    uid, gid = _image_user()
    assert sc.get("runAsNonRoot") is True
    assert sc.get("runAsUser") == uid and sc.get("runAsGroup") == gid  # the image's user
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("privileged", False) is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add")
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}
    # A read-only root: /tmp is an emptyDir.
    empty = {v["name"] for v in _pod(w).get("volumes", []) if "emptyDir" in v}
    assert any(m["mountPath"] == "/tmp" and m["name"] in empty for m in c.get("volumeMounts", [])), "no /tmp"
    # Device access through the Neuron device plugin's resource, not host devices.
    assert not any("hostPath" in v and v["hostPath"]["path"].startswith("/dev") for v in _pod(w).get("volumes", []))


@pytest.mark.parametrize(("f", "w"), _workloads(), ids=lambda x: x if isinstance(x, str) else x["metadata"]["name"])
def test_no_host_path_is_writable_and_serving_pods_write_only_emptydirs(f: str, w: dict) -> None:
    pod = _pod(w)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in _containers(pod):
        for m in c.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "hostPath" in v:
                assert m.get("readOnly") is True, f"{c['name']} mounts hostPath {v['hostPath']['path']} writable"
            if w["kind"] == "Deployment" and "emptyDir" not in v:
                assert m.get("readOnly") is True, f"serving container {c['name']} mounts {m['name']} writable"
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"].get("readOnly") is True
    if w["kind"] == "Deployment":
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")


def _cache_mount(w: dict) -> tuple[dict, dict, dict]:
    """(container, its mount of the compile cache, the volume) of an engine or compile Job."""
    pod = _pod(w)
    c = pod["containers"][0]
    root = _env(c)["COMPILE_CACHE_ROOT"]["value"]
    m = next(m for m in c["volumeMounts"] if m["mountPath"] == root)
    return c, m, next(v for v in pod["volumes"] if v["name"] == m["name"])


@pytest.mark.parametrize("model", ["laplace-3b", "mla-trinity"])
def test_the_compile_cache_is_read_only_to_serving_and_filled_by_one_job(model: str) -> None:
    engine = next(w for w in _by_component("engine") if _labels(w)["app"] == model)
    job = next(w for _, w in _workloads() if w["kind"] == "Job" and _labels(w)["app"] == model)
    ec, em, ev = _cache_mount(engine)
    jc, jm, jv = _cache_mount(job)
    claim = ev["persistentVolumeClaim"]["claimName"]
    assert jv["persistentVolumeClaim"]["claimName"] == claim
    assert em.get("readOnly") is True and ev["persistentVolumeClaim"].get("readOnly") is True
    assert not jm.get("readOnly") and not jv["persistentVolumeClaim"].get("readOnly")  # the only writer
    pvc = next(d for _, d in _manifests() if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim)
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # one cache for every node
    # The Job compiles what the engines serve: same image, model, checkpoint and arguments (so the same key).
    assert jc["image"] == ec["image"]
    assert Path(jc["command"][0]).name == "fill-compile-cache.sh"
    assert jc.get("args") == [_env(ec)["MODEL"]["value"], _env(ec)["CHECKPOINT"]["value"]]
    assert _env(ec)["MODEL"]["value"] == model and "args" not in ec
    # A serving pod without the compiled graphs stops at once rather than compiling on its own.
    assert _env(ec)["REQUIRE_COMPILE_CACHE"]["value"] == "1"


def _secret_env(c: dict) -> dict[str, dict]:
    return {n: e["valueFrom"]["secretKeyRef"] for n, e in _env(c).items() if "secretKeyRef" in e.get("valueFrom", {})}


@pytest.mark.parametrize("w", [w for _, w in _serving()], ids=lambda w: f"{w['metadata']['name']}")
def test_every_serving_container_takes_the_api_key_from_a_secret(w: dict) -> None:
    c = next(c for c in _pod(w)["containers"] if c["name"] in ("engine", "router"))
    secrets = _secret_env(c)
    if c["name"] == "engine":
        # vLLM reads VLLM_API_KEY as --api-key's default: the key stays off the command line.
        assert "VLLM_API_KEY" in secrets
    else:
        # The router's flag, expanded by the kubelet from an env var that comes from the Secret.
        flags = [re.fullmatch(r"--api-key=\$\((\w+)\)", a) for a in c["args"] if a.startswith("--api-key")]
        assert len(flags) == 1 and flags[0] and flags[0].group(1) in secrets, flags
    assert {s["name"] for s in secrets.values()} == {"vllm-trn-api-key"}
    assert all(s.get("optional") is not True for s in secrets.values())  # no key: no pod
    # No key committed: no Secret with data in the manifests, no literal --api-key.
    assert not [d for _, d in _manifests() if d["kind"] == "Secret"]
    assert not any(re.fullmatch(r"--api-key(=[^$].*)?", a) for a in c.get("args", []) + c.get("command", []))


def _policies_selecting(labels: dict, namespace: str) -> list[dict]:
    return [
        d
        for _, d in _manifests()
        if d["kind"] == "NetworkPolicy"
        and d["metadata"]["namespace"] == namespace
        and "Ingress" in d["spec"].get("policyTypes", [])
        and _selects(d["spec"]["podSelector"], labels)
    ]


def _port_names(rule: dict) -> set:
    return {p["port"] for p in rule.get("ports", [])}


@pytest.mark.parametrize("model", ["laplace-3b", "mla-trinity"])
def test_a_network_policy_admits_only_the_router_and_prometheus_to_the_engines(model: str) -> None:
    engine = next(w for w in _by_component("engine") if _labels(w)["app"] == model)
    policies = _policies_selecting(_labels(engine), engine["metadata"]["namespace"])
    assert policies, f"no NetworkPolicy selects the {model} engines"
    router_labels = {"app": model, "component": "router"}
    admits_router = False
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            assert rule.get("from"), f"{p['metadata']['name']} admits every source"
            assert _port_names(rule) == {"http"}, "engines answer on their one port only"
            for peer in rule["from"]:
                assert "ipBlock" not in peer
                if "namespaceSelector" in peer:  # Prometheus, from the monitoring namespace only
                    assert peer["namespaceSelector"]["matchLabels"] and peer.get("podSelector", {}).get("matchLabels")
                else:
                    assert _selects(peer["podSelector"], router_labels), peer
                    admits_router = True
    assert admits_router


def test_a_network_policy_admits_the_router_on_its_ports_only() -> None:
    for router in _by_component("router"):
        c = _pod(router)["containers"][0]
        names = {p["name"] for p in c["ports"]}
        policies = _policies_selecting(_labels(router), router["metadata"]["namespace"])
        assert policies
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                ports = _port_names(rule)
                assert ports and ports <= names
                if "metrics" in ports:  # metrics to Prometheus only
                    assert rule.get("from") and all("namespaceSelector" in peer for peer in rule["from"])


@pytest.mark.parametrize("w", [w for _, w in _serving()], ids=lambda w: w["metadata"]["name"])
def test_probes_notice_a_dead_server(w: dict) -> None:
    c = _pod(w)["containers"][0]
    kinds = ["readinessProbe", "livenessProbe"] + (["startupProbe"] if _labels(w)["component"] == "engine" else [])
    for kind in kinds:
        probe = c.get(kind)
        assert probe, f"{w['metadata']['name']} has no {kind}"
        assert probe["httpGet"]["path"] == "/health" and probe["httpGet"]["port"] in {p["name"] for p in c["ports"]}
        assert probe.get("failureThreshold", 0) >= 1 and probe.get("timeoutSeconds", 0) >= 1
        if kind != "startupProbe":  # a dead or hung server is out of rotation / restarted within two minutes
            assert probe["failureThreshold"] * probe.get("periodSeconds", 10) <= 120


# --- the compile cache's key and its filling ---------------------------------------------------------------------

KEY = re.compile(r"[0-9a-f]{16}/(laplace-3b|mla-trinity)/[0-9a-f]{16}")


def _key(model: str, ckpt: Path, *args: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [str(TRN2 / "serve-replica.sh"), model, str(ckpt), *args, "--cache-key"],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert KEY.fullmatch(out) and out.split("/")[1] == model, out
    return out


def test_the_cache_key_changes_with_what_is_compiled_and_nothing_else(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"hidden_size": 64}')
    base = _key("laplace-3b", ckpt)
    # Not compiled in: where it listens, the served name, the drain, tool calling.
    same = _key(
        "laplace-3b",
        ckpt,
        "--host",
        "127.0.0.1",
        "--port=9001",
        env={"PORT": "9", "SERVED_NAME": "x", "SHUTDOWN_TIMEOUT": "5", "TOOL_CALL_PARSER": "hermes"},
    )
    assert same == base
    # Compiled in: the buckets and shapes, the LNC degree, the model's config, the model.
    assert _key("laplace-3b", ckpt, "--max-num-seqs", "16") != base
    assert _key("laplace-3b", ckpt, env={"NEURON_LOGICAL_NC_CONFIG": "1"}) != base
    assert _key("mla-trinity", ckpt).split("/")[2] != base.split("/")[2]
    assert _key("mla-trinity", ckpt).split("/")[0] == base.split("/")[0]  # same image
    (ckpt / "config.json").write_text('{"hidden_size": 128}')
    assert _key("laplace-3b", ckpt) != base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict, timeout: float, cwd: Path | None = None) -> tuple[int, str, str, float]:
    """Run cmd in its own process group; past `timeout` the whole group is killed and the test fails."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{cmd[0]} still running after {timeout} s\nstdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}")
    return p.returncode, out, err, time.monotonic() - t0


FAKE_REPLICA = r"""#!/usr/bin/env bash
# Stands in for serve-replica.sh: the key; otherwise "compiles" into VLLM_CACHE_ROOT and serves /health, or dies.
for a in "$@"; do [[ $a == --cache-key ]] && { echo "img0/$1/bucket0"; exit 0; }; done
echo "$$" >>"$FAKE_STARTS"
echo "fake replica $1 on port $PORT, cache $VLLM_CACHE_ROOT"
if [[ -n ${FAKE_DIE:-} ]]; then echo "fake replica: $FAKE_DIE"; exit 7; fi
mkdir -p "$VLLM_CACHE_ROOT/graphs" && echo neff >"$VLLM_CACHE_ROOT/graphs/g.neff"
www=$(mktemp -d) && touch "$www/health"
exec python3 -m http.server --bind 127.0.0.1 "$PORT" --directory "$www"
"""


def _scripts_with_fake_replica(tmp_path: Path) -> Path:
    """deploy/trn2's scripts copied beside a fake serve-replica.sh (they call it as $here/serve-replica.sh)."""
    d = tmp_path / "trn2"
    d.mkdir()
    for f in TRN2.glob("*.sh"):
        if f.name != "serve-replica.sh":
            shutil.copy2(f, d / f.name)
    (d / "serve-replica.sh").write_text(FAKE_REPLICA)
    (d / "serve-replica.sh").chmod(0o755)
    return d


def _fill_env(tmp_path: Path, root: Path, **extra: str) -> dict[str, str]:
    """The fill script's environment in a test: its cache under `root`, a free port, the fake replica's record of
    starts, and TMPDIR (the fill's log and the fake's files) under tmp_path."""
    return {
        "COMPILE_CACHE_ROOT": str(root),
        "FILL_PORT": str(_free_port()),
        "FAKE_STARTS": str(tmp_path / "starts"),
        "TMPDIR": str(tmp_path),
        **extra,
    }


def test_the_fill_compiles_into_a_temporary_directory_and_renames_it_into_place(tmp_path: Path) -> None:
    d = _scripts_with_fake_replica(tmp_path)
    root = tmp_path / "cache"
    env = _fill_env(tmp_path, root)
    rc, out, err, _ = _run([str(d / "fill-compile-cache.sh"), "laplace-3b", "/models/x"], env, timeout=60)
    assert rc == 0, err
    final = root / "img0" / "laplace-3b" / "bucket0"
    assert (final / "graphs" / "g.neff").read_text() == "neff\n"
    assert sorted(p.name for p in final.parent.iterdir()) == ["bucket0"]  # no temporary directory left
    assert len((tmp_path / "starts").read_text().split()) == 1
    # Filled already: nothing to do, no server started.
    rc, out, err, _ = _run([str(d / "fill-compile-cache.sh"), "laplace-3b", "/models/x"], env, timeout=60)
    assert rc == 0 and len((tmp_path / "starts").read_text().split()) == 1, err


def test_a_failed_fill_stops_at_once_and_leaves_nothing(tmp_path: Path) -> None:
    d = _scripts_with_fake_replica(tmp_path)
    root = tmp_path / "cache"
    env = _fill_env(tmp_path, root, FAKE_DIE="NEFF compilation failed for bucket 20")
    rc, out, err, elapsed = _run([str(d / "fill-compile-cache.sh"), "laplace-3b", "/models/x"], env, timeout=60)
    assert rc != 0 and elapsed < 30
    assert "NEFF compilation failed for bucket 20" in err and "status 7" in err
    assert not (root / "img0" / "laplace-3b" / "bucket0").exists()
    assert not list((root / "img0" / "laplace-3b").iterdir())


FAKE_VLLM = r"""#!/usr/bin/env bash
# Stands in for `vllm`: shows what the replica's VLLM_CACHE_ROOT holds, then exits.
echo "VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT"
echo "ARGS=$*"
"""


def test_a_serving_replica_links_the_read_only_graphs_into_its_own_cache(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    root = tmp_path / "cache"
    key = _key("laplace-3b", ckpt)
    compiled = root / key
    (compiled / "torch_compile_cache" / "abc").mkdir(parents=True)
    (compiled / "torch_compile_cache" / "abc" / "graph.neff").write_text("neff")
    private = tmp_path / "private"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "COMPILE_CACHE_ROOT": str(root),
        "REQUIRE_COMPILE_CACHE": "1",
        "VLLM_CACHE_ROOT": str(private),
    }
    for f in [compiled, *compiled.rglob("*")]:  # as a read-only mount would have it
        f.chmod(f.stat().st_mode & ~0o222)
    try:
        for _ in range(2):  # a restarted container finds its earlier links
            rc, out, err, _ = _run([str(TRN2 / "serve-replica.sh"), "laplace-3b", str(ckpt)], env, timeout=60)
            assert rc == 0, err
            assert f"VLLM_CACHE_ROOT={private}" in out
            link = private / "torch_compile_cache" / "abc" / "graph.neff"
            assert link.is_symlink() and link.resolve() == (compiled / "torch_compile_cache/abc/graph.neff").resolve()
            d = private / "torch_compile_cache" / "abc"
            assert not d.is_symlink() and d.stat().st_mode & stat.S_IWUSR  # vLLM writes beside the links
    finally:
        for f in [compiled, *compiled.rglob("*")]:
            f.chmod(f.stat().st_mode | 0o200)
    # No compiled graphs for this key: the replica stops at once instead of compiling them itself.
    rc, out, err, _ = _run(
        [str(TRN2 / "serve-replica.sh"), "laplace-3b", str(ckpt), "--max-num-seqs", "16"], env, timeout=60
    )
    assert rc != 0 and "ARGS=" not in out and "no compiled graphs" in err


# --- wait_healthy: give up on a replica that has exited ---------------------------------------------------------


def _bash_wait_healthy(tmp_path: Path, start: str, timeout_s: int = 3600) -> tuple[int, str, str, float]:
    """Source deploy/trn2/health.sh, start `start` in the background (its output to a log), wait_healthy on it."""
    port = _free_port()
    script = f"""
set -euo pipefail
source {TRN2 / "health.sh"}
log={tmp_path / "replica.log"}
{start} >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_healthy http://127.0.0.1:{port} "$pid" "$log"
"""
    env = {"PORT": str(port), "HEALTH_TIMEOUT": str(timeout_s), "WWW": str(tmp_path)}
    return _run(["bash", "-c", script], env, timeout=60)


def test_wait_healthy_gives_up_as_soon_as_the_replica_exits(tmp_path: Path) -> None:
    rc, out, err, elapsed = _bash_wait_healthy(
        tmp_path, "bash -c 'echo loading weights; sleep 1; echo RuntimeError: out of device memory; exit 3'"
    )
    assert rc != 0 and elapsed < 15, (rc, elapsed)
    assert "exited with status 3" in err and "RuntimeError: out of device memory" in err and "loading weights" in err


def test_wait_healthy_returns_once_the_replica_answers(tmp_path: Path) -> None:
    (tmp_path / "health").touch()
    rc, out, err, elapsed = _bash_wait_healthy(
        tmp_path, "bash -c 'sleep 1; exec python3 -m http.server --bind 127.0.0.1 $PORT --directory $WWW'"
    )
    assert rc == 0, err


def test_wait_healthy_gives_up_on_a_live_replica_after_its_timeout(tmp_path: Path) -> None:
    rc, out, err, elapsed = _bash_wait_healthy(tmp_path, "sleep 60", timeout_s=2)
    assert rc != 0 and elapsed < 15 and "did not become healthy" in err


def test_launch_instance_stops_when_a_replica_dies_and_shows_its_log(tmp_path: Path) -> None:
    d = _scripts_with_fake_replica(tmp_path)
    (tmp_path / "cache" / "img0" / "laplace-3b" / "bucket0").mkdir(parents=True)  # compiled already
    env = {
        "REPLICAS": "2",
        "BASE_PORT": str(_free_port()),
        "LOG_DIR": str(tmp_path / "logs"),
        "COMPILE_CACHE_ROOT": str(tmp_path / "cache"),
        "VLLM_API_KEY": "test-key",
        "FAKE_STARTS": str(tmp_path / "starts"),
        "TMPDIR": str(tmp_path),
        "FAKE_DIE": "NRT init failed: no NeuronCore 3",
    }
    rc, out, err, elapsed = _run([str(d / "launch-instance.sh"), "laplace-3b", "/models/x"], env, timeout=45)
    assert rc != 0 and elapsed < 30, (rc, elapsed, err)
    assert "NRT init failed: no NeuronCore 3" in err and "exited with status 7" in err


def test_launch_instance_dry_run_binds_replicas_and_metrics_to_localhost(tmp_path: Path) -> None:
    rc, out, err, _ = _run(
        [str(TRN2 / "launch-instance.sh"), "laplace-3b", "/models/x", "--dry-run"],
        {"REPLICAS": "2", "LOG_DIR": str(tmp_path / "logs")},
        timeout=60,
    )
    assert rc == 0, err
    lines = out.splitlines()
    replicas = [ln for ln in lines if "serve-replica.sh" in ln and "fill-compile-cache" not in ln]
    assert len(replicas) == 2 and all("--host 127.0.0.1" in ln for ln in replicas)
    assert any("fill-compile-cache.sh laplace-3b" in ln for ln in lines)
    router = next(ln for ln in lines if ln.startswith("vllm-router"))
    assert "--prometheus-host 127.0.0.1" in router
