"""The trn2 recipes drain on SIGTERM: deploy/trn2/serve-replica.sh passes --shutdown-timeout, and each Kubernetes
Deployment gives its pods a grace period that covers the preStop pause, the whole drain and a margin for the engine's
teardown, so a rolling update does not cut streams. (The drain itself is tested through the server:
tests/test_serving_features.py::test_sigterm_lets_streams_in_flight_finish.)"""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import TRN2, trn2_recipe_argv

TEARDOWN_MARGIN_S = 30  # for the engine to stop after the drain (seconds on CPU), inside the grace period


def _recipe_shutdown_timeout(model: str, env: dict[str, str]) -> int:
    """--shutdown-timeout of serve-replica.sh's command line, under the container's environment."""
    argv = trn2_recipe_argv(model, env=env)
    return int(argv[argv.index("--shutdown-timeout") + 1])


@pytest.mark.parametrize("model", ["laplace-3b", "mla-trinity"])
def test_grace_period_covers_the_drain(model: str) -> None:
    manifests = yaml.safe_load_all((TRN2 / "k8s" / f"{model}.yaml").read_text())
    pod = next(m for m in manifests if m and m["kind"] == "Deployment")["spec"]["template"]["spec"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    env = {e["name"]: e["value"] for e in engine["env"] if "value" in e}  # not the Secret's (valueFrom)
    drain = _recipe_shutdown_timeout(model, env)
    pause = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep" and drain > 0
    assert pod["terminationGracePeriodSeconds"] >= int(pause[1]) + drain + TEARDOWN_MARGIN_S
