"""Rollout generation: the types, the samplers and the long-lived rollout service.

- `qerl_lib.rollout.service`: where a stage finds the rollout server of its workspace (the
  address file written by `qerl serve`, or `QERL_ROLLOUT_SERVER`), and the errors.
- `qerl_lib.rollout.client`: the HTTP client every stage uses to talk to a server, stock
  `vllm serve` (GPU) or the project's CPU server alike: adapters, AQN noise, per-row seeds,
  sampling logprobs, sleep / wake.
- `qerl_lib.rollout.cpu_server`: the project's small FastAPI server with vLLM's endpoints, on the
  transformers backend (so CI runs the same client code as the GPU).
- `qerl_lib.rollout.serve`: `qerl serve`, which starts one of the two for a workspace.

A stage that finds no server samples in its own process, as before (`qerl_lib.policy`).
"""
