"""pytest plugin: AWS's nki-library harness with the project's NKI emulator as its CPU simulator.

Loaded with ``-p tests.nki_library_aws_plugin`` in a pytest run of the nki-library snapshot's own tests (rootdir = the
snapshot) with ``--test-mode simulation``: importing it installs the emulator under the ``nki_cpu_simulator`` names
AWS's ``test/utils/simulation_setup.py`` imports (and under ``nki``), before AWS's conftest configures simulation mode.

The snapshot lacks two modules AWS's harness imports: ``test/utils/scripts/remote_lock_scripts.py`` (core-lock helpers
for remote hardware hosts) and ``test/utils/perf_analysis_private.py`` (AWS-internal profile analysis, not in the public
repository at all). Where missing, the names imported from them get inert stand-ins: both serve only the hardware
paths (remote hosts, profiling), never simulation.
"""

import enum
import sys
import types

from tests import nki_library_peer

nki_library_peer.install()

if not (nki_library_peer.library_dir() / "test" / "utils" / "scripts").is_dir():

    class LockStatus(enum.Enum):
        """Stand-in: only referenced on the remote-host path."""

        ALLOCATED = 0
        RELEASED = 1
        DRAINED = 2
        UNDRAINED = 3
        NO_CORES = 4
        DRAINING = 5
        FLOCK_TIMEOUT = 6
        ERROR = 7

    class LockResult:
        """Stand-in: only referenced on the remote-host path."""

    scripts = types.ModuleType("test.utils.scripts")
    lock = types.ModuleType("test.utils.scripts.remote_lock_scripts")
    lock.LockStatus, lock.LockResult = LockStatus, LockResult
    scripts.remote_lock_scripts = lock
    sys.modules.setdefault("test.utils.scripts", scripts)
    sys.modules.setdefault("test.utils.scripts.remote_lock_scripts", lock)

if not (nki_library_peer.library_dir() / "test" / "utils" / "perf_analysis_private.py").exists():

    def analyze_trace(*args: object, **kwargs: object) -> None:
        """Stand-in: AWS-internal profile analysis, used on hardware runs only."""
        raise RuntimeError("perf_analysis_private is AWS-internal; profiling does not run in simulation")

    perf = types.ModuleType("test.utils.perf_analysis_private")
    perf.analyze_trace = analyze_trace
    sys.modules.setdefault("test.utils.perf_analysis_private", perf)


def pytest_configure(config: object) -> None:
    """AWS's Orchestrator sets ``_compiled_kernel`` only when it compiles, which simulation mode skips, and then reads
    it after every inference (``_rename_neff_outputs_to_python_names``): at this snapshot every simulation-mode test
    fails with AttributeError whatever the simulator. The missing default (None, "no compiled kernel") is supplied."""
    from test.utils import test_orchestrator

    nki_library_peer.patch_library_bugs()

    if not hasattr(test_orchestrator.Orchestrator, "_compiled_kernel"):
        test_orchestrator.Orchestrator._compiled_kernel = None
