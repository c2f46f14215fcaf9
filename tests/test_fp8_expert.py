"""The FP8 numerics every quantized matrix uses (kernels/fp8_expert.py: fp8_linear, fp8_experts),
against float64 and ml_dtypes' Trainium2 FP8 (`float8_e4m3`), op by op, where no rounding flip can hide an error."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from vllm_trn_plugin import envs
from vllm_trn_plugin.kernels.fp8 import fp8_linear, quantize_per_token
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights, fp8_experts

E4M3 = ml_dtypes.float8_e4m3  # Trainium2's IEEE-style E4M3: max 240, NaN beyond


def ref_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """float64: s = amax / 240, q = RNE_e4m3(x / s) (a zero row: s = 1, q = 0)."""
    xd = x.double().numpy()
    amax = np.abs(xd).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / 240.0, 1.0)
    return (xd / s).astype(E4M3).astype(np.float64), s[:, 0]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_quantize_per_token_is_rne_e4m3_with_amax_scale(scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 1000))
    x = torch.randn(64, 512, generator=g) * scale
    x[3] = 0  # a zero row
    x[5, 7] = -x[5].abs().max() * 1.5  # negative amax
    xq, s_tok = quantize_per_token(x)
    q_ref, s_ref = ref_quantize(x)
    q = xq.double().numpy()
    assert np.all(np.abs(q) <= 240) and not np.isnan(q).any()
    nz = np.arange(64) != 3
    # s_tok = amax * fp32(1 / 240): within one float32 ulp of amax / 240
    assert np.allclose(s_tok.double().numpy()[nz], s_ref[nz], rtol=2**-23, atol=0)
    assert (q[3] == 0).all() and float(s_tok[3]) > 0  # a zero row: codes 0 whatever its (floored) scale
    # The op multiplies by 240 * fp32(1 / amax) in float32, the reference divides in float64: they may only disagree
    # on an input that sits within float32 rounding of an FP8 midpoint, and then by one FP8 step.
    diff = q != q_ref
    assert diff.mean() < 1e-4, diff.mean()
    if diff.any():
        y = (x.double().numpy() / s_ref[:, None])[diff]
        step = np.abs(q - q_ref)[diff]
        assert np.all(step <= 2.0 ** (np.floor(np.log2(np.abs(y))) - 3) * 1.0001)


def test_fp8_linear_scales_apply_to_the_accumulator() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 256, generator=g)
    w = (torch.randn(96, 256, generator=g) * 40).clamp(-240, 240).to(torch.float8_e4m3fn)
    s_row = torch.exp2(torch.randint(-12, -4, (96,), generator=g).float())
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    y = fp8_linear(x, w, s_row, bias)
    q, s = ref_quantize(x)
    ref = (q @ w.double().numpy().T) * s[:, None] * s_row.double().numpy()[None, :] + bias.double().numpy()
    ok = (quantize_per_token(x)[0].double().numpy() == q).all(1)  # rows without a rounding flip
    assert ok.sum() >= 16
    np.testing.assert_allclose(y.double().numpy()[ok], ref[ok], rtol=2e-6, atol=2e-6 * np.abs(ref).max())
    assert y.dtype == torch.float32 and y.shape == (17, 96)


def random_routed_experts(
    seed: int, E: int, H: int, I: int, T: int, K: int
) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor]:
    """E random FP8 experts (row-major), and T tokens x [T, H] each routed to K distinct experts with random weights:
    (experts, x, topk_weights, topk_ids)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 30).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, generator=g) * 30).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(E, 2 * I, generator=g) * 1e-2, torch.rand(E, H, generator=g) * 1e-2
    b13, b2 = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, generator=g)
    return ExpertWeights(w13, s13, b13, w2, s2, b2), x, wts, ids


def test_fp8_experts_route_weight_and_sum() -> None:
    """Each token's output is sum_k w_k * down_e(SiLU(gate_e x) * up_e x) over its own experts: checked against the
    per-token composition of fp8_linear (whose numerics are checked above); a wrong expert, weight or order
    would be off by O(1)."""
    E, H, I, T, K = 6, 128, 64, 9, 2
    experts, x, wts, ids = random_routed_experts(2, E, H, I, T, K)
    w13, s13, b13, w2, s2, b2 = experts
    out = fp8_experts(x, wts, ids, experts)
    for t in range(T):
        want = torch.zeros(H)
        for k in range(K):
            e = int(ids[t, k])
            gate, up = fp8_linear(x[t : t + 1], w13[e], s13[e], b13[e]).chunk(2, -1)
            want += wts[t, k] * fp8_linear(torch.nn.functional.silu(gate) * up, w2[e], s2[e], b2[e])[0]
        torch.testing.assert_close(out[t], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def _integer_operands(t: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, k] and an FP8 weight [n, k] whose products and every partial sum are exact in float32 (integers |v| <=
    16, one 240 per row: each row quantizes with scale 1 to itself), so any accumulation order gives the float64
    sum bit for bit and a path that rounds a product or an operand shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (t, k), generator=g).float()
    x[:, 0] = 240.0
    w = torch.randint(-16, 17, (n, k), generator=g).float()
    w[:, 1] = -240.0
    return x, w.to(torch.float8_e4m3fn)


def _every_fp8_value() -> torch.Tensor:
    """The 253 finite E4M3FN values with |v| <= 240 (the packed range), subnormals and both zeros included."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return v[v.float().abs() <= 240]


def _avx512_bf16_kernel() -> None:
    """Skip where this CPU lacks AVX-512 BF16; fail where it has it and the kernel did not load (set-up installs
    the C compiler that builds it)."""
    from vllm_trn_plugin.kernels import fp8_cpu

    if fp8_cpu.kernel() is None:
        assert " avx512_bf16" not in _cpu_flags(), "this CPU has AVX-512 BF16 but the compiled FP8 kernel did not load"
        pytest.skip("this CPU has no AVX-512 BF16: its FP8 layers compute from FBGEMM's copy")


def _cpu_flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


ISAS = ["amx-bf16", "avx512-bf16"]


def _native_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the compiled kernel compute on `isa` (VLLM_TRN_NATIVE_GEMM): skip where this CPU lacks it, fail where it
    has it and the kernel cannot use it."""
    from vllm_trn_plugin.kernels import fp8_cpu

    monkeypatch.setenv(envs.NATIVE_GEMM, "1" if isa == "amx-bf16" else "avx512")
    _avx512_bf16_kernel()
    if isa not in fp8_cpu.isas():
        # torch's own probe (CPUID and the OS's tile permission): /proc/cpuinfo lists AMX on kernels that cannot
        # enable it (before Linux 5.16), so it cannot say whether the kernel should have run on AMX
        torch_amx = torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx()
        assert not torch_amx, "torch runs AMX tiles in this process but the FP8 kernel cannot use them"
        pytest.skip("this CPU has no AMX: its FP8 layers compute with vdpbf16ps")
    assert fp8_cpu.isas()[0] == isa


PATHS = ["AMX copy", "AVX-512 BF16 copy", "FBGEMM copy", "fp32 copy", "fp8 only (row chunks)", "FP8 GEMM (_scaled_mm)"]


@pytest.mark.parametrize("path", PATHS)
def test_fp8_products_exact_on_every_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the FP8 x FP8 products are computed (fp8.fp8_matmul: the CPU's compute copies made at load,
    the bf16 dot-product kernel's where the CPU has AVX-512 BF16 and FBGEMM's fp16 copy elsewhere; an fp32 copy;
    FP8-only residency, converting row chunks per call; torch's FP8 GEMM, the graph form on a device) gives the
    float64 products bit for bit: on sums exact in fp32, and on every E4M3 value once (a copy that rounded or
    flushed a subnormal, or a path that rounds its output to bf16, would fail)."""
    from vllm_trn_plugin.kernels import fp8 as f

    monkeypatch.setattr(f, "_CHUNK_ELEMS", 7 * 256)  # several chunks and a short last one below
    if path in ("AMX copy", "AVX-512 BF16 copy"):
        _native_isa("amx-bf16" if path == "AMX copy" else "avx512-bf16", monkeypatch)
    if path == "FBGEMM copy":
        monkeypatch.setenv(envs.NATIVE_GEMM, "0")
        if not f._fbgemm_fp16():
            pytest.skip("this torch has no exact FBGEMM fp16 GEMM: its FP8 layers hold fp32 copies")

    def products(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if path in ("AMX copy", "AVX-512 BF16 copy", "FBGEMM copy"):
            copy = f.fp8_compute_copy(w)
            assert copy.dtype == (torch.uint8 if path == "FBGEMM copy" else torch.bfloat16)
            return f.fp8_matmul(xq, w, copy)
        if path == "fp32 copy":
            return f.fp8_matmul(xq, w, w.float())
        if path == "fp8 only (row chunks)":
            return f.fp8_matmul(xq, w)
        return f.scaled_mm_products(xq, w)

    x, w = _integer_operands(5, 96, 256, seed=3)
    xq, s_tok = quantize_per_token(x)
    assert torch.equal(s_tok, torch.ones(5)) and torch.equal(xq.float(), x)
    got = products(xq, w)
    assert got.dtype == torch.float32 and torch.equal(got.double(), x.double() @ w.double().t())

    v = _every_fp8_value()  # one weight row per value, against activations 240 and 2^-9 (the extremes)
    w = torch.zeros(v.numel(), 256, dtype=torch.float8_e4m3fn)
    w[:, 0], w[:, 1] = v, v
    xq = torch.zeros(2, 256)
    xq[0, 0], xq[1, 1] = 240.0, 2.0**-9
    got = products(xq.to(torch.float8_e4m3fn), w)
    assert torch.equal(got.double(), xq.double() @ w.double().t())


@pytest.mark.parametrize("isa", ISAS)
def test_native_kernel_on_every_tile_shape(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dot-product kernel's tiles (vdpbf16ps: 16 rows by a k pair per vector, up to 4 row blocks by 4 tokens or 3
    by 8, work items of 4 or 6 blocks; AMX: 4 row blocks by up to 16 tokens by 32 k; 64 tokens per work item): rows,
    columns and tokens that fill no tile (odd K, K not a multiple of 32, a short last row block, 9, 17 and 130
    tokens), an empty batch, and activations with a row stride (a slice): the float64 products, bit for bit."""
    from vllm_trn_plugin.kernels import fp8_cpu

    _native_isa(isa, monkeypatch)
    cases = [(0, 16, 4), (1, 1, 1), (3, 17, 3), (9, 100, 77), (130, 65, 256), (8, 200, 64), (17, 33, 96)]
    for t, n, k in cases + [(16, 1000, 1024), (9, 4100, 64), (2, 48, 80)]:  # 4100 rows: 6-block work items
        x, w = _integer_operands(t, n, k + 6, seed=t + n + k)
        xq = x.to(torch.float8_e4m3fn)[:, 3 : 3 + k]  # a row stride k + 6
        got = fp8_cpu.products(xq, fp8_cpu.pack(w[:, 3 : 3 + k]), n)
        assert torch.equal(got.double(), xq.double() @ w[:, 3 : 3 + k].double().t()), (t, n, k)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_cpu.products(xq, fp8_cpu.pack(w[:, :10]), n)


@pytest.mark.parametrize("isa", ISAS)
def test_native_kernel_groups_rows_by_expert(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One call for a layer's experts (fp8_experts): rows bounds[g] .. bounds[g+1] multiply copy g, empty groups and
    groups longer than a work item's 64 tokens included, each the float64 products of its own matrix; bounds that
    do not cover the rows in order are refused."""
    from vllm_trn_plugin.kernels import fp8_cpu

    _native_isa(isa, monkeypatch)
    x, _ = _integer_operands(150, 1, 96, seed=5)
    ws = [_integer_operands(1, 40, 96, seed=6 + g)[1] for g in range(5)]
    bounds = [0, 3, 3, 70, 71, 150]
    xq = x.to(torch.float8_e4m3fn)
    got = fp8_cpu.products(xq, [fp8_cpu.pack(w) for w in ws], 40, bounds)
    for g, w in enumerate(ws):
        rows = slice(bounds[g], bounds[g + 1])
        assert torch.equal(got[rows].double(), xq[rows].double() @ w.double().t()), g
    for bad in ([0, 3, 2, 70, 71, 150], [0, 3, 3, 70, 149], [1, 3, 3, 70, 71, 150]):
        with pytest.raises(ValueError, match="ascending row offsets"):
            fp8_cpu.products(xq, [fp8_cpu.pack(w) for w in ws], 40, bad)


@pytest.mark.parametrize("isa", ISAS)
def test_native_kernel_applies_scales_and_bias_as_torch_does(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's epilogue, (sum * s_tok[t]) * row_scale[r] + bias[r] in fp32 as it stores (what fp8_linear and the
    routed experts take from it): bit for bit torch's ops on the kernel's own sums, for rows that fill no vector, any
    subset of the three, one scale and bias vector per expert, a bf16 bias, and an infinite or NaN scale propagating
    as torch's does. A fused multiply-add, a reordered product or a missed mask would fail."""
    from vllm_trn_plugin.kernels import fp8_cpu

    _native_isa(isa, monkeypatch)
    g = torch.Generator().manual_seed(9)
    t, n, k, groups = 19, 45, 96, 3
    xq, _ = quantize_per_token(torch.randn(t, k, generator=g))
    ws = [(torch.randn(n, k, generator=g) * 30).to(torch.float8_e4m3fn) for _ in range(groups)]
    copies, bounds = [fp8_cpu.pack(w) for w in ws], [0, 7, 7, t]
    s_tok = torch.rand(t, generator=g) * 1e-2
    s_tok[3] = float("inf")
    scales = [torch.rand(n, generator=g) * 1e-3 for _ in range(groups)]
    scales[0][5] = float("nan")
    biases = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(groups)]
    sums = fp8_cpu.products(xq, copies, n, bounds)
    rows = torch.repeat_interleave(torch.arange(groups), torch.tensor(bounds).diff())
    per_row = {"row_scale": torch.stack(scales)[rows], "bias": torch.stack(biases)[rows].float()}
    for given in [("s_tok",), ("row_scale",), ("bias",), ("s_tok", "row_scale"), ("s_tok", "row_scale", "bias")]:
        want = sums
        if "s_tok" in given:
            want = want * s_tok[:, None]
        if "row_scale" in given:
            want = want * per_row["row_scale"]
        if "bias" in given:
            want = want + per_row["bias"]
        kw = {"s_tok": s_tok, "row_scale": scales, "bias": biases}
        got = fp8_cpu.products(xq, copies, n, bounds, **{name: kw[name] for name in given})
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"epilogue {given}")
    one = fp8_cpu.products(xq[:7], copies[0], n, s_tok=s_tok[:7], row_scale=scales[0], bias=biases[0])
    torch.testing.assert_close(one, sums[:7] * s_tok[:7, None] * scales[0] + biases[0].float(), rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip
    with pytest.raises(ValueError, match="row_scale must be 3"):
        fp8_cpu.products(xq, copies, n, bounds, row_scale=scales[:2])


def test_fp8_linear_from_its_compute_copy_equals_the_definition() -> None:
    """fp8_linear with the weight's compute copy (what a CPU layer computes with), row scales and a bias: the float64
    definition, bit for bit on operands whose sums are exact (power-of-two row scales, a bias exact in fp32)."""
    from vllm_trn_plugin.kernels.fp8 import fp8_compute_copy

    x, w = _integer_operands(9, 64, 256, seed=4)
    s_row = torch.exp2(torch.randint(-12, -4, (64,))).float()
    bias = torch.randint(-8, 9, (64,)).float() / 4
    y = fp8_linear(x, w, s_row, bias, fp8_compute_copy(w))
    ref = (x.double() @ w.double().t()) * s_row.double() + bias.double()
    assert torch.equal(y.double(), ref)


def test_fp8_experts_with_compute_copies_equal_without() -> None:
    """The routed experts from their compute copies (made once from the kernel-layout stacks, as the MoE layer holds
    them) equal the same experts converting their weights per call, bit for bit. Every sum is exact in fp32 (integer
    activations and gate/up weights, down rows with one nonzero each, at scattered columns), so the paths' different
    accumulation orders cannot part them while a misplaced weight in either layout, or a scale or bias applied to
    the wrong expert's rows, would."""
    from vllm_trn_plugin.kernels.fp8_expert import expert_compute_copies, to_kernel_layout

    E, H, I, T = 4, 256, 128, 11
    plain, _, wts, ids = random_routed_experts(5, E, H, I, T, 2)
    x, _ = _integer_operands(T, 1, H, seed=6)
    w13 = torch.stack([_integer_operands(1, 2 * I, H, seed=7 + e)[1] for e in range(E)])
    g = torch.Generator().manual_seed(8)
    w2 = torch.zeros(E, H, I)
    w2.scatter_(2, torch.randint(0, I, (E, H, 1), generator=g), torch.randn(E, H, 1, generator=g) * 30)
    plain = plain._replace(w13=w13, w2=w2.to(torch.float8_e4m3fn))
    tiled = plain._replace(w13=to_kernel_layout(plain.w13), w2=to_kernel_layout(plain.w2))
    copies = expert_compute_copies(tiled)
    assert copies is not None and len(copies[0]) == len(copies[1]) == E
    want = fp8_experts(x, wts, ids, plain)
    assert want.abs().amax() > 0 and torch.equal(fp8_experts(x, wts, ids, tiled, copies), want)


def test_fp8_residency_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_TRN_FP8_RESIDENCY: `copy` (the default) gives a CPU layer its compute copy, `fp8` none (the layer then
    converts row chunks per call), anything else is refused naming the variable."""
    from vllm_trn_plugin.model_executors.mxfp4_fp8 import compute_copy

    w = torch.ones(32, 64).to(torch.float8_e4m3fn)
    monkeypatch.delenv("VLLM_TRN_FP8_RESIDENCY", raising=False)
    assert compute_copy(w) is not None
    monkeypatch.setenv("VLLM_TRN_FP8_RESIDENCY", "fp8")
    assert compute_copy(w) is None
    monkeypatch.setenv("VLLM_TRN_FP8_RESIDENCY", "bf16")
    with pytest.raises(ValueError, match="VLLM_TRN_FP8_RESIDENCY='bf16'"):
        compute_copy(w)


def test_compiled_quantize_equals_torch_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_cpu.quantize (one C pass, what CPU layers quantize with) against quantize_per_token's torch ops: codes
    and scales bit for bit on every finite bf16 value, on fp32 values at, beside and between E4M3 grid points (rows
    whose amax is 240, so the multiplier is exactly 1 and rounding ties reach the conversion), and on random rows
    from 1e-30 to 1e30 with zero and negative-zero rows. A NaN or an infinity is left to torch."""
    from vllm_trn_plugin.kernels import fp8_cpu
    from vllm_trn_plugin.kernels.fp8 import AMAX_FLOOR, INV_FP8_MAX

    def torch_ops(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with monkeypatch.context() as m:
            m.setenv(envs.NATIVE_GEMM, "0")
            return quantize_per_token(x)

    def check(x: torch.Tensor) -> None:
        got = fp8_cpu.quantize(x, AMAX_FLOOR, INV_FP8_MAX)
        assert got is not None, "the compiled quantizer did not load (set-up installs the C compiler)"
        want = torch_ops(x)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())]
    check(every[: every.numel() // 256 * 256].view(-1, 256))
    grid = _every_fp8_value().float().unique()
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])])
    near = torch.cat([near, -near])
    rows = near[: near.numel() // 63 * 63].view(-1, 63)
    check(torch.cat([torch.full((rows.shape[0], 1), 240.0), rows], 1))
    g = torch.Generator().manual_seed(9)
    for scale in (1e-30, 1e-6, 1e-2, 1.0, 37.0, 1e5, 1e30):
        x = torch.randn(16, 1000, generator=g) * scale
        x[3], x[4] = 0.0, -0.0
        check(x)
    x = torch.randn(3, 10, generator=g)
    x[1, 2] = float("inf")
    assert fp8_cpu.quantize(x, AMAX_FLOOR, INV_FP8_MAX) is None


def test_quantize_traced_into_a_graph_keeps_torch_ops() -> None:
    """Traced (the Neuron step graphs quantize FP8 latents and activations), quantize_per_token stays torch's ops: a
    fullgraph compile succeeds, no compiled call is baked into it, and the graph gives the eager bits."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = torch.compile(quantize_per_token, fullgraph=True, backend="aot_eager")(x)
    want = quantize_per_token(x)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    ops = {str(n.target) for n in make_fx(quantize_per_token)(x).graph.nodes}
    assert "aten.amax.default" in ops
