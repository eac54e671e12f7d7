"""fattn.testing: the one reference, accuracy rule, timer and benchmark grids that tests, the benchmark, the tuner
and the regression gate share.

    reference   visible(i, j) -- the mask rule of csrc/mask.h in Python -- and the float64 attention reference
    accuracy    flash-attention's accuracy rule (max|out - ref| <= k * max|out_lowp - ref| + eps)
    timer       CUDA events with the L2 flushed (kernel time), back-to-back batches (end to end), the CPU clock
    grids       the benchmark grids (seeds, fa3, decode, cpu) and FLOP counts
    suite       validate-then-time runs of fattn variants beside torch's SDPA backends (fattn.bench's engine)
    report      tables and JSON / CSV / Markdown files of suite results

Importing it imports neither torch nor numpy; the functions import what the arrays they are given need.
"""
