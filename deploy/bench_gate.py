"""Time and memory of a full default `vllm-trn gate`, and how they scale with the length of the text.

Run (from the repository root)::

    .venv/bin/python deploy/bench_gate.py                      # texts of 16k, 32k and 64k tokens
    .venv/bin/python deploy/bench_gate.py --tokens 8192 16384

The demo MLA-Trinity (`vllm-trn demo mla-trinity`, float32) served by `vllm-trn serve` (`--max-model-len 8192`) is
the candidate; transformers on the same files, in the gate's process, the reference. One text of random ASCII words
(byte-level tokens); for each length the whole default gate (every window scored by both sides, the greedy decode
check, the passkey grid the model's length allows) runs as a child process of this script, which reports its own
wall time and peak resident memory. The gate streams the text window by window, so its memory must not grow with
the text beyond one window; its time grows with the number of windows (plus a fixed decode check and passkey grid).

Results: a table on stdout and JSON (`--out`, default bench-out/bench_gate.json). The machines are noisy: compare
figures measured side by side in one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import scratch_dir

from vllm_trn_plugin.bench.local import serve_demo, vllm_trn_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536], help="text lengths to gate")
    p.add_argument("--workdir", type=Path, help="checkpoint, text, server log and reports here (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_gate.json"))
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(gate_argv: list[str]) -> None:
    """One gate in this process; its peak RSS (KiB, Linux) on the last stderr line."""
    from vllm_trn_plugin.gate.cli import main as gate_main

    rc = gate_main(gate_argv)
    print(f"MAXRSS_KIB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
    sys.exit(rc)


def write_text(path: Path, chars: int, seed: int) -> None:
    rng = random.Random(seed)
    words: list[str] = []
    n = 0
    while n < chars:
        w = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(2, 9)))
        words.append(w)
        n += len(w) + 1
    path.write_text(" ".join(words))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child(args.child)
    rows = []
    with scratch_dir(args.workdir, "bench-gate-") as root:
        ckpt = root / "demo-mla-trinity-float32"
        subprocess.run([vllm_trn_command(), "demo", "mla-trinity", str(ckpt), "--dtype", "float32"], check=True)
        text = root / "text.txt"
        write_text(text, max(args.tokens) + 1024, args.seed)  # one byte per token, and some to spare
        with serve_demo(ckpt, root / "server.log", extra=["--max-model-len", "8192"], dtype="float32") as server:
            server.wait_healthy(900)
            for n in args.tokens:
                out = root / f"gate-{n}"
                gate = ["--reference", f"transformers:{ckpt}", "--candidate", server.url, "--text", str(text)]
                gate += ["--max-tokens", str(n), "--out", str(out), "--quiet"]
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, "--child", *gate], capture_output=True, text=True)
                wall = time.perf_counter() - t0
                rss = [line for line in p.stderr.splitlines() if line.startswith("MAXRSS_KIB")]
                if p.returncode not in (0, 1) or not rss:
                    raise RuntimeError(f"gate of {n} tokens exited {p.returncode}:\n{p.stderr[-3000:]}")
                report = json.loads((out / "gate.json").read_text())
                row = {
                    "tokens": n,
                    "windows": report.get("text", {}).get("windows"),
                    "passed": p.returncode == 0,
                    "wall_s": round(wall, 1),
                    "seconds": report.get("seconds"),
                    "peak_rss_mib": int(rss[-1].split()[1]) // 1024,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'tokens':>8} {'windows':>8} {'pass':>5} {'wall s':>8} {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['windows']!s:>8} {r['passed']!s:>5} {r['wall_s']:>8.1f} {r['peak_rss_mib']:>13}")
    first, last = rows[0], rows[-1]
    print(
        f"{last['tokens'] / first['tokens']:.1f}x the text: {last['wall_s'] / first['wall_s']:.2f}x the time, "
        f"{last['peak_rss_mib'] / first['peak_rss_mib']:.2f}x the peak memory"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
