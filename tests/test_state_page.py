"""At the full Laplace 3B geometry (config only, no weights), vLLM's state page per sequence is
28-31 MB and independent of max_model_len: one fixed page per sequence, whatever the context."""

from __future__ import annotations

import json

import pytest

from vllm_trn_plugin import register
from vllm_trn_plugin.configs import LaplaceConfig


def _engine_config(ckpt, max_model_len: int):  # noqa: ANN001, ANN202
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(ckpt), max_model_len=max_model_len, dtype="bfloat16", skip_tokenizer_init=True)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def full_size_ckpt(tmp_path_factory):  # noqa: ANN001, ANN201
    register()
    d = tmp_path_factory.mktemp("laplace-3b-config")
    cfg = LaplaceConfig()  # defaults are the 3B geometry of spec §2
    cfg.architectures = ["LaplaceForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    return d


def test_full_geometry_state_page(full_size_ckpt) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_trn_plugin.model_executors.laplace import LaplaceForCausalLM

    pages = {}
    for max_len in (2048, 8192, 131072):
        vc = _engine_config(full_size_ckpt, max_len)
        hf = vc.model_config.hf_config
        assert (hf.num_hidden_layers, hf.num_heads, hf.head_k_dim, hf.head_v_dim) == (24, 16, 96, 192)
        # One page per sequence: vLLM sizes the state block to the whole context.
        assert vc.cache_config.mamba_block_size == max_len
        spec = MambaSpec(
            shapes=LaplaceForCausalLM.get_mamba_state_shape_from_config(vc),
            dtypes=LaplaceForCausalLM.get_mamba_state_dtype_from_config(vc),
            block_size=vc.cache_config.mamba_block_size,
        )
        pages[max_len] = spec.page_size_bytes * hf.num_hidden_layers
    assert len(set(pages.values())) == 1, f"state page changes with max_model_len: {pages}"
    page = pages[2048]
    # Independent count from the spec: 24 x (16 x 96 x 192 fp32 + 3 x 3072 bf16) bytes.
    assert page == 24 * (16 * 96 * 192 * 4 + 3 * 3072 * 2)
    assert 28e6 <= page <= 31e6, f"{page / 1e6:.2f} MB per sequence"


@pytest.mark.parametrize("k", [3, 4])
def test_full_geometry_state_page_under_speculation(full_size_ckpt, k: int) -> None:
    """Under n-gram speculation with k drafts a page also keeps k tokens' keys, values and conv inputs (bf16) and
    two int32 counters per layer: 28.75 MB + k x 0.369 MB per sequence, one page (vLLM's default for a recurrent
    model is a state page per position of a verification row, (k + 1) x 28.75 MB)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_trn_plugin.model_executors.laplace import LaplaceForCausalLM

    spec_config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    vc = EngineArgs(
        model=str(full_size_ckpt),
        max_model_len=8192,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        speculative_config=spec_config,
    ).create_engine_config()
    spec = MambaSpec(
        shapes=LaplaceForCausalLM.get_mamba_state_shape_from_config(vc),
        dtypes=LaplaceForCausalLM.get_mamba_state_dtype_from_config(vc),
        block_size=vc.cache_config.mamba_block_size,
    )
    per_token = (16 * 96 + 16 * 192 + 3072) * 2  # one token's key, value and conv input, one layer
    assert spec.page_size_bytes * 24 == 28_753_920 + 24 * (k * per_token + 8)
    print(f"\nk = {k}: {spec.page_size_bytes * 24 / 1e6:.2f} MB per sequence")


@pytest.mark.parametrize(("budget_pages", "sequences"), [(65, 64), (64, 63)])
def test_budget_in_pages_admits_one_sequence_less_than_pages(full_size_ckpt, budget_pages: int, sequences: int) -> None:
    """The README's sizing rule, through vLLM's own cache sizing and block pool: a budget of N whole state pages
    holds N - 1 sequences, since vLLM keeps one block as its null block."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_trn_plugin.model_executors.gla_state import GLAStateBackend
    from vllm_trn_plugin.model_executors.laplace import LaplaceForCausalLM

    vc = _engine_config(full_size_ckpt, 8192)
    spec = MambaSpec(
        shapes=LaplaceForCausalLM.get_mamba_state_shape_from_config(vc),
        dtypes=LaplaceForCausalLM.get_mamba_state_dtype_from_config(vc),
        block_size=vc.cache_config.mamba_block_size,
    )
    specs = {f"model.layers.{i}.mixer": spec for i in range(vc.model_config.hf_config.num_hidden_layers)}
    page = 24 * (16 * 96 * 192 * 4 + 3 * 3072 * 2)  # bytes of one sequence's state, every layer
    assert page == 28_753_920
    # As vllm/v1/engine/core.py does before sizing the cache.
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([GLAStateBackend])]
    resolve_kv_cache_layout(vc, [layouts], specs.values())
    (kv,) = get_kv_cache_configs(vc, [specs], [budget_pages * page])
    pool = BlockPool(kv.num_blocks, enable_caching=False, hash_block_size=spec.block_size)
    assert pool.get_num_free_blocks() == sequences  # one page per sequence
