"""One fattn v3 forward and one torch cudnn SDPA forward per shape (each after a warm-up call), for Nsight Compute's
memory counters side by side -- the run behind evidence/bench/h100_v3_fwd_memory_vs_cudnn_5ce6d08.md:

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        --csv --page raw --print-units base python3 bench/ncu_memory_vs_cudnn.py > out.csv
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402

for shape in ((32, 16, 512, 128), (32, 32, 512, 64), (16, 16, 1024, 128)):
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    fattn.attention(q, k, v, variant="v3")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    fattn.attention(q, k, v, variant="v3")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
