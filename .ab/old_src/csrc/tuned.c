/* tuned.c -- the tuned-config table (tuned.h). */
#include "tuned.h"

static int same_key(const fattn_tuned_entry *a, const fattn_tuned_entry *b) {
    return a->variant == b->variant && a->device == b->device && a->dtype == b->dtype && a->head_dim == b->head_dim &&
           a->causal == b->causal && a->bucket == b->bucket;
}

const fattn_tuned_entry *fattn_tuned_find(const fattn_tuned *t, int variant, int device, const attn_params *p) {
    if (!t || !t->n) return NULL;
    const fattn_tuned_entry key = {variant, device, (int)p->dtype, (int)p->d, p->mask.causal != 0,
                                   fattn_seq_bucket(p->sq, p->sk), 0, {0, 0, 0}};
    for (int i = 0; i < t->n; i++)
        if (same_key(&t->e[i], &key)) return &t->e[i];
    return NULL;
}

fattn_status fattn_tuned_set(fattn_tuned *t, const fattn_tuned_entry *e) {
    if (e->dtype < FATTN_F32 || e->dtype > FATTN_BF16 || e->head_dim < 8 || e->head_dim > FATTN_MAX_HEADDIM ||
        e->head_dim % 8 || e->bucket < 0 || e->bucket >= FATTN_SEQ_BUCKETS || e->device < 0)
        return FATTN_FAIL(FATTN_ERR_INVALID, "tuned entry: dtype, head dim, bucket or device out of range");
    for (int i = 0; i < t->n; i++)
        if (same_key(&t->e[i], e)) {
            t->e[i] = *e;
            return FATTN_OK;
        }
    if (t->n >= FATTN_TUNED_MAX) return FATTN_FAIL(FATTN_ERR_INVALID, "tuned table full (%d entries)", FATTN_TUNED_MAX);
    t->e[t->n++] = *e;
    return FATTN_OK;
}
