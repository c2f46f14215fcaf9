"""Laplace's prefill kernels on a mixed vLLM step: one call for the whole step vs one call per sequence.

Run (from the repository root; about 1-2 minutes on a 2-core CPU machine)::

    .venv/bin/python deploy/bench_gla_prefill.py

Options: `--help`. The step is what vLLM's chunked prefill schedules when a long prompt shares a
step with many short ones: one 4096-token chunk plus 64 prompts of 64 tokens (`--long`, `--short`,
`--num-short`), each sequence continuing from a random state. Kernels (`kernels/simple_gla.py`,
`kernels/causal_conv1d.py`):
- `gla`: `simple_gla_chunked_prefill` at Laplace 3B's head geometry (head_k_dim 96, head_v_dim 192);
  `--heads` defaults to 4, not the model's 16, to keep the run short on 2 cores (its cost is linear
  in the heads); fp32 inputs (it computes in fp32 whatever the input dtype);
- `conv`: `causal_conv1d_prefill`, width 4 over `--hidden` 3072 channels (Laplace 3B), fp32.

Variants, the same tokens, states and function either way:
- `mixed`: one call for the whole step (cu_seqlens over all 65 sequences), as Laplace's mixer does;
- `separate`: one call per sequence (as if each were alone in its step);
- `whole`: the step's tokens as one sequence from one state, the floor a step of those tokens costs: beside it,
  what each further sequence adds, in sizes of its state (a burst of tiny prompts: `--long 2 --short 2
  --num-short 31`, 32 two-token prompts against one 64-token one).

Measured for each: time, the best of `--repeats` interleaved runs (mixed, separate, mixed, ...);
peak memory, in a fresh subprocess per variant, after the inputs are built and a tiny warm-up call
has loaded the libraries: for each call, the growth of the peak resident set size (Linux `VmHWM`,
reset just before the call) over the resident size before it, so it counts every transient the call
creates plus its outputs; a variant's figure is the sum over its calls (what its tokens cost; the
largest single call is shown beside it). glibc is told to mmap every allocation of 64 KiB or more
and trim on free there, so the resident size follows the live tensors. Printed per kernel: both
figures per variant, the ratios mixed / separate (target <= 1.2: a step costs what its tokens
cost), and the largest difference between the two variants' outputs (they must agree).

`--module NAME` benchmarks the two functions of another importable module instead of the plugin's
`kernels/simple_gla.py` and `kernels/causal_conv1d.py` (an earlier `simple_gla.py`, which held both, on PYTHONPATH,
for before/after figures;
docs/kernels.md has the commands). The machines are noisy and shared: compare the ratios measured side by
side in one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_trn_plugin.kernels import simple_gla

KERNELS = {  # kernel: (its module in the plugin, the function)
    "gla": ("vllm_trn_plugin.kernels.simple_gla", "simple_gla_chunked_prefill"),
    "conv": ("vllm_trn_plugin.kernels.causal_conv1d", "causal_conv1d_prefill"),
}
VARIANTS = ("mixed", "separate", "whole")
CONV_WIDTH = 4
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=4, help="GLA heads (default 4; Laplace 3B has 16)")
    p.add_argument("--head-k-dim", type=int, default=96, help="default 96 (Laplace 3B)")
    p.add_argument("--head-v-dim", type=int, default=192, help="default 192 (Laplace 3B)")
    p.add_argument("--hidden", type=int, default=3072, help="conv channels (default 3072, Laplace 3B)")
    p.add_argument("--long", type=int, default=4096, help="tokens of the long prompt's chunk (default 4096)")
    p.add_argument("--short", type=int, default=64, help="tokens of each short prompt (default 64)")
    p.add_argument("--num-short", type=int, default=64, help="short prompts in the step (default 64)")
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant, best kept (default 3)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, the core count)")
    p.add_argument("--module", help="one module holding both kernels to benchmark (default: the plugin's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_gla_prefill.json"))
    p.add_argument("--child", nargs=2, metavar=("KERNEL", "VARIANT"), help=argparse.SUPPRESS)  # one memory run
    return p.parse_args(argv)


def load_kernel(module: str | None, kernel: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    own, name = KERNELS[kernel]
    fn = getattr(importlib.import_module(module or own), name, None)
    if fn is None:
        raise SystemExit(f"--module {module}: defines no {name}")
    return fn


def make_calls(args: argparse.Namespace, kernel: str) -> dict[str, list[tuple]]:
    """The argument tuples of each variant's calls: the whole step at once, or one per sequence."""
    lengths = [args.long] + [args.short] * args.num_short
    T, N = sum(lengths), len(lengths)
    g = torch.Generator().manual_seed(args.seed)
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32)
    if kernel == "gla":
        H, dk, dv = args.heads, args.head_k_dim, args.head_v_dim
        q, k = torch.randn(T, H, dk, generator=g), torch.randn(T, H, dk, generator=g)
        v, S0 = torch.randn(T, H, dv, generator=g), torch.randn(N, H, dk, dv, generator=g)
        aug, ld = 0.3 * torch.randn(H, dk, generator=g), simple_gla.geometric_log_decay(H, 1.0, 2048.0)

        def one(s: int, e: int, n: slice, cu_n: torch.Tensor) -> tuple:
            return (q[s:e], k[s:e], v[s:e], aug, ld, dk**-0.5, cu_n, S0[n])
    else:
        D = args.hidden
        x, state = torch.randn(T, D, generator=g), torch.randn(N, CONV_WIDTH - 1, D, generator=g)
        weight, bias = torch.randn(D, CONV_WIDTH, generator=g), torch.randn(D, generator=g)

        def one(s: int, e: int, n: slice, cu_n: torch.Tensor) -> tuple:
            return (x[s:e], weight, bias, cu_n, state[n])

    separate = [
        one(s, e, slice(n, n + 1), torch.tensor([0, e - s], dtype=torch.int32))
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]
    whole = [one(0, T, slice(0, 1), torch.tensor([0, T], dtype=torch.int32))]
    return {"mixed": [one(0, T, slice(0, N), cu)], "separate": separate, "whole": whole}


def run_calls(fn: Callable, todo: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    results = [fn(*call) for call in todo]
    return torch.cat([out for out, _ in results]), torch.cat([state for _, state in results])


def warm_up(fn: Callable, args: argparse.Namespace, kernel: str) -> None:
    tiny = argparse.Namespace(**{**vars(args), "long": 3, "short": 2, "num_short": 1, "hidden": 8})
    run_calls(fn, make_calls(tiny, kernel)["mixed"])


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field} (the memory figure needs Linux)")


def child(args: argparse.Namespace) -> None:
    """Each call of one kernel's variant in this fresh process; prints each call's peak RSS growth."""
    kernel, variant = args.child
    fn = load_kernel(args.module, kernel)
    todo = make_calls(args, kernel)[variant]
    warm_up(fn, args, kernel)
    growth = []
    for call in todo:
        # VmHWM reset to the current RSS (Linux >= 4.0; ru_maxrss would not do: it keeps the
        # parent's peak across fork + exec).
        Path("/proc/self/clear_refs").write_text("5")
        before = proc_status_kib("VmRSS")
        out = fn(*call)
        growth.append((proc_status_kib("VmHWM") - before) * 1024)
        del out
    print(json.dumps(growth))


def peak_memory(argv: list[str], kernel: str, variant: str) -> list[int]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", kernel, variant]
    # A fixed mmap threshold also turns off glibc's adaptive one, which would otherwise keep freed
    # tensors resident for the next call to reuse unseen.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode != 0:
        raise SystemExit(f"memory run of {kernel} {variant} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return [int(b) for b in json.loads(res.stdout.strip().splitlines()[-1])]


def bench_kernel(args: argparse.Namespace, argv: list[str], kernel: str) -> dict[str, Any]:
    fn = load_kernel(args.module, kernel)
    todo = make_calls(args, kernel)
    warm_up(fn, args, kernel)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            t0 = time.perf_counter()
            results[variant] = run_calls(fn, todo[variant])
            times[variant].append(time.perf_counter() - t0)
    pair = (results["mixed"], results["separate"])
    diff = [(a - b).abs().max().item() for a, b in zip(*pair, strict=True)]
    del results, todo

    growth = {v: peak_memory(argv, kernel, v) for v in VARIANTS}
    best = {v: min(ts) for v, ts in times.items()}
    mem = {v: sum(g) for v, g in growth.items()}
    print(f"\n{kernel}: {KERNELS[kernel][1]}")
    print(f"{'variant':<10} {'calls':>5} {'best s':>8}  {'runs s':<22} {'peak RSS growth MiB: sum (largest call)':>40}")
    for v in VARIANTS:
        runs = " ".join(f"{t:.3f}" for t in times[v])
        largest = max(growth[v]) / MiB
        print(f"{v:<10} {len(growth[v]):>5} {best[v]:>8.3f}  {runs:<22} {mem[v] / MiB:>30.1f} ({largest:.1f})")
    ratio_time, ratio_mem = best["mixed"] / best["separate"], mem["mixed"] / max(mem["separate"], 1)
    print(f"ratio mixed / separate: time {ratio_time:.2f}, peak memory {ratio_mem:.2f} (target <= 1.2)")
    # The same tokens as one sequence: what a step's tokens cost with one state. Each further sequence may add its
    # state (read, handed on, written: a few state sizes), nothing proportional to a padded length.
    state_bytes = make_calls(argparse.Namespace(**{**vars(args), "long": 1, "num_short": 0}), kernel)["whole"][0][-1]
    state_bytes = state_bytes.numel() * state_bytes.element_size()
    n_extra = args.num_short
    per_seq = (mem["mixed"] - mem["whole"]) / max(n_extra, 1) / state_bytes
    print(
        f"mixed vs whole (the step's tokens as one sequence): peak memory {mem['mixed'] / max(mem['whole'], 1):.2f}x, "
        f"{per_seq:.1f} state sizes ({state_bytes / MiB:.2f} MiB) per further sequence (target <= 6)"
    )
    return {
        "times_s": times,
        "best_s": best,
        "peak_rss_growth_bytes_per_call": growth,
        "ratio_time": ratio_time,
        "ratio_peak_memory": ratio_mem,
        "state_sizes_per_further_sequence": per_seq,
        "max_abs_diff": {"output": diff[0], "final_state": diff[1]},
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    kernel_src = args.module or "the plugin"
    T, N = args.long + args.short * args.num_short, 1 + args.num_short
    print(
        f"step: 1 x {args.long} + {args.num_short} x {args.short} tokens (T={T}, N={N}); "
        f"gla H={args.heads}, dk={args.head_k_dim}, dv={args.head_v_dim}; conv D={args.hidden}, W={CONV_WIDTH}; "
        f"{torch.get_num_threads()} threads; kernels from {kernel_src}",
        flush=True,
    )
    report = {
        "step": {"long": args.long, "short": args.short, "num_short": args.num_short, "T": T, "N": N},
        "geometry": {"heads": args.heads, "head_k_dim": args.head_k_dim, "head_v_dim": args.head_v_dim},
        "hidden": args.hidden,
        "threads": torch.get_num_threads(),
        "kernel_source": kernel_src,
    }
    for kernel in args.kernels:
        report[kernel] = bench_kernel(args, argv, kernel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
