"""Where should MLA-Trinity's per-key norm scale come from in absorbed decode?

The global layers keep the per-head key RMSNorm, so every cached latent c_i needs
s_g,i = 1 / rms(W_k,g c_i) for each of the 4 KV heads. Two exact options:

  recompute  from the latent inside the decode path: one extra [L x r] @ [r x 4*128] product per
             layer and step;
  at write   once, when the latent is written, stored beside it: 4 fp32 values per token (+16 B
             on a 512 B bf16 latent row, +3.1% cache bytes), read back in decode.

This prints, measured side by side in one run on the torch path (fp32, 1 thread), the absorbed
decode time per layer for both at contexts 2k, 8k, 32k, and the cache-byte cost of the second.

    .venv/bin/python deploy/bench_key_scale.py [--reps 7] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

H, HKV, HD, R = 32, 4, 128, 256


def absorbed_decode(q, C, Wk, Wv, gamma, inv_rms=None):  # noqa: ANN001, ANN201
    """q [B, H, hd]; C [B, L, r]; Wk, Wv [Hkv, hd, r]; inv_rms [B, L, Hkv] or None (recompute)."""
    B = q.shape[0]
    qg = (q * gamma).view(B, HKV, H // HKV, HD)
    q_lat = torch.einsum("bgjd,gdr->bgjr", qg, Wk)
    if inv_rms is None:
        inv_rms = torch.rsqrt(torch.einsum("blr,gdr->blgd", C, Wk).pow(2).mean(-1) + 1e-5)
    scores = torch.einsum("bgjr,blr->bgjl", q_lat, C) * inv_rms.permute(0, 2, 1)[:, :, None, :] * HD**-0.5
    p = torch.softmax(scores, -1)
    u = torch.einsum("bgjl,blr->bgjr", p, C)
    return torch.einsum("bgjr,gdr->bgjd", u, Wv).reshape(B, H, HD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    Wk, Wv = torch.randn(HKV, HD, R, generator=g) / R**0.5, torch.randn(HKV, HD, R, generator=g) / R**0.5
    gamma = 1 + 0.1 * torch.randn(HD, generator=g)
    print(f"absorbed decode, one layer, batch {args.batch}, fp32, 1 thread, median of {args.reps}")
    print(f"{'context':>8} {'recompute ms':>13} {'at-write ms':>12} {'recompute/at-write':>19} {'max |diff|':>11}")
    for L in args.contexts:
        q = torch.randn(args.batch, H, HD, generator=g)
        C = torch.randn(args.batch, L, R, generator=g)
        inv = torch.rsqrt(torch.einsum("blr,gdr->blgd", C, Wk).pow(2).mean(-1) + 1e-5)  # done at write time
        times = {"recompute": [], "write": []}
        for _ in range(args.reps):  # interleaved, so drift hits both alike
            for name, extra in (("recompute", None), ("write", inv)):
                t = time.perf_counter()
                absorbed_decode(q, C, Wk, Wv, gamma, extra)
                times[name].append(time.perf_counter() - t)
        diff = (absorbed_decode(q, C, Wk, Wv, gamma, inv) - absorbed_decode(q, C, Wk, Wv, gamma)).abs().max().item()
        a, b = statistics.median(times["recompute"]), statistics.median(times["write"])
        print(f"{L:>8} {a * 1e3:>13.2f} {b * 1e3:>12.2f} {a / b:>19.2f} {diff:>11.1e}")
    latent, scales = R * 2, HKV * 4
    print(
        f"cache bytes per token per latent layer: latent {latent} B (bf16); with write-time scales "
        f"{latent + scales} B (+{scales / latent:.1%}), and a per-token size of {latent + scales} B no longer divides "
        f"the sliding layers' 2048 B pages (vLLM 0.32 then pads or stops grouping them as sliding windows)."
    )


if __name__ == "__main__":
    main()
