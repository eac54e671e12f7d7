"""sdpa_host_probe.py -- the host cost of torch's own decode-like call (scaled_dot_product_attention, one query token
over a contiguous cache, enable_gqa), issue time and back-to-back events per call, beside bench/varlen_host_probe.py --kvcache."""
import time, statistics, torch, torch.nn.functional as F
B, H, HK, S, D = 8, 32, 8, 4096, 128
q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
k = torch.randn(B, HK, S, D, device="cuda", dtype=torch.float16)
for name, be in (("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION), ("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                 ("efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)):
    try:
        with torch.nn.attention.sdpa_kernel(be):
            for _ in range(5): F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
            torch.cuda.synchronize(); iss = []
            for r in range(3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); t0 = time.perf_counter()
                for _ in range(50): F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
                t1 = time.perf_counter(); e1.record(); torch.cuda.synchronize()
                iss.append(((t1 - t0) * 1e6 / 50, e0.elapsed_time(e1) * 1e3 / 50))
            print(f"torch sdpa {name:<10} decode B={B} H={H} Hkv={HK} S={S} D={D}: issue us/call, back to back us/call:",
                  ", ".join(f"({a:.1f}, {b:.1f})" for a, b in iss))
    except Exception as e:
        print(name, "failed:", str(e)[:100])
