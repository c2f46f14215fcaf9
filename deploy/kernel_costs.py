"""Cost tables of the three NKI decode kernels at realistic shapes, per physical NeuronCore at LNC=1 and LNC=2: DMA
bytes, descriptors and estimated DMA time against the analytic minimum, instructions emitted (the compiled program)
and executed, and an estimated Trainium2 time (an estimate from a model, not a measurement).

    .venv/bin/python deploy/kernel_costs.py                      # the tables of docs/kernels.md
    .venv/bin/python deploy/kernel_costs.py --layout row-major   # the FP8 experts with the weights row-major (before)
    .venv/bin/python deploy/kernel_costs.py --before DIR         # the kernels before issue 28, run in the emulator

`--before DIR` imports `head_latent_decode_nki`, `head_fp8_expert_nki` and `head_simple_gla_nki` from DIR (the kernel
modules as they were before issue 28, e.g. `for m in latent_decode_nki fp8_expert_nki simple_gla_nki; do git show
057fdda:kernels/$m.py > DIR/head_$m.py; done`) and runs them at LNC=1 (all they ran at) in the emulator at the
table's shapes (FP8 experts at T = 1 and 8 only: emulating 112 experts' 1-byte descriptors takes too long): their
counters, not a formula (those modules' formulas did not count descriptors).

Counts come from each kernel's cost formula (kernels/*_nki.py, built on kernels/kernel_cost.py, which tallies DMAs the
way the NKI emulator's DMA model does: kernels/nki_emu/cost.py). First, for one small shape per kernel and both LNC
degrees (the FP8 experts in both weight layouts), the kernel is run in the emulator and every counter of every program
is checked equal to the formula (the kernel tests check more shapes).

Per core, at LNC=2 the slower of the two programs. "DMA busy us" is the busiest DMA engine's time summed over the
transfers (the emulator's `dma_transfer_ns`: per descriptor 22.3 ns + bytes at 23 B/ns, engine = partition // 8; the
22.3 ns is fitted to the DMA bandwidth guide's curve, UNCONFIRMED), the throughput-side estimate when transfers queue
and overlap; "DMA serial us" adds 1.3 us per transfer as if none overlapped (`dma_time_ns`). "min us" is the analytic
minimum's bytes (every input byte read once, every output byte written once) split evenly over the cores at 368 B/ns
(16 engines x 23 B/ns). "PE us": the core's multiply-accumulates at 79 TFLOPS bf16 dense, 2x that for FP8 double-row,
1/4 of it for fp32 operands (TRN2 docs give the fp32 rate as 20 TFLOPS). "est. us" = max(DMA busy, PE). Not modelled:
instruction issue, engine dependencies and overlap between engines, SBUF bank conflicts; the second core's share of
HBM bandwidth (HBM 2.9 TB/s per chip is 362 GB/s per core, about the DMA engines' 368 B/ns).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki, simple_gla_nki
from vllm_trn_plugin.kernels.fp8 import quantize_per_token
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents
from vllm_trn_plugin.kernels.nki_shim import nki, simulate

BF16_MACS_PER_S = 79e12 / 2
RATE = {"bf16": BF16_MACS_PER_S, "fp8": 2 * BF16_MACS_PER_S, "fp32": BF16_MACS_PER_S / 4}

# Trinity-Mini / Laplace 3B geometry (docs/models.md)
H, HKV, HD, R = 32, 4, 128, 256
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 128, 8
GLA_H, DK, DV = 16, 96, 192
COUNTERS = (
    "dma_hbm_to_sbuf_bytes", "dma_sbuf_to_hbm_bytes", "dma_instructions", "dma_descriptors", "matmul_instructions",
    "transpose_instructions", "matmul_macs", "emitted_instructions", "executed_instructions",
)  # fmt: skip


def _runner(lnc: int) -> Any:
    return simulate if lnc == 1 else (lambda kernel: simulate(kernel[lnc], compiler_lnc=lnc))


def random_absorbed_weights(g: torch.Generator) -> AbsorbedWeights:
    """A latent layer's absorbed weights at Trinity-Mini's geometry, bf16, drawn from `g`."""
    return AbsorbedWeights(
        torch.rand(HD, generator=g).bfloat16() + 0.5,
        (torch.randn(HKV, HD, R, generator=g) / 16).bfloat16(),
        (torch.randn(HKV, HD, R, generator=g) / 16).bfloat16(),
        HD**-0.5,
    )


def _check(name: str, want: dict[str, Any]) -> None:
    c = nki.last_counters()
    bad = {}
    for p, (got, exp) in enumerate(zip(c.programs, want["programs"])):
        bad.update({(p, k): (getattr(got, k), exp[k]) for k in COUNTERS if getattr(got, k) != exp[k]})
        for k in ("dma_transfer_ns", "dma_time_ns"):
            if not math.isclose(getattr(got, k), exp[k], rel_tol=1e-9):
                bad[(p, k)] = (getattr(got, k), exp[k])
    if bad or c.num_programs != want["lnc"]:
        raise SystemExit(f"{name}: emulator counters differ from the cost formula: {bad}")
    print(f"{name}: every counter of every program equals the cost formula")


def verify() -> None:
    g = torch.Generator().manual_seed(0)
    # latent decode, B = 3 at full geometry, bucket 2304, bf16 and FP8 caches
    lens, bs = [700, 2000, 129], 128
    bt = torch.zeros(3, 18, dtype=torch.int32)
    bt[0, :6], bt[1, :16], bt[2, :2] = torch.arange(6), torch.arange(6, 22), torch.arange(22, 24)
    q = torch.randn(3, H, HD, generator=g).bfloat16()
    weights = random_absorbed_weights(g)
    history = PagedLatents(
        torch.randn(24 * bs, R, generator=g).bfloat16(),
        torch.rand(24 * bs, HKV, generator=g) + 0.5,
        bt,
        torch.tensor(lens, dtype=torch.int32),
        bs,
    )
    codes, latent_scales = quantize_per_token(history.cache)
    fp8_history = history._replace(cache=codes, latent_scales=latent_scales)
    for lnc in (1, 2):
        latent_decode_nki.latent_decode_nki(q, weights, history, _runner(lnc))
        _check(f"latent decode, LNC={lnc}", latent_decode_nki.latent_decode_cost(lens, lnc=lnc))
        latent_decode_nki.latent_decode_nki(q, weights, fp8_history, _runner(lnc))
        _check(f"latent decode, FP8 cache, LNC={lnc}", latent_decode_nki.latent_decode_cost(lens, fp8=True, lnc=lnc))

    # FP8 experts, T = 3 tokens at full geometry (4 experts: the weights of 4 of 128 are enough to check)
    e, t = 4, 3
    w13 = (torch.randn(e, 2 * INTER, HIDDEN, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, HIDDEN, INTER, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
    ids = torch.tensor([[0, 2], [2, 3], [3, 0]])
    experts = ExpertWeights(
        w13, torch.full((e, 2 * INTER), 1e-3), torch.zeros(e, 2 * INTER),
        w2, torch.full((e, HIDDEN), 1e-3), torch.zeros(e, HIDDEN),
    )  # fmt: skip
    x = torch.randn(t, HIDDEN, generator=g).bfloat16()
    tw = torch.rand(t, 2, generator=g)
    for layout, stacks in (("tiled", experts.to_kernel_layout()), ("row-major", experts)):
        for lnc in (1, 2):
            fp8_expert_nki.fp8_experts_nki(x, tw, ids, stacks, _runner(lnc))
            want = fp8_expert_nki.fp8_experts_cost(t, HIDDEN, INTER, 3, min(e, t * 2), lnc=lnc, layout=layout)
            _check(f"FP8 experts, {layout}, LNC={lnc}", want)

    # GLA step, B = 4 at full geometry, one padding row
    b = 4
    args = (
        torch.randn(b, GLA_H, DK, generator=g).bfloat16(), torch.randn(b, GLA_H, DK, generator=g).bfloat16(),
        torch.randn(b, GLA_H, DV, generator=g).bfloat16(), torch.randn(GLA_H, DK, generator=g),
        -torch.rand(GLA_H, generator=g), DK**-0.5,
    )  # fmt: skip
    for lnc in (1, 2):
        pool = torch.randn(6, GLA_H, DK, DV, generator=g)
        simple_gla_nki.gla_decode_nki(*args, pool, torch.tensor([3, 0, -1, 1], dtype=torch.int32), _runner(lnc))
        _check(f"GLA step, LNC={lnc}", simple_gla_nki.gla_decode_cost(b, num_padding=1, lnc=lnc))


HEADER = (
    "| kernel | shape (per call) | LNC | DMA MB / core | min MB / core | descriptors / core | DMA busy us | "
    "DMA serial us | min us | PE us | est. us | instr. emitted | instr. executed / core |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
)


def _row(kernel: str, shape: str, cost: dict[str, Any], dma_min: int, macs: dict[str, float]) -> str:
    """One table row from a cost formula's result; `macs` by operand rate for the slower core."""
    core = max(cost["programs"], key=lambda p: p["dma_transfer_ns"])
    busy, serial = cost["dma_transfer_ns_core"] / 1e3, cost["dma_time_ns_core"] / 1e3
    pe = sum(m / RATE[k] for k, m in macs.items()) * 1e6
    bound = "DMA" if busy >= pe else "PE"
    lnc = cost["lnc"]
    executed = max(p["executed_instructions"] for p in cost["programs"])
    return (
        f"| {kernel} | {shape} | {lnc} | {core['dma_bytes'] / 1e6:.2f} | {dma_min / lnc / 1e6:.2f} | "
        f"{core['dma_descriptors']} | {busy:.0f} | {serial:.0f} | {cost['dma_time_min_ns'] / 1e3:.0f} | {pe:.0f} | "
        f"{max(busy, pe):.0f} ({bound}) | {core['emitted_instructions']} | {executed} |"
    )


def _latent_macs(b: int, tiles: int) -> dict[str, int]:
    """The latent decode's MACs by operand rate (bf16 and FP8 caches alike): projections and scores on fp32 operands
    (q~ . c cancels, see the kernel; an FP8 tile's codes are upcast on chip), p^T C on bf16."""
    return {"fp32": b * 2 * H * HD * R + tiles * 128 * H * R, "bf16": tiles * 128 * H * R}


def table(layout: str) -> list[str]:
    rows = list(HEADER)
    for b in (1, 8, 32):
        for ctx in (2048, 8192, 16384):
            for lnc in (1, 2):
                c = latent_decode_nki.latent_decode_cost([ctx] * b, lnc=lnc)
                per = -(-b // lnc)
                macs = _latent_macs(per, per * -(-ctx // 128))
                bucket = latent_decode_nki.pick_bucket(ctx)
                rows.append(_row("latent decode", f"B={b}, ctx {ctx} (bucket {bucket})", c, c["dma_bytes_min"], macs))
    for t in (1, 8, 32):
        active = round(EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** t))  # expected distinct experts of t tokens
        for lnc in (1, 2):
            c = fp8_expert_nki.fp8_experts_cost(
                t, HIDDEN, INTER, active, min(EXPERTS, t * TOP_K), lnc=lnc, layout=layout
            )
            shape = f"T={t}, {active} of {EXPERTS} experts, {layout}"
            rows.append(_row("FP8 experts", shape, c, c["min_dma_bytes"], {"fp8": c["matmul_macs"] / lnc}))
    for b in (1, 8, 32, 64):
        for lnc in (1, 2):
            c = simple_gla_nki.gla_decode_cost(b, lnc=lnc)
            rows.append(_row("GLA step", f"B={b}, one layer", c, c["dma_min_bytes"], {"fp32": c["matmul_macs"] / lnc}))
    return rows


def fp8_cache_table() -> list[str]:
    """The latent decode per call with a bf16 and with an FP8 latent cache, every sequence filling its bucket, per
    core at LNC=2."""
    rows = [
        "| shape (per call) | bf16 DMA MB / core | FP8 DMA MB / core | bf16 / FP8 bytes | bf16 DMA busy us | "
        "FP8 DMA busy us | PE us | bf16 est. us | FP8 est. us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in (1, 8, 32):
        for ctx in latent_decode_nki.BUCKETS:
            c16 = latent_decode_nki.latent_decode_cost([ctx] * b, lnc=2)
            c8 = latent_decode_nki.latent_decode_cost([ctx] * b, fp8=True, lnc=2)
            per = -(-b // 2)
            t_pe = sum(m / RATE[k] for k, m in _latent_macs(per, per * ctx // 128).items()) * 1e6
            m16, m8 = c16["programs"][0]["dma_bytes"], c8["programs"][0]["dma_bytes"]
            t16, t8 = c16["dma_transfer_ns_core"] / 1e3, c8["dma_transfer_ns_core"] / 1e3
            rows.append(
                f"| B={b}, ctx {ctx} | {m16 / 1e6:.2f} | {m8 / 1e6:.2f} | {m16 / m8:.3f} | {t16:.0f} | {t8:.0f} | "
                f"{t_pe:.0f} | {max(t16, t_pe):.0f} | {max(t8, t_pe):.0f} |"
            )
    return rows


def before(directory: str) -> list[str]:
    """The kernels as committed before issue 28 (modules head_*.py in `directory`), run in the emulator at LNC=1."""
    import importlib
    import sys

    sys.path.insert(0, directory)
    old_latent, old_fp8, old_gla = (
        importlib.import_module(f"head_{m}") for m in ("latent_decode_nki", "fp8_expert_nki", "simple_gla_nki")
    )
    rows = [
        "| kernel (before, LNC=1) | shape (per call) | DMA MB | descriptors | DMA busy us | DMA serial us | "
        "instr. emitted | instr. executed |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(kernel: str, shape: str) -> None:
        c = nki.last_counters()
        rows.append(
            f"| {kernel} | {shape} | {c.dma_bytes / 1e6:.2f} | {c.dma_descriptors} | {c.dma_transfer_ns / 1e3:.0f} | "
            f"{c.dma_time_ns / 1e3:.0f} | {c.emitted_instructions} | {c.executed_instructions} |"
        )
        print(rows[-1], flush=True)

    g = torch.Generator().manual_seed(0)
    for b in (1, 8, 32):
        for ctx in (2048, 16384):
            bs, n = 128, b * ctx // 128
            q = torch.randn(b, H, HD, generator=g).bfloat16()
            w = random_absorbed_weights(g)
            h = PagedLatents(
                torch.randn(n * bs, R, generator=g).bfloat16(),
                torch.rand(n * bs, HKV, generator=g) + 0.5,
                torch.arange(n, dtype=torch.int32).view(b, ctx // bs),
                torch.full((b,), ctx, dtype=torch.int32),
                bs,
            )
            old_latent.latent_decode_nki(q, w, h, simulate)
            row("latent decode", f"B={b}, ctx {ctx}")
    for t, active in ((1, 8), (8, 52)):
        w13 = (torch.randn(active, 2 * INTER, HIDDEN, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
        w2 = (torch.randn(active, HIDDEN, INTER, generator=g) * 60).clamp(-240, 240).to(torch.float8_e4m3fn)
        experts = ExpertWeights(
            w13, torch.full((active, 2 * INTER), 1e-3), torch.zeros(active, 2 * INTER),
            w2, torch.full((active, HIDDEN), 1e-3), torch.zeros(active, HIDDEN),
        )  # fmt: skip
        ids = torch.arange(t * TOP_K).remainder(active).view(t, TOP_K)  # every one of the experts routed
        x = torch.randn(t, HIDDEN, generator=g).bfloat16()
        old_fp8.fp8_experts_nki(x, torch.rand(t, TOP_K, generator=g), ids, experts, simulate)
        row("FP8 experts", f"T={t}, {active} experts, row-major")
    for b in (1, 8, 32, 64):
        pool = torch.randn(b + 1, GLA_H, DK, DV, generator=g)
        old_gla.gla_decode_nki(
            torch.randn(b, GLA_H, DK, generator=g).bfloat16(), torch.randn(b, GLA_H, DK, generator=g).bfloat16(),
            torch.randn(b, GLA_H, DV, generator=g).bfloat16(), torch.randn(GLA_H, DK, generator=g),
            -torch.rand(GLA_H, generator=g), DK**-0.5, pool, torch.arange(b, dtype=torch.int32), simulate,
        )  # fmt: skip
        row("GLA step", f"B={b}, one layer")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=("tiled", "row-major"), default="tiled", help="the FP8 expert weights' layout")
    ap.add_argument("--before", metavar="DIR", help="run the kernels as they were before issue 28 (module docstring)")
    args = ap.parse_args()
    if args.before:
        before(args.before)
        return
    verify()
    print()
    print("\n".join(table(args.layout)))
    print()
    print("\n".join(fp8_cache_table()))


if __name__ == "__main__":
    main()
