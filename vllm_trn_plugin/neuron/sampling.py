"""On-device sampling under vLLM Neuron's runner: top-k, top-p and temperature per row, in graph ops.

The runner hands the model ``sampling_params`` [rows, 3] = ``[top_k, top_p, temperature]`` per row (float32; top_k
<= 0 means no top-k limit; temperature 0 means greedy) and takes the sampled token ids back; on-device sampling is on
unless the runner's neuron_config sets it to null (contract.py, ``NeuronConfig``). As the runner's own sampler does,
the candidates are the ``max_top_k`` largest logits of each row; within them a row's distribution is vLLM's: logits
divided by the temperature, the ``top_k`` best kept, then the smallest prefix whose probability reaches ``top_p``,
renormalised. A row draws its token by the Gumbel-max rule (the argmax of log-probability plus Gumbel noise is a draw
from the distribution), so the whole step stays one static graph.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Token ids [R] int32 for logits [R, V] and ``sampling_params`` rows [R, 3] (top_k, top_p, temperature)."""
    logits = logits.float()
    p = params.to(logits.device, torch.float32)[: logits.shape[0]]
    top_k, top_p, temperature = p[:, 0], p[:, 1], p[:, 2]
    greedy = (temperature <= 0) | (top_k == 1)
    k_max = min(max_top_k, logits.shape[-1])
    cand, ids = logits.topk(k_max, dim=-1)  # sorted, largest first
    cand = cand / torch.where(greedy, 1.0, temperature)[:, None]
    rank = torch.arange(k_max, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=k_max), k_max)
    cand = cand.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(cand, dim=-1)
    # keep a candidate while the mass before it is below top_p (the first is always kept)
    keep = (probs.cumsum(-1) - probs) < top_p[:, None]
    logp = torch.log_softmax(cand.masked_fill(~keep, float("-inf")), dim=-1)
    u = torch.rand_like(logp).clamp(min=torch.finfo(torch.float32).tiny)
    choice = (logp - torch.log(-torch.log(u))).argmax(-1)
    drawn = ids.gather(1, choice[:, None])[:, 0]
    return torch.where(greedy, logits.argmax(-1), drawn).to(torch.int32)
