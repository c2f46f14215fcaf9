"""`vllm-trn gate`: does a candidate serve the same model as a reference? Exit 0 on pass, 1 on fail, 2 on an error
(bad input, an unreachable or unsuitable source), with no report written then."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_trn_plugin.gate import passkey
from vllm_trn_plugin.gate.errors import GateError
from vllm_trn_plugin.gate.metrics import DEFAULT_BUCKETS, Thresholds
from vllm_trn_plugin.gate.report import plot, table, write_json
from vllm_trn_plugin.gate.run import GateOptions, run_gate
from vllm_trn_plugin.gate.sources import DEFAULT_TIMEOUT, Source, open_source
from vllm_trn_plugin.gate.ties import TIE_MARGIN

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
REPORT_FILES = ("gate.json", "gate.txt", "gate.png")
SPEC_HELP = (
    "an OpenAI-compatible vLLM server (http://host:port), or a checkpoint directory run in this process: "
    "transformers:DIR (transformers' model; an MLA-Trinity checkpoint as its dense equivalent) or vllm:DIR; a bare "
    "DIR runs in vLLM for the plugin's architectures, else in transformers"
)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers") from None


def _depths(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated percentages") from None
    return [v / 100 for v in vals]


def parser() -> argparse.ArgumentParser:
    d = Thresholds()
    p = argparse.ArgumentParser(
        prog="vllm-trn gate",
        description="Gate a candidate deployment, kernel, conversion or quantization against a reference: next-token "
        "agreement, logit cosine / KL, NLL by context length, passkey retrieval (docs/gate.md). Exit 0 only on pass.",
    )
    p.add_argument("--reference", required=True, help=SPEC_HELP)
    p.add_argument("--candidate", required=True, help=SPEC_HELP)
    p.add_argument("--reference-model", help="model name on the reference endpoint (default: the first listed)")
    p.add_argument("--candidate-model", help="model name on the candidate endpoint (default: the first listed)")
    p.add_argument("--api-key", help="bearer token for the endpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file, tokenized with the reference's tokenizer")
    src.add_argument("--tokens", help="token id file (.json list or .npy)")
    p.add_argument("--max-tokens", type=int, help="score at most this many tokens of the text")
    p.add_argument("--window", type=int, help="tokens per scored window (default: the longest both sides allow)")
    p.add_argument(
        "--buckets",
        type=_ints,
        default=list(DEFAULT_BUCKETS),
        help="context-length bucket edges (default 0,2048,8192,32768)",
    )
    p.add_argument("--top-k", type=int, default=20, help="logprobs per position from an endpoint (default 20)")
    p.add_argument(
        "--tie-margin",
        type=float,
        default=TIE_MARGIN,
        help=f"reference top-2 margin (nats) under which a position is a near-tie (default {TIE_MARGIN}; "
        "0.125 for bf16 sides)",
    )
    p.add_argument("--min-agreement", type=float, default=d.min_agreement, help=f"(default {d.min_agreement})")
    p.add_argument("--max-nll-diff", type=float, default=d.max_nll_diff, help=f"nats (default {d.max_nll_diff})")
    p.add_argument("--min-cosine", type=float, default=d.min_cosine, help=f"full logits (default {d.min_cosine})")
    p.add_argument(
        "--min-topk-cosine", type=float, default=d.min_topk_cosine, help=f"top-k support (default {d.min_topk_cosine})"
    )
    p.add_argument("--max-kl", type=float, default=d.max_kl, help=f"mean KL, nats (default {d.max_kl})")
    p.add_argument(
        "--max-passkey-misses", type=int, default=d.max_passkey_misses, help=f"(default {d.max_passkey_misses})"
    )
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=8,
        help="greedy continuations of the candidate scored by the reference: the decode path (default 8; 0: none)",
    )
    p.add_argument("--decode-context", type=int, default=1024, help="text tokens before each (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per continuation (default 64)")
    p.add_argument("--no-passkey", action="store_true", help="skip passkey retrieval")
    p.add_argument(
        "--passkey-lengths",
        type=_ints,
        default=list(passkey.DEFAULT_LENGTHS),
        help="prompt lengths in tokens; longer than the models allow: tested at the longest allowed "
        "(default 2048,8192,14336,32768)",
    )
    p.add_argument(
        "--passkey-depths",
        type=_depths,
        default=list(passkey.DEFAULT_DEPTHS),
        help="key depths in percent (default 10,30,50,70,90)",
    )
    p.add_argument("--seed", type=int, default=0, help="passkey keys")
    p.add_argument("--local-dtype", default="float32", help="dtype of a side run in this process (default float32)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per endpoint request")
    p.add_argument("--out", type=Path, help="write gate.json, gate.txt and gate.png (with matplotlib) here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _open(label: str, spec: str, model: str | None, args: argparse.Namespace, other: Source | None) -> Source:
    if other is not None and other.kind == "vllm" and spec.startswith("vllm:"):
        raise GateError("one vLLM engine per process: serve one side (vllm-trn serve DIR) and gate its URL")
    longest = max([*args.buckets, *([] if args.no_passkey else args.passkey_lengths)])
    return open_source(
        label,
        spec,
        model=model,
        api_key=args.api_key,
        timeout=args.timeout,
        dtype=args.local_dtype,
        max_len=longest + passkey.ANSWER_TOKENS + 1,
        top_k=args.top_k,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.out is not None:  # a stale report must never stand in for this run's
        for name in REPORT_FILES:
            (args.out / name).unlink(missing_ok=True)
    opts = GateOptions(
        text=args.text,
        tokens=args.tokens,
        max_tokens=args.max_tokens,
        window=args.window,
        buckets=args.buckets,
        top_k=args.top_k,
        tie_margin=args.tie_margin,
        thresholds=Thresholds(
            min_agreement=args.min_agreement,
            max_nll_diff=args.max_nll_diff,
            min_cosine=args.min_cosine,
            min_topk_cosine=args.min_topk_cosine,
            max_kl=args.max_kl,
            max_passkey_misses=args.max_passkey_misses,
        ),
        decode_prompts=args.decode_prompts,
        decode_context=args.decode_context,
        decode_tokens=args.decode_tokens,
        passkey=not args.no_passkey,
        passkey_lengths=args.passkey_lengths,
        passkey_depths=args.passkey_depths,
        seed=args.seed,
        progress=not args.quiet,
    )
    ref = cand = None
    try:
        ref = _open("reference", args.reference, args.reference_model, args, None)
        cand = _open("candidate", args.candidate, args.candidate_model, args, ref)
        report = run_gate(ref, cand, opts)
    except GateError as e:
        print(f"vllm-trn gate: error: {e}\nno report written; the gate did not pass", file=sys.stderr)
        return EXIT_ERROR
    finally:
        for side in (ref, cand):
            if side is not None:
                side.close()
    text = table(report)
    print(text)
    if args.out is not None:
        write_json(report, args.out / "gate.json")
        (args.out / "gate.txt").write_text(text + "\n")
        if not plot(report, args.out / "gate.png"):
            print("note: no plot (matplotlib is not installed: pip install 'vllm-trn-plugin[bench]')")
    return EXIT_PASS if report["verdict"] == "pass" else EXIT_FAIL
