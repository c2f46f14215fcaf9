"""On-device sampling under vLLM Neuron (vllm_trn_plugin/neuron/sampling.py): greedy rows are the argmax; sampled rows
follow vLLM's distribution (temperature, then top-k, then top-p, renormalised) computed independently in float64; the
candidates are at most `max_top_k`; and the sampler traces into one static graph."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_trn_plugin.neuron.sampling import sample


def reference_probs(logits: list[float], top_k: int, top_p: float, temperature: float, max_top_k: int) -> list[float]:
    """The distribution a row draws from, by plain float64 arithmetic: the `max_top_k` largest logits, divided by
    the temperature, the top_k best (all when top_k <= 0), then the fewest best whose probability reaches top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:max_top_k]
    if top_k > 0:
        order = order[:top_k]
    weights = [math.exp(logits[i] / temperature) for i in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights):
        kept.append((i, w))
        mass += w / total
        if mass >= top_p:
            break
    z = sum(w for _, w in kept)
    probs = [0.0] * len(logits)
    for i, w in kept:
        probs[i] = w / z
    return probs


LOGITS = [1.3, -0.2, 2.9, 0.4, 2.1, -1.7, 0.0, 1.9, 3.3, -0.6, 0.8, 2.5]


@pytest.mark.parametrize(
    "top_k,top_p,temperature,max_top_k",
    [(5, 0.8, 0.7, 256), (-1, 1.0, 1.3, 256), (0, 0.5, 1.0, 256), (-1, 1.0, 1.0, 3), (8, 0.95, 2.0, 6)],
)
def test_sampled_rows_follow_the_reference_distribution(
    top_k: int, top_p: float, temperature: float, max_top_k: int
) -> None:
    n = 40_000
    torch.manual_seed(0)
    logits = torch.tensor([LOGITS] * n)
    params = torch.tensor([[top_k, top_p, temperature]] * n)
    counts = torch.bincount(sample(logits, params, max_top_k).long(), minlength=len(LOGITS)).double() / n
    want = reference_probs(LOGITS, top_k, top_p, temperature, max_top_k)
    for i, (p, f) in enumerate(zip(want, counts.tolist())):
        if p == 0.0:
            assert f == 0.0, f"token {i} is outside top-k / top-p but was drawn ({f:.4f})"
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(f - p) < 5 * sigma + 1e-9, f"token {i}: drawn {f:.4f}, expected {p:.4f}"


def test_greedy_rows_are_the_argmax_and_rows_are_independent() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    params = torch.tensor([[-1, 1.0, 0.0], [1, 1.0, 0.8], [-1, 0.9, 0.0], [5, 0.5, 1.0], [1, 0.1, 3.0], [-1, 1.0, 0.0]])
    tokens = sample(logits, params, 256)
    assert tokens.dtype == torch.int32
    argmax = logits.argmax(-1)
    for r in (0, 1, 2, 4, 5):  # temperature 0 or top_k 1: greedy whatever top_p says
        assert tokens[r] == argmax[r]
    top5 = set(logits[3].topk(5).indices.tolist())
    assert int(tokens[3]) in top5


def test_sampler_traces_into_one_static_graph() -> None:
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda lg, p: sample(lg, p, 16), backend=backend, fullgraph=True, dynamic=False)
    logits = torch.randn(4, 100)
    params = torch.tensor([[-1, 1.0, 0.0]] * 4)
    assert torch.equal(compiled(logits, params), logits.argmax(-1).to(torch.int32))
    compiled(torch.randn(4, 100), torch.tensor([[3, 0.9, 0.7]] * 4))  # other values, same graph
    assert len(graphs) == 1
