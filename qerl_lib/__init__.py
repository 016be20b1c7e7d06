"""qerl: QeRL-style RL of language models on a frozen NVFP4 base with LoRA and AQN.

The library is pure and importable: no Prefect, no DVC inside. Stages live in
`qerl_lib.stages`, the CLI in `qerl_lib.cli`.
"""

import os

# MKL's default kernels may round differently with a buffer's memory alignment, which
# differs between processes; strict CNR mode makes CPU stages repeat bit for bit whichever
# door (CLI, DVC, Prefect, in-process) runs them. Must be set before torch loads MKL.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
