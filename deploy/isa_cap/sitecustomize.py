"""Loaded at every Python start under `isa_cap.cap_env` (its folder leads PYTHONPATH): the CPU probes torch and
vLLM decide their kernels by answer as on the lesser CPU the variable TRN_BENCH_ISA_CAP names. A benchmark's
stand-in for hardware it does not have; never part of serving."""

import os

_CAP = os.environ.get("TRN_BENCH_ISA_CAP")
if _CAP in ("avx512", "avx2"):
    import torch

    def _no() -> bool:
        return False

    # vLLM picks its AMX GEMMs (sgl-kernel's weight_packed_linear, the CPU MoE) from torch.cpu's probes alone; oneDNN,
    # capped by ONEDNN_MAX_CPU_ISA, then refuses them mid-step, so it must agree with the cap.
    torch.cpu._is_amx_tile_supported = _no
    torch.cpu._is_amx_fp16_supported = _no
    if _CAP == "avx2":
        torch.cpu._is_avx512_supported = _no
        torch.cpu._is_avx512_bf16_supported = _no
        torch.cpu._is_vnni_supported = _no
