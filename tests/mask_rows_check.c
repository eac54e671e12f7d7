/* mask_rows_check.c -- tests/test_mask.py compiles and runs this: csrc/mask.h's fattn_rows_seeing (closed form)
 * against its contract, scanned row by row from fattn_row_keys: lo is the first row whose visible keys end past j0
 * (sq if none), hi the first row from lo on whose visible keys start past j1 (sq if none).  Prints the number of
 * cases checked, or the first mismatch and exits 1. */
#include <stdint.h>
#include <stdio.h>

#define FATTN_HD static inline
#include "mask.h"

static int check(const fattn_mask *m, int64_t sq, int64_t sk, int64_t j0, int64_t j1) {
    int64_t lo, hi, want_lo = sq, want_hi = sq, klo, khi;
    for (int64_t i = 0; i < sq; i++) {
        fattn_row_keys(m, sq, sk, i, &klo, &khi);
        if (khi > j0) {
            want_lo = i;
            break;
        }
    }
    for (int64_t i = want_lo; i < sq; i++) {
        fattn_row_keys(m, sq, sk, i, &klo, &khi);
        if (klo > j1) {
            want_hi = i;
            break;
        }
    }
    fattn_rows_seeing(m, sq, sk, j0, j1, &lo, &hi);
    if (lo == want_lo && hi == want_hi) return 0;
    printf("mismatch: sq %lld sk %lld causal %d bottom_right %d left %lld right %lld j0 %lld j1 %lld: got [%lld, %lld) "
           "want [%lld, %lld)\n", (long long)sq, (long long)sk, m->causal, m->bottom_right, (long long)m->left,
           (long long)m->right, (long long)j0, (long long)j1, (long long)lo, (long long)hi, (long long)want_lo,
           (long long)want_hi);
    return 1;
}

int main(void) {
    static const int64_t lens[] = {1, 2, 3, 7, 16, 17, 64, 65, 113, 128, 200, 257};
    static const int64_t bounds[] = {-1, 0, 1, 2, 5, 16, 63, 64, 100, 300};
    static const int64_t widths[] = {1, 2, 16, 64, 80, 128};
    const int nl = sizeof lens / sizeof *lens, nb = sizeof bounds / sizeof *bounds, nw = sizeof widths / sizeof *widths;
    long cases = 0;
    for (int a = 0; a < nl; a++)
        for (int c = 0; c < nl; c++)
            for (int br = 0; br < 2; br++)
                for (int l = 0; l < nb; l++)
                    for (int r = 0; r < nb; r++) {
                        const fattn_mask m = {bounds[r] == 0 ? 1 + br : 0, br, bounds[l], bounds[r]};
                        const int64_t sq = lens[a], sk = lens[c];
                        for (int w = 0; w < nw; w++)
                            for (int64_t j0 = 0; j0 < sk; j0 += widths[w]) {
                                const int64_t j1 = (j0 + widths[w] < sk ? j0 + widths[w] : sk) - 1;
                                if (check(&m, sq, sk, j0, j1)) return 1;
                                cases++;
                            }
                    }
    printf("%ld cases\n", cases);
    return 0;
}
