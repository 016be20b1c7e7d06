"""`benchmarks/train_step.py --mode linears`: the seven linears of one Qwen2.5-7B layer, forward and
input gradient, at `--micro-batches` x (prompt + completion) tokens: cuBLAS BF16 vs the fused Triton
kernels vs plain PyTorch dequantization vs one-kernel Triton dequantization + cuBLAS, with the
measured bf16 matmul ceiling (the CLI and its other modes live in `train_step.py`)."""

from __future__ import annotations

import torch

from benchmarks.train_step import free_gpu, qwen_config, random_nvfp4_linear


def mode_linears(args, device) -> dict:
    import triton

    from qerl_lib.kernels import nvfp4_triton as kt
    from qerl_lib.kernels.nvfp4_backends import make_dequant_backend
    from qerl_lib.kernels.nvfp4_triton import nvfp4_grad_input, nvfp4_matmul
    from qerl_lib.nvfp4_linear import torch_matmul_forward, torch_matmul_grad_input

    cfg = qwen_config(args.shape, None)
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (i, h), "up": (i, h), "down": (h, i)}
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")  # noqa: E731

    def sweep(fn, configs):  # every prefill-regime configuration, autotuner bypassed
        res = {}
        for c in configs[8:]:
            cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            key = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}/w{num_warps}s{num_stages}".format(**cfg)
            try:
                res[key] = round(bench(lambda: fn(cfg)), 4)
            except Exception as e:  # noqa: BLE001 - out of resources
                res[key] = f"{type(e).__name__}"
        return res

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ceiling_ms = bench(lambda: a @ a)
    out = {"bf16_matmul_ceiling_tflops": round(2 * 8192**3 / ceiling_ms / 1e9, 1), "micro_batch": {}}
    del a
    gen = torch.Generator(device=device).manual_seed(0)
    for mb in args.micro_batches:
        m = mb * (args.prompt + args.completion)
        rows, tot = {}, {"bf16": 0.0, "triton": 0.0, "torch": 0.0, "dq": 0.0}
        dq = make_dequant_backend()
        for name, (n, k) in shapes.items():
            lin = random_nvfp4_linear(k, n, False, device, gen)
            p, s, gs = lin.weight_packed, lin.weight_scale, lin.weight_global_scale
            w = lin.dequantized_weight(torch.bfloat16)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            r = {
                "bf16_fwd": bench(lambda: torch.nn.functional.linear(x, w)),
                "bf16_grad": bench(lambda: dy @ w),
                "triton_fwd": bench(lambda: nvfp4_matmul(x, p, s, gs)),
                "triton_grad": bench(lambda: nvfp4_grad_input(dy, p, s, gs)),
                "torch_fwd": bench(lambda: torch_matmul_forward(x, p, s, gs, None)),
                "torch_grad": bench(lambda: torch_matmul_grad_input(dy, p, s, gs)),
                "dq_fwd": bench(lambda: dq.forward(x, p, s, gs, None)),
                "dq_grad": bench(lambda: dq.grad_input(dy, p, s, gs)),
                "dq_dequant_only": bench(lambda: kt.nvfp4_dequantize_triton(p, s, gs, torch.bfloat16)),
            }
            flops = 2 * m * n * k
            r = {key: round(v, 4) for key, v in r.items()}
            with torch.no_grad():  # the autotuned kernels against a float32 reference, beside cuBLAS's error
                ref = x.float() @ w.float().T
                rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
                r["rel_err_fwd"] = {"triton": rel(nvfp4_matmul(x, p, s, gs), ref),
                                    "cublas": rel(torch.nn.functional.linear(x, w), ref)}
                ref = dy.float() @ w.float()
                r["rel_err_grad"] = {"triton": rel(nvfp4_grad_input(dy, p, s, gs), ref), "cublas": rel(dy @ w, ref)}
                del ref
            if args.sweep:
                r["sweep_fwd"] = sweep(lambda c: nvfp4_matmul(x, p, s, gs, config=c), kt.FWD_CONFIGS)
                r["sweep_grad"] = sweep(lambda c: nvfp4_grad_input(dy, p, s, gs, config=c), kt.GRAD_CONFIGS)
            r.update({f"{key}_tflops": round(flops / r[key] / 1e9, 1) for key in list(r)
                      if not key.startswith(("sweep", "rel_err", "dq_dequant"))})
            # bytes the dequantization moves: packed codes + FP8 scales read, bf16 W written
            r["dq_dequant_only_gb_per_s"] = round(n * k * (0.5 + 1 / 16 + 2) / r["dq_dequant_only"] / 1e6, 1)
            r["triton_vs_bf16"] = round((r["triton_fwd"] + r["triton_grad"]) / (r["bf16_fwd"] + r["bf16_grad"]), 3)
            rows[name] = r
            tot["bf16"] += r["bf16_fwd"] + r["bf16_grad"]
            tot["triton"] += r["triton_fwd"] + r["triton_grad"]
            tot["torch"] += r["torch_fwd"] + r["torch_grad"]
            tot["dq"] += r["dq_fwd"] + r["dq_grad"]
            print(f"[linears] mb={mb} {name} {n}x{k}: {r}", flush=True)
            del lin, p, s, gs, w, x, dy
            free_gpu()
        out["micro_batch"][str(mb)] = {
            "tokens": m, "per_linear_ms": rows,
            "layer_fwd_plus_grad_ms": {key: round(v, 3) for key, v in tot.items()},
            "layer_triton_vs_bf16": round(tot["triton"] / tot["bf16"], 3),
            "layer_torch_vs_bf16": round(tot["torch"] / tot["bf16"], 3),
            "layer_dq_vs_bf16": round(tot["dq"] / tot["bf16"], 3),
        }
    try:
        from qerl_lib.kernels.nvfp4_triton import tuned_configs

        out["tuned_configs"] = tuned_configs()
    except Exception:  # noqa: BLE001
        pass
    return out
