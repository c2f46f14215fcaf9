"""vLLM Neuron's runner and scheduler as a model sees them, for driving the plugin's contract adapters on CPU.

`NeuronRunner` plays vllm-neuron's `NeuronModelRunner` with its `NeuronScheduler`, step for step. No vLLM Neuron
0.29/GA runner source is public; each behaviour follows the newest source that shows it (docs/trainium.md, "The
contract", has the table; commits in full there):

- construction: `from_configs(hf_config, neuron_config)` under `torch.device("meta")`, `load_weights(checkpoint_path,
  device, cache_dir)`, `.to(device)` (0.24 runner @ 9fc042ea, 0.26 runner longdct/vllm-neuron @ 056829c0);
- neuron_config: an absent `on_device_sampling_config` turns on-device sampling on, an explicit null off
  (`NeuronConfig.from_dict`, both runners); segmented prefill is on when max_num_batched_tokens < max_model_len,
  with kv_segment_size_buckets = num_batched_tokens_buckets = [max_num_batched_tokens], a size in {512 ... 8192},
  and a differing explicit num_batched_tokens_buckets refused (`resolve_segmented_prefill_config`,
  `validate_kv_segment_size_buckets`, 0.26 runner; docs 2.32/2.33 configuration reference);
- caches (0.26 runner, native route, `initialize_kv_cache`): every layer in the --kv-cache-dtype (`LayerSpec.dtype`
  is not read, both runners); FULL / SLIDING_WINDOW layers get separate zeroed K and V tensors `[blocks, kv_heads,
  block_size, head]`, bound `[k, v]`; MLA layers one `[blocks, kv_heads, block_size, head]` tensor, bound
  `[latent]`; recurrent states (`RecurrentLayerSpec`, fork code: no runner read allocates them) one tensor per
  state, `[blocks, *shape]` in the spec's dtypes;
- one prefill per step, padded to its token bucket (pad token 0 at the last real position), never mixed with
  decodes; decode batches padded to a `num_seqs_buckets` bucket (token 0, position 0, stale block-table rows,
  sampling positions padded with the last real index); padded tokens' slots `PAD_SLOT_ID` (-1: docs, 0.26 runner;
  `pad_slot=NULL_BLOCK_ID` plays the 0.24 runner, which wrote 0); block tables with the null block as -1
  (`_remap_null_block_to_sentinel`), trimmed at decode to the sliding window (`swa_kv_pos_offset`) or a
  `decode_context_length_buckets` bucket (both runners);
- forward kwargs (0.26 runner `_execute_model_forward`, onboarding docs): input_ids int32, positions int64,
  attn_metadata, sampling_positions, sampling_params float32 `[rows, 3]` = top_k, top_p, temperature (None without
  on-device sampling; warm-up rows `[0, 1.0, 1.0]`), spec_decode_metadata None, logit_mask None (no structured
  outputs), rank (0-d int32), and with `prompt_embeds` the `inputs_embeds` / `is_token_ids` pair;
- compile (both runners' `load_model`, fork `neuron_utils.model_forward_context`): with `compile_backend`,
  `torch.compile(fullgraph=True, dynamic=False)` (one static graph per input shape), the recompile limit lifted,
  every bucket warmed up with the runner's synthetic inputs, then every step under `fail_on_recompile`. Each graph
  the backend compiles is kept (`graphs`: the aten-level graph after functionalization).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STEPS = 8  # generated tokens per request
NULL_BLOCK_ID = 0  # vLLM's null block (both runners)
PAD_SLOT_ID = -1  # padded tokens' slot (docs, 0.26 runner)
SUPPORTED_KV_SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)  # 0.26 runner's bucket_utils
GREEDY = (-1.0, 1.0, 0.0)  # a request's sampling_params row: top_k (off), top_p, temperature 0


def bucket_for_count(count: int, buckets: list[int]) -> int:
    """vllm-neuron's `get_bucket_for_count`: the smallest bucket that holds `count` (else the largest)."""
    return next((b for b in buckets if b >= count), buckets[-1])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    prompt: list[int]
    arrival: int  # decode steps after which it is submitted
    sampling: tuple[float, float, float] = GREEDY
    out: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose cache entries are written
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class Group:
    """One KV-cache group: the layers sharing a block table (the runner shares one metadata dict among them)."""

    layers: list[str]
    block_size: int
    window: int | None = None  # sliding-window group
    recurrent: bool = False
    free: list[int] = field(default_factory=list)


class NeuronRunner:
    """vLLM Neuron's runner and scheduler, as far as a model can tell (one process per tensor-parallel rank, each
    driving the same steps; no spec decode)."""

    def __init__(
        self,
        model_cls: type,
        ckpt: Path,
        runner_cfg: Any,
        neuron_config: dict[str, Any],
        *,
        block_size: int,
        num_blocks: int,
        pad_slot: int = PAD_SLOT_ID,
        rank: int = 0,
        compile_backend: str | None = None,
        prompt_embeds: bool = False,
    ) -> None:
        from vllm.config import set_current_vllm_config

        self.max_model_len = runner_cfg.model_config.max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens = runner_cfg.scheduler_config.max_num_batched_tokens
        nc = dict(neuron_config)
        self.num_seqs_buckets = nc["num_seqs_buckets"]
        self.context_buckets = nc.get("decode_context_length_buckets") or []
        self.sampling_on_device = nc.get("on_device_sampling_config", {}) is not None
        self.segment = self._segmented_prefill(nc, max_num_batched_tokens)
        self.token_buckets = nc.get("num_batched_tokens_buckets") or [self.segment or max_num_batched_tokens]
        self.max_num_seqs = self.num_seqs_buckets[-1]
        self.kv_dtype = _kv_cache_dtype(runner_cfg)
        self.pad_slot = pad_slot
        self.rank = rank  # this worker's tensor-parallel rank, passed to every forward
        self.prompt_embeds = prompt_embeds
        t0 = time.perf_counter()
        with set_current_vllm_config(runner_cfg):  # the worker's load_model runs under its config
            with torch.device("meta"):
                model = model_cls.from_configs(runner_cfg.model_config.hf_config, neuron_config)
            model.load_weights(runner_cfg.model_config.model, torch.device("cpu"), None)
        self.model = model.to("cpu")
        self.load_seconds = time.perf_counter() - t0
        self.kv_caches = self._initialize_kv_cache(self.model.get_kv_spec(), block_size, num_blocks)
        self.model.bind_kv_cache(self.kv_caches)
        self.rows: list[Request] = []  # the persistent batch, in row order
        self.prefilling: list[Request] = []  # the request a prefill step runs
        self.tables = {
            g: torch.zeros(self.max_num_seqs, self._width(grp), dtype=torch.int32) for g, grp in self.groups.items()
        }
        self.decode_steps = 0
        self.emulate_check: Any = None  # callable(runner, kwargs, n) run at the first padded decode step
        self.padded_shapes: set[tuple[str, int]] = set()
        self.stale_padded_rows = 0  # padded decode rows whose block-table row still names real blocks
        self.forward: Any = self.model
        self.graphs: list[Any] = []  # with compile_backend: the graphs compiled, in order
        self.graph_inputs: list[list[str]] = []  # each graph's inputs as dynamo names them (`parameter_conversions`)
        self.warmup_seconds: dict[tuple, float] = {}  # with compile_backend: each warmed bucket's first call
        if compile_backend is not None:
            self.forward = torch.compile(
                self.model, backend=self._recording(compile_backend), fullgraph=True, dynamic=False
            )
            # The runner lifts dynamo's recompile limit (8 graphs per frame by default) for its bucket grid.
            with torch._dynamo.config.patch(recompile_limit=2**62, accumulated_recompile_limit=2**62):
                self.warm_up()

    def _segmented_prefill(self, nc: dict[str, Any], mnbt: int) -> int | None:
        """The prefill segment size, or None for single-shot prefill (`resolve_segmented_prefill_config`)."""
        if mnbt >= self.max_model_len:
            return None
        if mnbt not in SUPPORTED_KV_SEGMENT_SIZES:
            raise ValueError(f"runner: segmented prefill needs max_num_batched_tokens in {SUPPORTED_KV_SEGMENT_SIZES}")
        given = nc.get("num_batched_tokens_buckets")
        if given is not None and list(given) != [mnbt]:
            raise ValueError(f"runner: num_batched_tokens_buckets {given} must equal kv_segment_size_buckets {[mnbt]}")
        return mnbt

    # --- initialize_kv_cache ---

    def _initialize_kv_cache(self, spec: Any, block_size: int, num_blocks: int) -> dict[str, list[torch.Tensor]]:
        def zeros(*shape: int, dtype: torch.dtype = self.kv_dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype)

        self.groups: dict[str, Group] = {}
        caches: dict[str, list[torch.Tensor]] = {}
        for s in spec.layers:
            shape = (num_blocks, s.num_kv_heads, block_size, s.head_size)
            if s.cache_kind.value == "mla":
                self.groups.setdefault("mla", Group([], block_size)).layers.append(s.name)
                caches[s.name] = [zeros(*shape)]
                continue
            key = f"attn-w{s.sliding_window_size}"
            self.groups.setdefault(key, Group([], block_size, window=s.sliding_window_size)).layers.append(s.name)
            caches[s.name] = [zeros(*shape), zeros(*shape)]
        for s in spec.recurrent_layers:
            # vLLM sizes a recurrent group's block to max_model_len: one block (= state slot) per request
            self.groups.setdefault("recurrent", Group([], self.max_model_len, recurrent=True)).layers.append(s.name)
            caches[s.name] = [zeros(num_blocks, *sh, dtype=dt) for sh, dt in zip(s.shapes, s.dtypes)]
        for g in self.groups.values():
            g.free = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))  # block 0 is vLLM's null block
        return caches

    def _width(self, g: Group) -> int:
        """The InputBatch block-table width: blocks for max_model_len, aligned to 128 / block_size."""
        align = 128 // g.block_size if g.block_size <= 128 else 1
        return cdiv(cdiv(self.max_model_len, g.block_size), align) * align

    # --- helpers shared by both steps ---

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        for name, g in self.groups.items():
            blocks = req.blocks.setdefault(name, [])
            while len(blocks) * g.block_size < upto:
                blocks.append(g.free.pop())

    def _slot(self, req: Request, name: str, pos: int) -> int:
        bs = self.groups[name].block_size
        return req.blocks[name][pos // bs] * bs + pos % bs

    def _sync_table_row(self, row: int, req: Request) -> None:
        for name, table in self.tables.items():
            ids = req.blocks[name]
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def step(self, kwargs: dict[str, Any], stance: str = "fail_on_recompile") -> Any:
        """One forward of the model as the runner's execute_model makes it: under inference mode and, compiled,
        failing on any recompile (`model_forward_context`)."""
        with torch.inference_mode(), torch.compiler.set_stance(stance if self.graphs else "default"):
            return self.forward(**kwargs)

    def _recording(self, backend: str) -> Any:
        """`backend` at the aten level, keeping each graph it is handed (after AOT functionalization). "capture":
        trace and keep the graph, run nothing (each call returns uninitialised outputs of the traced shapes), to
        check that buckets far too large to run here are captured whole."""
        from torch._dynamo import lookup_backend
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        if backend not in ("aot_eager", "capture"):
            inner = lookup_backend(backend)

            def record_inner(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
                self.graphs.append(gm)
                self.graph_inputs.append([])  # a graph before AOT: no aten-level inputs to name
                return inner(gm, example_inputs)

            return record_inner

        names: list[str] = []

        def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.graphs.append(gm)
            self.graph_inputs.append(list(names))
            if backend == "aot_eager":
                return make_boxed_func(gm.forward)
            (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
            vals = [None if o is None else o.meta["val"] for o in outputs]
            return make_boxed_func(
                lambda *args: [
                    None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device) for v in vals
                ]
            )

        aot = aot_autograd(fw_compiler=record)

        def named(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            # dynamo's graph names its inputs after their source (a parameter's module path); the aten graph AOT
            # hands `record` takes the same inputs in the same order under positional names
            names[:] = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            return aot(gm, example_inputs)

        return named

    def warm_up(self) -> None:
        """Every bucket once, with the runner's synthetic inputs (one prefill of each token bucket; one decode of
        each width bucket at each context bucket), compiling its graph; timed per bucket."""
        vocab = self.model.config.vocab_size  # the runner's token ids 1..T, within a small model's vocabulary
        for T in self.token_buckets:
            t0 = time.perf_counter()
            self.step(self._prefill_kwargs([1 + t % (vocab - 1) for t in range(T)], 0, None), stance="default")
            self.warmup_seconds[("prefill", T)] = time.perf_counter() - t0
        contexts = [c - 1 for c in self.context_buckets] + [self.max_model_len - 1]
        for P in self.num_seqs_buckets:
            for ctx in contexts:
                kwargs = self._decode_kwargs([1] * P, torch.full((P,), ctx, dtype=torch.long), None)
                t0 = time.perf_counter()
                self.step(kwargs, stance="default")
                self.warmup_seconds[("decode", P, ctx + 1)] = time.perf_counter() - t0

    def _run(self, kwargs: dict[str, Any], n: int) -> list[int]:
        owned = {
            name: {b for req in self.rows + self.prefilling for b in req.blocks.get(name, [])} for name in self.groups
        }
        before = self._unowned_blocks(owned)
        out = self.step(kwargs)
        for key, blocks in self._unowned_blocks(owned).items():  # what a padded row must never write
            if not torch.equal(blocks.view(torch.uint8), before[key].view(torch.uint8)):
                raise AssertionError(f"{key}: a block no live request owns was written")
        if isinstance(out, tuple):  # on-device sampling: (tokens, logits or None)
            return out[0][:n].tolist()
        return out[:n].argmax(-1).tolist()  # the host sampler; the tests' host-sampled requests are greedy

    def _meta(self, name: str, table: torch.Tensor, slots: torch.Tensor, max_query_len: int, cached: int) -> dict:
        full = torch.where(table == NULL_BLOCK_ID, PAD_SLOT_ID, table)  # _remap_null_block_to_sentinel
        return {
            "block_table_tensor": full,
            "slot_mapping": slots,
            "max_query_len": max_query_len,
            "block_size": self.groups[name].block_size,
            "max_blocks_per_seq": full.shape[1],
            "decode_token_threshold": 1,
            "cached_seq_len": torch.tensor([[cached]], dtype=torch.int32),
            "kv_segment_size": self.segment or 0,
            "full_block_table_tensor": full.clone(),
        }

    def _by_layer(self, metas: dict[str, dict]) -> dict[str, dict]:
        return {layer: metas[name] for name, g in self.groups.items() for layer in g.layers}

    # --- one scheduler step each ---

    def prefill(self, req: Request) -> None:
        """One segment of one request (NeuronScheduler: one prefill per step, padded to its bucket)."""
        n = min(len(req.prompt) - req.computed, self.max_num_batched_tokens)
        start = req.computed
        self._ensure_blocks(req, start + n)
        kwargs = self._prefill_kwargs(req.prompt[start : start + n], start, req)
        self.prefilling = [req]
        self.padded_shapes.add(("prefill", kwargs["input_ids"].shape[0]))
        token = self._run(kwargs, 1)[0]
        self.prefilling = []
        req.computed += n
        if req.computed == len(req.prompt):  # a finished prompt's last logit is the first output token
            req.out.append(token)
            self.rows.append(req)
            self._sync_table_row(len(self.rows) - 1, req)

    def _prefill_kwargs(self, tokens: list[int], start: int, req: Request | None) -> dict[str, Any]:
        """The forward arguments of a prefill of `tokens` at positions start.., padded to its token bucket; without a
        request, the runner's synthetic warm-up inputs (slots and block ids counting up from 0)."""
        n = len(tokens)
        T = bucket_for_count(n, self.token_buckets)
        ids = torch.zeros(T, dtype=torch.int32)
        ids[:n] = torch.tensor(tokens)
        positions = torch.full((T,), start + n - 1, dtype=torch.long)  # pads repeat the last real position
        positions[:n] = torch.arange(start, start + n)
        metas = {}
        for name in self.groups:
            table = torch.zeros(1, self.tables[name].shape[1], dtype=torch.int32)
            slots = torch.full((T,), self.pad_slot, dtype=torch.long)
            if req is None:
                table[0] = torch.arange(table.shape[1])
                slots = torch.arange(T)
            else:
                table[0, : len(req.blocks[name])] = torch.tensor(req.blocks[name], dtype=torch.int32)
                slots[:n] = torch.tensor([self._slot(req, name, p) for p in range(start, start + n)])
            metas[name] = self._meta(name, table, slots, T, start)
        sampling = [req.sampling] if req is not None else [(0.0, 1.0, 1.0)]
        return self._kwargs(ids, positions, metas, torch.tensor([n - 1]), sampling, embedded=n if req else 0)

    def decode(self) -> None:
        n = len(self.rows)
        for r, req in enumerate(self.rows):
            self._ensure_blocks(req, req.computed + 1)
            self._sync_table_row(r, req)
        ctx = torch.tensor([req.computed for req in self.rows])
        kwargs = self._decode_kwargs([req.out[-1] for req in self.rows], ctx, self.rows)
        P = kwargs["input_ids"].shape[0]
        self.padded_shapes.add(("decode", P))
        first_table = next(iter(self.tables.values()))
        self.stale_padded_rows += int((first_table[n:P] != NULL_BLOCK_ID).any(dim=1).sum())
        if self.emulate_check is not None and P > n > 1:
            self.emulate_check(self, kwargs, n)
            self.emulate_check = None
        tokens = self._run(kwargs, n)
        self.decode_steps += 1
        for req, tok in zip(self.rows, tokens):
            req.computed += 1
            req.out.append(tok)
        done = [r for r, req in enumerate(self.rows) if len(req.out) >= STEPS]
        for r in reversed(done):  # finished: its blocks return to the pool, later rows move up
            req = self.rows.pop(r)
            for name, g in self.groups.items():
                g.free.extend(req.blocks.pop(name))
            for table in self.tables.values():
                table[r:-1] = table[r + 1 :].clone()

    def _decode_kwargs(self, tokens: list[int], ctx: torch.Tensor, rows: list[Request] | None) -> dict[str, Any]:
        """The forward arguments of a decode of one token per row at positions `ctx`, padded to its width bucket;
        without requests, the runner's synthetic warm-up inputs (every row live, slots and block ids from 0)."""
        n = len(tokens)
        P = bucket_for_count(n, self.num_seqs_buckets)  # get_decode_padded_batch_size
        ids = torch.zeros(P, dtype=torch.int32)
        ids[:n] = torch.tensor(tokens)
        positions = torch.zeros(P, dtype=torch.long)
        positions[:n] = ctx
        metas = {}
        for name, g in self.groups.items():
            if rows is None:
                slots = torch.arange(P)
                table = torch.arange(self.tables[name].shape[1], dtype=torch.int32).expand(P, -1).clone()
            else:
                slots = torch.full((P,), self.pad_slot, dtype=torch.long)
                slots[:n] = torch.tensor([self._slot(req, name, req.computed) for req in rows])
                table = self.tables[name][:P].clone()  # rows >= n: stale entries of departed requests
            meta = self._meta(name, table, slots, 1, int(positions.max()))
            bs = g.block_size
            if g.window is not None:  # _compute_swa_num_blocks / _compute_swa_decode_tensors
                need = g.window // bs + 1
                per = max(1, 128 // bs)
                nblk = min(cdiv(need, per) * per, cdiv(self.max_model_len, bs))
                start = torch.clamp(positions // bs - nblk + 1, min=0)
                gather = start[:, None] + torch.arange(nblk)[None, :]
                meta["block_table_tensor"] = meta["block_table_tensor"].gather(1, gather)
                meta["max_blocks_per_seq"] = nblk
                meta["swa_kv_pos_offset"] = (start * bs).to(torch.int32)
            elif not g.recurrent and self.context_buckets:  # _decode_ctx_blocks_from_max_decode_ctx_len
                bucket = bucket_for_count(int(positions.max()) + 1, self.context_buckets + [self.max_model_len])
                nblk = cdiv(bucket, bs)
                meta["block_table_tensor"] = meta["block_table_tensor"].index_select(1, torch.arange(nblk))
                meta["max_blocks_per_seq"] = nblk
                meta["swa_kv_pos_offset"] = torch.zeros(P, dtype=torch.int32)
                if rows is not None:
                    self.padded_shapes.add(("decode-ctx", bucket))
            metas[name] = meta
        sampling_positions = torch.cat([torch.arange(n), torch.full((P - n,), n - 1)])
        sampling = [req.sampling for req in rows] if rows else [(0.0, 1.0, 1.0)] * n
        sampling += [GREEDY] * (P - n)
        return self._kwargs(ids, positions, metas, sampling_positions, sampling, embedded=0)

    def _kwargs(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        metas: dict,
        sampling_positions: torch.Tensor,
        sampling: list[tuple[float, float, float]],
        embedded: int,
    ) -> dict:
        """The forward's keyword arguments; with `prompt_embeds`, the first `embedded` tokens (a prompt's) are given
        as embeddings (the table's rows for those ids) and marked as such in is_token_ids."""
        kwargs = dict(
            input_ids=ids,
            positions=positions,
            attn_metadata=self._by_layer(metas),
            sampling_positions=sampling_positions,
            sampling_params=torch.tensor(sampling, dtype=torch.float32) if self.sampling_on_device else None,
            spec_decode_metadata=None,
            logit_mask=None,
            rank=torch.tensor(self.rank, dtype=torch.int32),
        )
        if self.prompt_embeds:
            table = self.embedding_table()
            # in the model dtype (the docs' example serves bf16, whose embeddings are bf16)
            embeds = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype)
            embeds[:embedded] = table[ids[:embedded].long()]
            is_token_ids = torch.ones(ids.shape[0], dtype=torch.bool)
            is_token_ids[:embedded] = False
            kwargs |= dict(inputs_embeds=embeds, is_token_ids=is_token_ids)
        return kwargs

    def embedding_table(self) -> torch.Tensor:
        """The checkpoint's token embedding table as loaded (what a client's prompt embeddings are rows of)."""
        return next(p for n, p in self.model.named_parameters() if n.endswith("embed_tokens.weight")).detach()

    def generate(self, requests: list[Request], max_decode_steps: int | None = None) -> list[list[int]]:
        """NeuronScheduler order: an arrived prompt is prefilled (segment by segment) before the next decode."""
        pending = list(requests)
        while (pending or self.rows) and (max_decode_steps is None or self.decode_steps < max_decode_steps):
            ready = [r for r in pending if r.arrival <= self.decode_steps]
            if ready and len(self.rows) < self.max_num_seqs:
                self.prefill(ready[0])
                if ready[0].computed == len(ready[0].prompt):
                    pending.remove(ready[0])
            elif self.rows:
                self.decode()
            else:
                self.decode_steps = min(r.arrival for r in pending)
        return [r.out for r in requests]

    def _unowned_blocks(self, owned: dict[str, set[int]]) -> dict[tuple[str, int], torch.Tensor]:
        """Copies of every cache tensor's blocks (leading index) that neither a live request of the step owns nor
        are the null block (where the runner points padding), per layer and tensor."""
        out = {}
        for name, g in self.groups.items():
            for layer in g.layers:
                for i, t in enumerate(self.kv_caches[layer]):
                    keep = [b for b in range(1, t.shape[0]) if b not in owned[name]]
                    out[(layer, i)] = t[keep].clone()
        return out

    # --- the emulate check's cache snapshot ---

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a step writes: the bound caches and the latent layers' side stores (key scales, an FP8
        latent's dequantization scales)."""
        tensors = [t for ts in self.kv_caches.values() for t in ts]
        for a in self.latent_layers():
            tensors += [t for t in (a.key_scales, a.latent_scales) if t is not None]
        return tensors

    def latent_layers(self) -> list[Any]:
        """The model's TrinityLatentAttention layers (none for Laplace)."""
        from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

        return [m for m in self.model.modules() if isinstance(m, TrinityLatentAttention)]


def _kv_cache_dtype(cfg: Any) -> torch.dtype:
    """`kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config)`: every layer's cache dtype."""
    cache_dtype = str(cfg.cache_config.cache_dtype)
    if cache_dtype == "auto":
        return cfg.model_config.dtype
    if cache_dtype.startswith("fp8"):
        return torch.float8_e4m3fn
    return getattr(torch, cache_dtype)


def runner_config(ckpt: Path, max_model_len: int, tp: int = 1, dtype: str = "float32", **engine_args: Any) -> Any:
    """The runner's vLLM config (what the worker holds; float32 like the reference engines by default);
    `engine_args` as the user passes them (e.g. additional_config, kv_cache_dtype, max_num_batched_tokens)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(ckpt),
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        tensor_parallel_size=tp,
        **engine_args,
    )
    return args.create_engine_config()


def opaque_ops(graphs: list[Any], declared: tuple[str, ...]) -> dict[str, int]:
    """Every op the compiled graphs call that the graph cannot see into, other than the `declared` kernel ops
    ("trn::..."), with its count: anything not in aten or prims (Python custom ops such as vLLM's, CPU kernels of
    vLLM's build, Python arithmetic on a value read off a tensor), and every host read of a device value
    (`aten._local_scalar_dense`: what `.item()`, `int(t)` and `.tolist()` trace to). A mutating op appears wrapped
    by functionalization; its wrapped op is what is judged."""
    return {name: n for (name, _), n in kernel_nodes(graphs, declared).items()}


def kernel_nodes(graphs: list[Any], declared: tuple[str, ...] = ()) -> dict[tuple[str, tuple[str, ...]], int]:
    """`opaque_ops` keyed by (op name, the arguments functionalization marks it as mutating)."""
    found: dict[tuple[str, tuple[str, ...]], int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            target, mutated = node.target, ()
            if isinstance(target, torch._ops.HigherOrderOperator) and target.name().startswith("auto_functionalized"):
                target = node.args[0]
                mutated = tuple(sorted(a.name for a in target._schema.arguments if a.is_write))
            name = target.name() if isinstance(target, torch._ops.OpOverload) else str(target)
            host_read = name.startswith("aten::_local_scalar_dense")
            if (name.split("::")[0] in ("aten", "prims") and not host_read) or name in declared:
                continue
            found[(name, mutated)] = found.get((name, mutated), 0) + 1
    return found


# aten ops whose output is a view of (or the same values as) their first argument: a conversion of such a view is a
# conversion of the tensor it views
_VIEWS = {
    "alias",
    "as_strided",
    "detach",
    "expand",
    "permute",
    "reshape",
    "select",
    "slice",
    "squeeze",
    "t",
    "transpose",
    "unsqueeze",
    "view",
    "_unsafe_view",
    "clone",
    "contiguous",
}
_CONVERSIONS = {"prims::convert_element_type", "aten::_to_copy", "aten::to"}


def parameter_conversions(graphs: list[Any], inputs: list[list[str]]) -> dict[str, set[str]]:
    """Every dtype conversion each step would make of a model parameter or buffer (a graph input whose dynamo name
    holds `_parameters_` or `_buffers_`), directly or of a view of it: the input's name -> the dtypes it is
    converted to. What a weight needs in another dtype is made once at load, never in the step."""
    found: dict[str, set[str]] = {}
    for gm, names in zip(graphs, inputs, strict=True):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(names):
            raise AssertionError(f"the aten graph has {len(placeholders)} inputs, dynamo's {len(names)}")
        source = dict(zip(placeholders, names))

        def root(node: Any) -> Any:
            while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                if node.target._schema.name.split("::")[-1] not in _VIEWS or not node.args:
                    break
                node = node.args[0]
            return node

        for node in gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if node.target._schema.name not in _CONVERSIONS:
                continue
            name = source.get(root(node.args[0]), "")
            if "_parameters_" in name or "_buffers_" in name:
                found.setdefault(name, set()).add(str(node.meta["val"].dtype))
    return found
