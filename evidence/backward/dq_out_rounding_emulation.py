"""CPU emulation of dQ out's rounding (evidence/backward/h100_v3_bwd_dq_out_c912537.md): dQ of one (B=1, H=2) call
summed over 128-key blocks in float32 and rounded once, against the same partials rounded to the dtype and added in
the dtype; errors against float64, and the accuracy rule's eps for gradients.  Run: python3 THIS > ..._cpu.txt."""
import torch, math
torch.manual_seed(0)
def run(S, D, dt, causal=False, H=2):
    q = torch.randn(1, H, S, D).to(dt); k = torch.randn(1, H, S, D).to(dt); v = torch.randn(1, H, S, D).to(dt); do = torch.randn(1, H, S, D).to(dt)
    qd, kd, vd, dod = (x.double() for x in (q, k, v, do))
    sc = 1 / math.sqrt(D)
    s = qd @ kd.transpose(-1, -2) * sc
    if causal: s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float('-inf'))
    p = s.softmax(-1); o = p @ vd
    dp = dod @ vd.transpose(-1, -2); Dr = (dod * o).sum(-1, keepdim=True)
    ds = p * (dp - Dr)
    ref = ds @ kd * sc
    # kernel-like: P, dS in fp32; dS rounded to dt for the dQ GEMM; per 128-key block partial in fp32
    ds32 = ds.float().to(dt).float(); k32 = k.float()
    nkb = (S + 127) // 128
    acc32 = torch.zeros_like(ref, dtype=torch.float32); accl = torch.zeros_like(ref).to(dt)
    for j in range(nkb):
        part = ds32[..., j*128:(j+1)*128] @ k32[:, :, j*128:(j+1)*128] * sc
        acc32 += part
        accl = (accl.float() + part.to(dt).float()).to(dt)
    e32 = (acc32.to(dt).double() - ref).abs(); el = (accl.double() - ref).abs()
    return e32.max().item(), el.max().item(), e32.mean().item(), el.mean().item(), ref.abs().max().item(), dp.abs().max().item()
for dt in (torch.float16, torch.bfloat16):
    for S in (512, 1024):
        for D in (64, 128):
            for c in (False, True):
                m32, ml, a32, al, rm, dpm = run(S, D, dt, c)
                eps = (2**-10 if dt == torch.float16 else 2**-7) * max(rm, dpm)
                print(str(dt)[6:], S, D, c, f"max x{ml/m32:.2f} mean x{al/a32:.2f}  max {ml:.2e} vs eps {eps:.2e}")
