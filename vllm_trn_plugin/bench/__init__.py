"""Load generator for OpenAI-compatible servers (`vllm-trn bench`): workload, client, runner, report.

It does not import vLLM, so it runs against a remote server from any machine with the plugin and its `bench`
extra (aiohttp, tqdm, matplotlib; the soak also psutil, requests, prometheus_client).
"""

from vllm_trn_plugin.bench.cli import build_parser, main, run_bench

__all__ = ["build_parser", "main", "run_bench"]
