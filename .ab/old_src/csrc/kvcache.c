/* kvcache.c -- the CPU append of new keys and values (kvcache.h). */
#include "kvcache.h"

#include <string.h>

/* Row t of sequence b's new keys (or values) copied to its cache slot. */
static void append_row(const attn_params *s, void *cache, const void *src, int64_t slot, int64_t hk, int64_t sb,
                       int64_t sh, int64_t ss, int64_t src_off) {
    const int64_t e = fattn_elem_bytes(s->dtype);
    char *dst = (char *)cache + (fattn_key_offset(s, slot, sb, ss) + hk * sh) * e;
    memcpy(dst, (const char *)src + src_off * e, (size_t)(s->d * e));
}

void fattn_cpu_append_kv(const attn_params *p, const fattn_append *a) {
    for (int64_t b = 0; b < p->b; b++) {
        attn_params s;
        fattn_seq_params(p, b, &s);
        const int64_t first = p->seqused_k[b];
        for (int64_t t = 0; t < a->s_new; t++)
            for (int64_t hk = 0; hk < p->h_kv; hk++) {
                append_row(&s, (void *)s.k, a->k_new, first + t, hk, p->k_stride_b, p->k_stride_h, p->k_stride_s,
                           b * a->kn_stride_b + hk * a->kn_stride_h + t * a->kn_stride_s);
                append_row(&s, (void *)s.v, a->v_new, first + t, hk, p->v_stride_b, p->v_stride_h, p->v_stride_s,
                           b * a->vn_stride_b + hk * a->vn_stride_h + t * a->vn_stride_s);
            }
    }
}
