"""Cost table of the three NKI decode kernels at realistic shapes: DMA bytes per call against the analytic
minimum, instruction counts, and an estimated Trainium2 time (a roofline estimate, not a measurement).

    .venv/bin/python deploy/kernel_costs.py            # prints the markdown tables of docs/kernels.md

Counts come from each kernel's cost formula (kernels/*_nki.py); first, for one shape per kernel, the
kernel is run in the NKI emulator and its counters are checked equal to the formula (the kernel tests
check more shapes; the latent decode with a bf16 and with an FP8 latent cache). The second table sets the
latent decode with an FP8 latent cache (`fp8_expert.quantize_per_token`: 1 B per element + a 4 B scale per key)
beside the bf16 cache at each context bucket filled. The estimate is max(HBM time, TensorE time) for one physical
NeuronCore-v3 (the kernels are called at LNC=1): HBM 2.9 TB/s per Trainium2 chip shared by its 8 NeuronCores, TensorE
79 TFLOPS bf16 dense, 2x that for FP8 double-row, 1/4 of it for fp32 operands (fp32 matmuls take four
passes: an assumption, the public docs give bf16 and FP8 rates only). Not modelled: instruction issue
and DMA descriptor overheads, engine dependencies and overlap, SBUF bank conflicts.
"""

from __future__ import annotations

import torch

from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki, simple_gla_nki
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights, quantize_per_token
from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents
from vllm_trn_plugin.kernels.nki_shim import nki, simulate

HBM_BYTES_PER_S = 2.9e12 / 8
BF16_MACS_PER_S = 79e12 / 2
RATE = {"bf16": BF16_MACS_PER_S, "fp8": 2 * BF16_MACS_PER_S, "fp32": BF16_MACS_PER_S / 4}

# Trinity-Mini / Laplace 3B geometry (docs/models.md)
H, HKV, HD, R = 32, 4, 128, 256
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 128, 8
GLA_H, DK, DV = 16, 96, 192


def _check(name: str, got: dict[str, int], want: dict[str, int], keys: dict[str, str]) -> None:
    bad = {k: (got[k], want[v]) for k, v in keys.items() if got[k] != want[v]}
    if bad:
        raise SystemExit(f"{name}: emulator counters differ from the cost formula: {bad}")
    print(f"{name}: emulator counters equal the cost formula ({', '.join(keys)})")


def verify() -> None:
    g = torch.Generator().manual_seed(0)
    # latent decode, B = 2 at full geometry, bucket 2304
    lens, bs = [700, 2000], 128
    bt = torch.zeros(2, 16, dtype=torch.int32)
    bt[0, :6], bt[1, :16] = torch.arange(6), torch.arange(6, 22)
    q = torch.randn(2, H, HD, generator=g).bfloat16()
    weights = AbsorbedWeights(
        torch.rand(HD, generator=g).bfloat16() + 0.5,
        (torch.randn(HKV, HD, R, generator=g) / 16).bfloat16(),
        (torch.randn(HKV, HD, R, generator=g) / 16).bfloat16(),
        HD**-0.5,
    )
    history = PagedLatents(
        torch.randn(22 * bs, R, generator=g).bfloat16(),
        torch.rand(22 * bs, HKV, generator=g) + 0.5,
        bt,
        torch.tensor(lens, dtype=torch.int32),
        bs,
    )
    latent_decode_nki.latent_decode_nki(q, weights, history, simulate)
    c = nki.last_counters()
    want = latent_decode_nki.latent_decode_cost(lens)
    _check("latent decode", _counts(c), want, {"dma": "dma_bytes", "matmuls": "matmul_instructions"})
    # the same history as an FP8 latent cache
    codes, latent_scales = quantize_per_token(history.cache)
    latent_decode_nki.latent_decode_nki(
        q, weights, history._replace(cache=codes, latent_scales=latent_scales), simulate
    )
    want = latent_decode_nki.latent_decode_cost(lens, fp8=True)
    _check(
        "latent decode, FP8 cache",
        _counts(nki.last_counters()),
        want,
        {"dma": "dma_bytes", "matmuls": "matmul_instructions"},
    )

    # FP8 experts, T = 2 tokens at full geometry (4 experts: the weights of 4 of 128 are enough to check)
    e, t = 4, 2
    w13 = (torch.randn(e, 2 * INTER, HIDDEN, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, HIDDEN, INTER, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
    ids = torch.tensor([[0, 2], [2, 3]])
    experts = ExpertWeights(
        w13, torch.full((e, 2 * INTER), 1e-3), torch.zeros(e, 2 * INTER),
        w2, torch.full((e, HIDDEN), 1e-3), torch.zeros(e, HIDDEN),
    )  # fmt: skip
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    fp8_expert_nki.fp8_experts_nki(x, torch.rand(t, 2, generator=g), ids, experts, simulate)
    want = fp8_expert_nki.fp8_experts_cost(t, HIDDEN, INTER, active_experts=3, num_blocks=min(e, t * 2))
    _check("FP8 experts", _counts(nki.last_counters()), want, {"dma": "dma_bytes", "matmuls": "matmul_instructions"})

    # GLA step, B = 4 at full geometry
    b = 4
    pool = torch.randn(6, GLA_H, DK, DV, generator=g)
    simple_gla_nki.gla_decode_nki(
        torch.randn(b, GLA_H, DK, generator=g).bfloat16(), torch.randn(b, GLA_H, DK, generator=g).bfloat16(),
        torch.randn(b, GLA_H, DV, generator=g).bfloat16(), torch.randn(GLA_H, DK, generator=g),
        -torch.rand(GLA_H, generator=g), DK**-0.5, pool, torch.tensor([3, 0, 5, 1], dtype=torch.int32), simulate,
    )  # fmt: skip
    want = simple_gla_nki.gla_decode_cost(b)
    _check("GLA step", _counts(nki.last_counters()), want, {"dma": "dma_bytes", "matmuls": "matmuls"})


def _counts(c: object) -> dict[str, int]:
    return {"dma": c.dma_bytes, "matmuls": c.matmul_instructions}


def _times(dma: int, macs_by_rate: dict[str, int]) -> tuple[float, float, str]:
    t_hbm = dma / HBM_BYTES_PER_S
    t_pe = sum(m / RATE[k] for k, m in macs_by_rate.items())
    return t_hbm, t_pe, "HBM" if t_hbm >= t_pe else "PE"


def _row(kernel: str, shape: str, dma: int, dma_min: int, n_dma: int, n_mm: int, macs_by_rate: dict[str, int]) -> str:
    t_hbm, t_pe, bound = _times(dma, macs_by_rate)
    return (
        f"| {kernel} | {shape} | {dma / 1e6:.2f} | {dma_min / 1e6:.2f} | {dma / dma_min:.3f} | {n_dma} | {n_mm} | "
        f"{t_hbm * 1e6:.0f} | {t_pe * 1e6:.0f} | {max(t_hbm, t_pe) * 1e6:.0f} ({bound}) |"
    )


def table() -> list[str]:
    rows = [
        "| kernel | shape (per call) | DMA MB | minimum MB | ratio | DMA instr. | matmuls | HBM us | PE us | est. us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in (1, 8, 32):
        for ctx in (2048, 8192, 16384):
            c = latent_decode_nki.latent_decode_cost([ctx] * b)
            nt = latent_decode_nki.pick_bucket(ctx) // 128
            macs = _latent_macs(b, nt)
            assert sum(macs.values()) == c["matmul_macs"]
            rows.append(
                _row("latent decode", f"B={b}, ctx {ctx} (bucket {nt * 128})", c["dma_bytes"], c["dma_bytes_min"],
                     c["dma_instructions"], c["matmul_instructions"], macs)
            )  # fmt: skip
    for t in (1, 8, 32):
        active = round(EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** t))  # expected distinct experts of t tokens
        c = fp8_expert_nki.fp8_experts_cost(t, HIDDEN, INTER, active, min(EXPERTS, t * TOP_K))
        rows.append(
            _row("FP8 experts", f"T={t} tokens, {active} of {EXPERTS} experts active", c["dma_bytes"],
                 c["min_dma_bytes"], c["dma_instructions"], c["matmul_instructions"], {"fp8": c["matmul_macs"]})
        )  # fmt: skip
    for b in (1, 8, 32, 64):
        c = simple_gla_nki.gla_decode_cost(b)
        macs = b * GLA_H * DK * DV * (1 + GLA_H)  # k v^T, and q^T S as a [dk, H] masked stationary per head
        rows.append(
            _row("GLA step", f"B={b}, one layer", c["dma_bytes"], c["dma_min_bytes"], c["dma_instructions"],
                 c["matmuls"], {"fp32": macs})
        )  # fmt: skip
    return rows


def _latent_macs(b: int, nt: int) -> dict[str, int]:
    """The latent decode's MACs by operand rate, the same for a bf16 and an FP8 cache: projections and scores on
    fp32 operands (q~ . c cancels, see the kernel; an FP8 tile's codes are upcast on chip), p^T C on bf16."""
    return {"fp32": b * (2 * H * HD * R + nt * 128 * H * R), "bf16": b * nt * 128 * H * R}


def fp8_table() -> list[str]:
    """The latent decode per call with a bf16 and with an FP8 latent cache, every sequence filling its bucket."""
    rows = [
        "| shape (per call) | bf16 DMA MB | FP8 DMA MB | bf16 / FP8 bytes | latent MB bf16 | latent MB FP8 | "
        "bf16 HBM us | FP8 HBM us | PE us | bf16 est. us | FP8 est. us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in (1, 8, 32):
        for ctx in latent_decode_nki.BUCKETS:
            c16 = latent_decode_nki.latent_decode_cost([ctx] * b)
            c8 = latent_decode_nki.latent_decode_cost([ctx] * b, fp8=True)
            macs = _latent_macs(b, ctx // 128)
            assert sum(macs.values()) == c16["matmul_macs"] == c8["matmul_macs"]
            t16, t_pe, bound16 = _times(c16["dma_bytes"], macs)
            t8, _, bound8 = _times(c8["dma_bytes"], macs)
            rows.append(
                f"| B={b}, ctx {ctx} | {c16['dma_bytes'] / 1e6:.2f} | {c8['dma_bytes'] / 1e6:.2f} | "
                f"{c16['dma_bytes'] / c8['dma_bytes']:.3f} | {c16['latent_bytes'] / 1e6:.2f} | "
                f"{c8['latent_bytes'] / 1e6:.2f} | {t16 * 1e6:.0f} | {t8 * 1e6:.0f} | {t_pe * 1e6:.0f} | "
                f"{max(t16, t_pe) * 1e6:.0f} ({bound16}) | "
                f"{max(t8, t_pe) * 1e6:.0f} ({bound8}) |"
            )
    return rows


if __name__ == "__main__":
    verify()
    print()
    print("\n".join(table()))
    print()
    print("\n".join(fp8_table()))
