"""The decode kernels as graph ops (kernels/dispatch.py): torch custom ops whose schema, fake implementation and
declared mutation let torch.compile hold each as one node, and whose in-place writes land in the caller's tensor.

The write that never happened: a cache written in place through a reshaped view under a compiler that redirects
later uses of the view but not of the cache leaves the cache unwritten. Here the state pool handed to the op is a
view of the tensor the caller holds; after a compiled call the caller's tensor must hold the eager result.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from vllm_trn_plugin.kernels import dispatch

FP8 = torch.float8_e4m3fn


def gla_args(g: torch.Generator) -> tuple:
    B, H, dk, dv, slots = 3, 2, 8, 16, 5
    return (
        torch.randn(B, H, dk, generator=g),
        torch.randn(B, H, dk, generator=g),
        torch.randn(B, H, dv, generator=g),
        torch.randn(H, dk, generator=g),
        -torch.rand(H, generator=g),
        dk**-0.5,
        torch.randn(slots, H, dk, dv, generator=g),
        torch.tensor([3, -1, 1]),  # row 1 is padding
    )


def latent_args(g: torch.Generator) -> tuple:
    H, Hkv, hd, r, bs = 4, 2, 8, 128, 4
    return (
        torch.randn(2, H, hd, generator=g),
        torch.rand(hd, generator=g) + 0.5,
        torch.randn(Hkv, hd, r, generator=g) / 16,
        torch.randn(Hkv, hd, r, generator=g) / 16,
        torch.randn(6, bs, r, generator=g),
        torch.rand(6 * bs, Hkv, generator=g) + 0.5,
        torch.tensor([[2, 5, 1], [4, 3, 0]]),
        torch.tensor([9, 5]),
        hd**-0.5,
        bs,
    )


def expert_args(g: torch.Generator, weight_dtype: torch.dtype = FP8) -> tuple:
    E, H, I, T = 3, 64, 32, 4
    return (
        torch.randn(T, H, generator=g),
        torch.rand(T, 2, generator=g),
        torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]]),
        (torch.randn(E, 2 * I, H, generator=g) * 30).to(weight_dtype),
        torch.full((E, 2 * I), 1e-3),
        torch.randn(E, 2 * I, generator=g) * 1e-3,
        (torch.randn(E, H, I, generator=g) * 30).to(weight_dtype),
        torch.full((E, H), 1e-3),
        torch.randn(E, H, generator=g) * 1e-3,
        True,
    )


@pytest.mark.parametrize(
    "op,make",
    [
        (torch.ops.trn.gla_decode_step.default, gla_args),
        (torch.ops.trn.latent_decode.default, latent_args),
        (torch.ops.trn.fp8_experts.default, expert_args),
        # opcheck's schema test perturbs the inputs arithmetically, which FP8 tensors do not support on CPU
        (torch.ops.trn.fp8_experts.default, lambda g: expert_args(g, torch.float32)),
    ],
    ids=["gla_decode_step", "latent_decode", "fp8_experts", "experts_fp32"],
)
def test_ops_pass_torch_opcheck(op, make) -> None:  # noqa: ANN001
    """torch.library.opcheck: the schema (including the declared mutation) matches what the op does, the fake
    implementation's outputs match the real ones in shape, dtype and strides, and the op traces under
    make_fx / AOT."""
    args = make(torch.Generator().manual_seed(0))
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    torch.library.opcheck(op, args, test_utils=("test_faketensor",) if fp8 else ("test_schema", "test_faketensor"))


def test_gla_step_writes_through_a_view_land_in_the_pool_under_compile() -> None:
    args = gla_args(torch.Generator().manual_seed(1))
    q, k, v, aug, log_decay, scale, pool, slots = args
    flat = pool.reshape(pool.shape[0], -1).clone()  # the caller's tensor; the op sees a reshaped view of it

    def step(flat: torch.Tensor) -> torch.Tensor:
        return dispatch.gla_decode_step(q, k, v, aug, log_decay, scale, flat.view(pool.shape), slots)

    eager_flat = flat.clone()
    want = step(eager_flat)
    assert not torch.equal(eager_flat, flat)  # the step wrote
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")(flat)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(flat, eager_flat), "the compiled step's state write did not land in the caller's tensor"
    assert torch.equal(flat.view(pool.shape)[0], pool[0]), "an untouched page changed"
