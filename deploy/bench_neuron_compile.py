"""The Neuron adapters' decode step, eager vs compiled as vLLM Neuron's runner compiles it, side by side in one run.

Run (from the repository root)::

    .venv/bin/python deploy/bench_neuron_compile.py

For each model (demo geometry: Laplace's 4 GLA layers; MLA-Trinity's real head geometry with 4 layers, 8 experts),
the adapter is built and loaded as vLLM Neuron's runner does it (`from_configs`, `load_weights`, caches allocated per
`get_kv_spec`, `bind_kv_cache`). Each decode bucket (width x context bucket) is then:

1. compiled: `torch.compile(adapter, fullgraph=True, dynamic=False, backend=--backend)`, its first call timed as the
   bucket's warm-up (trace + compile, the cost a new bucket pays once);
2. timed, eager and compiled interleaved (ABBA) over `--steps` steps each, from the same inputs: every row live, at
   the context bucket's last position, its own pages (a decode step's work is fixed by its bucket, not by the
   values it reads). Reported: median ms per step and the eager / compiled ratio;
3. counted: the bucket's graph as a device compiler receives it (aten level, after functionalization): its kernel
   calls by op against its aten ops (anything else would be an opaque node the device compiler cannot lower).

Laplace's step does not depend on the context (a fixed state per sequence): its context column is the state's
and only the width varies. This is a CPU proxy: the compiled graphs are what a device compiler would take, but
the times are this host's (torch's CPU kernels, `--backend` inductor's generated C++), not Trainium2's. Compare the
ratios measured side by side, never absolute milliseconds across machines.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import save_result, scratch_dir

MODELS = ("laplace", "mla-trinity")


def _build(model: str, root: Path, max_model_len: int, block_size: int, rows: int) -> Any:
    """A demo checkpoint of `model`, its Neuron adapter loaded as the runner loads it, and caches for `rows`
    sequences of `max_model_len` tokens bound to it."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from vllm_trn_plugin.demo import write_laplace_demo, write_trinity_demo

    if model == "laplace":
        from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel as cls

        ckpt = write_laplace_demo(root / model, dtype=torch.float32)
    else:
        from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel as cls

        ckpt = write_trinity_demo(root / model, dtype=torch.float32, max_position_embeddings=max_model_len)
    cfg = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=max_model_len, enforce_eager=True)
    cfg = cfg.create_engine_config()
    with set_current_vllm_config(cfg):
        with torch.device("meta"):
            adapter = cls.from_configs(cfg.model_config.hf_config, {})
        adapter.load_weights(str(ckpt), torch.device("cpu"), None)
    spec = adapter.get_kv_spec()
    num_blocks = 1 + rows * math.ceil(max_model_len / block_size)

    def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    caches: dict[str, list[torch.Tensor]] = {}
    for s in spec.layers:  # as vLLM Neuron binds them: [k, v], or [latent] for an MLA layer
        shape = (num_blocks, s.num_kv_heads, block_size, s.head_size)
        caches[s.name] = [zeros(*shape, dtype=s.dtype) for _ in ("latent",) if s.cache_kind.value == "mla"] or [
            zeros(*shape, dtype=s.dtype) for _ in "kv"
        ]
    for s in spec.recurrent_layers:
        caches[s.name] = [zeros(rows + 1, *shape, dtype=dt) for shape, dt in zip(s.shapes, s.dtypes)]
    adapter.bind_kv_cache(caches)
    return adapter, spec


def _decode_inputs(spec: Any, rows: int, context: int, block_size: int, window_blocks: int) -> dict[str, Any]:
    """A decode step's forward arguments in the runner's form: `rows` live rows, each at position context - 1 with
    its own pages (row r: blocks 1 + r * nb ..., recurrent page r + 1); the latent table trimmed to the context
    bucket, the sliding table to the window (with its position offset)."""
    nb = math.ceil(context / block_size)
    pos = torch.full((rows,), context - 1, dtype=torch.long)
    table = 1 + torch.arange(rows)[:, None] * nb + torch.arange(nb)[None, :]
    slot = table[:, -1] * block_size + (context - 1) % block_size

    def meta(t: torch.Tensor, s: torch.Tensor, bs: int) -> dict[str, Any]:
        return {
            "block_table_tensor": t.to(torch.int32).contiguous(),
            "slot_mapping": s.long(),
            "max_query_len": 1,
            "decode_token_threshold": 1,
            "block_size": bs,
            "max_blocks_per_seq": t.shape[1],
            "cached_seq_len": torch.tensor([[context - 1]], dtype=torch.int32),
            "kv_segment_size": 0,
            "full_block_table_tensor": t.to(torch.int32).clone(),
            "swa_kv_pos_offset": torch.zeros(rows, dtype=torch.int32),
        }

    metas: dict[str, Any] = {}
    latent = meta(table, slot, block_size)
    start = (nb - window_blocks) if nb > window_blocks else 0
    sliding = meta(table[:, start : start + window_blocks], slot, block_size)
    sliding["swa_kv_pos_offset"] = torch.full((rows,), start * block_size, dtype=torch.int32)
    for s in spec.layers:
        metas[s.name] = latent if s.cache_kind.value == "mla" else sliding
    if spec.recurrent_layers:
        pages = 1 + torch.arange(rows)
        recurrent = meta(pages[:, None], pages, context)
        for s in spec.recurrent_layers:
            metas[s.name] = recurrent
    return dict(
        input_ids=torch.ones(rows, dtype=torch.int32),
        positions=pos,
        attn_metadata=metas,
        sampling_positions=torch.arange(rows),
        sampling_params=None,
        spec_decode_metadata=None,
        rank=torch.tensor(0, dtype=torch.int32),
        logit_mask=None,
    )


def _graph_nodes(adapter: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step's graph as the device compiler receives it (aten level, after functionalization; traced only): how
    many of its op calls are kernel calls (by op) and how many aten ops; `other` would be anything opaque."""
    import operator

    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(adapter, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=keep))(**kwargs)
    torch._dynamo.reset()
    kernels: dict[str, int] = {}
    aten = other = 0
    for node in graphs[0].graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator) and target.name().startswith("auto_functionalized"):
            target = node.args[0]
        name = target.name() if isinstance(target, torch._ops.OpOverload) else str(target)
        if name.startswith("trn::"):
            kernels[name] = kernels.get(name, 0) + 1
        elif name.split("::")[0] in ("aten", "prims"):
            aten += 1
        else:
            other += 1
    return {"kernel_nodes": sum(kernels.values()), "kernels": kernels, "aten_nodes": aten, "other_nodes": other}


def _time(fn: Any, kwargs: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn(**kwargs)
    return time.perf_counter() - t0


def bench_model(model: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    import torch._dynamo

    from vllm_trn_plugin.neuron.contract import NeuronConfig

    rows = max(args.widths)
    max_model_len = max(args.contexts)
    adapter, spec = _build(model, root, max_model_len, args.block_size, rows)
    adapter.neuron_config = NeuronConfig(on_device_sampling_config=None)  # host sampling: logits out
    window = getattr(adapter.config, "sliding_window", None) or args.block_size
    window_blocks = math.ceil((window // args.block_size + 1) / max(1, 128 // args.block_size)) * max(
        1, 128 // args.block_size
    )
    torch._dynamo.reset()
    compiled = torch.compile(adapter, fullgraph=True, dynamic=False, backend=args.backend)
    has_latent = any(s.cache_kind.value == "mla" for s in spec.layers)
    contexts = args.contexts if has_latent else [max_model_len]
    results = []
    for width in args.widths:
        for context in contexts:
            kwargs = _decode_inputs(spec, width, context, args.block_size, window_blocks)
            nodes = _graph_nodes(adapter, kwargs)
            warmup = _time(compiled, kwargs)
            _time(adapter, kwargs)
            eager, comp = [], []
            with torch.compiler.set_stance("fail_on_recompile"):
                for i in range(args.steps):  # ABBA: neither side always runs first
                    order = [(adapter, eager), (compiled, comp)]
                    for fn, out in order if i % 2 == 0 else order[::-1]:
                        out.append(_time(fn, kwargs))
            row = {
                "model": model,
                "width": width,
                "context": context if has_latent else None,
                "warmup_compile_s": round(warmup, 2),
                "eager_ms": round(1e3 * statistics.median(eager), 2),
                "compiled_ms": round(1e3 * statistics.median(comp), 2),
            }
            row["eager_over_compiled"] = round(row["eager_ms"] / row["compiled_ms"], 2)
            row |= nodes
            results.append(row)
            print(
                f"{model:12s} width {width:3d} context {str(row['context']):>6s}: "
                f"warm-up {row['warmup_compile_s']:7.2f}"
                f" s; eager {row['eager_ms']:8.2f} ms, compiled {row['compiled_ms']:8.2f} ms, "
                f"ratio {row['eager_over_compiled']:.2f}x; graph: {nodes['kernel_nodes']} kernel calls "
                f"{nodes['kernels']}, {nodes['aten_nodes']} aten ops, {nodes['other_nodes']} other",
                flush=True,
            )
    return results


def _worker_groups() -> None:
    """What the Neuron worker sets up before building the model: a single-process (gloo) TP/PP/EP group."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()), tempfile.NamedTemporaryFile() as f:
        ps.init_distributed_environment(1, 0, f"file://{f.name}", 0, backend="gloo")
        ps.initialize_model_parallel(1, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--widths", type=int, nargs="+", default=[1, 8], help="decode width buckets")
    p.add_argument("--contexts", type=int, nargs="+", default=[2304, 4352], help="decode context buckets")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and bucket")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--work", type=Path, default=None, help="keep the demo checkpoints here")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_neuron_compile.json"))
    args = p.parse_args(argv)
    import vllm_trn_plugin

    vllm_trn_plugin.register()
    t0 = time.perf_counter()
    _worker_groups()
    results = []
    with scratch_dir(args.work, "bench-neuron-") as root:
        for model in args.models:
            results += bench_model(model, args, root)
    save_result(args.out, {"backend": args.backend, "steps": args.steps, "results": results}, t0)


if __name__ == "__main__":
    main()
