"""The NKI kernels inside the real vLLM forward pass (VLLM_TRN_KERNELS=emulate) against the torch path.

One in-process engine per model (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the dispatch switch, read at
every call, flips between the torch path and the emulated kernel in the same engine: same weights,
same scheduling, same cache. Every decode step of every layer then runs the kernel's NKI source in the
project's NumPy NKI emulator; prefill stays torch (no prefill kernels). The kernel calls are counted so a
silent fallback to torch cannot pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import count_calls, greedy_params, random_prompts, token_prompts

pytestmark = pytest.mark.vllm

STEPS = 8


def _generate(llm: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(token_prompts(prompts), greedy_params(STEPS, logprobs=1), use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


def _compare(llm: Any, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, tol: float) -> float:
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    ref = _generate(llm, prompts)
    monkeypatch.setenv("VLLM_TRN_KERNELS", "emulate")
    got = _generate(llm, prompts)
    worst = 0.0
    for p, (t_ref, lp_ref), (t_got, lp_got) in zip(prompts, ref, got):
        assert t_got == t_ref, f"prompt of {len(p)}: emulated kernels chose {t_got}, torch path {t_ref}"
        worst = max(worst, max(abs(a - b) for a, b in zip(lp_ref, lp_got)))
    assert worst < tol, f"greedy-token logprobs differ by {worst:.2e}"
    return worst


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _engine(model: Path, cache_mib: int) -> Any:
    from vllm import LLM

    options = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "seed": 0}
    return LLM(str(model), kv_cache_memory_bytes=cache_mib << 20, **options)


def test_laplace_gla_kernel_in_vllm(laplace_ckpt: Path, in_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_trn_plugin.kernels import simple_gla_nki

    llm = _engine(laplace_ckpt, 64)
    try:
        calls = count_calls(monkeypatch, simple_gla_nki, "gla_decode_nki")
        prompts = random_prompts(5, [1, 9, 40, 3, 130], seed=31)
        worst = _compare(llm, prompts, monkeypatch, tol=1e-4)
    finally:
        del llm
    layers = 4
    assert calls[0] >= layers * (STEPS - 1), f"the GLA kernel ran {calls[0]} times"
    print(f"\nLaplace: {calls[0]} emulated GLA kernel calls, greedy tokens equal, logprobs within {worst:.1e}")


def test_trinity_latent_and_fp8_expert_kernels_in_vllm(
    tmp_path: Path, in_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed MLA-Trinity (FP8 experts, I = 256: the expert kernel's double-row tiling needs multiples of 256)."""
    from tests.references.afmoe import convert_to_mla, make_random_afmoe
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki
    from vllm_trn_plugin.loaders.packed import pack

    orig = make_random_afmoe(tmp_path / "orig", seed=5, full_kv_rank=256, moe_intermediate_size=256)
    packed = pack(convert_to_mla(orig, tmp_path / "mla", kv_lora_rank=256), tmp_path / "packed").dst
    llm = _engine(packed, 128)
    try:
        latent = count_calls(monkeypatch, latent_decode_nki, "latent_decode_nki")
        experts = count_calls(monkeypatch, fp8_expert_nki, "fp8_experts_nki")
        prompts = random_prompts(4, [1, 9, 70, 3], seed=32)
        # FP8 activations turn the kernel's different fp32 accumulation order into occasional one-step FP8
        # flips (tests/test_packed_vllm.py measures the same with its float64 reference): logprobs move at some
        # steps (the test prints by how much; docs/kernels.md), the tokens must not.
        worst = _compare(llm, prompts, monkeypatch, tol=0.5)
    finally:
        del llm
    assert latent[0] >= STEPS - 1, f"the latent decode kernel ran {latent[0]} times"
    assert experts[0] >= 3 * (STEPS - 1), f"the FP8 expert kernel ran {experts[0]} times"
    print(
        f"\nMLA-Trinity: {latent[0]} emulated latent-decode and {experts[0]} FP8-expert kernel calls, "
        f"greedy tokens equal, logprobs within {worst:.1e}"
    )
