"""Ping-pong w2 prototype against the shipped Hopper w2 kernel: same inputs, answers compared
(with each other and, on sampled rows, against float64), times side by side."""
import sys

import torch, triton
from kernels.align import align_pairs
from kernels import hopper_w2
from kernels.synthetic import random_routing
from kernels.prototypes import hopper_w2_pingpong as pp

SHAPES = {"qwen3": (128, 2048, 768, 8), "mixtral": (8, 4096, 14336, 2), "gpt_oss": (32, 2880, 2880, 4),
          "qwen3_235b": (128, 4096, 1536, 8)}
dev = torch.device("cuda")
SYNC = torch.cuda.synchronize
for name, (E, H, I, k) in SHAPES.items():
  if len(sys.argv) > 1 and name != sys.argv[1]:
    continue
  for M in map(int, (sys.argv[2] if len(sys.argv) > 2 else '512,4096').split(',')):
        torch.manual_seed(0)
        routing = random_routing(M, E, k, device=dev, seed=M)
        w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
        S, R = 4, 16
        token_slots = (torch.arange(M, device=dev) % S).to(torch.int32)
        enabled = torch.ones(S, dtype=torch.int32, device=dev)
        al = align_pairs(routing.topk_ids, E, 128, token_slots, enabled)
        rows = al.sorted_pair_ids.numel()
        act = torch.randn(rows, I, device=dev).to(torch.bfloat16)
        xa = (torch.randn(rows, R, device=dev) * 0.1).to(torch.bfloat16)
        lb = (torch.randn(S, E, H, R, device=dev) * 0.1).to(torch.bfloat16)
        tw = routing.topk_weights.contiguous()
        for lora in (False, True):
            lo = (xa, lb, al.row_slots) if lora else (None, None, None)
            outs, times = {}, {}
            variants = {"shipped": lambda o: hopper_w2.w2_launch(act, w2, None, tw, al, *lo, False, o)}
            for st, regs in ((3, 232), (4, 232), (5, 232)):
                variants[f"pingpong s{st}"] = (lambda st, regs: lambda o: pp.w2_pingpong_launch(act, w2, None, tw, al, *lo, False, o, st, regs))(st, regs)
            for label, make in variants.items():
                out = torch.zeros(M * k, H, device=dev, dtype=torch.bfloat16)
                try:
                    launch = make(out)
                    launch(dev); SYNC()
                except Exception as exc:
                    print(name, M, lora, label, "FAILED", type(exc).__name__, str(exc)[:200]); continue
                outs[label] = out.clone()
                times[label] = triton.testing.do_bench(lambda: launch(dev), return_mode="median") * 1e3
            ref = outs["shipped"]
            # float64 reference on 64 sampled valid rows
            ids = al.sorted_pair_ids.long()
            row_experts = torch.repeat_interleave(al.block_experts.long(), 128)
            valid = torch.nonzero((row_experts >= 0) & (ids >= 0)).flatten()
            pick = valid[torch.randperm(valid.numel(), device=dev)[:64]]
            exp = row_experts[pick]
            pair = ids[pick]
            want = torch.einsum("ri,rhi->rh", act[pick].double(), w2[exp].double())
            if lora:
                s = al.row_slots[pick].long()
                want += torch.einsum("rk,rhk->rh", xa[pick].double(), lb[s, exp].double())
            want *= tw.flatten()[pair].double()[:, None]
            line = [f"{name} M={M} lora={int(lora)}"]
            for label, out in outs.items():
                err = ((out[pair].double() - want).norm() / want.norm()).item()
                same = (out == ref).all().item()
                line.append(f"{label} {times[label]:.1f} us err {err:.1e} {'=' if same else 'diff %.1e' % (out.float() - ref.float()).abs().max().item()}")
            print(" | ".join(line), flush=True)
        del w2, act
        torch.cuda.empty_cache()
