"""`vllm-trn gate`: measure whether a candidate (a trn2 deployment, a kernel change, a conversion or quantization)
computes the same model as a reference, and pass or fail it on thresholds (docs/gate.md).

Modules: `sources` (endpoint / transformers / vLLM sides), `inputs` (text and token files, windows), `metrics`
(per-position metrics, buckets, thresholds), `passkey` (prompts and scoring), `run` (one gate run), `report`
(JSON, table, plot), `cli` (options, exit codes)."""
