"""The vllm-neuron "Beta" model contract, and the adapter that drives this plugin's models through it.

The Beta runner (vllm-neuron ``release-0.24.0.1.1.0``, vLLM 0.24) builds the model class itself and calls a small
contract instead of vLLM's model runner; docs/trainium.md describes it piece by piece with the vllm-neuron source
of each. The data structures the runner and the model exchange are re-declared here with the fields both use:

- construction: ``model_cls.from_configs(hf_config, neuron_config)`` inside ``torch.device("meta")``, then
  ``load_weights(checkpoint_path, device, cache_dir)``, ``model.to(device)`` and ``torch.compile``;
- ``NeuronConfig``: the runner's bucket and sampling settings (``num_seqs_buckets``, ``num_batched_tokens_buckets``,
  ``decode_context_length_buckets``, ``on_device_sampling_config``, ``max_logprobs``);
- ``get_kv_spec()`` -> ``KVSpec`` of ``LayerSpec`` (attention, optionally sliding), ``LatentLayerSpec`` (one latent
  row per token) and ``RecurrentLayerSpec`` (fixed-size states per sequence); ``bind_kv_cache`` receives the caches
  allocated as raw int8 zeros viewed per spec (``[k, v]`` per attention layer, one tensor per state);
- ``forward(input_ids, positions, attn_metadata, sampling_positions, sampling_params, spec_decode_metadata, rank,
  logit_mask)`` returns logits at ``sampling_positions`` or, with on-device sampling, ``(tokens, logits)``;
  ``attn_metadata`` maps each layer to its KV group's dict (``block_table_tensor`` with the null block as -1,
  ``slot_mapping``, ``max_query_len``, ``cached_seq_len``, ``swa_kv_pos_offset``, ...);
- padding: a prefill is padded to a token bucket and a decode batch to a sequence bucket, padded tokens' slots at
  ``NULL_BLOCK_ID`` (0; -1 at vLLM 0.21, still the block-table sentinel); one prefill per step, never mixed with
  decodes; under tensor parallelism one worker process per rank, vLLM's groups set up before the model is built.

How the adapter honours it: the model is the plugin's own vLLM model class (``model_executors/laplace.py``,
``model_executors/trinity_mla.py``), built with vLLM's ``initialize_model`` and loaded with vLLM's loader plus the
model's own ``load_weights`` (so packed MXFP4 checkpoints and every load check behave as under vLLM). Each forward
translates the Beta metadata into the metadata those layers already read from vLLM's forward context
(``GLAStateMetadata``, ``LatentMetadata``) and runs the unchanged model under that context; the caches the layers
read and write are the tensors the runner bound. Decode ops go through ``kernels/dispatch.py`` exactly as under
vLLM (``VLLM_TRN_KERNELS``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

NULL_BLOCK_ID = 0  # vLLM's reserved block; the Beta runner points padded tokens' slots at it (0.24)
PAD_SLOT_ID = -1  # the 0.21 padding slot, and the Beta block-table sentinel for the null block


# --- the data structures the runner and the model exchange (vllm_neuron/model/kv_cache.py) ---


@dataclass
class LayerSpec:
    """A paged K/V layer: the runner binds ``[k, v]``, each ``[num_blocks, num_kv_heads, block_size, head_size]``."""

    name: str
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window_size: int | None = None
    chunk_size: int | None = None


@dataclass
class RecurrentLayerSpec:
    """A fixed-size state per sequence: one tensor per state, ``[num_blocks, *shape]``; a request's state is
    its (single) block's id."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass
class LatentLayerSpec:
    """An MLA layer: one ``kv_lora_rank``-wide latent row per token, ``[num_blocks, block_size, kv_lora_rank]``."""

    name: str
    kv_lora_rank: int
    dtype: torch.dtype


@dataclass
class KVSpec:
    layers: list[LayerSpec]
    recurrent_layers: list[RecurrentLayerSpec] = field(default_factory=list)
    latent_layers: list[LatentLayerSpec] = field(default_factory=list)


@dataclass
class NeuronConfig:
    """The part of vllm-neuron's ``NeuronConfig`` the runner and these models read (unknown keys are kept)."""

    num_seqs_buckets: list[int] | None = None
    num_batched_tokens_buckets: list[int] | None = None
    decode_context_length_buckets: list[int] | None = None
    on_device_sampling_config: Any = None
    max_logprobs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NeuronConfig:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})


# --- one step of the Beta runner, as the model sees it ---


def is_decode(meta: dict[str, Any]) -> bool:
    """The runner's own test (``_build_attention_metadata``): a decode iff the longest query is within the
    decode threshold (1 without speculative decoding)."""
    return int(meta["max_query_len"]) <= int(meta["decode_token_threshold"])


def _prefix_count(live: torch.Tensor, what: str) -> int:
    """How many leading entries are live; the runner only ever pads at the end, so anything else is a bug."""
    n = int(live.sum())
    if not bool(live[:n].all()):
        raise ValueError(f"{what}: padded entries are not all at the end ({live.int().tolist()})")
    return n


@dataclass(frozen=True)
class StepPlan:
    """What the padded step holds: ``live_rows`` real requests (the first rows), each with ``query_lens``
    real tokens (the first tokens of its row) after ``context_lens`` cached ones. Host tensors (int64)."""

    is_decode: bool
    num_tokens: int  # padded token count (the compiled bucket)
    rows: int  # padded rows of the block table
    context_lens: torch.Tensor  # [live_rows]
    query_lens: torch.Tensor  # [live_rows]

    @property
    def live_rows(self) -> int:
        return int(self.context_lens.numel())

    @property
    def live_tokens(self) -> int:
        return int(self.query_lens.sum())

    def query_start_loc(self) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.long), self.query_lens.cumsum(0)])

    def seq_lens(self) -> torch.Tensor:
        return self.context_lens + self.query_lens


def plan_step(positions: torch.Tensor, meta: dict[str, Any]) -> StepPlan:
    """Read a step's real extent off the padding the runner applied (host sync: the decisions here pick
    which rows the model's layers touch).

    A token is real iff its slot is > 0: padding points at the null block (0 at 0.24, -1 at 0.21) and no
    live token maps into block 0. A decode row holds one token at ``positions[row]`` (its context
    length); a prefill is one request whose context is ``cached_seq_len`` (= ``positions[0]``).
    """
    slots = meta["slot_mapping"].detach().to("cpu", torch.long)
    T = int(positions.shape[0])
    rows = int(meta["block_table_tensor"].shape[0])
    if is_decode(meta):
        if T != rows:
            raise ValueError(
                f"decode step: {T} tokens for {rows} block-table rows (speculative decoding is not supported)"
            )
        n = _prefix_count(slots[:rows] > 0, "decode slot_mapping")
        ctx = positions[:n].detach().to("cpu", torch.long)
        return StepPlan(True, T, rows, ctx, torch.ones(n, dtype=torch.long))
    if rows != 1:
        raise ValueError(f"prefill step with {rows} requests: the Beta scheduler runs one prefill per step")
    n = _prefix_count(slots[:T] > 0, "prefill slot_mapping")
    ctx = int(positions[0]) if n else 0
    cached = meta.get("cached_seq_len")
    if cached is not None and n and int(cached.reshape(-1)[0]) != ctx:
        raise ValueError(f"prefill: cached_seq_len {int(cached.reshape(-1)[0])} but first position {ctx}")
    return StepPlan(False, T, rows, torch.tensor([ctx]), torch.tensor([n]))


def real_block_table(meta: dict[str, Any], rows: int) -> torch.Tensor:
    """The first ``rows`` rows of the group's block table (int64), the -1 sentinel sent back to the null
    block: the layers index with it, and a never-written block 0 reads as zeros, not as another block."""
    return meta["block_table_tensor"][:rows].long().clamp(min=NULL_BLOCK_ID)


# --- the adapter ---


def _current_vllm_config() -> Any:
    from vllm.config import get_current_vllm_config

    try:
        cfg = get_current_vllm_config()
    except AssertionError:  # vLLM >= 0.32 asserts when no config is set
        return None
    return cfg if getattr(cfg, "model_config", None) is not None else None


def _adapter_vllm_config(hf_config: Any) -> Any:
    """The vLLM config the plugin's model is built under: the runner's checkpoint, dtype and length when a
    config is current (the worker sets it), else the checkpoint ``hf_config`` was read from; always eager
    (the Beta runner, not vLLM, decides how the graph is compiled); tensor-parallel size that of the
    tensor-parallel group the worker set up before building the model (1 without one), so that each rank
    builds and loads its own shard through vLLM's parallel layers, whose collectives run over that group."""
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs

    tp = parallel_state.get_tp_group().world_size if parallel_state.model_parallel_is_initialized() else 1

    current = _current_vllm_config()
    if current is not None:
        mc = current.model_config
        model, dtype, max_len = mc.model, mc.dtype, mc.max_model_len
        download_dir = current.load_config.download_dir
    else:
        model = getattr(hf_config, "_name_or_path", "") or ""
        if not model:
            raise ValueError("from_configs: no current vLLM config and hf_config does not name its checkpoint")
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        max_len, download_dir = None, None
    args = EngineArgs(
        model=model,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_len,
        download_dir=download_dir,
        enforce_eager=True,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
    )
    return args.create_engine_config()


class BetaModelAdapter(nn.Module):
    """One of the plugin's vLLM models presented through the Beta contract.

    Subclasses name the vLLM model class and translate, per forward, the Beta ``attn_metadata`` into the
    per-layer metadata that model's layers read from vLLM's forward context.
    """

    vllm_model_path: ClassVar[str]  # "module:Class" of the plugin's vLLM model

    def __init__(self, vllm_config: Any, neuron_config: NeuronConfig | None) -> None:
        super().__init__()
        import importlib

        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        module, cls_name = self.vllm_model_path.split(":")
        model_cls = getattr(importlib.import_module(module), cls_name)
        self._vllm_config = vllm_config
        self.neuron_config = neuron_config or NeuronConfig()
        self.config = vllm_config.model_config.hf_config
        self.dtype = vllm_config.model_config.dtype
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(self.dtype), torch.device("cpu"):
            self.model = initialize_model(vllm_config=vllm_config, model_class=model_cls)
        self._bound = False

    # --- construction and weights ---

    @classmethod
    def from_configs(
        cls, hf_config: Any, neuron_config: NeuronConfig | dict[str, Any] | None = None
    ) -> BetaModelAdapter:
        """Build the model as the Beta runner does (``model_cls.from_configs(hf_config, neuron_config)``)."""
        if isinstance(neuron_config, dict):
            neuron_config = NeuronConfig.from_dict(neuron_config)
        # The runner calls this inside `torch.device("meta")`; the configs, the imports and vLLM's layers
        # need real tensors (module constants, rotary caches, the GLA decay rates), so build on the host.
        with torch.device("cpu"):
            return cls(_adapter_vllm_config(hf_config), neuron_config)

    def load_weights(self, checkpoint_path: str, device: torch.device, cache_dir: str | None) -> None:
        """Load the checkpoint with vLLM's loader and the model's own ``load_weights`` (its name mapping,
        the packed MXFP4 -> FP8 reader and their errors), then vLLM's per-layer post-processing for
        ``device`` -- exactly the steps vLLM's ``DefaultModelLoader.load_model`` takes."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        cfg = self._vllm_config
        if str(checkpoint_path) != str(cfg.model_config.model):
            raise ValueError(f"load_weights({checkpoint_path}): the model was configured for {cfg.model_config.model}")
        if cache_dir is not None:
            cfg.load_config.download_dir = cache_dir
        with set_current_vllm_config(cfg), torch.device("cpu"):
            get_model_loader(cfg.load_config).load_weights(self.model, cfg.model_config)
            process_weights_after_loading(self.model, cfg.model_config, torch.device(device))
        self.model.eval()
        self.to(device)

    # --- caches (subclasses) ---

    def get_kv_spec(self) -> KVSpec:
        raise NotImplementedError

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        raise NotImplementedError

    def _forward_metadata(self, plan: StepPlan, attn_metadata: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Per-layer metadata for vLLM's forward context, keyed by the layers' prefixes."""
        raise NotImplementedError

    @staticmethod
    def _cache_entry(kv_caches: dict[str, list[torch.Tensor]], name: str, count: int) -> list[torch.Tensor]:
        if name not in kv_caches:
            raise KeyError(f"KV cache for layer {name} not initialized")
        entry = kv_caches[name]
        entry = [entry] if isinstance(entry, torch.Tensor) else list(entry)
        if len(entry) != count:
            raise ValueError(f"{name}: expected {count} cache tensor(s), got {len(entry)}")
        return entry

    # --- forward ---

    @contextmanager
    def _vllm_context(self, metadata: dict[str, Any], num_tokens: int) -> Iterator[None]:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        with (
            set_current_vllm_config(self._vllm_config),
            set_forward_context(metadata, self._vllm_config, num_tokens=num_tokens),
        ):
            yield

    @torch.inference_mode()  # as vLLM's runner: the plugin's ops share workspaces with vLLM's own runs
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: dict[str, dict[str, Any]] | None = None,
        sampling_positions: torch.Tensor | None = None,
        sampling_params: torch.Tensor | None = None,
        spec_decode_metadata: Any = None,
        logit_mask: torch.Tensor | None = None,
        rank: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """One Beta step: logits at ``sampling_positions`` or, with on-device sampling, greedy tokens.

        The cache writes happen inside the plugin's layers (slot per real token; padding slots are never
        written), so the step needs the runner's ``attn_metadata``.
        """
        if attn_metadata is None:
            raise ValueError("forward needs the runner's attn_metadata (the model writes its own caches)")
        if spec_decode_metadata is not None:
            raise NotImplementedError("speculative decoding is not supported by the plugin's models")
        if not self._bound:
            raise RuntimeError("bind_kv_cache() has not been called")
        first = attn_metadata[self._first_layer_name()]
        plan = plan_step(positions, first)
        metadata = self._forward_metadata(plan, attn_metadata)
        if sampling_positions is None:
            sampling_positions = plan.query_start_loc()[1:] - 1
        with self._vllm_context(metadata, plan.num_tokens):
            hidden = self.model(input_ids.long(), positions.long())
            logits = self.model.compute_logits(hidden.index_select(0, sampling_positions.long()))
        if logit_mask is not None:
            logits = logits.masked_fill(~logit_mask.to(logits.device, torch.bool), float("-inf"))
        if self.neuron_config.on_device_sampling_config is None:
            return logits
        return self._greedy(logits, sampling_params), (logits if self.neuron_config.max_logprobs else None)

    def _first_layer_name(self) -> str:
        raise NotImplementedError

    # vLLM's registry inspects these when the Beta runner resolves the architecture through it.
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with self._vllm_context({}, int(hidden_states.shape[0])):
            return self.model.compute_logits(hidden_states)

    @staticmethod
    def _greedy(logits: torch.Tensor, sampling_params: torch.Tensor | None) -> torch.Tensor:
        """On-device sampling, greedy rows only: ``sampling_params`` rows are ``[top_k, top_p, temperature]``
        (``build_sampling_params_tensor``); a row is greedy when its temperature is 0 or top_k is 1."""
        if sampling_params is not None:
            p = sampling_params.float()
            greedy = (p[:, 2] == 0) | (p[:, 0] == 1)
            if not bool(greedy[: logits.shape[0]].all()):
                raise NotImplementedError("on-device sampling: only greedy rows (temperature 0 or top_k 1)")
        return logits.argmax(dim=-1).to(torch.int32)
