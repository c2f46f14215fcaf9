"""The absorbed latent decode NKI kernel (kernels/latent_decode_nki.py) in the NKI emulator, and the op's torch
path (kernels/latent_decode.py), against the op's definition `latent_decode_reference` and the unabsorbed
attention in float64 (`expanded_float64`, here).

Inputs are built the way the model holds them: a paged latent cache whose unwritten rows are NaN,
a key-scale side store (NaN where never written, 1 / rms(W_k,g c) where written), shuffled
block tables whose entries past a sequence's used blocks are stale (other sequences' blocks,
never-written blocks, 0). An FP8 cache (`FP8`) holds `fp8.quantize_per_token` codes with their per-token
dequantization scales (NaN where never written) and key scales computed from the dequantized latents.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from tests.emulator_helpers import assert_counters_equal_cost, lnc2
from vllm_trn_plugin.kernels import nki_emu
from vllm_trn_plugin.kernels.fp8 import quantize_per_token
from vllm_trn_plugin.kernels.latent_decode import (
    DECODE_TILE,
    AbsorbedWeights,
    PagedLatents,
    dequantize_latents,
    gather_blocks,
    latent_decode_reference,
    latent_decode_torch,
)
from vllm_trn_plugin.kernels.latent_decode_nki import (
    BUCKETS,
    kernel_inputs,
    latent_decode_cost,
    latent_decode_kernel,
    latent_decode_nki,
    pick_bucket,
    row_table,
)
from vllm_trn_plugin.kernels.nki_shim import simulate

REAL = dict(H=32, Hkv=4, hd=128, r=256)
SMALL = dict(H=8, Hkv=2, hd=64, r=128)
EPS = 1e-5
FP8 = torch.float8_e4m3fn


class Case(NamedTuple):
    """The op's arguments: queries, the layer's absorbed weights, the batch's paged history."""

    q: torch.Tensor
    w: AbsorbedWeights
    h: PagedLatents


def make_case(
    lens: list[int],
    block_size: int,
    H: int,
    Hkv: int,
    hd: int,
    r: int,
    cache_dtype: torch.dtype = torch.bfloat16,
    q_dtype: torch.dtype = torch.bfloat16,
    w_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Case:
    """Random model-like inputs; blocks shuffled, stale table tails, NaN where never written."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // block_size) for L in lens]
    n_blocks = sum(need) + spare_blocks
    perm = torch.randperm(n_blocks, generator=g)
    max_blocks = max(need) + 2
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    w_k = torch.randn(Hkv, hd, r, generator=g) / math.sqrt(r)
    w_v = torch.randn(Hkv, hd, r, generator=g) / math.sqrt(r)
    cache = torch.full((n_blocks * block_size, r), float("nan"), dtype=cache_dtype)
    key_scales = torch.full((n_blocks * block_size, Hkv), float("nan"))
    latent_scales = torch.full((n_blocks * block_size,), float("nan")) if cache_dtype == FP8 else None
    used = 0
    for b, L in enumerate(lens):
        ids = perm[used : used + need[b]]
        used += need[b]
        table[b, : need[b]] = ids
        # stale tail: a never-written block, another sequence's block, 0
        stale = torch.tensor([perm[-1], perm[0], 0], dtype=torch.int32)
        table[b, need[b] :] = stale.repeat(max_blocks)[: max_blocks - need[b]]
        i = torch.arange(L)
        rows = ids[i // block_size] * block_size + i % block_size
        c = torch.randn(L, r, generator=g)
        if cache_dtype == FP8:  # the latent as stored: codes and scales, s_g,i from their product
            cache[rows], latent_scales[rows] = quantize_per_token(c)
            c = dequantize_latents(cache[rows], latent_scales[rows])
        else:
            c = c.to(cache_dtype)
            cache[rows] = c
        k = (c.float() @ w_k.to(w_dtype).float().reshape(Hkv * hd, r).t()).view(L, Hkv, hd)
        key_scales[rows] = torch.rsqrt(k.pow(2).mean(-1) + EPS)
    q = (2.0 * torch.randn(len(lens), H, hd, generator=g)).to(q_dtype)
    gamma = (1.0 + 0.2 * torch.randn(hd, generator=g)).to(q_dtype)
    w_k, w_v = w_k.to(w_dtype), w_v.to(w_dtype)
    return Case(
        q,
        AbsorbedWeights(gamma, w_k, w_v, hd**-0.5),
        PagedLatents(cache, key_scales, table, torch.tensor(lens), block_size, latent_scales),
    )


def expanded_float64(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The unabsorbed attention in float64: K and V rebuilt from the latents, softmax, sum over V.

    Returns (out, sum_i p_i |v_i|) [B, H, hd]; the second bounds what rounding p costs.
    """
    (q, w, h), (B, H, hd) = case, case.q.shape
    Hkv = w.w_k.shape[0]
    G = H // Hkv
    w_kv = torch.cat([w.w_k, w.w_v]).double().reshape(2 * Hkv * hd, -1)
    out = torch.empty(B, H, hd, dtype=torch.float64)
    mix = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        L, bs = int(h.seq_lens[b]), h.block_size
        i = torch.arange(L)
        rows = h.block_table[b].long()[i // bs] * bs + i % bs
        c = h.cache.reshape(-1, h.cache.shape[-1])[rows].double()
        if h.latent_scales is not None:  # FP8: the dequantized latents d_i * code_i, exact in float64
            c = c * h.latent_scales.reshape(-1)[rows].double()[:, None]
        s = h.key_scales.reshape(-1, Hkv)[rows].double().t()[:, :, None]  # [Hkv, L, 1]
        kv = (c @ w_kv.t()).view(L, 2, Hkv, hd).permute(1, 2, 0, 3)  # [2, Hkv, L, hd]
        k = w.gamma.double() * kv[0] * s
        v = kv[1]
        qh = q[b].double().view(Hkv, G, hd)
        p = torch.softmax(w.scale * torch.einsum("gjd,gld->gjl", qh, k), dim=-1)
        out[b] = torch.einsum("gjl,gld->gjd", p, v).reshape(H, hd)
        mix[b] = torch.einsum("gjl,gld->gjd", p, v.abs()).reshape(H, hd)
    return out, mix


def run_kernel(case: Case, bucket: int | None = None) -> torch.Tensor:
    return latent_decode_nki(*case, runner=simulate, bucket=bucket)


def assert_close(out: torch.Tensor, case: Case, ref: torch.Tensor | None = None) -> None:
    """Kernel vs the float64 expanded attention (and the fp32 reference when given).

    The kernel's one low-precision step is p in the cache dtype for the p^T C matmul (the
    operands must pair with the latents); rounding p to bf16 (unit roundoff 2^-8) moves out_h by
    at most 2^-8 sum_i p_i |v_i| elementwise. Everything else is fp32 (scores, softmax state, PSUM):
    1e-5 of the output scale covers it. An FP8 cache is compared with its dequantized latents (the op's
    definition): its codes enter the matmuls exactly (as bf16), and its one rounding is p_i d_i, formed
    in fp32 and rounded to bf16 once, so out_h moves by at most 2^-8 sum_i p_i d_i |W_v code_i| =
    2^-8 sum_i p_i |v_i|, the bf16 bound.
    """
    f64, mix = expanded_float64(case)
    p_round = 2.0**-8 if case.h.cache.dtype in (torch.bfloat16, FP8) else 0.0
    bound = p_round * mix + 1e-5 * f64.abs().amax(dim=(1, 2), keepdim=True)
    assert torch.isfinite(out).all()
    assert ((out.double() - f64).abs() <= bound).all(), float(((out.double() - f64).abs() / bound).max())
    if ref is not None:
        assert ((out.double() - ref.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize(
    "lens, block_size, geometry, dtypes, bucket",
    [
        ([1, 77, 200, 256], 16, SMALL, (torch.float32, torch.float32, torch.float32), 256),
        ([1, 77, 200, 256], 32, SMALL, (torch.bfloat16, torch.bfloat16, torch.bfloat16), 384),
        ([300, 2304, 1], 128, REAL, (torch.bfloat16, torch.bfloat16, torch.float32), None),
        ([3000, 129, 4352], 512, REAL, (torch.float32, torch.float32, torch.float32), None),
        ([1, 77, 200, 256], 16, SMALL, (FP8, torch.bfloat16, torch.float32), 256),
        ([300, 2304, 1], 128, REAL, (FP8, torch.bfloat16, torch.float32), None),
        ([3000, 129, 4352], 512, REAL, (FP8, torch.float32, torch.float32), None),
    ],
    ids=[
        "fp32-small-bs16",
        "bf16-small-bs32",
        "bf16-real-2304-bs128",
        "fp32-real-4352-bs512",
        "fp8-small-bs16",
        "fp8-real-2304-bs128",
        "fp8-real-4352-bs512",
    ],
)
def test_kernel_matches_reference_and_float64(
    lens: list[int], block_size: int, geometry: dict[str, int], dtypes: tuple[torch.dtype, ...], bucket: int | None
) -> None:
    cache_dtype, q_dtype, w_dtype = dtypes
    case = make_case(lens, block_size, **geometry, cache_dtype=cache_dtype, q_dtype=q_dtype, w_dtype=w_dtype, seed=1)
    ref = latent_decode_reference(*case)
    f64, _ = expanded_float64(case)
    assert float((ref.double() - f64).abs().max() / f64.abs().max()) < 1e-5  # the reference is the op
    out = run_kernel(case, bucket=bucket)
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    assert_close(out, case, ref)
    if cache_dtype == FP8:  # the torch path folds d_i the kernel's way
        got = latent_decode_torch(*case)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def subset(case: Case, idx: list[int]) -> Case:
    h = case.h._replace(block_table=case.h.block_table[idx], seq_lens=case.h.seq_lens[idx])
    return Case(case.q[idx], case.w, h)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_every_batch_size_equals_single_sequence_runs(cache_dtype: torch.dtype) -> None:
    """Batches 1..32 drawn in shuffled orders from 32 sequences: each row bit-equal to its own run.

    A one-tile bucket keeps the 560 sequence runs quick; what differs between batch sizes is the
    per-sequence addressing (row table, seq_lens column, output rows), not the tile loop.
    """
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 129, (32,), generator=g).tolist()
    lens[:3] = [1, 127, 128]
    case = make_case(lens, 16, **REAL, cache_dtype=cache_dtype, seed=2)
    single = [run_kernel(subset(case, [i]), bucket=128)[0] for i in range(32)]
    assert_close(torch.stack(single), case)
    for n in range(1, 33):
        idx = torch.randperm(32, generator=g)[:n].tolist()
        out = run_kernel(subset(case, idx), bucket=128)
        for j, i in enumerate(idx):
            assert torch.equal(out[j], single[i]), (n, j, i)


@pytest.mark.parametrize(
    "bucket, block_size, cache_dtype",
    [
        (2304, 16, torch.bfloat16),
        (4352, 128, torch.bfloat16),
        (8448, 512, torch.bfloat16),
        (16640, 64, torch.bfloat16),
        (2304, 16, FP8),
        (16640, 64, FP8),
    ],
    ids=["2304-16-bf16", "4352-128-bf16", "8448-512-bf16", "16640-64-bf16", "2304-16-fp8", "16640-64-fp8"],
)
def test_context_lengths_at_bucket_edges(bucket: int, block_size: int, cache_dtype: torch.dtype) -> None:
    """Real geometry and bucket; L = 1, 127, 128, 129, bucket - 1, bucket in one batch. An FP8 cache at the smallest
    and the largest bucket (what differs between buckets is the tile count, the same for both dtypes; the FP8
    kernel's 4352-key bucket runs in test_kernel_matches_reference_and_float64)."""
    lens = [1, 127, 128, 129, bucket - 1, bucket]
    assert pick_bucket(bucket) == bucket and pick_bucket(bucket - 1) == bucket
    case = make_case(lens, block_size, **REAL, cache_dtype=cache_dtype, seed=bucket)
    assert_close(run_kernel(case), case)
    over = make_case([bucket + 1], block_size, **REAL, cache_dtype=cache_dtype, seed=3)
    with pytest.raises(ValueError, match="exceeds the kernel's bucket"):
        run_kernel(over, bucket=bucket)
    if bucket == BUCKETS[-1]:
        with pytest.raises(ValueError, match="largest decode bucket"):
            run_kernel(over)
    else:
        assert pick_bucket(bucket + 1) == BUCKETS[BUCKETS.index(bucket) + 1]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_unwritten_rows_and_stale_table_entries_have_no_effect(cache_dtype: torch.dtype) -> None:
    """NaN or garbage in never-written cache rows / key scales (and an FP8 cache's dequantization scales) and in
    table entries past L changes no bit."""
    lens = [5, 200, 129]
    case = make_case(lens, 16, **REAL, cache_dtype=cache_dtype, seed=4, spare_blocks=6)
    base = run_kernel(case, bucket=384)
    assert_close(base, case)
    (q, w, h) = case
    unwritten = torch.isnan(h.key_scales[:, 0])
    assert unwritten.sum() > 6 * 16  # spare blocks and the tails of partly used blocks
    garbage = h._replace(cache=h.cache.clone(), key_scales=h.key_scales.clone(), block_table=h.block_table.clone())
    if cache_dtype == FP8:
        assert torch.isnan(h.latent_scales[unwritten]).all() and torch.isnan(h.cache[unwritten].float()).all()
        garbage = garbage._replace(latent_scales=h.latent_scales.clone())
        # the largest code, times a huge scale (written as bits: torch has no masked fill for FP8)
        garbage.cache.view(torch.uint8)[unwritten] = torch.tensor(240.0).to(FP8).view(torch.uint8)
        garbage.latent_scales[unwritten] = 3e4
    else:
        garbage.cache[unwritten] = 3e4
    garbage.key_scales[unwritten] = -7.0
    for b, L in enumerate(lens):
        garbage.block_table[b, -(-L // 16) :] = 2**30  # far out of range
    assert torch.equal(run_kernel(Case(q, w, garbage), bucket=384), base)

    # The kernel itself (not only the wrapper's row table) ignores rows past L: point them at
    # never-written (NaN) rows that are in range.
    rows = row_table(h.block_table, h.seq_lens, 16, 384, h.cache.shape[0])
    nan_row = int(torch.nonzero(unwritten)[0])
    rows[rows == h.cache.shape[0]] = nan_row
    fp8_args = () if h.latent_scales is None else (h.latent_scales,)
    out = simulate(latent_decode_kernel)(
        q, w.gamma, w.w_k, w.w_v, h.cache, h.key_scales, rows, h.seq_lens.int(), w.scale, *fp8_args
    )
    assert torch.equal(out, base)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_torch_path_agrees_with_reference(cache_dtype: torch.dtype) -> None:
    """The model's torch path (`latent_decode_torch`: one sequence at a time, DECODE_TILE-key tiles, online softmax)
    computes the same op, across a tile boundary."""
    lens = [1, 300, DECODE_TILE + 700]
    case = make_case(lens, 16, **REAL, cache_dtype=cache_dtype, seed=6)
    ref = latent_decode_reference(*case)
    got = latent_decode_torch(*case)
    for b in range(len(lens)):
        assert torch.allclose(got[b], ref[b], rtol=0, atol=1e-5 * float(ref[b].abs().max()))


def extra_bytes(lens: list[int], per_key: int) -> int:
    """What the kernel reads beyond the analytic minimum: per sequence L_b and the row of key 0 broadcast to the 128
    partitions, the row indices of its ceil(L_b / 128) tiles, and the last tile's keys past L_b (pointed at key 0)."""
    tiles = [-(-L // 128) for L in lens]
    return sum(2 * 128 * 4 + n * 128 * 4 + (n * 128 - L) * per_key for n, L in zip(tiles, lens))


@pytest.mark.parametrize("lnc", [1, 2])
def test_counters_equal_cost_formula(lnc: int) -> None:
    """DMA bytes, descriptors and times, instruction counts of one real-geometry call equal `latent_decode_cost`,
    program by program, at LNC=1 and LNC=2 (program 0 decodes rows 0-1, program 1 rows 2-3)."""
    lens = [100, 2304, 1000, 2000]
    case = make_case(lens, 128, **REAL, seed=7)
    # the cache as vLLM allocates it: [num_blocks, block_size, r]
    h = case.h._replace(
        cache=case.h.cache.view(-1, 128, REAL["r"]), key_scales=case.h.key_scales.view(-1, 128, REAL["Hkv"])
    )
    paged = case._replace(h=h)
    runner = simulate if lnc == 1 else lnc2
    assert torch.equal(latent_decode_nki(*paged, runner=runner), latent_decode_nki(*case, runner=runner))
    c = nki_emu.last_counters()
    cost = latent_decode_cost(lens, w_bytes=4, lnc=lnc)  # bf16 cache, q and gamma; fp32 weights as the model holds them
    assert_counters_equal_cost(c, cost)
    # each latent byte and key scale of the valid keys read once; beside them only L_b, the row indices and the last
    # tile's keys past L_b; at LNC=2 each core reads the weights and gamma once more
    per_key = 2 * REAL["r"] + 4 * REAL["Hkv"]
    weights = 2 * REAL["Hkv"] * REAL["hd"] * REAL["r"] * 4 + REAL["hd"] * 2
    assert cost["dma_bytes"] - cost["dma_bytes_min"] == extra_bytes(lens, per_key) + (lnc - 1) * weights
    assert c.dma_bytes < 1.05 * cost["dma_bytes_min"] + (lnc - 1) * weights


def test_fp8_counters_equal_cost_formula_and_halve_the_latent_bytes() -> None:
    """An FP8 cache at the shape of `test_counters_equal_cost_formula`: counters equal `latent_decode_cost(fp8=True)`,
    and against the bf16 cache of the same latents the kernel moves exactly r bytes less per gathered key (2r -> r
    latent bytes) and 4 more (its dequantization scale): every other byte and every PE instruction is the same, one
    more gather per tile."""
    lens, r = [100, 2304, 1000, 2000], REAL["r"]
    bf16 = make_case(lens, 128, **REAL, seed=7)
    fp8 = make_case(lens, 128, **REAL, cache_dtype=FP8, seed=7)
    run_kernel(bf16)
    c16 = nki_emu.last_counters()
    # the FP8 cache and its scales as vLLM allocates them: [num_blocks, block_size, ...]
    h = fp8.h._replace(
        cache=fp8.h.cache.view(-1, 128, r),
        key_scales=fp8.h.key_scales.view(-1, 128, REAL["Hkv"]),
        latent_scales=fp8.h.latent_scales.view(-1, 128),
    )
    paged = fp8._replace(h=h)
    assert torch.equal(run_kernel(paged), run_kernel(fp8))
    c8 = nki_emu.last_counters()
    cost = latent_decode_cost(lens, w_bytes=4, fp8=True)
    assert_counters_equal_cost(c8, cost)
    for key in ("matmul_instructions", "transpose_instructions", "matmul_macs"):
        assert getattr(c8, key) == cost[key] == getattr(c16, key), key
    tiles = sum(-(-L // 128) for L in lens)
    n_keys = sum(lens)
    assert c16.dma_bytes - c8.dma_bytes == tiles * 128 * (r - 4)
    assert c8.dma_instructions - c16.dma_instructions == tiles
    cost16 = latent_decode_cost(lens, w_bytes=4)
    assert cost16["latent_bytes"] == 2 * cost["latent_bytes"] == 2 * n_keys * r
    assert cost["dma_bytes"] - cost["dma_bytes_min"] == extra_bytes(lens, r + 4 * REAL["Hkv"] + 4)
    # per tile one more gather and one more on-chip instruction (the codes' bf16 upcast, a tensor_copy); the d_i
    # folds ride on instructions the bf16 kernel has anyway: the score scaling becomes a scalar_tensor_tensor, the
    # p^T eviction (a tensor_copy) a tensor_scalar
    ops16, ops8 = c16.instructions, c8.instructions
    assert ops8.get("tensor_tensor", 0) == ops16["tensor_tensor"] - tiles
    assert ops8["scalar_tensor_tensor"] == ops16["scalar_tensor_tensor"] + tiles
    assert ops8["tensor_scalar"] == ops16["tensor_scalar"] + tiles
    assert ops8["tensor_copy"] == ops16["tensor_copy"]
    assert ops8["memset"] == ops16["memset"]
    assert sum(ops8.values()) - sum(ops16.values()) == 2 * tiles


def test_wrapper_rejects_what_the_kernel_cannot_run() -> None:
    case = make_case([40, 17], 16, **SMALL, seed=8)

    def changed(**fields: object) -> Case:
        return case._replace(h=case.h._replace(**fields))

    with pytest.raises(ValueError, match="power of two"):
        run_kernel(changed(block_size=24), bucket=128)
    with pytest.raises(ValueError, match="1 <= seq_len"):
        run_kernel(changed(seq_lens=torch.tensor([40, 0])), bucket=128)
    with pytest.raises(ValueError, match="more blocks"):
        run_kernel(changed(block_table=case.h.block_table[:, :2]), bucket=128)
    with pytest.raises(ValueError, match="multiple of 128"):
        run_kernel(case, bucket=100)


def test_wrapper_rejects_a_cache_and_latent_scales_that_do_not_pair() -> None:
    """A float cache with latent_scales, an FP8 cache without, or scales for another number of rows: an error, not a
    silently wrong decode."""
    fp8 = make_case([40, 17], 16, **SMALL, cache_dtype=FP8, seed=8)
    bf16 = make_case([40, 17], 16, **SMALL, seed=8)
    with pytest.raises(ValueError, match="without latent_scales"):
        run_kernel(fp8._replace(h=fp8.h._replace(latent_scales=None)), bucket=128)
    with pytest.raises(ValueError, match="with latent_scales"):
        run_kernel(bf16._replace(h=bf16.h._replace(latent_scales=fp8.h.latent_scales)), bucket=128)
    with pytest.raises(ValueError, match="latent_scales holds"):
        run_kernel(fp8._replace(h=fp8.h._replace(latent_scales=fp8.h.latent_scales[:-16])), bucket=128)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_prefill_and_decode_normalise_keys_alike(cache_dtype: torch.dtype) -> None:
    """The model's prefill (K rebuilt from the latents) and its absorbed decode give the same attention for the
    same query, in bf16 too: both read each key's scale from the store, so a request's last prompt token (prefill)
    and a decode step at the same position see the same keys (before, prefill normalised K rounded to bf16). From
    an FP8 cache both read the latents as stored: prefill dequantizes them, decode folds the scales in."""
    from types import SimpleNamespace

    from torch.nn.attention.bias import causal_lower_right

    from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

    case = make_case([700, 129], block_size=64, **REAL, cache_dtype=cache_dtype, q_dtype=torch.bfloat16)
    decoded = latent_decode_torch(*case)
    (q, w, h) = case
    layer = SimpleNamespace(k_norm=SimpleNamespace(weight=w.gamma), scaling=w.scale)
    Hkv, r, bs = w.w_k.shape[0], w.w_k.shape[2], h.block_size
    worst = 0.0
    for b, L in enumerate(h.seq_lens.tolist()):
        ids = h.block_table[b, : -(-L // bs)].long()
        c = gather_blocks(h.cache.view(-1, bs, r), ids, L)
        d = None if h.latent_scales is None else h.latent_scales.view(-1, bs)[ids].reshape(-1)[:L]
        c = TrinityLatentAttention.latent_values(c, d)
        s = h.key_scales.view(-1, bs, Hkv)[ids].reshape(-1, Hkv)[:L]
        mask = causal_lower_right(1, L)  # the last prompt token's query, as the model's prefill masks it
        got = TrinityLatentAttention.rebuilt_attention(layer, q[b : b + 1], c, s, w.w_k, w.w_v, mask)[0]
        worst = max(worst, float((got - decoded[b]).abs().max() / decoded[b].abs().max()))
    assert worst < 1e-5, worst  # fp32 summation order only


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_tensor_parallel_rank_decodes_its_heads_of_the_whole_layer(tp: int) -> None:
    """Trinity-Mini's 32 query / 4 KV heads split over `tp` ranks (8: more ranks than KV heads, each KV head on two)
    as the model places them (`kv_heads_of_rank`, q heads contiguous): a rank's absorbed decode from the whole latent
    and its own KV heads' W_k, W_v and key scales equals the whole layer's output for its query heads; every head
    is served, the KV heads read are the ones GQA assigns."""
    from vllm_trn_plugin.model_executors.latent_cache import kv_heads_of_rank

    H, Hkv = 32, 4
    case = make_case([5, 300, 131], block_size=64, H=H, Hkv=Hkv, hd=32, r=64, seed=3)
    whole = latent_decode_torch(*case)
    served = torch.zeros(H, dtype=torch.bool)
    for rank in range(tp):
        kv = kv_heads_of_rank(Hkv, tp, rank)
        q_heads = range(rank * H // tp, (rank + 1) * H // tp)
        assert {h // (H // Hkv) for h in q_heads} <= set(kv)
        mine = slice(kv.start, kv.stop)
        out = latent_decode_torch(
            case.q[:, q_heads.start : q_heads.stop],
            case.w._replace(w_k=case.w.w_k[mine], w_v=case.w.w_v[mine]),
            case.h._replace(key_scales=case.h.key_scales[:, mine]),
        )
        torch.testing.assert_close(out, whole[:, q_heads.start : q_heads.stop], rtol=1e-6, atol=1e-6)
        served[q_heads.start : q_heads.stop] = True
    assert served.all()


def test_tensor_parallel_sizes_the_heads_do_not_allow_are_refused() -> None:
    from vllm_trn_plugin.model_executors.latent_cache import kv_heads_of_rank

    for tp, what in [(3, "does not divide the 4 KV heads"), (6, "is not a multiple of the 4 KV heads")]:
        with pytest.raises(ValueError, match=f"--tensor-parallel-size {tp} {what}"):
            kv_heads_of_rank(4, tp, 0)


# --- LNC=2, compiled loops, no out-of-bounds rows (issue 28) ---


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lens", [[700], [300, 129, 1], [5, 900, 128, 1, 257]], ids=["B1", "B3", "B5"])
def test_lnc2_is_bit_identical_to_lnc1(lens: list[int], cache_dtype: torch.dtype) -> None:
    """Launched as a Trn2 deployment at LNC=2 (two programs, each decoding its contiguous half of the batch rows; at
    B = 1 program 1 has none, at B odd program 0 one more), every output bit equals the LNC=1 launch's, and each
    program's counters equal its part of `latent_decode_cost(lnc=2)`. Catches a split that drops or repeats a row
    (`b0`/`b1` off by one), a program that writes another's rows, and a core-dependent instruction sequence."""
    case = make_case(lens, 64, **REAL, cache_dtype=cache_dtype, seed=len(lens))
    one = run_kernel(case, bucket=1024)
    two = latent_decode_nki(*case, runner=lnc2, bucket=1024)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    assert_close(two, case)
    c = nki_emu.last_counters()
    assert_counters_equal_cost(c, latent_decode_cost(lens, 1024, w_bytes=4, fp8=cache_dtype == FP8, lnc=2))
    assert c.programs[0].emitted_instructions == c.programs[1].emitted_instructions  # one program text


EMITTED_CAP = 200  # the project's cap (docstring of test_compiled_program_does_not_grow_with_bucket_or_batch)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_compiled_program_does_not_grow_with_bucket_or_batch(cache_dtype: torch.dtype) -> None:
    """The kernel's emitted (compiled) instructions per program are the same for every context bucket, batch width
    and LNC degree: the batch rows and the 128-key tiles are `nl.fori_loop`s, so a compiled loop's size does not grow
    with its trip count (docs/nki.md section 8). Before, `for b in range(B)` and `for t in range(NT)` unrolled
    ~4,160 tile bodies at B = 32 over 16,640 keys. Cap: 200 instructions per program, the project's choice: the
    program is ~90 at Trinity-Mini's geometry (once-per-call setup, one row body, one tile body); 200 leaves room for
    a revision of the bodies and fails at once if any loop over rows, tiles or buckets is unrolled again (two tile
    bodies are already ~50 more). Prints the count per bucket and batch (`pytest -s`)."""
    seen = {}
    for bucket in BUCKETS:
        for lens in ([1], [300, 2], [bucket, 5, 129]):
            if max(lens) > bucket or (len(lens) == 3 and bucket > BUCKETS[0]):
                continue  # a full-bucket row only at the smallest bucket: the emulator runs every tile
            case = make_case(lens, 128, **REAL, cache_dtype=cache_dtype, seed=bucket)
            for lnc, runner in ((1, simulate), (2, lnc2)):
                latent_decode_nki(*case, runner=runner, bucket=bucket)
                c = nki_emu.last_counters()
                seen[(bucket, len(lens), lnc)] = [p.emitted_instructions for p in c.programs]
                assert c.emitted["fori_loop"] == 2 * lnc  # the row loop and the tile loop, per program
    counts = {n for per in seen.values() for n in per}
    print(f"\nlatent decode ({cache_dtype}), emitted instructions per program by (bucket, B, LNC): {seen}")
    assert len(counts) == 1 and counts.pop() <= EMITTED_CAP, seen


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_no_row_past_a_sequence_end_is_addressed(cache_dtype: torch.dtype) -> None:
    """The kernel never relies on an indirect DMA skipping out-of-bounds rows (whose semantics the docs leave open:
    the bound checked and what a skipped destination row holds): it points the last tile's keys past L_b at the
    sequence's key 0 and selects their scores away. Its gathers use `oob_mode.error`, so with every row-table entry
    past L_b out of range (the wrapper's own table) and again 2**30, any such row addressed would raise; the bytes
    gathered are exactly ceil(L_b / 128) tiles of 128 keys. Catches a kernel that gathers the table's entries as they
    are (no re-pointing) or runs a tile past ceil(L_b / 128)."""
    lens = [5, 200, 129]
    case = make_case(lens, 16, **REAL, cache_dtype=cache_dtype, seed=4)
    (q, w, h) = case
    base = run_kernel(case, bucket=384)
    args = list(kernel_inputs(q, w, h, 384))
    rows = args[6]
    assert (rows[torch.arange(384)[None, :] >= h.seq_lens[:, None]] == h.cache.shape[0]).all()  # out of range
    rows[rows == h.cache.shape[0]] = 2**30
    assert torch.equal(simulate(latent_decode_kernel)(*args), base)
    c = nki_emu.last_counters()
    per_key = REAL["r"] * (1 if cache_dtype == FP8 else 2) + 4 * REAL["Hkv"] + (4 if cache_dtype == FP8 else 0)
    tiles = sum(-(-L // 128) for L in lens)
    # gathered: 128 keys per tile and their row indices; beside them L_b and key 0's row per row, q, weights, gamma
    once = 2 * REAL["Hkv"] * REAL["hd"] * REAL["r"] * 4 + REAL["hd"] * 2
    per_row = 2 * 128 * 4 + REAL["H"] * REAL["hd"] * 2
    assert c.dma_hbm_to_sbuf_bytes == tiles * 128 * (per_key + 4) + len(lens) * per_row + once


# --- numerics the device may have (issue 28 item 5) ---

# No source documents the ScalarE polynomials' error nor how TensorE forms fp32 products (docs/nki.md section 7.1;
# kernels/nki_emu/ops.py: ACTIVATION_ERROR_BOUND and FP32_MATMUL_PRECISION are None). The project's assumption, which
# these tests hold the kernels to: exp within ACT_ERR relative, and fp32 TensorE operands at worst rounded to bf16
# (8 significant bits) or tf32 (11), the emulator's models of them.
ACT_ERR = 2.0**-10
OPERAND_ROUNDING = {"tf32": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff of an fp32 operand rounded (RNE) to the format


@pytest.mark.parametrize("operands", ["tf32", "bf16"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
def test_tolerance_holds_under_device_numerics(cache_dtype: torch.dtype, operands: str) -> None:
    """The kernel against float64 with exp off by up to ACT_ERR (relative, the emulator's deterministic perturbation)
    and every fp32 TensorE operand rounded to `operands` (unit roundoff u): each sequence's largest error stays within
    4 u + 4 ACT_ERR (+ 2^-8 where p is rounded to a 16-bit cache dtype) of its largest |out|. A normwise, first-order
    tolerance: the worst-case elementwise bound is vacuous here (q~ . c cancels heavily, so sum |q~| |c| exceeds the
    scores by orders of magnitude); the measured errors (printed with -s) reach about half the tolerance, the scores'
    fp32 operands dominating (why the kernel keeps them fp32, docs/kernels.md). Catches a kernel whose error grows
    past that (an operand rounded to bf16 where the tf32 model is assumed, p rounded twice)."""
    case = make_case([300, 2304, 1], 128, **REAL, cache_dtype=cache_dtype, q_dtype=torch.bfloat16, seed=11)
    with nki_emu.numerics(activation_rel_error=ACT_ERR, fp32_matmul=operands):
        out = run_kernel(case)
    u = OPERAND_ROUNDING[operands]
    f64, _ = expanded_float64(case)
    p_round = 0.0 if cache_dtype == torch.float32 else 2.0**-8
    scale = f64.abs().amax(dim=(1, 2))
    err = (out.double() - f64).abs().amax(dim=(1, 2)) / scale
    assert torch.isfinite(out).all() and (err <= 4 * u + 4 * ACT_ERR + p_round).all(), err
    print(f"\nlatent decode {cache_dtype}, {operands} operands: normwise error {[f'{e:.1e}' for e in err.tolist()]}")
