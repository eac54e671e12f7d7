/* mask.h -- which keys a query sees: the one rule every kernel, scheduler, planner and the CPU backend ask.
 *
 * A query row i of a sequence of sq queries and sk keys sits at key position pos(i) = i + (sk - sq when the call is
 * bottom-right aligned, else 0) and sees the keys j with
 *
 *     pos(i) - left <= j <= pos(i) + right,     0 <= j < sk,
 *
 * left or right < 0 meaning unbounded on that side.  causal is right = 0 (top-left: torch SDPA's is_causal; bottom-
 * right: flash-attention's), a sliding window sets left (and right), a dense call sets neither.  Both bounds grow
 * with i, so a block of consecutive rows sees the union [lo(first row), hi(last row)) and every one of its rows sees
 * the intersection [lo(last row), hi(first row)): that is what fattn_key_span reports, in key blocks of bc keys.
 *
 * Plain C, usable on the host, in CUDA kernels and under NVRTC; included by fattn.h (which defines int64_t and
 * FATTN_HD there).
 */
#ifndef FATTN_MASK_H
#define FATTN_MASK_H

typedef enum { FATTN_CAUSAL_NONE = 0, FATTN_CAUSAL_TOP_LEFT = 1, FATTN_CAUSAL_BOTTOM_RIGHT = 2 } fattn_causal;

typedef struct fattn_mask {
    int causal;          /* fattn_causal as the caller asked; causal calls have right = 0 */
    int bottom_right;    /* 1: pos(i) = i + sk - sq (per sequence), 0: pos(i) = i */
    int64_t left;      /* keys before pos(i) a row sees; < 0: all of them */
    int64_t right;     /* keys after pos(i) a row sees; < 0: all of them */
} fattn_mask;

/* Key position of query row i. */
FATTN_HD int64_t fattn_row_pos(const fattn_mask *m, int64_t sq, int64_t sk, int64_t i) {
    return i + (m->bottom_right ? sk - sq : 0);
}

/* The rule itself: a row at key position pos sees keys j0 + [*lo, *hi) of the n keys from j0 on (0 <= lo <= hi <= n;
 * hi == lo: none).  Kernels ask it per key block (j0, n = Bc) in this relative form, which keeps their registers. */
FATTN_HD void fattn_visible(const fattn_mask *m, int64_t sk, int64_t pos, int64_t j0, int64_t n, int64_t *lo,
                            int64_t *hi) {
    const int64_t p = pos - j0, kc = sk - j0;
    int64_t h = m->right < 0 ? kc : p + m->right + 1;
    h = h < kc ? h : kc;
    h = h < 0 ? 0 : h > n ? n : h;
    const int64_t l = m->left < 0 ? 0 : p - m->left;
    *lo = l < 0 ? 0 : l > h ? h : l;
    *hi = h;
}

/* Keys [*lo, *hi) visible from query row i. */
FATTN_HD void fattn_row_keys(const fattn_mask *m, int64_t sq, int64_t sk, int64_t i, int64_t *lo, int64_t *hi) {
    fattn_visible(m, sk, fattn_row_pos(m, sq, sk, i), 0, sk, lo, hi);
}

/* The same rule for a kernel's key block, in 32-bit arithmetic that keeps registers free: the rows i_first + delta
 * (0 <= delta < 2^20) of one thread against keys [j0, j0 + n) (n <= 2^20).  Row i_first + delta sees columns
 * [lo, hi) of the block, with lo = clamp(pl + delta, 0, n) and hi = clamp(min(pr + delta, kc), 0, n): pl, pr and kc
 * are pos - left - j0, pos + right + 1 - j0 and sk - j0 for the first row, saturated at +-2^30 (exact: a saturated
 * value clamps to the same 0 or n). */
typedef struct {
    int pl, pr, kc;
} fattn_block_mask;

FATTN_HD int fattn_sat30(int64_t x) { return x < -(1 << 30) ? -(1 << 30) : x > (1 << 30) ? (1 << 30) : (int)x; }

FATTN_HD fattn_block_mask fattn_block_mask_of(const fattn_mask *m, int64_t sq, int64_t sk, int64_t i_first, int64_t j0) {
    const int64_t p = fattn_row_pos(m, sq, sk, i_first) - j0;
    fattn_block_mask b;
    b.pl = m->left < 0 ? -(1 << 30) : fattn_sat30(p - m->left);
    b.pr = m->right < 0 ? (1 << 30) : fattn_sat30(p + m->right + 1);
    b.kc = fattn_sat30(sk - j0);
    return b;
}

FATTN_HD void fattn_block_cols(const fattn_block_mask *b, int delta, int n, int *lo, int *hi) {
    int h = b->pr + delta < b->kc ? b->pr + delta : b->kc, l = b->pl + delta;
    h = h < 0 ? 0 : h > n ? n : h;
    *lo = l < 0 ? 0 : l > h ? h : l;
    *hi = h;
}

/* One element of the same rule, for kernels that test each element of a fragment: row i_first + delta sees column col
 * (0 <= col < n) of the block iff lo <= col < hi above, that is pl <= col - delta < pr and col < kc. */
FATTN_HD int fattn_block_sees(const fattn_block_mask *b, int delta, int col) {
    const int diag = col - delta;
    return diag >= b->pl && diag < b->pr && col < b->kc;
}

/* The query rows that see some key of [j0, j1] (0 <= j0 <= j1 < sk): rows [*lo, *hi) (empty when lo >= hi).  Both
 * ends of a row's visible keys grow with the row (above), so the rows whose last visible key reaches j0 are a suffix
 * -- from row j0 - right - off on, off = pos(i) - i; every row without a right bound -- and the rows whose first
 * visible key is at most j1 a prefix -- up to row j1 + left - off; every row without a left bound --: the two
 * thresholds of fattn_row_keys' rule, clamped to [0, sq] (the first bounding the second from below).  In closed form
 * because the bisections over the rows it replaced cost each dK/dV block of the backward about 3 us at its start on
 * an H100 (bench/bwd_probe.py); tests/test_mask.py checks it against a scan of fattn_row_keys.  A row inside the
 * range may still see none of [j0, j1] (an empty window): the edge-block mask handles it. */
FATTN_HD void fattn_rows_seeing(const fattn_mask *m, int64_t sq, int64_t sk, int64_t j0, int64_t j1, int64_t *lo,
                               int64_t *hi) {
    const int64_t off = fattn_row_pos(m, sq, sk, 0);
    int64_t a = j0 >= sk ? sq : m->right < 0 ? 0 : j0 - m->right - off;
    a = a < 0 ? 0 : a > sq ? sq : a;
    int64_t b = m->left < 0 ? sq : j1 + m->left + 1 - off;
    b = b < a ? a : b > sq ? sq : b;
    *lo = a;
    *hi = b;
}

/* The key blocks (of bc keys: block n holds keys [n bc, (n + 1) bc)) that query rows [i0, i0 + rows) of the sequence
 * see, in order n_min <= n_full_min <= n_full_max <= n_max:
 *   [n_min, n_max)           blocks some row sees (the rest are never loaded)
 *   [n_full_min, n_full_max) blocks every row sees whole: no mask needed
 * so blocks [n_min, n_full_min) and [n_full_max, n_max) are the masked edges.  Rows past sq count as absent. */
typedef struct {
    int64_t n_min, n_full_min, n_full_max, n_max;
    int64_t k_end; /* no row sees key k_end or later (loads may zero-fill from there) */
} fattn_span;

FATTN_HD fattn_span fattn_key_span(const fattn_mask *m, int64_t sq, int64_t sk, int64_t i0, int64_t rows,
                                   int64_t bc) {
    fattn_span s = {0, 0, 0, 0, 0};
    const int64_t i1 = (i0 + rows < sq ? i0 + rows : sq) - 1; /* last row present */
    if (i1 < i0) return s;
    int64_t lo0, hi0, lo1, hi1;
    fattn_row_keys(m, sq, sk, i0, &lo0, &hi0);
    fattn_row_keys(m, sq, sk, i1, &lo1, &hi1);
    if (hi1 <= lo0) return s; /* no row sees a key */
    s.k_end = hi1;
    s.n_min = lo0 / bc;
    s.n_max = (hi1 + bc - 1) / bc;
    int64_t fmin = (lo1 + bc - 1) / bc, fmax = hi0 / bc;
    fmin = fmin < s.n_min ? s.n_min : fmin > s.n_max ? s.n_max : fmin;
    fmax = fmax < fmin ? fmin : fmax > s.n_max ? s.n_max : fmax;
    s.n_full_min = fmin;
    s.n_full_max = fmax;
    return s;
}

#endif
