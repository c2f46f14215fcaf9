"""convert-mla and quantize at Trinity-Mini's real layer geometry: time and peak memory per layer, and a projection.

Run (from the repository root)::

    .venv/bin/python deploy/bench_checkpoint_tools.py    # the tools' defaults: 65536 / 262144 tokens, ~7 GB disk
    .venv/bin/python deploy/bench_checkpoint_tools.py --tokens 8192 32768   # both tools at each size: the slope

A random bf16 AFMoE checkpoint with Trinity-Mini's layer geometry (hidden 2048, 32 q / 4 KV heads x 128, dense
intermediate 6144, 128 experts x 1024 top-8 + 1 shared expert, window 2048) and three layers: 0 dense (sliding),
1 MoE (sliding), 2 MoE (full attention); vocabulary 259 (the byte tokenizer: the embedding and head are not what
is measured). For each token count, in a fresh child process each:

- `convert_mla(latent=256)`: layer 0 and 1 are calibration forwards (what every layer before the last full one
  costs), layer 2 is the fit (input statistics, whitened SVD, refit; nothing runs after the last full layer);
- `quantize` of the converted checkpoint with `rtn_threshold=0` (every expert by GPTQ: the full cost; random
  tokens give every expert ~tokens x 8 / 128 tokens): layer 0 is a dense layer, layers 1-2 MoE layers.

Each tool reports per layer the wall time and the process's peak RSS during that layer (VmHWM reset at the layer's
start). The projection for the 32-layer model (2 dense + 30 MoE layers, 8 full-attention) is printed from these
figures; its assumptions are printed with it (docs/checkpoint-tools.md has the run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SEQ = 2048
CHILD = """
import json, sys, torch
from vllm_trn_plugin.tools.convert_mla import convert_mla
from vllm_trn_plugin.tools.quantize import QuantizeOptions, quantize
tool, src, dst, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
calib = torch.randint(0, 256, (tokens // 2048, 2048), generator=torch.Generator().manual_seed(0))
if tool == "convert":
    r = convert_mla(src, dst, latent=256, calib=calib, progress=False)
else:
    r = quantize(src, dst, calib=calib, options=QuantizeOptions(rtn_threshold=0), progress=False)
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("RESULT" + json.dumps({"seconds": r.seconds, "layer_seconds": r.layer_seconds,
                             "layer_peak_rss": r.layer_peak_rss}))
"""


def write_source(out: Path) -> Path:
    """Random bf16 AFMoE checkpoint (k_proj/v_proj everywhere) at Trinity-Mini's layer geometry, in ~1 GB shards."""
    from vllm_trn_plugin.demo import TRINITY_MINI, write_afmoe_demo

    geometry = {k: v for k, v in TRINITY_MINI.items() if k != "kv_lora_rank"}
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    geometry.update(num_hidden_layers=3, num_dense_layers=1, vocab_size=259, layer_types=types)
    return write_afmoe_demo(out, dtype=torch.bfloat16, **geometry)


def run(tool: str, src: Path, dst: Path, tokens: int) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tool, str(src), str(dst), str(tokens)], capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"{tool} failed:\n{out.stderr[-4000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    res = json.loads(line[len("RESULT") :])
    res["layer_seconds"] = {int(k): v for k, v in res["layer_seconds"].items()}
    res["layer_peak_rss"] = {int(k): v for k, v in res["layer_peak_rss"].items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="calibration tokens for both tools, one run per value (multiples of 2048; default: each tool's "
        "own default, convert-mla 65536 and quantize 262144)",
    )
    ap.add_argument("--out", default="bench-out/checkpoint-tools")
    ap.add_argument("--write-source", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_source:
        write_source(Path(args.write_source))
        return
    root = Path(args.out)
    src = root / "afmoe"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        # In a child: the generator's buffers would otherwise stay in this process while the tools run.
        subprocess.run([sys.executable, __file__, "--write-source", str(src)], check=True)
    gib = 1 << 30
    results = {}
    for n_conv, n_quant in [(n, n) for n in args.tokens] if args.tokens else [(65536, 262144)]:
        conv = run("convert", src, root / "mla", n_conv)
        quant = run("quantize", root / "mla", root / "packed", n_quant)
        results[f"{n_conv}/{n_quant}"] = {"convert": conv, "quantize": quant}
        c, q = conv["layer_seconds"], quant["layer_seconds"]
        cm, qm = conv["layer_peak_rss"], quant["layer_peak_rss"]
        print(
            f"\ncalibration tokens: convert-mla {n_conv}, quantize {n_quant} ({SEQ}-token sequences), "
            f"{torch.get_num_threads()} threads"
        )
        print("convert-mla: layer  seconds  peak RSS GiB")
        for i, what in ((0, "dense forward"), (1, "MoE forward"), (2, "full-attention fit")):
            print(f"  {i} {what:<20} {c[i]:8.1f}  {cm[i] / gib:6.2f}")
        print("quantize:    layer  seconds  peak RSS GiB")
        for i, what in ((0, "dense"), (1, "MoE (sliding)"), (2, "MoE (MLA)")):
            print(f"  {i} {what:<20} {q[i]:8.1f}  {qm[i] / gib:6.2f}")
        conv_total = c[0] * 2 + c[1] * 29 + c[2] * 8
        quant_total = q[0] * 2 + (q[1] + q[2]) / 2 * 30
        print(
            "projection, 32 layers (2 dense + 30 MoE; full layers 3, 7, ..., 31):\n"
            f"  convert-mla ~{conv_total / 3600:.1f} h (2 dense + 29 MoE calibration forwards and 8 fits: the last "
            "full layer is 31, so every layer before it runs)\n"
            f"  quantize ~{quant_total / 3600:.1f} h (2 dense + 30 MoE layers)\n"
            f"  peak RSS ~{max(cm.values()) / gib:.1f} / {max(qm.values()) / gib:.1f} GiB, plus the embedding and LM "
            "head (200192 x 2048 bf16, 0.8 GB each, read once)"
        )
    (root / "result.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
