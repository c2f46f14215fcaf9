"""Load generator for OpenAI-compatible servers (`vllm-trn bench`): workload, client, runner, report.

It needs only what vLLM itself installs (aiohttp, tqdm, Pillow), so it runs against a remote server
from any machine with the plugin; it does not import vLLM.
"""

from vllm_trn_plugin.bench.cli import build_parser, main, run_bench

__all__ = ["build_parser", "main", "run_bench"]
