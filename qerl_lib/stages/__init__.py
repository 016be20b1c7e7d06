"""The stages of the QeRL loop, one module each (`qerl_lib.stages.rollout`, ...), each a function
of (config, layout[, step][, policy]) with its inputs and outputs on disk (`qerl_lib.paths`).
`qerl_lib.stages.registry` lists them; the CLI (`qerl stage NAME`), `qerl run`, DVC and the
Prefect tasks all run these functions, so every door gives the same bytes.

    prepare -> convert -> init_adapter -> [rollout@i -> reward@i -> update@i]* -> eval@k -> report

Every output is written through a temporary name; a stage killed half-way leaves the previous
state untouched and is simply run again.

`from qerl_lib.stages import rollout_stage` works; the stage's module is imported only then, so
importing this package costs nothing and a stage's DVC dependencies are its own module and what
that imports (this file names no module in an import statement on purpose).
"""

from __future__ import annotations

import importlib

_FUNCTIONS = {
    "prepare_stage": "prepare", "convert_stage": "convert", "init_adapter_stage": "init_adapter",
    "rollout_stage": "rollout", "reward_stage": "reward", "update_stage": "update", "eval_stage": "eval",
    "report_stage": "report", "select_prompts": "rollout",
}


def __getattr__(name: str):
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
