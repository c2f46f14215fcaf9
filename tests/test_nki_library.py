"""The peer suite (issue 28): AWS's nki-library kernels, which AWS runs on Trainium, run in the project's NKI emulator
and are compared with AWS's own references at AWS's tolerances.

Source: the snapshot at ../shared/nki-library (or ``NKI_LIBRARY_DIR``); every test skips, naming the path, where it is
absent. Two layers:

- In process (needs only the project's test environment): cumsum, rope and router_topk, imported from the snapshot
  through ``tests/nki_library_peer.py``, with AWS's input generators where they import without AWS's harness
  (``tensor_generators``, ``test_router_topk_common``), AWS's comparator (``comparators.maxAllClose``: ``|a - b| <= atol
  + rtol * max|b|``) and the tolerances AWS's tests use (cited per test), against the kernels' ``*_torch.py``
  references.
- AWS's harness itself (``pytest --test-mode simulation`` on AWS's own test ids, with the emulator as its
  ``nki_cpu_simulator`` through ``tests/nki_library_aws_plugin.py``): cumsum, rmsnorm_quant, router_topk, rope,
  moe_tkg on its FP8 path and attention_tkg at small shapes, validated by AWS's validators. Needs the harness's own
  dependencies (the ``nki-library`` extra in pyproject.toml); skips, naming the missing ones, otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import nki_library_peer as peer

MISSING = peer.library_missing_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def lib() -> Iterator[Any]:
    """The emulator under the ``nki`` names and the snapshot on ``sys.path`` for this module's tests only."""
    with peer.installed():
        yield peer


def _close(out: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> tuple[bool, float]:
    from test.integration.nkilib.utils.comparators import maxAllClose  # AWS's comparator

    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return bool(maxAllClose(a, b, rtol=rtol, atol=atol)), float(np.max(np.abs(a - b)))


def _torch_args(inputs: dict[str, Any]) -> dict[str, Any]:
    """numpy -> torch as AWS's ``torch_ref_wrapper`` does: low-precision floats and float16 to float32, uint32 to
    int32."""
    import torch

    out = {}
    for k, v in inputs.items():
        k = k.removesuffix(".must_alias_input")
        if isinstance(v, np.ndarray):
            if v.dtype == np.uint32:
                v = v.astype(np.int32)
            elif v.dtype.kind == "f" or "bfloat16" in str(v.dtype) or "float8" in str(v.dtype):
                v = v.astype(np.float32)
            v = torch.from_numpy(v)
        out[k] = v
    return out


# ---- in process ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,dtype,lnc",
    [
        ((1, 256), "float32", 1),
        ((4, 3, 300), "bfloat16", 1),
        ((130, 2100), "float32", 1),
        ((64, 4, 1024), "bfloat16", 2),
    ],
)
def test_cumsum(lib: Any, shape: tuple[int, ...], dtype: str, lnc: int) -> None:
    """cumsum (tensor_tensor_scan over 2048-wide tiles, carry across tiles and 128-row tiles) vs ``cumsum_torch_ref``;
    tolerances of AWS's test_cumsum: atol 1e-2 above 5000 columns else 1e-3, rtol 1e-2 for bf16 else 1e-3."""
    import torch
    from nkilib_src.nkilib.core.cumsum import cumsum
    from nkilib_src.nkilib.core.cumsum.cumsum_torch import cumsum_torch_ref

    x = np.random.default_rng(42).standard_normal(shape).astype(np.dtype(dtype))
    (out,) = lib.run_kernel(cumsum, {"x": x}, lnc=lnc)
    ref = cumsum_torch_ref(torch.from_numpy(x.astype(np.float32)))["output_0"].numpy()
    rtol, atol = (1e-2 if dtype == "bfloat16" else 1e-3), (1e-2 if shape[-1] > 5000 else 1e-3)
    ok, err = _close(out, ref, rtol, atol)
    assert out.dtype == x.dtype and ok, f"max |err| {err} (rtol {rtol} x max|ref| {np.abs(ref).max():.3g}, atol {atol})"


@pytest.mark.parametrize(
    "d_head,b,n_heads,s,contiguous,relayout,lnc",
    [
        (64, 1, 1, 16, True, True, 1),
        (128, 2, 2, 16, False, False, 1),
        (64, 1, 8, 16, True, False, 2),
        (128, 2, 1, 128, False, True, 2),
    ],
)
def test_rope(lib: Any, d_head: int, b: int, n_heads: int, s: int, contiguous: bool, relayout: bool, lnc: int) -> None:
    """RoPE (bf16, LNC-sharded when LNC=2) vs ``rope_torch_ref`` with AWS's generator and test_rope's tolerances
    (rtol 2**-7, atol 1e-3)."""
    import nkilib_src.nkilib.core.embeddings.rope as rope
    from nkilib_src.nkilib.core.embeddings.rope_torch import rope_torch_ref
    from test.integration.nkilib.utils.tensor_generators import gaussian_tensor_generator

    gen = gaussian_tensor_generator()
    inputs = {
        "x_in": gen(name="x_in", shape=(d_head, b, n_heads, s), dtype="bfloat16"),
        "cos": gen(name="cos", shape=(d_head // 2, b, s), dtype="bfloat16"),
        "sin": gen(name="sin", shape=(d_head // 2, b, s), dtype="bfloat16"),
        "lnc_shard": True,
        "contiguous_layout": contiguous,
        "relayout_in_sbuf": relayout,
    }
    (out,) = lib.run_kernel(rope.RoPE, inputs, lnc=lnc)
    ref = rope_torch_ref(**_torch_args(inputs))
    ok, err = _close(out, np.asarray(ref["x_out"] if isinstance(ref, dict) else ref), 2**-7, 1e-3)
    assert ok, f"max |err| {err}"


def _router_cfg(t: int, h: int, k: int, act: str, **flags: Any) -> tuple:
    """A row of AWS's router_topk test table: (T, H, E=128, k, act_fn, has_bias, router_pre_norm, norm_topk_prob,
    use_column_tiling, use_indirect_dma_scatter, use_PE_broadcast_w_bias, shard_on_tokens, output_in_sbuf,
    x_input_in_sb, x_hbm_layout, x_sb_layout)."""
    from nkilib_src.nkilib.core.utils.common_types import RouterActFnType

    f = {
        "bias": True,
        "prenorm": False,
        "normprob": False,
        "coltile": False,
        "scatter": False,
        "pebias": False,
        "shard": False,
        "outsb": False,
        "xsb": False,
        "xhbm": 0,
        "xsbl": 0,
    } | flags
    return (
        t,
        h,
        128,
        k,
        getattr(RouterActFnType, act),
        f["bias"],
        f["prenorm"],
        f["normprob"],
        f["coltile"],
        f["scatter"],
        f["pebias"],
        f["shard"],
        f["outsb"],
        f["xsb"],
        f["xhbm"],
        f["xsbl"],
    )


ROUTER_CASES = {
    "softmax-xHT": dict(t=4, h=512, k=4, act="SOFTMAX"),
    "softmax-xTH": dict(t=4, h=512, k=4, act="SOFTMAX", xhbm=1),
    "sigmoid-prenorm-normprob-scatter": dict(t=8, h=512, k=8, act="SIGMOID", prenorm=True, normprob=True, scatter=True),
    "softmax-prenorm-xsb": dict(t=8, h=512, k=4, act="SOFTMAX", prenorm=True, xsb=True, xsbl=1),
    "coltile-pebias": dict(t=16, h=256, k=4, act="SOFTMAX", coltile=True, pebias=True),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_topk(lib: Any, case: str) -> None:
    """router_topk (logits, top-k with max8 / nc_find_index8, softmax or sigmoid, one-hot or indirect-DMA scatter) at
    LNC=2, the LNC AWS's CompilerArgs() gives trn2, with AWS's input generator (``test_router_topk_common``) vs
    ``router_topk_torch_ref``; test_router_topk's tolerances: rtol 2e-2, atol 1e-5."""
    from test.integration.nkilib.core.router_topk import test_router_topk_common as common

    inputs = common.generate_router_topk_inputs(*_router_cfg(**ROUTER_CASES[case]))
    outs = lib.run_kernel(common.router_topk_kernel_wrapper, inputs, lnc=2)
    ref = common.router_topk_torch_wrapper(**_torch_args(inputs))
    for name, out in zip(("router_logits", "expert_index", "expert_affinities"), outs):
        ok, err = _close(out, ref[name].float().numpy(), 2e-2, 1e-5)
        assert ok, f"{name}: max |err| {err}"


def test_router_topk_memset_float_on_uint32_refused(lib: Any) -> None:
    """The one router_topk path the emulator refuses, as NKI >= 0.3 does: with ``shard_on_tokens`` and
    ``output_in_sbuf`` the library's ``cross_partition_copy`` memsets a uint32 tile with ``value=0.0``; NKI 0.3 made
    memset's value match the dtype ("will now raise an error at compile time" [RN 0.3.0, MIG])."""
    from test.integration.nkilib.core.router_topk import test_router_topk_common as common

    from vllm_trn_plugin.kernels.nki_emu import errors

    inputs = common.generate_router_topk_inputs(*_router_cfg(8, 512, 4, "SOFTMAX", bias=False, shard=True, outsb=True))
    with pytest.raises(errors.DtypeError, match="memset: integer dst .* needs an integer value, got 0.0"):
        lib.run_kernel(common.router_topk_kernel_wrapper, inputs, lnc=2)


# ---- AWS's harness ---------------------------------------------------------------------------------------------------
_CORE = "test/integration/nkilib/core"
HARNESS_IDS = [
    f"{_CORE}/cumsum/test_cumsum.py::TestCumsumKernel::test_cumsum_fast[1_256_2_1_float32]",
    f"{_CORE}/cumsum/test_cumsum.py::TestCumsumKernel::test_cumsum_fast[64_1024_3_4_bfloat16]",
    f"{_CORE}/rmsnorm/test_rmsnorm_quant.py::TestRmsNormQuantKernel::test_rmsnorm_quant_lnc_unit"
    "[2-True-QuantizationType.ROW-51564336-tensor_generator-0.0-2-1-16384]",
    f"{_CORE}/rmsnorm/test_rmsnorm_quant.py::TestRmsNormQuantKernel::test_rmsnorm_quant_lnc_unit"
    "[2-False-QuantizationType.ROW-93851770-tensor_generator-0.5-2-1-16384]",
    f"{_CORE}/rmsnorm/test_rmsnorm_quant.py::TestRmsNormQuantKernel::test_rmsnorm_quant_lnc_unit"
    "[2-False-QuantizationType.STATIC-None-tensor_generator-0.0-2-1-16384]",
    f"{_CORE}/router_topk/test_router_topk.py::TestRouterTopkKernel::test_router_topk[T-4_H-3072_E-128_k-4_act_fn-1"
    "_bias-1_prenorm-0_normprob-0_coltile-0_scatter-0_pebias-0_shardt-0_outsb-0_xsb-0_xhbm-0_xsbl-0]",
    f"{_CORE}/router_topk/test_router_topk.py::TestRouterTopkKernel::test_router_topk[T-8_H-8192_E-128_k-8_act_fn-0"
    "_bias-1_prenorm-1_normprob-1_coltile-0_scatter-1_pebias-0_shardt-0_outsb-0_xsb-0_xhbm-0_xsbl-0]",
    f"{_CORE}/embeddings/test_rope.py::TestRopeKernel::test_rope_fast[64-1-1-16-True-True]",
    f"{_CORE}/embeddings/test_rope.py::TestRopeKernel::test_rope_fast[128-8-8-128-False-False]",
    f"{_CORE}/moe/moe_tkg/test_moe_tkg.py::TestMoeTkgKernel::test_moe_tkg_bfloat16[vnc-2_t-4_h-512_i-64_e-2_k-None"
    "_act-0_scaling-1_all_expert-1_quant_dtype-float8_e4m3_quant_type-2_dtype-float16_clamp-1_bias-1]",
    f"{_CORE}/moe/moe_tkg/test_moe_tkg.py::TestMoeTkgKernel::test_moe_tkg_bfloat16[vnc-2_t-4_h-512_i-64_e-4_k-2"
    "_act-3_scaling-1_all_expert-0_quant_dtype-float8_e4m3_quant_type-2_dtype-float16_clamp-1_bias-1]",
    f"{_CORE}/attention/test_attention_tkg.py::TestAttentionTkgKernel::test_attn_tkg_fast[bs_4-qh_2-sa_7-sp_256"
    "-spf_16384-d_128-bl_0-tpk_1-pid_1-fsr_1-osb_0-kosb_0-qsb_0-sm1_1-dt_bfloat16-sink_0-fp8_0-sw_0-1]",
    f"{_CORE}/attention/test_attention_tkg.py::TestAttentionTkgKernel::test_attn_tkg_fast[bs_4-qh_2-sa_7-sp_256"
    "-spf_16384-d_128-bl_0-tpk_1-pid_1-fsr_1-osb_0-kosb_0-qsb_0-sm1_1-dt_bfloat16-sink_0-fp8_0-sw_0-2]",
    f"{_CORE}/attention/test_attention_tkg.py::TestAttentionTkgKernel::test_attn_tkg_fast[bs_4-qh_1-sa_5-sp_1024"
    "-spf_10240-d_128-bl_0-tpk_0-pid_0-fsr_0-osb_0-kosb_0-qsb_1-sm1_0-dt_bfloat16-sink_0-fp8_1-sw_0-2]",
]

# What AWS's harness imports beyond the project's test environment (pyproject extra ``nki-library``).
HARNESS_MODULES = (
    "pytest_html",
    "xdist",
    "boto3",
    "fabric2",
    "allpairspy",
    "aws_embedded_metrics",
    "plotext",
    "filelock",
    "scipy",
)


def harness_missing() -> list[str]:
    return [m for m in HARNESS_MODULES if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One run of AWS's pytest over ``HARNESS_IDS`` in simulation mode with the emulator as its simulator; the outcome
    of each id. Runs in the snapshot (rootdir = the snapshot, as AWS runs it), writing only under a temp dir."""
    missing = harness_missing()
    if missing:
        pytest.skip(f"AWS's nki-library harness needs {', '.join(missing)} (pip install -e '.[nki-library]')")
    out = tmp_path_factory.mktemp("nki-library-harness")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(peer.REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONDONTWRITEBYTECODE="1",
        NKILIB_SIMULATION_RUN_ALL="1",  # AWS skips ids naming 4096/8192/16384 in simulation; ours are small
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.nki_library_aws_plugin",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(peer.library_dir()),
        "--test-mode",
        "simulation",
        "--output-directory",
        str(out / "o"),
        "-rA",
        "-q",
        *HARNESS_IDS,
    ]
    proc = subprocess.run(cmd, cwd=peer.library_dir(), env=env, capture_output=True, text=True, timeout=900)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    outcomes = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", line)
        if m:
            outcomes[m.group(2)] = m.group(1)
    outcomes["__log__"] = str(out / "log.txt")
    return outcomes


def _short(node: str) -> str:
    return node.split("/")[-1][:90]


@pytest.mark.parametrize("node", HARNESS_IDS, ids=[_short(n) for n in HARNESS_IDS])
def test_aws_harness(harness_run: dict[str, str], node: str) -> None:
    """AWS's own test, inputs, reference and validator, with the emulator as ``nki_cpu_simulator``."""
    got = next((v for k, v in harness_run.items() if node.endswith(k) or k.endswith(node)), None)
    assert got == "PASSED", f"{node}: {got or 'not run'} (log: {harness_run['__log__']})"


def test_snapshot_names_its_commit() -> None:
    """The snapshot says which nki-library commit it is (SOURCE), so a run can be traced to AWS's code."""
    assert re.search(r"[0-9a-f]{7,40}", (Path(peer.library_dir()) / "SOURCE").read_text())
