"""vllm-neuron's Beta runner and scheduler as a model sees them, for driving the plugin's contract adapters on CPU.

`BetaRunner` plays vllm-neuron's `NeuronModelRunner` with its `NeuronScheduler`, step for step: `from_configs(hf_config,
neuron_config)` under `torch.device("meta")`, `load_weights(checkpoint_path, device, cache_dir)`, `get_kv_spec()`,
caches allocated as raw int8 zeros viewed per spec (`[k, v]` from one `(2, blocks, kv_heads, block_size, head)`
buffer; one latent buffer; one tensor per recurrent state), `bind_kv_cache`, then one prefill per step padded to a
`num_batched_tokens_buckets` bucket (token 0 at the last real position, slot 0 = the null block; long prompts in
segments), decode batches padded to a `num_seqs_buckets` bucket (token 0, position 0, slot 0, stale block-table rows,
sampling positions padded with the last real index), block tables with the null block as -1, trimmed at decode to the
sliding window (`swa_kv_pos_offset`) or to a `decode_context_length_buckets` bucket, and greedy sampling at
`sampling_positions` (on-device for Laplace, on the host for MLA-Trinity). docs/trainium.md describes the contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_trn_plugin.neuron.contract import NULL_BLOCK_ID, PAD_SLOT_ID, NeuronConfig

STEPS = 8  # generated tokens per request


def bucket_for_count(count: int, buckets: list[int]) -> int:
    """vllm-neuron's `get_bucket_for_count`: the smallest bucket that holds `count` (else the largest)."""
    return next((b for b in buckets if b >= count), buckets[-1])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    prompt: list[int]
    arrival: int  # decode steps after which it is submitted
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


class BetaRunner:
    """vllm-neuron's Beta runner and scheduler, as far as a model can tell (one process per tensor-parallel rank,
    each driving the same steps; no spec decode; host sampling or greedy on-device sampling)."""

    def __init__(
        self,
        model_cls: type,
        ckpt: Path,
        runner_cfg: Any,
        neuron_config: dict[str, Any],
        *,
        block_size: int,
        num_blocks: int,
        max_num_batched_tokens: int,
        pad_slot: int = NULL_BLOCK_ID,
        rank: int = 0,
    ) -> None:
        from vllm.config import set_current_vllm_config

        self.nc = NeuronConfig.from_dict(neuron_config)
        self.max_model_len = runner_cfg.model_config.max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = self.nc.num_seqs_buckets[-1]
        self.pad_slot = pad_slot  # padded tokens' slot: NULL_BLOCK_ID (0) at vLLM 0.24, PAD_SLOT_ID (-1) at 0.21
        self.rank = rank  # this worker's tensor-parallel rank, passed to every forward
        t0 = time.perf_counter()
        with set_current_vllm_config(runner_cfg):  # the worker's load_model runs under its config
            with torch.device("meta"):
                model = model_cls.from_configs(runner_cfg.model_config.hf_config, self.nc)
            model.load_weights(runner_cfg.model_config.model, torch.device("cpu"), None)
        self.model = model.to("cpu")
        self.load_seconds = time.perf_counter() - t0
        self.kv_caches = self._initialize_kv_cache(self.model.get_kv_spec(), block_size, num_blocks)
        self.model.bind_kv_cache(self.kv_caches)
        self.rows: list[Request] = []  # the persistent batch, in row order
        self.tables = {
            g: torch.zeros(self.max_num_seqs, self._width(grp), dtype=torch.int32) for g, grp in self.groups.items()
        }
        self.decode_steps = 0
        self.emulate_check: Any = None  # callable(runner, kwargs, n) run at the first padded decode step
        self.padded_shapes: set[tuple[str, int]] = set()
        self.stale_padded_rows = 0  # padded decode rows whose block-table row still names real blocks

    # --- initialize_kv_cache ---

    def _initialize_kv_cache(self, spec: Any, block_size: int, num_blocks: int) -> dict[str, list[torch.Tensor]]:
        def raw(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(numel * dtype.itemsize, dtype=torch.int8).view(dtype)

        self.groups: dict[str, Group] = {}
        caches: dict[str, list[torch.Tensor]] = {}
        for s in spec.layers:
            key = f"attn-w{s.sliding_window_size}"
            self.groups.setdefault(key, Group([], block_size, window=s.sliding_window_size)).layers.append(s.name)
            t = raw(2 * num_blocks * s.num_kv_heads * block_size * s.head_size, s.dtype)
            t = t.view(2, num_blocks, s.num_kv_heads, block_size, s.head_size)
            caches[s.name] = [t[0], t[1]]
        for s in spec.latent_layers:
            self.groups.setdefault("latent", Group([], block_size)).layers.append(s.name)
            caches[s.name] = [raw(num_blocks * block_size * s.kv_lora_rank, s.dtype).view(num_blocks, block_size, -1)]
        for s in spec.recurrent_layers:
            # vLLM sizes a recurrent group's block to max_model_len: one block (= state slot) per request
            self.groups.setdefault("recurrent", Group([], self.max_model_len, recurrent=True)).layers.append(s.name)
            caches[s.name] = [
                raw(num_blocks * int(torch.Size(sh).numel()), dt).view(num_blocks, *sh)
                for sh, dt in zip(s.shapes, s.dtypes)
            ]
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

    def _run(self, kwargs: dict[str, Any], n: int) -> list[int]:
        out = self.model(**kwargs)
        if isinstance(out, tuple):  # on-device sampling: (tokens, logits or None)
            return out[0][:n].tolist()
        return out[:n].argmax(-1).tolist()  # the host sampler, all greedy

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
            "kv_segment_size": 0,
            "full_block_table_tensor": full.clone(),
        }

    def _by_layer(self, metas: dict[str, dict]) -> dict[str, dict]:
        return {layer: metas[name] for name, g in self.groups.items() for layer in g.layers}

    # --- one scheduler step each ---

    def prefill(self, req: Request) -> None:
        """One segment of one request (NeuronScheduler: one prefill per step, padded to its bucket)."""
        n = min(len(req.prompt) - req.computed, self.max_num_batched_tokens)
        T = bucket_for_count(n, self.nc.num_batched_tokens_buckets)
        self.padded_shapes.add(("prefill", T))
        start = req.computed
        self._ensure_blocks(req, start + n)
        ids = torch.zeros(T, dtype=torch.int32)
        ids[:n] = torch.tensor(req.prompt[start : start + n])
        positions = torch.full((T,), start + n - 1, dtype=torch.long)  # pads repeat the last real position
        positions[:n] = torch.arange(start, start + n)
        metas = {}
        for name in self.groups:
            slots = torch.full((T,), self.pad_slot, dtype=torch.long)
            slots[:n] = torch.tensor([self._slot(req, name, p) for p in range(start, start + n)])
            table = torch.zeros(1, self.tables[name].shape[1], dtype=torch.int32)
            table[0, : len(req.blocks[name])] = torch.tensor(req.blocks[name], dtype=torch.int32)
            metas[name] = self._meta(name, table, slots, T, start)
        kwargs = self._kwargs(ids, positions, metas, torch.tensor([n - 1]), rows=1)
        token = self._run(kwargs, 1)[0]
        req.computed += n
        if req.computed == len(req.prompt):  # a finished prompt's last logit is the first output token
            req.out.append(token)
            self.rows.append(req)
            self._sync_table_row(len(self.rows) - 1, req)

    def decode(self) -> None:
        n = len(self.rows)
        P = bucket_for_count(n, self.nc.num_seqs_buckets)  # get_decode_padded_batch_size
        self.padded_shapes.add(("decode", P))
        ids = torch.zeros(P, dtype=torch.int32)
        positions = torch.zeros(P, dtype=torch.long)
        ctx = torch.zeros(P, dtype=torch.long)
        for r, req in enumerate(self.rows):
            self._ensure_blocks(req, req.computed + 1)
            self._sync_table_row(r, req)
            ids[r], positions[r], ctx[r] = req.out[-1], req.computed, req.computed
        first_table = next(iter(self.tables.values()))
        self.stale_padded_rows += int((first_table[n:P] != NULL_BLOCK_ID).any(dim=1).sum())
        metas = {}
        for name, g in self.groups.items():
            slots = torch.full((P,), self.pad_slot, dtype=torch.long)
            slots[:n] = torch.tensor([self._slot(req, name, req.computed) for req in self.rows])
            table = self.tables[name][:P].clone()  # rows >= n: stale entries of departed requests
            meta = self._meta(name, table, slots, 1, int(ctx.max()))
            bs = g.block_size
            if g.window is not None:  # _compute_swa_num_blocks / _compute_swa_decode_tensors
                need = g.window // bs + 1
                per = max(1, 128 // bs)
                nblk = min(cdiv(need, per) * per, cdiv(self.max_model_len, bs))
                start = torch.clamp(ctx // bs - nblk + 1, min=0)
                gather = start[:, None] + torch.arange(nblk)[None, :]
                meta["block_table_tensor"] = meta["block_table_tensor"].gather(1, gather)
                meta["max_blocks_per_seq"] = nblk
                meta["swa_kv_pos_offset"] = (start * bs).to(torch.int32)
            elif not g.recurrent and self.nc.decode_context_length_buckets:  # _decode_ctx_blocks_from_...
                bucket = bucket_for_count(
                    int(ctx.max()) + 1, self.nc.decode_context_length_buckets + [self.max_model_len]
                )
                nblk = cdiv(bucket, bs)
                meta["block_table_tensor"] = meta["block_table_tensor"].index_select(1, torch.arange(nblk))
                meta["max_blocks_per_seq"] = nblk
                meta["swa_kv_pos_offset"] = torch.zeros(P, dtype=torch.int32)
                self.padded_shapes.add(("decode-ctx", bucket))
            metas[name] = meta
        sampling = torch.cat([torch.arange(n), torch.full((P - n,), n - 1)])
        kwargs = self._kwargs(ids, positions, metas, sampling, rows=P)
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

    def _kwargs(
        self, ids: torch.Tensor, positions: torch.Tensor, metas: dict, sampling: torch.Tensor, rows: int
    ) -> dict:
        ods = self.nc.on_device_sampling_config is not None
        return dict(
            input_ids=ids,
            positions=positions,
            attn_metadata=self._by_layer(metas),
            sampling_positions=sampling,
            sampling_params=torch.tensor([[0, 1.0, 0.0]] * rows) if ods else None,  # [top_k, top_p, temperature]
            spec_decode_metadata=None,
            rank=torch.tensor(self.rank, dtype=torch.int32),
            logit_mask=None,
        )

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

    # --- the emulate check's cache snapshot ---

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a step writes: the bound caches and the latent layers' key-scale side stores."""
        tensors = [t for ts in self.kv_caches.values() for t in ts]
        return tensors + [a.key_scales for a in getattr(self.model, "_latent", []) if a.key_scales is not None]


def runner_config(ckpt: Path, max_model_len: int, tp: int = 1) -> Any:
    """The runner's vLLM config (what the Beta worker holds; float32 like the reference engines)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(ckpt), dtype="float32", max_model_len=max_model_len, enforce_eager=True, tensor_parallel_size=tp
    )
    return args.create_engine_config()
