"""GPU test of the rollout service (`-m gpu`; skipped without vLLM and CUDA): `qerl serve` runs
stock `vllm serve` with the worker extension on a small random NVFP4 Llama, and the client that
every stage uses drives it: the checkpoint hash, repeatable per-row seeds, adapters by version,
AQN noise on and exactly off again, sleep / wake around a colocated update. Run on the H200 by
`scripts/device_vllm.sh service-tests`; the CPU twin is tests/test_rollout_service.py."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_vllm_engine import build_small_dense, make_adapter

from qerl_lib.rollout.sampling import SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAVE_VLLM and torch.cuda.is_available()), reason="needs vLLM and a CUDA GPU")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A workspace (checkpoint, convert report, two adapters) and `qerl serve` on it; yields
    (config, layout, url)."""
    from qerl_lib.config import load_config
    from qerl_lib.convert import checkpoint_hash
    from qerl_lib.nvfp4_checkpoint import write_nvfp4_checkpoint
    from qerl_lib.paths import Layout

    root = tmp_path_factory.mktemp("served_gpu")
    layout = Layout(root)
    dense = build_small_dense(root / "dense")
    ckpt = write_nvfp4_checkpoint(dense, layout.checkpoint("nvfp4"))
    (ckpt / "convert_report.json").write_text(json.dumps({"checkpoint_hash": checkpoint_hash(ckpt)}))
    for i in range(2):
        make_adapter(ckpt, layout.adapter(i), seed=i + 1)
    tree = {"run": {"root": str(root), "seed": 0}, "model": {"base": str(dense), "quant": "nvfp4"},
            "lora": {"r": 8, "alpha": 16},
            "rollout": {"backend": "vllm", "vllm_max_lora_rank": 8, "vllm_gpu_memory_utilization": 0.25,
                        "vllm_dense_above": 4, "vllm_lora_dual_stream": True}}
    cfg_path = root / "config.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(tree))
    cfg = load_config(cfg_path)
    log = open(root / "serve.log", "wb")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "qerl_lib", "serve", "-c", str(cfg_path)], stdout=log,
                            stderr=subprocess.STDOUT)
    addr = root / "rollout_server.json"
    try:
        while not addr.is_file():
            assert proc.poll() is None, (root / "serve.log").read_text()[-4000:]
            assert time.time() - t0 < 600, "vllm serve did not come up"
            time.sleep(1)
        print(f"\n[serve] vllm serve answered after {time.time() - t0:.1f} s")
        yield cfg, layout, json.loads(addr.read_text())["url"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()
    assert not addr.exists(), "qerl serve removes its address file when it stops"


def _rows(n: int = 8):
    prompts = [[3 + (i * 7 + j) % 200 for j in range(5 + i % 3)] for i in range(n)]
    return prompts, [1000 + i for i in range(n)]


def test_served_vllm_repeats_swaps_noises_and_sleeps(served):
    """Bitwise checks use one row at a time: vLLM batches concurrent requests as they arrive, so the
    rows of a batch may share decode steps differently from one call to the next (docs/gpu.md)."""
    from qerl_lib.rollout.client import RemotePolicy, server_asleep

    cfg, layout, url = served
    pol = RemotePolicy(cfg, layout, url)  # checks the checkpoint hash and the backend
    assert pol.engine.info()["backend"] == "vllm"
    prompts, seeds = _rows()
    params = SamplingParams(0.8, 0.95, 24)

    def one(i: int = 3):
        (c,) = pol.generate(prompts[i:i + 1], seeds[i:i + 1], params, batch_size=1)
        return c.token_ids, c.logprobs

    pol.load_adapter(layout.adapter(0), 0)
    batch = pol.generate(prompts, seeds, params, batch_size=8)
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in batch)
    first = one()
    assert one() == first  # a row is a function of its seed

    pol.load_adapter(layout.adapter(1), 1)  # another version: another LoRA on the server
    other = one()
    assert other[1] != first[1]
    names = [m["id"] for m in pol.engine.models() if m.get("parent")]
    assert len(names) == 1 and names[0].startswith("qerl-v1-")

    clean_print = pol.engine.rpc("qerl_norm_info")["fingerprint"]
    pol.set_noise(0.05, 7, 3)
    assert pol.engine.rpc("qerl_norm_info")["fingerprint"] != clean_print
    assert one()[1] != other[1]
    pol.set_noise(0.0, 7, 3)
    assert pol.engine.rpc("qerl_norm_info")["fingerprint"] == clean_print  # sigma 0 restores the clean bits
    assert one() == other

    with server_asleep(layout.root) as slept:  # the server shares this GPU: it sleeps
        assert slept and pol.engine.is_sleeping()
    assert not pol.engine.is_sleeping()
    assert one() == other
