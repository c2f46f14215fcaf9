"""The reliability soak of `vllm-trn serve` (vllm_trn_plugin.bench.soak): `--help` describes it."""

import sys

from vllm_trn_plugin.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
