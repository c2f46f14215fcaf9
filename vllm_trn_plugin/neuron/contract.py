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
model's own ``load_weights`` (so packed MXFP4 checkpoints and every load check behave as under vLLM). The forward is
the adapter's own static ``step``: the model's layers called one by one, the cache and state reads and writes as
graph ops over the runner's tensors, masked by which tokens are live, so that ``torch.compile(fullgraph=True)``
captures each bucket whole. Decode ops are the torch custom ops of ``kernels/dispatch.py`` (``VLLM_TRN_KERNELS``
chooses who computes at run time). docs/trainium.md, "Static graphs", says what the runner's compile needs.
"""

from __future__ import annotations

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
    decode threshold (1 without speculative decoding). Both are Python ints fixed per bucket: the choice is made
    when the bucket's graph is traced."""
    return int(meta["max_query_len"]) <= int(meta["decode_token_threshold"])


def live_tokens(meta: dict[str, Any]) -> torch.Tensor:
    """[T] bool: the step's real tokens. Padding points at the null block (slot 0 at 0.24, -1 at 0.21) and no real
    token maps into block 0; the runner pads at the end, so the real tokens are a prefix."""
    return meta["slot_mapping"] > 0


def block_rows(meta: dict[str, Any]) -> torch.Tensor:
    """The group's block table as int64 with the -1 sentinel sent back to the null block, for indexing: a
    never-written or dead entry then reads block 0 and is masked by the caller."""
    return meta["block_table_tensor"].long().clamp(min=NULL_BLOCK_ID)


def slot_rows(meta: dict[str, Any]) -> torch.Tensor:
    """[T] int64: each token's cache row (``slot_mapping``); padded tokens' rows are in the null block (row 0)."""
    return meta["slot_mapping"].long().clamp(min=NULL_BLOCK_ID)


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
    extra: dict[str, Any] = {}
    if (
        current is not None
        and getattr(hf_config, "model_type", None) == "laplace"
        and current.cache_config.enable_prefix_caching
    ):
        raise NotImplementedError(
            "--enable-prefix-caching: the Beta contract adapter keeps one Laplace state page per sequence (its static "
            "step has no state checkpoints per block); prefix caching of Laplace's state runs on the vLLM path. Serve "
            "with --no-enable-prefix-caching"
        )
    if current is not None and getattr(hf_config, "kv_lora_rank", None) is not None:
        from vllm_trn_plugin.kernels.fp8_expert import FP8_DTYPE
        from vllm_trn_plugin.model_executors.latent_attention import LATENT_CACHE_DTYPE, latent_cache_dtype

        if str(current.cache_config.cache_dtype).startswith("fp8"):
            raise NotImplementedError(
                f"--kv-cache-dtype {current.cache_config.cache_dtype}: the Beta contract adapter keeps MLA-Trinity's "
                "sliding layers' K/V in the model dtype (its static step has no FP8 K/V with vLLM's per-tensor k/v "
                "scales). For an FP8 latent with model-dtype sliding layers serve with --kv-cache-dtype auto and "
                f'--additional-config \'{{"{LATENT_CACHE_DTYPE}": "fp8"}}\''
            )
        # The latent's dtype is the runner's choice (its --additional-config), resolved once here.
        extra[LATENT_CACHE_DTYPE] = "fp8" if latent_cache_dtype(current) == FP8_DTYPE else "model"
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
        additional_config=extra,
        # vLLM's custom layers (norms, rotary embedding, activations) in their plain torch form: the CPU build's
        # own kernels are not what a device graph holds.
        compilation_config={"custom_ops": ["none"]},
    )
    return args.create_engine_config()


class BetaModelAdapter(nn.Module):
    """One of the plugin's vLLM models presented through the Beta contract.

    The model's weights and layers are the plugin's vLLM model class, built and loaded as under vLLM. The forward
    is the adapter's own (`step`, one per subclass): the same layers called one by one, with the parts that read and
    write the caches and states written as graph ops over the runner's tensors, so that the runner's
    ``torch.compile(fullgraph=True)`` captures each bucket's step whole.
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
        _set_worker_ir_state(vllm_config)
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
        ``device``, as vLLM's ``DefaultModelLoader.load_model`` does, but device-shaped: the unquantized linear
        and embedding layers keep their weights as loaded and compute with F.linear (vLLM's CPU build would repack
        them for its own GEMM kernels), and `_prepare_for_device` replaces what only vLLM's runner runs."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        cfg = self._vllm_config
        if str(checkpoint_path) != str(cfg.model_config.model):
            raise ValueError(f"load_weights({checkpoint_path}): the model was configured for {cfg.model_config.model}")
        if cache_dir is not None:
            cfg.load_config.download_dir = cache_dir
        dense = _dense_methods()
        with set_current_vllm_config(cfg), torch.device("cpu"):
            get_model_loader(cfg.load_config).load_weights(self.model, cfg.model_config)
            self._prepare_for_device()
            for module in self.model.modules():
                method = dense.get(type(getattr(module, "quant_method", None)))
                if method is not None:
                    module.quant_method = method()
            process_weights_after_loading(self.model, cfg.model_config, torch.device(device))
        self.model.eval()
        self.to(device)

    def _prepare_for_device(self) -> None:
        """Between loading and vLLM's post-processing: swap out what only vLLM's own runner can run (subclasses)."""

    # --- caches (subclasses) ---

    def get_kv_spec(self) -> KVSpec:
        raise NotImplementedError

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
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

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, Any]) -> torch.Tensor:
        """The model over one padded step: the final hidden states [T, hidden] of every token (subclasses)."""
        raise NotImplementedError

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

        Traceable whole by ``torch.compile(fullgraph=True)``, one graph per bucket: shapes and the Python ints of
        ``attn_metadata`` are fixed per bucket; everything else (real rows and tokens, slots, context lengths) is a
        tensor masked on device; the caches and states are read and written by graph ops or by the declared kernel
        ops of ``kernels/dispatch.py``. The checks below read Python values only.
        """
        if attn_metadata is None:
            raise ValueError("forward needs the runner's attn_metadata (the model writes its own caches)")
        if spec_decode_metadata is not None:
            raise NotImplementedError("speculative decoding is not supported by the plugin's models")
        if sampling_positions is None:
            raise ValueError("forward needs sampling_positions (the rows the runner samples)")
        if not self._bound:
            raise RuntimeError("bind_kv_cache() has not been called")
        hidden = self.step(input_ids, positions, attn_metadata)
        logits = self.model.compute_logits(hidden.index_select(0, sampling_positions.long()))
        if logit_mask is not None:
            logits = logits.masked_fill(~logit_mask.to(logits.device, torch.bool), float("-inf"))
        if self.neuron_config.on_device_sampling_config is None:
            return logits
        return self._greedy(logits, sampling_params), (logits if self.neuron_config.max_logprobs else None)

    # vLLM's registry inspects these when the Beta runner resolves the architecture through it.
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    @staticmethod
    def _greedy(logits: torch.Tensor, sampling_params: torch.Tensor | None) -> torch.Tensor:
        """On-device sampling, greedy rows only: ``sampling_params`` rows are ``[top_k, top_p, temperature]``
        (``build_sampling_params_tensor``); a row is greedy when its temperature is 0 or top_k is 1. A non-greedy
        row fails the step (an assertion the graph holds), never a silently greedy answer."""
        if sampling_params is not None:
            p = sampling_params.float()[: logits.shape[0]]
            greedy = ((p[:, 2] == 0) | (p[:, 0] == 1)).all()
            torch._assert_async(greedy, "on-device sampling: only greedy rows (temperature 0 or top_k 1)")
        return logits.argmax(dim=-1).to(torch.int32)


def _set_worker_ir_state(vllm_config: Any) -> None:
    """What vLLM's worker sets for its lifetime (``WorkerBase.__init__``, vLLM versions with ``vllm.ir``): its IR ops
    (RMSNorm, fused add + RMSNorm) at their default implementation priority, called directly rather than through the
    torch custom op that only vLLM's own Inductor pass lowers. The Beta worker runs no vLLM runner beside the model,
    and a device compiler cannot see into a vLLM custom op, so the ops' torch bodies are what its graph holds."""
    try:
        import vllm.ir
    except ImportError:  # vLLM without IR ops (0.24): its layers call their torch forms (custom_ops "none")
        return
    vllm_config.kernel_config.ir_op_priority.set_default()
    vllm.ir.set_default_torch_wrap(False)


def _dense_methods() -> dict[type, type]:
    """vLLM's unquantized linear and embedding methods -> the same keeping their weights as loaded and computing
    with torch's F.linear (the attribute vLLM's CPU GEMM dispatch reads), as on a device."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    return {
        base: type(f"Dense{base.__name__}", (base,), {"process_weights_after_loading": process_weights_after_loading})
        for base in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    }
