"""Micro-benchmark: stream an (N, K) FP8 matrix through a decode GEMM (M=16 rows of x), four
ways of turning the weight tile into a dot operand. Prints TB/s of weight bytes, checks answers."""
import sys
import torch
import triton
import triton.language as tl

BF16 = 0
TO = 1        # w.to(bf16), product scaled (current FP8_SCALE_PRODUCT)
DEQ = 2       # (w.to(f32) * scale).to(bf16) (current FP8_DEQUANT)
ASM = 3       # integer conversion in PTX, product scaled


@triton.jit
def e4m3_to_bf16(w):
    """e4m3 bytes (uint8) → bf16, exactly, by integer ops (no conversion unit): each byte's
    sign to bit 15, its 7 exponent+mantissa bits to bits 10..4 (w·2^-120, a bf16 subnormal for
    e4m3 subnormals), then ×2^120 in a bf16x2 fma (subnormals supported)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, t, s, z, c, m;
        mov.b32 z, 0;
        mov.b32 c, 0x7B807B80;
        mov.b32 m, 0x80008000;
        prmt.b32 lo, $2, z, 0x1404;
        prmt.b32 hi, $2, z, 0x3424;
        shr.b32 t, lo, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 s, lo, 0x80008000;
        or.b32 t, t, s;
        fma.rn.bf16x2 $0, t, c, m;
        shr.b32 t, hi, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 s, hi, 0x80008000;
        or.b32 t, t, s;
        fma.rn.bf16x2 $1, t, c, m;
        }""",
        constraints="=r,=r,r",
        args=[w],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def gemv(x_ptr, w_ptr, s_ptr, out_ptr, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptr + rows[:, None] * K + k0 + offs_k[None, :])
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k0 + offs_k[:, None])
        if MODE == 0:
            acc = tl.dot(x, w, acc)
        else:
            scale = tl.load(s_ptr + (cols // 128) * (K // 128) + k0 // 128)
            if MODE == 1:
                acc += tl.dot(x, w.to(tl.bfloat16)) * scale[None, :]
            elif MODE == 2:
                acc = tl.dot(x, (w.to(tl.float32) * scale[None, :]).to(tl.bfloat16), acc)
            else:
                wb = e4m3_to_bf16(w.to(tl.uint8, bitcast=True))
                acc += tl.dot(x, wb) * scale[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


def run(n: int, k: int, modes, block_n=16, block_k=128, stages=4) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    wf = torch.randn(n, k, device=dev) * 0.05
    s = wf.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    q = (wf / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    wb = deq.to(torch.bfloat16)
    ref = x.double() @ deq.double().T
    out = torch.empty(16, n, device=dev)
    for mode in modes:
        w = wb if mode == BF16 else q
        fn = lambda: gemv[(n // block_n,)](x, w, s, out, n, k, mode, 16, block_n, block_k, stages)
        fn()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ms = triton.testing.do_bench(fn, return_mode="median")
        print(f"N={n} K={k} bn={block_n} bk={block_k} st={stages} mode={mode}: {ms*1e3:8.1f} us "
              f"{w.numel() * w.element_size() / ms / 1e9:6.2f} TB/s err={err:.2e}", flush=True)


if __name__ == "__main__":
    # exhaustive exactness of the integer conversion over all 256 codes (NaN codes aside)
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    @triton.jit
    def conv(src, dst, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(dst + o, e4m3_to_bf16(tl.load(src + o)))
    got = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    conv[(1,)](codes, got, 256)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    ok = (got.view(torch.int16) == want.view(torch.int16)) | want.isnan()
    print("exact on all non-NaN codes:", bool(ok.all()), "mismatches:", codes[~ok].tolist())
    for n, k in ((16384, 4096), (4096, 2048), (2816, 2048)):
        for bn, bk, st in ((16, 128, 4), (32, 128, 4), (64, 128, 4)):
            run(n, k, (BF16, TO, DEQ, ASM), bn, bk, st)
