"""Micro-benchmark: a 128-row-block GEMM (x (M, K) bf16 · W (N, K)ᵀ, W FP8 with 128x128 block
scales), the W8A16 dequantising loop as shipped (converted tile → shared memory → wgmma B)
against the same with operands swapped (converted tile as wgmma's register A operand,
accumulating the transposed product), beside bf16 weights. Prints TFLOP/s, checks answers."""
import torch
import triton
import triton.language as tl


@triton.jit
def gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if MODE == 4:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if MODE == 4:
            xt = tl.load(x_ptr + rows[None, :] * K + k0 + offs_k[:, None])  # (BK, BM)
            wn = tl.load(w_ptr + cols[:, None] * K + k0 + offs_k[None, :])  # (BN, BK)
            scale = tl.load(s_ptr + (cols // 128) * (K // 128) + k0 // 128)
            wd = (wn.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
            acc_t = tl.dot(wd, xt, acc_t)
        else:
            x = tl.load(x_ptr + rows[:, None] * K + k0 + offs_k[None, :])
            w = tl.load(w_ptr + cols[None, :] * K + k0 + offs_k[:, None])  # (BK, BN)
            if MODE == 0:
                acc = tl.dot(x, w, acc)
            else:
                scale = tl.load(s_ptr + (cols // 128) * (K // 128) + k0 // 128)
                acc = tl.dot(x, (w.to(tl.float32) * scale[None, :]).to(tl.bfloat16), acc)
    if MODE == 4:
        acc = acc_t.T
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


def run(m, n, k, configs):
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    wf = torch.randn(n, k, device=dev) * 0.05
    s = wf.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q = (wf / full).to(torch.float8_e4m3fn)
    deq = (q.float() * full).to(torch.bfloat16)
    ref = x.float() @ deq.float().T
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    for mode, bm, bn, bk, warps, stages in configs:
        w = deq if mode == 0 else q
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        fn = lambda: gemm[grid](x, w, s, out, m, n, k, mode, bm, bn, bk, 8, num_warps=warps,
                                num_stages=stages)
        try:
            fn()
        except Exception as exc:  # resources
            print(f"M={m} N={n} K={k} mode={mode} {bm}x{bn}x{bk} w{warps} s{stages}: {type(exc).__name__} {str(exc)[:80]}")
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = triton.testing.do_bench(fn, return_mode="median")
        print(f"M={m} N={n} K={k} mode={mode} {bm}x{bn}x{bk} w{warps} s{stages}: {ms*1e3:8.1f} us "
              f"{2*m*n*k/ms/1e9:6.1f} TFLOP/s err={err:.2e}", flush=True)


if __name__ == "__main__":
    cfgs = [(0, 128, 128, 64, 8, 4), (0, 128, 128, 64, 4, 4)]
    for bn, bk, warps, stages in ((64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3)):
        cfgs += [(2, 128, bn, bk, warps, stages), (4, 128, bn, bk, warps, stages)]
    for m, n, k in ((8192, 1536, 2048), (8192, 2048, 768), (8192, 4096, 4096)):
        run(m, n, k, cfgs)
