"""Both models driven through the vllm-neuron "Beta" model contract, the way its runner drives a model,
against real vLLM serving the same checkpoint: the same greedy tokens, token for token.

`BetaRunner` below plays vllm-neuron's `NeuronModelRunner` with its `NeuronScheduler`, step for step as
their source does it (citations in vllm_trn_plugin/neuron/contract.py): `from_configs(hf_config,
neuron_config)` under `torch.device("meta")`, `load_weights(checkpoint_path, device, cache_dir)`,
`get_kv_spec()`, caches allocated as raw int8 zeros viewed per spec (`[k, v]` from one
`(2, blocks, kv_heads, block_size, head)` buffer; one latent buffer; one tensor per recurrent state),
`bind_kv_cache`, then one prefill per step padded to a `num_batched_tokens_buckets` bucket (token 0 at the
last real position, slot 0 = the null block; long prompts in segments), decode batches padded to a
`num_seqs_buckets` bucket (token 0, position 0, slot 0, stale block-table rows, sampling positions padded
with the last real index), block tables with the null block as -1, trimmed at decode to the sliding
window (`swa_kv_pos_offset`) or to a `decode_context_length_buckets` bucket, and greedy sampling at
`sampling_positions` (on-device for Laplace, on the host for MLA-Trinity). Requests arrive while others
decode and leave when done, so the batch bucket changes under them.

Reference: real vLLM (CPU build) on the same checkpoint, greedy, all prompts at once: for Laplace the session's
float32 engine, for MLA-Trinity one eager engine on a float32 MLA checkpoint converted exactly from a random
transformers AFMoE. At one padded decode step per model the kernels run in the NKI emulator
(VLLM_TRN_KERNELS=emulate) from the same cache state as the torch path: same tokens, logits close, kernel calls
counted; for MLA-Trinity on the packed form of that checkpoint (FP8 experts), so the FP8 expert kernel runs too.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import count_calls, greedy_params, random_prompts, token_prompts
from vllm_trn_plugin.neuron.contract import NULL_BLOCK_ID, PAD_SLOT_ID, NeuronConfig

pytestmark = pytest.mark.vllm

STEPS = 8  # generated tokens per request


def _bucket(count: int, buckets: list[int]) -> int:
    """vllm-neuron's `get_bucket_for_count`: the smallest bucket that holds `count` (else the largest)."""
    return next((b for b in buckets if b >= count), buckets[-1])


def _cdiv(a: int, b: int) -> int:
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
        return _cdiv(_cdiv(self.max_model_len, g.block_size), align) * align

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
        T = _bucket(n, self.nc.num_batched_tokens_buckets)
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
        P = _bucket(n, self.nc.num_seqs_buckets)  # get_decode_padded_batch_size
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
                nblk = min(_cdiv(need, per) * per, _cdiv(self.max_model_len, bs))
                start = torch.clamp(ctx // bs - nblk + 1, min=0)
                gather = start[:, None] + torch.arange(nblk)[None, :]
                meta["block_table_tensor"] = meta["block_table_tensor"].gather(1, gather)
                meta["max_blocks_per_seq"] = nblk
                meta["swa_kv_pos_offset"] = (start * bs).to(torch.int32)
            elif not g.recurrent and self.nc.decode_context_length_buckets:  # _decode_ctx_blocks_from_...
                bucket = _bucket(int(ctx.max()) + 1, self.nc.decode_context_length_buckets + [self.max_model_len])
                nblk = _cdiv(bucket, bs)
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


def _runner_config(ckpt: Path, max_model_len: int, tp: int = 1) -> Any:
    """The runner's vLLM config (what the Beta worker holds; float32 like the reference engines)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(ckpt), dtype="float32", max_model_len=max_model_len, enforce_eager=True, tensor_parallel_size=tp
    )
    return args.create_engine_config()


@pytest.fixture(scope="module")
def worker() -> None:
    """What the Beta worker sets up before load_model: a single-process (gloo) TP/PP/EP group. Under a config
    without a model, so vLLM also creates the expert-parallel group MLA-Trinity's MoE layers ask for."""
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:  # left by an in-process engine for a dense model
        ps.destroy_model_parallel()
    own_groups = not ps.model_parallel_is_initialized()
    own_world = not dist.is_initialized()
    if own_groups:
        with set_current_vllm_config(VllmConfig()), tempfile.NamedTemporaryFile() as f:
            ps.init_distributed_environment(1, 0, f"file://{f.name}", 0, backend="gloo")
            ps.initialize_model_parallel(1, 1)
    yield
    if own_groups:
        ps.destroy_model_parallel()
    if own_world:
        ps.destroy_distributed_environment()


@torch.inference_mode()  # the side stores the model allocates in its (inference-mode) forward
def restore(runner: BetaRunner, saved: list[torch.Tensor]) -> None:
    for t, s in zip(runner.state_tensors(), saved):
        t.copy_(s)


def _emulate_check(monkeypatch: pytest.MonkeyPatch, counters: dict[str, tuple[Any, str]], report: dict) -> Any:
    """At one padded decode step: run it with the kernels in the emulator, restore every cache, run it on
    the torch path (the run that continues); both runs must pick the same tokens."""

    def check(runner: BetaRunner, kwargs: dict[str, Any], n: int) -> None:
        saved = [t.clone() for t in runner.state_tensors()]
        calls = {k: count_calls(monkeypatch, mod, fn) for k, (mod, fn) in counters.items()}
        monkeypatch.setenv("VLLM_TRN_KERNELS", "emulate")
        t0 = time.perf_counter()
        emulated = runner.model(**kwargs)
        report["emulate_seconds"] = time.perf_counter() - t0
        restore(runner, saved)
        monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
        torch_path = runner.model(**kwargs)
        restore(runner, saved)  # the step proper runs next, from the same state
        monkeypatch.undo()
        monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
        if isinstance(emulated, tuple):
            assert emulated[0][:n].tolist() == torch_path[0][:n].tolist(), "on-device greedy tokens differ"
            emulated, torch_path = emulated[1], torch_path[1]
        assert emulated is not None and torch_path is not None
        assert emulated[:n].argmax(-1).tolist() == torch_path[:n].argmax(-1).tolist(), "greedy tokens differ"
        report["emulate_max_logit_diff"] = float((emulated[:n] - torch_path[:n]).abs().max())
        report["kernel_calls"] = {k: c[0] for k, c in calls.items()}
        report["emulate_rows"] = (n, kwargs["input_ids"].shape[0])

    return check


def test_laplace_through_beta_contract_equals_vllm(
    laplace_ckpt: Path, laplace_llm: Any, worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_trn_plugin.kernels import gla_decode_nki
    from vllm_trn_plugin.neuron.laplace import LaplaceBetaModel

    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    prompts = random_prompts(4, [1, 37, 130, 600], seed=41)  # 600 > one 512-token segment
    served = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in served]

    nc = {"num_seqs_buckets": [1, 2, 4], "num_batched_tokens_buckets": [128, 256, 512]}
    nc |= {"on_device_sampling_config": {}, "max_logprobs": 1}  # greedy on-device sampling, logits gathered
    runner = BetaRunner(
        LaplaceBetaModel,
        laplace_ckpt,
        _runner_config(laplace_ckpt, 1024),
        nc,
        block_size=32,
        num_blocks=8,
        max_num_batched_tokens=512,
    )
    report: dict[str, Any] = {}
    runner.emulate_check = _emulate_check(monkeypatch, {"gla": (gla_decode_nki, "gla_decode_nki")}, report)
    t0 = time.perf_counter()
    got = runner.generate([Request(p, a) for p, a in zip(prompts, [0, 1, 2, 4])])
    seconds = time.perf_counter() - t0

    for p, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Beta contract {g}, vLLM {e}"
    assert report["kernel_calls"]["gla"] == 4, report  # one emulated GLA step per layer
    assert report["emulate_max_logit_diff"] < 1e-4, report
    assert {("prefill", 128), ("prefill", 512), ("decode", 4), ("decode", 2), ("decode", 1)} <= runner.padded_shapes
    assert runner.stale_padded_rows > 0  # a padded row whose block-table row still names a live block
    print(
        f"\nLaplace via the Beta contract: {len(prompts)} prompts x {STEPS} tokens equal vLLM's; shapes "
        f"{sorted(runner.padded_shapes)}; {runner.stale_padded_rows} padded rows with stale block tables; "
        f"{runner.decode_steps} decode steps in {seconds:.1f} s (load {runner.load_seconds:.1f} s); "
        f"emulated decode step {report['emulate_rows']}: "
        f"{report['kernel_calls']} kernel calls, logits within {report['emulate_max_logit_diff']:.1e}, "
        f"{report['emulate_seconds']:.1f} s"
    )


@pytest.fixture(scope="module")
def trinity_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random transformers AFMoE with Trinity's head geometry, converted exactly to MLA (latent 256), and its
    packed MXFP4 form (FP8 experts, I = 256: the expert kernel's double-row tiling needs multiples of 256)."""
    from tests.afmoe_reference import convert_to_mla, make_random_afmoe
    from vllm_trn_plugin.loaders.packed import pack

    root = tmp_path_factory.mktemp("trinity-beta")
    orig = make_random_afmoe(root / "orig", seed=7, full_kv_rank=256, moe_intermediate_size=256)
    mla = convert_to_mla(orig, root / "mla", kv_lora_rank=256)
    return mla, pack(mla, root / "packed").dst


TRINITY_NC = {
    "num_seqs_buckets": [1, 2, 4],
    "num_batched_tokens_buckets": [128, 256, 512],
    "decode_context_length_buckets": [256],
}


TRINITY_PROMPTS = random_prompts(3, [7, 40, 150], seed=43)  # 150 > the sliding window (64)
TRINITY_ARRIVALS = [0, 0, 2]


@pytest.fixture(scope="module")
def trinity_expected(trinity_ckpts: tuple[Path, Path]) -> list[list[int]]:
    """vLLM's greedy tokens for TRINITY_PROMPTS on the float32 MLA checkpoint (one eager engine, TP 1)."""
    from vllm import LLM

    mla, _ = trinity_ckpts
    llm = LLM(
        model=str(mla),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
    )
    try:
        served = llm.generate(token_prompts(TRINITY_PROMPTS), greedy_params(STEPS), use_tqdm=False)
    finally:
        del llm
    return [list(o.outputs[0].token_ids) for o in served]


def test_trinity_through_beta_contract_equals_vllm(
    trinity_ckpts: tuple[Path, Path],
    trinity_expected: list[list[int]],
    worker: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The float32 MLA checkpoint: vLLM and the adapter differ only in summation order, so every token must
    agree. (On the packed checkpoint a long prompt can legitimately differ: FP8 activation rounding turns a
    1e-7 difference into a ~0.1 logit jump, see tests/test_packed_vllm.py, and a near-tie then flips.)"""
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    mla, _ = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    prompts, expected = TRINITY_PROMPTS, trinity_expected

    runner = BetaRunner(
        TrinityMLABetaModel,
        mla,
        _runner_config(mla, 512),
        TRINITY_NC,
        block_size=32,
        num_blocks=32,
        max_num_batched_tokens=512,
    )
    t0 = time.perf_counter()
    got = runner.generate([Request(p, a) for p, a in zip(prompts, TRINITY_ARRIVALS)])
    seconds = time.perf_counter() - t0

    for p, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Beta contract {g}, vLLM {e}"
    assert {
        ("prefill", 128),
        ("prefill", 256),
        ("decode", 4),
        ("decode", 2),
        ("decode-ctx", 256),
    } <= runner.padded_shapes
    print(
        f"\nMLA-Trinity via the Beta contract: {len(prompts)} prompts x {STEPS} tokens equal vLLM's; shapes "
        f"{sorted(runner.padded_shapes)}; {runner.decode_steps} decode steps in {seconds:.1f} s "
        f"(load {runner.load_seconds:.1f} s)"
    )


def test_trinity_kernels_in_emulator_through_beta_contract(
    trinity_ckpts: tuple[Path, Path], worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed checkpoint (FP8 experts), padded with the 0.21 convention (slot -1) this time: at the first
    padded decode step the latent-decode and FP8-expert kernels run in the emulator."""
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    _, packed = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    runner = BetaRunner(
        TrinityMLABetaModel,
        packed,
        _runner_config(packed, 512),
        TRINITY_NC,
        block_size=32,
        num_blocks=32,
        max_num_batched_tokens=512,
        pad_slot=PAD_SLOT_ID,
    )
    report: dict[str, Any] = {}
    counters = {"latent": (latent_decode_nki, "latent_decode_nki"), "fp8_experts": (fp8_expert_nki, "fp8_experts_nki")}
    runner.emulate_check = _emulate_check(monkeypatch, counters, report)
    runner.generate([Request(p, 0) for p in random_prompts(3, [7, 9, 70], seed=44)], max_decode_steps=1)

    assert report["emulate_rows"] == (3, 4), report
    assert report["kernel_calls"] == {"latent": 1, "fp8_experts": 3}, report  # 1 global layer, 3 MoE layers
    # FP8 activations: the kernel's fp32 accumulation order can flip one rounding (tests/test_kernels_vllm.py)
    assert report["emulate_max_logit_diff"] < 0.5, report
    print(
        f"\nMLA-Trinity (packed) via the Beta contract, emulated decode step {report['emulate_rows']}: "
        f"{report['kernel_calls']} kernel calls, greedy tokens equal, logits within "
        f"{report['emulate_max_logit_diff']:.1e}, {report['emulate_seconds']:.1f} s"
    )


def _trinity_tp_rank(rank: int, world: int, mla: str, init_file: str, out_dir: str) -> None:
    """One Beta worker of a tensor-parallel group (a spawned process per rank): the worker's gloo world and vLLM's
    TP group of `world` ranks, then the same runner as at TP 1; the adapter builds and loads this rank's shard."""
    import os

    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    os.environ["VLLM_TRN_KERNELS"] = "torch"
    torch.set_num_threads(1)
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world, rank, f"file://{init_file}", rank, backend="gloo")
        ps.initialize_model_parallel(world, 1)
    ckpt = Path(mla)
    runner = BetaRunner(
        TrinityMLABetaModel,
        ckpt,
        _runner_config(ckpt, 512, tp=world),
        TRINITY_NC,
        block_size=32,
        num_blocks=32,
        max_num_batched_tokens=512,
        rank=rank,
    )
    got = runner.generate([Request(p, a) for p, a in zip(TRINITY_PROMPTS, TRINITY_ARRIVALS)])
    spec = runner.model.get_kv_spec()
    latent = runner.model._latent[0]
    torch.save(
        {
            "tokens": got,
            "sliding_kv_heads": sorted({layer.num_kv_heads for layer in spec.layers}),
            "latent_rank": sorted({layer.kv_lora_rank for layer in spec.latent_layers}),
            "kv_heads": list(latent.kv_heads),
            "key_scales": tuple(latent.key_scales.shape[1:]),
            "shapes": sorted(runner.padded_shapes),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def test_trinity_beta_contract_at_tp2_equals_tp1(
    trinity_ckpts: tuple[Path, Path], trinity_expected: list[list[int]], tmp_path: Path
) -> None:
    """Two Beta workers (spawned processes, gloo), each building through the adapter the shard of its rank of a
    TP-2 group the worker set up: sliding layers with 2 of the 4 KV heads, the whole 256-wide latent, the latent
    layer's KV heads and key-scale columns split between the ranks; both ranks' greedy tokens equal TP 1's
    (vLLM's engine on the same float32 checkpoint)."""
    import torch.multiprocessing as mp

    mla, _ = trinity_ckpts
    mp.start_processes(
        _trinity_tp_rank,
        args=(2, str(mla), str(tmp_path / "dist-init"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["sliding_kv_heads"] == [2] and got["latent_rank"] == [256], got
        assert got["kv_heads"] == [2 * r, 2 * r + 1] and got["key_scales"] == (2,), got
        for p, g, e in zip(TRINITY_PROMPTS, got["tokens"], trinity_expected):
            assert g == e, f"rank {r}, prompt of {len(p)} tokens: Beta contract at TP 2 {g}, vLLM at TP 1 {e}"
    print(f"\nMLA-Trinity via the Beta contract at TP 2 (two gloo ranks): tokens equal TP 1's; {ranks[0]['shapes']}")
