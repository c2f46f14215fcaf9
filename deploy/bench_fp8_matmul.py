"""The FP8 x FP8 products of one quantized layer on this CPU, every way torch can compute them, side by side.

Run (from the repository root)::

    .venv/bin/python deploy/bench_fp8_matmul.py                    # a 32768 x 2048 FP8 weight, 1 and 8 tokens
    .venv/bin/python deploy/bench_fp8_matmul.py --rows 131072 --cols 1024   # Trinity-Mini's LM head at hidden 1024

Each form computes sum_k xq[t, k] * w[n, k] for FP8 activations xq [T, K] and an FP8 weight w [N, K], in fp32:
- `per-call upcast`: w converted to fp32 on every call (what fp8_linear did before compute copies);
- `fp8 only (chunks)`: kernels/fp8.fp8_matmul without a copy (VLLM_TRN_FP8_RESIDENCY=fp8): row chunks;
- `fp32 copy`: an fp32 copy held once (4 bytes per weight; the fallback where FBGEMM is missing);
- `bf16 copy, bf16 out`: a bf16 copy and a bf16 GEMM: exact products, but its output is rounded to bf16 (not the
  definition: shown for its speed only);
- `vLLM oneDNN bf16`: what a bf16 engine computes the same layer with (vLLM's prepacked oneDNN GEMM, bf16 in and
  out: also not the definition); the packed engine's decode time against the bf16 engine's follows from this row
  against `compute copy` (docs/fp8.md). Left out where vLLM's CPU ops are missing;
- `compute copy`: kernels/fp8.fp8_compute_copy, what a CPU layer computes with: on CPUs with AVX-512 BF16
  the compiled kernel's packed bf16 copy (kernels/fp8_cpu.py: AMX where the CPU has it), else FBGEMM's packed fp16
  (2 bytes per weight either way, fp32 accumulation);
- `kernel, vdpbf16ps only`: the same copy on AVX-512 BF16 alone (VLLM_TRN_NATIVE_GEMM=avx512), where AMX is there;
- `FBGEMM fp16 copy`: FBGEMM's copy, shown beside the compute copy where that is the kernel's;
- `_scaled_mm`: torch's FP8 GEMM (unit scales, fp32 out), the form a GPU or the Neuron graph runs.
Reps interleave the forms; the median per form is printed with its ratio to the compute copy, and its largest
difference from the compute copy's output relative to the output's scale (fp32 accumulation orders differ: ~1e-7;
the bf16 output's rounding: ~1e-3).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from vllm_trn_plugin import envs
from vllm_trn_plugin.kernels import fp8_cpu
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, fp8_compute_copy, fp8_matmul, scaled_mm_products

FORM_NAMES = {torch.bfloat16: "compiled kernel", torch.uint8: "FBGEMM fp16", torch.float32: "fp32"}


@contextlib.contextmanager
def native_gemm(mode: str) -> Iterator[None]:
    """VLLM_TRN_NATIVE_GEMM=mode inside the block (read per call): "0" for FBGEMM's copy, "avx512" for no AMX."""
    before = os.environ.get(envs.NATIVE_GEMM)
    os.environ[envs.NATIVE_GEMM] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[envs.NATIVE_GEMM]
        else:
            os.environ[envs.NATIVE_GEMM] = before


def without_amx(w: torch.Tensor, copy: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(xq: torch.Tensor) -> torch.Tensor:
        with native_gemm("avx512"):
            return fp8_matmul(xq, w, copy)

    return run


def forms(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w32, w16, copy = w.float(), w.to(torch.bfloat16), fp8_compute_copy(w)
    out = {
        "per-call upcast": lambda xq: xq.float() @ w.float().t(),
        "fp8 only (chunks)": lambda xq: fp8_matmul(xq, w),
        "fp32 copy": lambda xq: xq.float() @ w32.t(),
        "bf16 copy, bf16 out": lambda xq: (xq.to(torch.bfloat16) @ w16.t()).float(),
        "compute copy": lambda xq: fp8_matmul(xq, w, copy),
    }
    if copy.dtype == torch.bfloat16:
        if fp8_cpu.isas()[0] == fp8_cpu.AMX:
            out["kernel, vdpbf16ps only"] = without_amx(w, copy)
        with native_gemm("0"):
            fb = fp8_compute_copy(w)
        out["FBGEMM fp16 copy"] = lambda xq: fp8_matmul(xq, w, fb)
    try:
        from vllm import _custom_ops as ops

        handler = ops.create_onednn_mm(w16.t(), 32)
        out["vLLM oneDNN bf16"] = lambda xq: ops.onednn_mm(handler, xq.to(torch.bfloat16), None).float()
    except (ImportError, AttributeError, RuntimeError) as e:
        print(f"vLLM oneDNN bf16 left out: {e}")
    out["_scaled_mm"] = lambda xq: scaled_mm_products(xq, w)  # last: seconds per call, and its temporaries
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32768, help="N: output features")
    p.add_argument("--cols", type=int, default=2048, help="K: input features")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.rows, args.cols, generator=g) * 40).clamp(-240, 240).to(FP8_DTYPE)
    fns = forms(w)
    print(
        f"FP8 weight {args.rows} x {args.cols}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"compute copy: {FORM_NAMES[fp8_compute_copy(w).dtype]} {' / '.join(fp8_cpu.isas())}"
    )
    for t in args.tokens:
        xq = (torch.randn(t, args.cols, generator=g) * 40).clamp(-240, 240).to(FP8_DTYPE)
        ref = fns["compute copy"](xq)
        times: dict[str, list[float]] = {k: [] for k in fns}
        same = {}
        for rep in range(args.reps + 1):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                y = fn(xq)
                if rep:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
                else:  # accumulation orders differ between forms: the error relative to the output's scale
                    same[name] = float((y - ref).abs().max() / ref.abs().max())
        base = statistics.median(times["compute copy"])
        print(f"\n{t} token(s): ms per call (median of {args.reps}), ratio to the copy, max |y - y_copy| / max |y|")
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"  {name:<22} {m * 1e3:9.1f} ms {m / base:8.2f}x   {same[name]:.1e}")


if __name__ == "__main__":
    main()
