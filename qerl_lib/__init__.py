"""qerl: QeRL-style RL of language models on a frozen NVFP4 base with LoRA and AQN.

The library is pure and importable: no Prefect, no DVC inside. Stages live in
`qerl_lib.stages`, the CLI in `qerl_lib.cli`.
"""

__version__ = "0.1.0"
