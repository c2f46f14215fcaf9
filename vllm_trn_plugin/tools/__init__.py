"""Offline checkpoint tools: convert-mla, quantize (GPTQ, calibration) and the plain-torch AFMoE forward they run."""
