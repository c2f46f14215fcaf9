"""The FP8 conversion on the torch path (`kernels.fp8.fp8_to_float32`): exact, and the latent decode
and prefill that read an FP8 latent cache through it unchanged bit for bit.

The oracle is torch's own float8_e4m3fn -> float32 conversion (`codes.float()`, an independent implementation:
c10's scalar bit decoding), which the torch path used before and which is slow on CPU. Compared as bit patterns,
so -0.0, subnormal codes and the NaN codes' exact bits count.
"""

from __future__ import annotations

import pytest
import torch

from vllm_trn_plugin.kernels import latent_decode
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, fp8_to_float32, quantize_per_token
from vllm_trn_plugin.kernels.latent_decode import (
    AbsorbedWeights,
    PagedLatents,
    dequantize_latents,
    latent_decode_reference,
    latent_decode_torch,
)

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
NAN_CODES = (0x7F, 0xFF)


@pytest.fixture(autouse=True)
def fast_path_at_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_to_float32 hands small inputs to torch's conversion (faster there); these tests hold the fast path to
    account on every input, however small."""
    from vllm_trn_plugin.kernels import fp8

    monkeypatch.setattr(fp8, "_FAST_FP8_MIN", 1)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def torch_conversion(
    codes: torch.Tensor, out: torch.Tensor | None = None, *, work: torch.Tensor | None = None
) -> torch.Tensor:
    """What the torch path did before, in fp8_to_float32's place: torch's elementwise FP8 conversion into a fresh
    tensor (`out`, the decode's reused tile buffer, and `work` ignored, as the previous code had neither)."""
    return codes.float()


@pytest.mark.parametrize(
    "layout",
    ["flat", "rows of 16", "odd width", "transposed", "offset by one", "repeated 4096 x", "3-d"],
)
def test_every_code_converts_as_torch_does(layout: str) -> None:
    """All 256 codes, in layouts the byte tricks could get wrong (a last dimension that is odd, strided, or starts
    at an odd byte): the fp32 bit patterns equal torch's, so the sign of -0.0 (0x80), the subnormal codes (0x01-0x07,
    0x81-0x87), the largest finite ones (+-448) and the NaN codes (torch's NaN bits) all hold."""
    codes = {
        "flat": ALL_CODES,
        "rows of 16": ALL_CODES.view(16, 16),
        "odd width": ALL_CODES[:255].view(15, 17),
        "transposed": ALL_CODES.view(16, 16).t(),
        "offset by one": ALL_CODES[1:],
        "repeated 4096 x": ALL_CODES.repeat(4096).view(-1, 256),
        "3-d": ALL_CODES.view(4, 8, 8).permute(1, 0, 2),
    }[layout]
    want = codes.float()
    got = fp8_to_float32(codes)
    assert got.shape == codes.shape and got.dtype == torch.float32
    assert torch.equal(bits(got), bits(want))
    # into a given buffer, holding stale values beforehand
    out = torch.full(codes.shape, 7.0)
    assert fp8_to_float32(codes, out) is out and torch.equal(bits(out), bits(want))


def test_nan_codes_and_only_they_are_nan() -> None:
    got = fp8_to_float32(ALL_CODES)
    assert got.isnan().nonzero().flatten().tolist() == list(NAN_CODES)
    assert got[0x7E].item() == 448.0 and got[0xFE].item() == -448.0 and got[0x01].item() == 2.0**-9
    # a NaN code among finite ones in a decode-sized tile: found by the min/max pass wherever it sits
    tile = ALL_CODES[:0x7F].repeat(2048 * 256 // 0x7F + 1)[: 2048 * 256].view(2048, 256).clone()
    tile.view(torch.uint8)[1234, 77] = 0xFF
    assert torch.equal(bits(fp8_to_float32(tile)), bits(tile.float()))


def test_empty_and_refused_inputs() -> None:
    assert fp8_to_float32(ALL_CODES[:0].view(0, 256)).shape == (0, 256)
    with pytest.raises(ValueError, match="codes"):
        fp8_to_float32(torch.zeros(4))
    with pytest.raises(ValueError, match="out must be"):
        fp8_to_float32(ALL_CODES, torch.empty(256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        fp8_to_float32(ALL_CODES.view(16, 16), torch.empty(16, 32)[:, :16])


def random_codes(rows: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizer output (what a cache holds) for latents with outliers (so many codes are subnormal), and per-token
    scales from 1e-30 to 1e30."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, r, generator=g) * 10.0 ** torch.randint(-30, 31, (rows, 1), generator=g).float()
    x[::3, 5] *= 1e4
    return quantize_per_token(x)


def test_dequantized_latents_equal_the_previous_conversion() -> None:
    """dequantize_latents (the prefill's and the key scales' read of an FP8 cache) equals torch's conversion times
    the scales bit for bit, and its result is its own (not the scratch the decode reuses)."""
    codes, scales = random_codes(3000, 256, seed=1)
    want = codes.float() * scales[:, None]
    got = dequantize_latents(codes, scales)
    assert torch.equal(bits(got), bits(want))
    other, other_scales = random_codes(3000, 256, seed=2)
    dequantize_latents(other, other_scales)  # reuses the scratch, must not touch `got`
    fp8_to_float32(other, torch.empty(other.shape))
    assert torch.equal(bits(got), bits(want))
    # every code (NaN ones included) through the same path
    every = ALL_CODES.repeat(2).view(2, 256)
    s = torch.tensor([0.5, 3.0])
    assert torch.equal(bits(dequantize_latents(every, s)), bits(every.float() * s[:, None]))


def test_prefill_reads_the_fp8_cache_as_before() -> None:
    """The model's prefill / key-scale read (`TrinityLatentAttention.latent_values`) of FP8 rows."""
    from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

    codes, scales = random_codes(1500, 256, seed=3)
    got = TrinityLatentAttention.latent_values(codes, scales)
    assert torch.equal(bits(got), bits(codes.float() * scales[:, None]))


def fp8_case(
    lens: list[int], bs: int, seed: int, raw_codes: bool
) -> tuple[torch.Tensor, AbsorbedWeights, PagedLatents]:
    """A paged FP8 latent cache in the real geometry (H 32, Hkv 4, hd 128, r 256), shuffled blocks. raw_codes: every
    finite code at random (not only what the quantizer writes), with random positive scales."""
    H, Hkv, hd, r = 32, 4, 128, 256
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // bs) for L in lens]
    n_blocks = sum(need) + 2
    rows = n_blocks * bs
    if raw_codes:
        finite = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
        cache = finite[torch.randint(0, len(finite), (rows, r), generator=g)].view(FP8_DTYPE)
        latent_scales = torch.rand(rows, generator=g) * 0.01 + 1e-4
    else:
        cache, _ = random_codes(rows, r, seed)  # the quantizer's codes (many subnormal), with moderate scales
        latent_scales = torch.rand(rows, generator=g) * 0.01 + 1e-4  # so the softmax stays informative
    key_scales = torch.rand(rows, Hkv, generator=g) + 0.5
    perm = torch.randperm(n_blocks, generator=g, dtype=torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    w = AbsorbedWeights(
        1.0 + 0.2 * torch.randn(hd, generator=g),
        torch.randn(Hkv, hd, r, generator=g) / 16,
        torch.randn(Hkv, hd, r, generator=g) / 16,
        hd**-0.5,
    )
    q = 2.0 * torch.randn(len(lens), H, hd, generator=g)
    return q, w, PagedLatents(cache, key_scales, table, torch.tensor(lens), bs, latent_scales)


@pytest.mark.parametrize("raw_codes", [False, True], ids=["quantized", "every-code"])
def test_decode_of_an_fp8_cache_is_unchanged_bit_for_bit(monkeypatch: pytest.MonkeyPatch, raw_codes: bool) -> None:
    """latent_decode_torch over FP8 caches spanning several DECODE_TILE tiles (the tile buffer reused between them)
    equals, bit for bit, the same decode with torch's conversion put back; and it stays the op (against the fp32
    reference, which converts with torch independently)."""
    case = fp8_case([1, 700, 2 * latent_decode.DECODE_TILE + 300], bs=64, seed=4, raw_codes=raw_codes)
    with torch.inference_mode():
        got = latent_decode_torch(*case)
        with monkeypatch.context() as m:
            m.setattr(latent_decode, "fp8_to_float32", torch_conversion)
            before = latent_decode_torch(*case)
        again = latent_decode_torch(*case)  # a second call over the now warm buffers
    assert torch.equal(bits(got), bits(before))
    assert torch.equal(bits(again), bits(got))
    ref = latent_decode_reference(*case)
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_decode_outside_inference_mode_after_inside() -> None:
    """The scratch buffers follow the inference-mode state (an inference tensor may not be written under no_grad)."""
    case = fp8_case([900], bs=128, seed=5, raw_codes=False)
    with torch.inference_mode():
        inside = latent_decode_torch(*case)
    with torch.no_grad():
        outside = latent_decode_torch(*case)
    assert torch.equal(bits(inside), bits(outside))
