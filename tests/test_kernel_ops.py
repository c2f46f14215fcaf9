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
        [],  # no compute copies: each expert's weights converted per call
        [],
    )


def expert_args_with_copies(g: torch.Generator) -> tuple:
    """expert_args with each expert's compute copies (fp32: FBGEMM's handles are opaque to fake tensors)."""
    args = expert_args(g, torch.float32)
    return (*args[:10], list(args[3].unbind(0)), list(args[6].unbind(0)))


def linear_args(g: torch.Generator, weight_dtype: torch.dtype = FP8, copy: bool = False) -> tuple:
    N, K, T = 48, 64, 5
    w = (torch.randn(N, K, generator=g) * 30).to(weight_dtype)
    return (
        torch.randn(T, K, generator=g),
        w,
        torch.full((N,), 1e-3),
        torch.randn(N, generator=g) * 1e-3,
        w.float() if copy else None,
    )


@pytest.mark.parametrize(
    "op,make",
    [
        (torch.ops.trn.gla_decode_step.default, gla_args),
        (torch.ops.trn.latent_decode.default, latent_args),
        (torch.ops.trn.fp8_experts.default, expert_args),
        # opcheck's schema test perturbs the inputs arithmetically, which FP8 tensors do not support on CPU
        (torch.ops.trn.fp8_experts.default, lambda g: expert_args(g, torch.float32)),
        (torch.ops.trn.fp8_experts.default, expert_args_with_copies),
        (torch.ops.trn.fp8_linear.default, linear_args),
        (torch.ops.trn.fp8_linear.default, lambda g: linear_args(g, torch.float32, copy=True)),
    ],
    ids=[
        "gla_decode_step",
        "latent_decode",
        "fp8_experts",
        "experts_fp32",
        "experts_copies",
        "fp8_linear",
        "linear_copy",
    ],
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


# --- on Neuron: the kernels as the stack's graph ops (kernels/nki_ops.py), at the deployment's LNC ---


def test_deployment_lnc_and_a_kernel_of_another_degree_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment's degree is NEURON_LOGICAL_NC_CONFIG, else Trn2's default 2; a degree some kernel does not run
    at is refused when the ops are registered (at import on a Neuron host), naming the kernel, the degree, the
    compiler's error and the setting that works, instead of failing in neuronx-cc at the first request."""
    from vllm_trn_plugin.kernels import latent_decode_nki, nki_ops

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert nki_ops.deployment_lnc() == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert nki_ops.deployment_lnc() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='4'"):
        nki_ops.deployment_lnc()
    monkeypatch.setattr(latent_decode_nki, "LNC_DEGREES", (1,))
    with pytest.raises(RuntimeError, match=r"latent_decode_kernel .* runs at LNC 1.*LNC=2.*NCC_EVRF066"):
        nki_ops.check_lnc(2)
    monkeypatch.setattr(nki_ops, "_registered", {})
    with pytest.raises(RuntimeError, match="LNC=2"):
        nki_ops.register(lambda *a, **k: None, lambda kernel: None, 2)
    assert not nki_ops.registered()


def test_nki_mode_without_a_neuron_stack_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_TRN_KERNELS=nki asks for the kernels as Neuron graph ops: where no Neuron torch stack registered them, the
    call says so instead of running another path; auto on CPU tensors takes the trn op."""
    from vllm_trn_plugin.kernels import nki_ops

    monkeypatch.setattr(nki_ops, "_registered", {})
    monkeypatch.setenv("VLLM_TRN_KERNELS", "nki")
    with pytest.raises(RuntimeError, match="VLLM_TRN_KERNELS=nki needs the Neuron torch stack"):
        dispatch.gla_decode_step(*gla_args(torch.Generator().manual_seed(2)))
    monkeypatch.setenv("VLLM_TRN_KERNELS", "auto")
    assert not dispatch.graph_kernels(torch.device("cpu"))


def test_placeholder_packages_are_not_a_neuron_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyPI's torch-neuronx and libtorch-neuronx-lite are empty placeholders: a module of that name without
    nki_op / wrap_nki is no Neuron torch stack (nothing is registered on this host)."""
    import sys
    import types

    from vllm_trn_plugin.kernels import nki_ops

    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    assert nki_ops.neuron_torch_stack() is None
