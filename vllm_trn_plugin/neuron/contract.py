"""vLLM Neuron's model contract (SDK 2.33/2.34: vllm-neuron 0.29, GA in 2.34), and the adapter that drives this
plugin's models through it.

vLLM Neuron's runner builds the model class itself and calls a small contract instead of vLLM's model runner;
docs/trainium.md describes it piece by piece with the source and version of each, and lists what no public source
shows (no 0.29/GA runner source is public: the pieces come from the 0.24 runner @ 9fc042ea, a 0.26 fork's runner and
the 2.33/2.34 docs). The data structures the runner and the model exchange are re-declared here with the fields both
use:

- construction: ``model_cls.from_configs(hf_config, neuron_config)`` inside ``torch.device("meta")``, then
  ``load_weights(checkpoint_path, device, cache_dir)``, ``model.to(device)`` and ``torch.compile(fullgraph=True)``,
  one graph per bucket, warmed up, then ``fail_on_recompile``;
- ``NeuronConfig`` (``--additional-config '{"neuron_config": ...}'``): buckets, segmented prefill and on-device
  sampling (on unless the config sets ``on_device_sampling_config`` to null);
- ``get_kv_spec()`` -> ``KVSpec`` of ``LayerSpec`` with a ``cache_kind`` (``FULL``, ``SLIDING_WINDOW``, ``MLA``: an
  MLA layer is vLLM's ``MLAAttentionSpec``, bound as one ``[blocks, 1, block_size, r]`` tensor) and
  ``RecurrentLayerSpec`` (fixed-size states per sequence); every layer's cache in the ``--kv-cache-dtype`` (the runner
  does not read ``LayerSpec.dtype``);
- ``forward(input_ids, positions, attn_metadata, sampling_positions, sampling_params, spec_decode_metadata, logit_mask,
  rank, inputs_embeds=None, is_token_ids=None)`` (2.34 adds ``adapter_ids`` with LoRA) returns logits at
  ``sampling_positions`` or, with on-device sampling, ``(tokens, logits)``; ``attn_metadata`` maps each layer to its
  KV group's dict (``block_table_tensor`` with the null block as -1, ``slot_mapping``, ``max_query_len``,
  ``cached_seq_len``, ``swa_kv_pos_offset``, ...);
- padding: a prefill is padded to a token bucket and a decode batch to a sequence bucket; padded tokens' slots are
  ``PAD_SLOT_ID`` (-1: the docs and the 0.26 runner; the 0.24 runner wrote ``NULL_BLOCK_ID``, 0); one prefill per
  step, never mixed with decodes; under tensor parallelism one worker process per rank.

How the adapter honours it: the model is the plugin's own vLLM model class (``model_executors/laplace.py``,
``model_executors/trinity_mla.py``), built with vLLM's ``initialize_model`` and loaded with vLLM's loader plus the
model's own ``load_weights`` (so packed MXFP4 checkpoints and every load check behave as under vLLM). The forward is
the model's own, with the layers that touch a cache or a state swapped for static forms that read this step's
metadata (``StepContext``) and call the model's own cache helpers, so that ``torch.compile(fullgraph=True)``
captures each bucket whole. Decode kernels enter the graph as kernel ops (``kernels/dispatch.py``: on Neuron the
stack's ``nki_op`` ops of ``kernels/nki_ops.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_trn_plugin.neuron.sampling import sample

NULL_BLOCK_ID = 0  # vLLM's reserved block: block tables carry it as -1; no request owns it

# Segmented prefill (docs 2.32/2.33 "configuration reference"; the 0.26 runner's bucket_utils): the sizes a KV
# segment may have, and the longest max_model_len a prompt may prefill in one shot.
SUPPORTED_KV_SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)
MAX_MODEL_LEN_SINGLE_SHOT = 16 * 1024


# --- the data structures the runner and the model exchange (vllm_neuron/model/kv_cache.py, neuron_config.py) ---


class CacheKind(str, Enum):
    """``LayerSpec.cache_kind`` (0.26 runner's kv_cache.py; the kinds these models use)."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"


@dataclass
class LayerSpec:
    """A paged cache layer. FULL / SLIDING_WINDOW: the runner binds ``[k, v]``, each ``[num_blocks, num_kv_heads,
    block_size, head_size]``; MLA (vLLM's ``MLAAttentionSpec``): ``[latent]``, ``[num_blocks, num_kv_heads (1),
    block_size, head_size (the latent width)]``. ``dtype`` is the model's wish; the runner allocates every layer in
    the ``--kv-cache-dtype`` (``bind_kv_cache`` checks what it gets)."""

    name: str
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window_size: int | None = None
    chunk_size: int | None = None
    cache_kind: CacheKind = CacheKind.FULL


@dataclass
class RecurrentLayerSpec:
    """A fixed-size state per sequence: one tensor per state, ``[num_blocks, *shape]``; a request's state is
    its (single) block's id. (Fork code: no GA source shows how recurrent states are declared.)"""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass
class KVSpec:
    layers: list[LayerSpec]
    recurrent_layers: list[RecurrentLayerSpec] = field(default_factory=list)


@dataclass
class OnDeviceSamplingConfig:
    """``neuron_config["on_device_sampling_config"]``: on-device top-k / top-p / temperature sampling over the
    ``max_top_k`` largest logits (0.24/0.26 runners' neuron_config.py)."""

    all_greedy: bool = False
    max_top_k: int = 256
    deterministic: bool = False


_ABSENT = object()


@dataclass
class NeuronConfig:
    """The part of vllm-neuron's ``NeuronConfig`` the runner and these models read (unknown keys are kept).
    ``from_dict`` as the runner's: an absent ``on_device_sampling_config`` enables on-device sampling with the
    defaults, an explicit null disables it (sampling on the host)."""

    num_seqs_buckets: list[int] | None = None
    num_batched_tokens_buckets: list[int] | None = None
    decode_context_length_buckets: list[int] | None = None
    kv_segment_size_buckets: list[int] | None = None
    on_device_sampling_config: OnDeviceSamplingConfig | None = None
    max_logprobs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NeuronConfig:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kw = {k: v for k, v in d.items() if k in known}
        ods = d.get("on_device_sampling_config", _ABSENT)
        if ods is _ABSENT:
            kw["on_device_sampling_config"] = OnDeviceSamplingConfig()
        elif isinstance(ods, dict):
            kw["on_device_sampling_config"] = OnDeviceSamplingConfig(**ods)
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})


def check_buckets(nc: NeuronConfig, max_num_batched_tokens: int, max_model_len: int) -> None:
    """The runner's segmented-prefill rule, checked when the model is built rather than left to the first prefill
    (docs 2.32/2.33 configuration reference; 0.26 runner ``resolve_segmented_prefill_config`` and
    ``validate_kv_segment_size_buckets``): a prompt longer than ``max_num_batched_tokens`` is prefilled in segments
    of that size, which must be a supported KV segment size, and then the token buckets must equal the segment
    buckets (a kernel constraint); without segments max_model_len is at most 16k."""
    if max_num_batched_tokens >= max_model_len:
        if max_model_len > MAX_MODEL_LEN_SINGLE_SHOT:
            raise ValueError(
                f"--max-model-len {max_model_len} > {MAX_MODEL_LEN_SINGLE_SHOT} needs segmented prefill: set "
                f"--max-num-batched-tokens to one of {SUPPORTED_KV_SEGMENT_SIZES}"
            )
        return
    if max_num_batched_tokens not in SUPPORTED_KV_SEGMENT_SIZES:
        raise ValueError(
            f"--max-num-batched-tokens {max_num_batched_tokens} < --max-model-len {max_model_len} turns on segmented "
            f"prefill, whose segment must be one of {SUPPORTED_KV_SEGMENT_SIZES}"
        )
    segments = nc.kv_segment_size_buckets or [max_num_batched_tokens]
    if segments != [max_num_batched_tokens]:
        raise ValueError(
            f"neuron_config kv_segment_size_buckets {segments}: with segmented prefill it is "
            f"[--max-num-batched-tokens] = [{max_num_batched_tokens}]"
        )
    if nc.num_batched_tokens_buckets is not None and list(nc.num_batched_tokens_buckets) != segments:
        raise ValueError(
            f"neuron_config num_batched_tokens_buckets {nc.num_batched_tokens_buckets} must equal "
            f"kv_segment_size_buckets {segments} with segmented prefill (--max-num-batched-tokens "
            f"{max_num_batched_tokens} < --max-model-len {max_model_len})"
        )


# --- one step of the runner, as the model sees it ---


def is_decode(meta: dict[str, Any]) -> bool:
    """The runner's own test (``_build_attention_metadata``): a decode iff the longest query is within the
    decode threshold (1 without speculative decoding). Both are Python ints fixed per bucket: the choice is made
    when the bucket's graph is traced."""
    return int(meta["max_query_len"]) <= int(meta["decode_token_threshold"])


def live_tokens(meta: dict[str, Any]) -> torch.Tensor:
    """[T] bool: the step's real tokens. A padded token's slot is -1 (the runner's ``PAD_SLOT_ID``) or, at the 0.24
    runner, 0 (the null block), and no real token maps into block 0, so either convention reads the same; the runner
    pads at the end, so the real tokens are a prefix."""
    return meta["slot_mapping"] > 0


def block_rows(meta: dict[str, Any]) -> torch.Tensor:
    """The group's block table as int64 with the -1 sentinel sent back to the null block, for indexing: a
    never-written or dead entry then reads block 0 and is masked by the caller."""
    return meta["block_table_tensor"].long().clamp(min=NULL_BLOCK_ID)


def slot_rows(meta: dict[str, Any]) -> torch.Tensor:
    """[T] int64: each token's cache row (``slot_mapping``); padded tokens' rows are in the null block (row 0)."""
    return meta["slot_mapping"].long().clamp(min=NULL_BLOCK_ID)


class StepContext:
    """What a step's layers read besides their inputs: the runner's ``attn_metadata`` (per layer name) and the
    positions, set by the adapter's ``step`` for the duration of the model's forward, as vLLM's forward context is
    under vLLM's runner. A plain object, so that torch.compile traces the reads into the graph."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.attn_metadata: dict[str, dict[str, Any]] | None = None

    def meta(self, layer: str) -> dict[str, Any]:
        if self.attn_metadata is None:
            raise RuntimeError(f"{layer}: called outside a step (no attn_metadata)")
        return self.attn_metadata[layer]


# --- the adapter ---


def _current_vllm_config() -> Any:
    from vllm.config import get_current_vllm_config

    try:
        cfg = get_current_vllm_config()
    except AssertionError:  # vLLM >= 0.32 asserts when no config is set
        return None
    return cfg if getattr(cfg, "model_config", None) is not None else None


def check_runner_config(vllm_config: Any, nc: NeuronConfig) -> None:
    """What no adapter serves, refused when the model is built: LoRA (vLLM Neuron 2.34 passes ``adapter_ids`` and
    LoRA slot weights the plugin's models do not apply), and a bucket layout the runner's segmented prefill refuses
    (``check_buckets``)."""
    if getattr(vllm_config, "lora_config", None) is not None:
        raise NotImplementedError(
            "--enable-lora: the plugin's models under vLLM Neuron apply no LoRA adapters (the runner's adapter_ids "
            "and LoRA slot weights would be ignored); serve the base model, or LoRA on the vLLM path (CPU/GPU)"
        )
    check_buckets(nc, vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len)


def _adapter_vllm_config(hf_config: Any, current: Any, extra: dict[str, Any]) -> Any:
    """The vLLM config the plugin's model is built under: the runner's checkpoint, dtype and length when a
    config is current (the worker sets it), else the checkpoint ``hf_config`` was read from; always eager
    (the runner, not vLLM, decides how the graph is compiled); tensor-parallel size that of the
    tensor-parallel group the worker set up before building the model (1 without one), so that each rank
    builds and loads its own shard through vLLM's parallel layers, whose collectives run over that group;
    ``extra``: the model's ``additional_config`` entries (the adapter's ``check_config``)."""
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs

    tp = parallel_state.get_tp_group().world_size if parallel_state.model_parallel_is_initialized() else 1
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


class NeuronModelAdapter(nn.Module):
    """One of the plugin's vLLM models presented through vLLM Neuron's contract.

    The model's weights and layers are the plugin's vLLM model class, built and loaded as under vLLM. The forward
    is the model's own (``step``), with the modules that read and write caches or states swapped for static forms
    (``_prepare_for_device``, subclasses) that read this step's metadata from ``step_context`` and call the model's
    own cache helpers, so that the runner's ``torch.compile(fullgraph=True)`` captures each bucket's step whole.
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
        self.step_context = StepContext()
        self._bound = False

    # --- construction and weights ---

    @classmethod
    def from_configs(
        cls, hf_config: Any, neuron_config: NeuronConfig | dict[str, Any] | None = None
    ) -> NeuronModelAdapter:
        """Build the model as the runner does (``model_cls.from_configs(hf_config, neuron_config)``), refusing first
        what the adapter cannot serve exactly under the runner's config (``check_runner_config``, ``check_config``)."""
        if not isinstance(neuron_config, NeuronConfig):
            neuron_config = NeuronConfig.from_dict(neuron_config or {})
        current = _current_vllm_config()
        extra: dict[str, Any] = {}
        if current is not None:
            extra = cls.check_config(current)
            check_runner_config(current, neuron_config)
        # The runner calls this inside `torch.device("meta")`; the configs, the imports and vLLM's layers
        # need real tensors (module constants, rotary caches, the GLA decay rates), so build on the host.
        with torch.device("cpu"):
            return cls(_adapter_vllm_config(hf_config, current, extra), neuron_config)

    @classmethod
    def check_config(cls, vllm_config: Any) -> dict[str, Any]:
        """The runner's vLLM config, checked for this model: refuse (naming the option) what the adapter cannot serve
        exactly; return the ``additional_config`` entries the model is built with (subclasses)."""
        return {}

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

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's own forward over one padded step: the final hidden states [T, hidden] of every token. The
        layers that touch a cache or state are the adapter's static forms (``_prepare_for_device``), which read this
        step's metadata from ``step_context``."""
        ctx = self.step_context
        ctx.positions, ctx.attn_metadata = positions.long(), attn_metadata
        try:
            return self.model.model.forward(input_ids.long(), ctx.positions, None, inputs_embeds)
        finally:
            ctx.positions = ctx.attn_metadata = None

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
        inputs_embeds: torch.Tensor | None = None,
        is_token_ids: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """One runner step: logits at ``sampling_positions`` or, with on-device sampling, ``(tokens, logits or
        None)``. An argument the runner passes that is not named here fails the trace (a TypeError naming it),
        never a silently ignored input.

        Traceable whole by ``torch.compile(fullgraph=True)``, one graph per bucket: shapes and the Python ints of
        ``attn_metadata`` are fixed per bucket; everything else (real rows and tokens, slots, context lengths) is a
        tensor masked on device. ``inputs_embeds`` (prompt embeddings) replace the token embedding where
        ``is_token_ids`` is False. ``adapter_ids`` may only name slot 0, the base model (LoRA is refused when the
        model is built; a row naming an adapter fails the step). ``rank`` is not read: each rank's shard is fixed
        when it is built.
        """
        if attn_metadata is None:
            raise ValueError("forward needs the runner's attn_metadata (the model writes its own caches)")
        if spec_decode_metadata is not None:
            raise NotImplementedError("speculative decoding is not supported by the plugin's models")
        if sampling_positions is None:
            raise ValueError("forward needs sampling_positions (the rows the runner samples)")
        if not self._bound:
            raise RuntimeError("bind_kv_cache() has not been called")
        if adapter_ids is not None:
            torch._assert_async((adapter_ids == 0).all(), "adapter_ids: a LoRA adapter asked of a model serving none")
        if inputs_embeds is not None:
            embeds = inputs_embeds.to(self.dtype)
            if is_token_ids is not None:
                tokens = self.model.embed_input_ids(input_ids.long())
                embeds = torch.where(is_token_ids.to(torch.bool)[:, None], tokens, embeds)
            inputs_embeds = embeds
        hidden = self.step(input_ids, positions, attn_metadata, inputs_embeds)
        logits = self.model.compute_logits(hidden.index_select(0, sampling_positions.long()))
        if logit_mask is not None:
            logits = logits.masked_fill(~logit_mask.to(logits.device, torch.bool), float("-inf"))
        ods = self.neuron_config.on_device_sampling_config
        if ods is None:
            return logits
        if sampling_params is None:
            tokens = logits.argmax(dim=-1).to(torch.int32)
        else:
            tokens = sample(logits, sampling_params, ods.max_top_k)
        return tokens, (logits if self.neuron_config.max_logprobs else None)

    # vLLM's registry inspects these when the runner resolves the architecture through it.
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


def _set_worker_ir_state(vllm_config: Any) -> None:
    """What vLLM's worker sets for its lifetime (``WorkerBase.__init__``): its IR ops (RMSNorm, fused add + RMSNorm) at
    their default implementation priority, called directly rather than through the torch custom op that only vLLM's
    own Inductor pass lowers. The Neuron worker runs no vLLM runner beside the model, and a device compiler cannot see
    into a vLLM custom op, so the ops' torch bodies are what its graph holds."""
    import vllm.ir

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
