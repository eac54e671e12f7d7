/* v3_plan.c -- v3's host side in plain C: whether v3 takes a call (TMA can address its tensors, positive scale),
 * which config it runs, the persistent grid and the tile order. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/variants.h"
#include "v3_addr.h"
#include "v3_configs.h"
#include "v3_schedule.h"

static const v3_config v3_table[V3_NCONFIGS] = {
#define ROW(dp, bc, st, cwg, pp) {dp, bc, st, cwg, pp},
    V3_TABLE(ROW)
#undef ROW
};

typedef struct {
    v3_config cfg;
    int causal;
    int64_t sk_min, sk_max;
    int waves_min, waves_max; /* > 0: the bucket default's tiles at least / at most this many per SM */
} v3_rule;
static const v3_rule v3_rules[V3_NRULES + 1] = {
#define RULE(dp, bc, st, cwg, pp, causal, sk_min, sk_max, wmin, wmax)                                                 \
    {{dp, bc, st, cwg, pp}, causal, sk_min, sk_max, wmin, wmax},
    V3_RULES(RULE)
#undef RULE
    {{0, 0, 0, 0, 0}, -1, 0, 0, 0, 0}};

static const v3_config v3_seq_table[V3_NDEFAULTS] = {
#define ROW(dp, bc, st, cwg, pp) {dp, bc, st, cwg, pp},
    V3_SEQ_CONFIGS(ROW)
#undef ROW
};

static int v3_index_of(const v3_config *c) {
    for (int i = 0; i < V3_NCONFIGS; i++)
        if (!memcmp(&v3_table[i], c, sizeof *c)) return i;
    return -1;
}

int fattn_v3_seq_config(int dp) { return v3_index_of(&v3_seq_table[v3_bucket(dp)]); }

int fattn_configs_v3(int i, fattn_config_info *out) {
    static const char *names[] = {"dp", "bc", "stages", "consumers", "pingpong"};
    if (i < 0 || i >= V3_NCONFIGS) return 0;
    const v3_config *c = &v3_table[i];
    memset(out, 0, sizeof *out);
    int rule = 0;
    for (int r = 0; r < V3_NRULES; r++) rule |= !memcmp(&v3_rules[r].cfg, c, sizeof *c);
    out->role = i < V3_NDEFAULTS ? "default" : rule ? "rule" : "sweep";
    out->dtypes = 1 << FATTN_F16 | 1 << FATTN_BF16;
    out->smem = V3_SMEM(c->dp, c->bc, c->stages, c->consumers);
    const int64_t values[] = {c->dp, c->bc, c->stages, c->consumers, c->pingpong};
    out->n = 5;
    for (int k = 0; k < 5; k++) {
        out->names[k] = names[k];
        out->values[k] = values[k];
    }
    return 1;
}

fattn_status fattn_check_config_v3(const int64_t *values, int n, int d, int dtype, size_t smem_limit) {
    (void)values; (void)n; (void)d; (void)dtype; (void)smem_limit;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 runs only its compiled configs (_C._dev.configs('v3'))");
}

/* ---- which calls v3 takes --------------------------------------------------------------------------------------- */

/* K and V's head or batch dimension: TMA-addressable, or broadcast (stride 0 in both: expanded K/V, read as one). */
static int kv_dim_ok(int64_t ks, int64_t vs, int64_t size) {
    return (ks == 0 && vs == 0) || (stride_ok(ks, size) && stride_ok(vs, size));
}

/* 1 if TMA can address every tensor of p: 16-byte aligned bases, positive strides a multiple of 16 bytes (a size-1
 * dimension's stride does not matter; K/V may broadcast heads or batch), 32-bit coordinates.  A paged cache's K / V
 * are maps over the pools (rows of a page, heads, pages). */
static int tma_ok(const attn_params *p) {
    /* packed batches: one batch of total_q / total_k rows */
    const int64_t bq = p->cu_seqlens_q ? 1 : p->b, rq = p->cu_seqlens_q ? p->total_q : p->sq;
    const int64_t rk = p->cu_seqlens_k ? p->total_k : p->block_table ? p->page_size : p->sk;
    const int64_t kvb = p->block_table ? p->num_pages : p->b; /* (a pool of no pages has no map) */
    return aligned16(p->q) && aligned16(p->k) && aligned16(p->v) && aligned16(p->o) && stride_ok(p->q_stride_s, rq) &&
           stride_ok(p->q_stride_h, p->h) && stride_ok(p->q_stride_b, bq) && stride_ok(p->k_stride_s, rk) &&
           stride_ok(p->v_stride_s, rk) && kv_dim_ok(p->k_stride_h, p->v_stride_h, p->h_kv) &&
           kv_dim_ok(p->k_stride_b, p->v_stride_b, kvb) && (!p->block_table || kvb >= 1) && kvb <= 0x7fffffff &&
           stride_ok(p->o_stride_s, rq) &&
           stride_ok(p->o_stride_h, p->h) && stride_ok(p->o_stride_b, bq) && rq <= 0x7fffffff && rk <= 0x7fffffff &&
           p->h <= 0x7fffffff && p->b <= 0x7fffffff;
}

/* Where v3 is the default on sm_90: more than 64 query rows (decode-like calls go to v2's split-KV). */
int fattn_prefer_v3(const attn_params *p) { return p->sq > 64; }

/* An explicit config (checked), else the first of V3_RULES that matches the call, else its bucket's default. */
static fattn_status v3_choose(const attn_params *p, const fattn_overrides *ov, int sm_count, int *index) {
    /* a softcap or ALiBi: kernels of their own for the defaults; per-sequence lengths: V3_SEQ_CONFIGS (with mods) */
    const int dp = fattn_head_dim_bucket(p->d), seq = p->cu_seqlens_q || p->seqused_k;
    const int own = fattn_score_mods(p) || seq;
    const int seq_index = fattn_v3_seq_config(dp);
    if (ov->config >= 0) {
        if (ov->config >= V3_NCONFIGS)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d out of range [0, %d)", ov->config, V3_NCONFIGS);
        if (seq && ov->config != seq_index)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d has no kernel for per-sequence lengths (config %d "
                              "does)", ov->config, seq_index);
        if (!seq && own && ov->config >= V3_NDEFAULTS)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d has no softcap / ALiBi kernel (configs 0-%d do)",
                              ov->config, V3_NDEFAULTS - 1);
        if (v3_table[ov->config].dp != dp)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d is for head dims in the %d bucket", ov->config,
                              v3_table[ov->config].dp);
        *index = ov->config;
        return FATTN_OK;
    }
    *index = seq ? seq_index : v3_bucket(dp); /* the defaults come first, in bucket order */
    const int64_t default_br = 64 * v3_table[v3_bucket(dp)].consumers;
    const int64_t default_tiles = (p->sq + default_br - 1) / default_br * p->b * p->h;
    for (int r = 0; r < V3_NRULES && !own; r++) {
        const v3_rule *u = &v3_rules[r];
        if (u->cfg.dp == dp && u->causal == (p->mask.causal != 0) && p->sk >= u->sk_min && p->sk <= u->sk_max &&
            (u->waves_min <= 0 || default_tiles >= (int64_t)u->waves_min * sm_count) &&
            (u->waves_max <= 0 || default_tiles <= (int64_t)u->waves_max * sm_count)) {
            *index = v3_index_of(&u->cfg);
            break;
        }
    }
    return *index >= 0 ? FATTN_OK : FATTN_FAIL(FATTN_ERR_INVALID, "a V3_RULES config is not in V3_TABLE");
}

/* ---- the tile order ------------------------------------------------------------------------------------------- */

/* The busiest SM's work over the mean when `grid` persistent blocks walk the tiles in order `group`
 * (v3_tile_index's zig-zag rounds; a tile costs its key blocks plus one for its prologue and epilogue), over the n
 * SMs it spans.  With several blocks per SM (one consumer) an SM's load is its blocks' together -- block x taken to
 * share SM x % n with x + n, ... -- since a block that finishes early leaves its SM to the others: counted per
 * block, a grid of three blocks per SM read 5-8% less balanced head by head at D=64 causal 1k-4k and went
 * heads-fastest, 1.3-1.7x slower than head by head (evidence/bench/h100_v3_three_blocks_2c94c1b.md). */
static double v3_imbalance(const attn_params *p, int br, int bc, int64_t grid, int64_t n, int64_t group, int split,
                           int64_t *load) {
    const int64_t ntiles = v3_ntiles(p, br); /* n: the SMs the grid spans, load[n] */
    int64_t total = 0, most = 0;
    for (int64_t x = 0; x < n; x++) load[x] = 0;
    for (int64_t k = 0; k * grid < ntiles; k++)
        for (int64_t x = 0; x < grid; x++) {
            const int64_t t = v3_tile_index(k, x, grid);
            if (t < ntiles) { /* a split tail's blocks are shared out over the br / 64 consumers */
                const v3_tile w = v3_tile_of(p, br, bc, t, group, split);
                load[x % n] += (w.split ? (w.nblocks + br / 64 - 1) / (br / 64) : w.nblocks) + 1;
            }
        }
    for (int64_t x = 0; x < n; x++) {
        total += load[x];
        most = load[x] > most ? load[x] : most;
    }
    return total > 0 ? (double)most * n / total : 1.0;
}

/* Head by head (1), for K and V reuse in L2 -- measured on the H100 at S = 512-2k: 1.1-1.5x faster than
 * heads-fastest; unless the call is masked and the static schedule would then be more than 5% less balanced than
 * heads-fastest (b * h) (S = 16k causal, D = 128: a 1.54x busiest block by the replay, 1.58x slower measured).  The
 * replay runs once per shape (a few recent ones are remembered) and only for grids of at most 2^20 tiles; larger
 * masked calls take heads-fastest. */
#define V3_ORDER_MEMO 8
typedef struct {
    int64_t sq, sk, bh, grid, sms, left, right;
    int br, bc, bottom_right, split;
    int64_t group;
} v3_order_memo;
static v3_order_memo v3_memo[V3_ORDER_MEMO];
static int v3_memo_next;
static pthread_mutex_t v3_memo_lock = PTHREAD_MUTEX_INITIALIZER;

static int memo_matches(const v3_order_memo *m, const attn_params *p, int64_t nbh, int br, int bc, int64_t grid,
                        int64_t sms, int split) {
    return m->group && m->sq == p->sq && m->sk == p->sk && m->bh == nbh && m->grid == grid && m->sms == sms &&
           m->br == br && m->bc == bc && m->left == p->mask.left && m->right == p->mask.right &&
           m->bottom_right == p->mask.bottom_right && m->split == split;
}

static int64_t v3_order(const attn_params *p, int br, int bc, int64_t grid, int64_t sms, int split) {
    const int64_t nbh = p->b * p->h < INT32_MAX ? p->b * p->h : INT32_MAX; /* a group of >= b * h: one group */
    const int64_t ntiles = v3_ntiles(p, br);
    const int masked = p->mask.left >= 0 || p->mask.right >= 0;
    if (!masked || nbh == 1) return 1;
    if (ntiles > (1 << 20)) return nbh;
    int64_t group = 0;
    pthread_mutex_lock(&v3_memo_lock);
    for (int i = 0; i < V3_ORDER_MEMO && !group; i++)
        if (memo_matches(&v3_memo[i], p, nbh, br, bc, grid, sms, split)) group = v3_memo[i].group;
    pthread_mutex_unlock(&v3_memo_lock);
    if (group) return group;
    const int64_t n = sms > 0 && sms < grid ? sms : grid; /* the SMs the grid spans */
    int64_t *load = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    if (!load) return nbh;
    const double by_head = v3_imbalance(p, br, bc, grid, n, 1, split, load);
    const double by_block = v3_imbalance(p, br, bc, grid, n, nbh, split, load);
    free(load);
    group = by_head <= 1.05 * by_block ? 1 : nbh;
    const v3_order_memo m = {p->sq, p->sk, nbh, grid, sms, p->mask.left, p->mask.right, br, bc, p->mask.bottom_right,
                             split, group};
    pthread_mutex_lock(&v3_memo_lock);
    v3_memo[v3_memo_next] = m;
    v3_memo_next = (v3_memo_next + 1) % V3_ORDER_MEMO;
    pthread_mutex_unlock(&v3_memo_lock);
    return group;
}

/* ---- split tails ------------------------------------------------------------------------------------------------ */

/* Split tails (v3_schedule.h): where a head's last query block holds at most 64 rows, the dense kernels of three
 * consumers share its key blocks out over the consumers -- else two of them compute rows that do not exist
 * through the whole tile.  The rule takes them on unmasked calls only: a masked tail is the head's longest tile
 * (causal) or no shorter than the others, and on an H100 splitting causal ones ran 0.92-0.97x (D=64, 4k and 16k).
 * Overrides: splits 1 turns it off, 0 leaves it to the rule, the config's consumer count forces it wherever the
 * kernel can (masked calls too); v3 does not take other counts, nor splits where it cannot (fattn's own choice of
 * variant then runs one that does: v2). */
static fattn_status v3_split_tails(const attn_params *p, const v3_config *c, int asked, int *split) {
    const int br = 64 * c->consumers, tail = (int)(p->sq % br);
    const int can = c->consumers == 3 && !p->cu_seqlens_q && !p->seqused_k && tail > 0 && tail <= 64;
    *split = 0;
    if (asked == 1) return FATTN_OK;
    if (asked > 1 && (asked != c->consumers || !can))
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 splits only a head's last query block (at most 64 of its %d "
                          "rows) over its %d consumers, on dense calls of three: splits=%d does not apply here (0 or 1 "
                          "do)", br, c->consumers, asked);
    *split = can && (asked > 1 || (p->mask.left < 0 && p->mask.right < 0));
    return FATTN_OK;
}

/* Short tails: with three consumers a head's last query block is shorter than the others where it holds at most
 * 128 rows -- split (at most 64 rows: each consumer a third of the key blocks, then the merge) or with one consumer
 * idle (v3_fwd_kernel.cuh: it only takes its turns) -- and a grid of G blocks walking nqb tiles a head can hand
 * every short one to the same few blocks (at 132 blocks and 6 tiles a head, blocks 0, 6, 12, ... take them all).
 * The grid among the V3_TAIL_GRIDS sizes up to the slots whose busiest block has the least work by a replay, the
 * largest on a tie: in quarters of a consumer's key blocks, a full tile costs 4 (nb + 1), a split tail 4 (its
 * share + 2), a tail with one idle consumer 3 (nb + 1).  Unmasked calls only (masked ones keep every slot); calls
 * of more than 2^16 tiles keep every slot; a few recent answers are remembered. */
#define V3_TAIL_GRIDS 8
static int64_t v3_busiest(const attn_params *p, int br, int64_t group, int64_t grid, int64_t full, int64_t tail) {
    const int64_t ntiles = v3_ntiles(p, br);
    int64_t most = 0;
    for (int64_t x = 0; x < grid; x++) {
        int64_t load = 0;
        for (int64_t k = 0, t; (t = v3_tile_index(k, x, grid)) < ntiles; k++)
            load += v3_tile_place(p, br, t, group, 1).split ? tail : full;
        most = load > most ? load : most;
    }
    return most;
}

typedef struct {
    int64_t sq, sk, bh, slots, group, full, tail, grid;
    int br;
} v3_grid_memo;
static v3_grid_memo v3_grids[V3_ORDER_MEMO];
static int v3_grids_next;

static int64_t v3_tail_grid(const attn_params *p, int br, int64_t group, int64_t slots, int64_t full, int64_t tail) {
    const int64_t ntiles = v3_ntiles(p, br), nbh = p->b * p->h;
    if (ntiles > (1 << 16) || slots <= V3_TAIL_GRIDS || ntiles <= slots) return ntiles < slots ? ntiles : slots;
    int64_t grid = 0;
    pthread_mutex_lock(&v3_memo_lock);
    for (int i = 0; i < V3_ORDER_MEMO && !grid; i++) {
        const v3_grid_memo *m = &v3_grids[i];
        if (m->grid && m->sq == p->sq && m->sk == p->sk && m->bh == nbh && m->slots == slots && m->group == group &&
            m->br == br && m->full == full && m->tail == tail)
            grid = m->grid;
    }
    pthread_mutex_unlock(&v3_memo_lock);
    if (grid) return grid;
    int64_t best = -1;
    for (int64_t g = slots; g > slots - V3_TAIL_GRIDS; g--) {
        const int64_t most = v3_busiest(p, br, group, g, full, tail);
        if (best < 0 || most < best) {
            best = most;
            grid = g;
        }
    }
    const v3_grid_memo m = {p->sq, p->sk, nbh, slots, group, full, tail, grid, br};
    pthread_mutex_lock(&v3_memo_lock);
    v3_grids[v3_grids_next] = m;
    v3_grids_next = (v3_grids_next + 1) % V3_ORDER_MEMO;
    pthread_mutex_unlock(&v3_memo_lock);
    return grid;
}

fattn_status fattn_plan_v3(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                           fattn_plan *plan) {
    (void)tuned;
    const char *missing = fattn_missing_feature(p, FATTN_TAKES_SOFTCAP | FATTN_TAKES_ALIBI | FATTN_TAKES_VARLEN |
                                                       FATTN_TAKES_SEQUSED | FATTN_TAKES_PAGED);
    if (missing) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 does not take %s yet", missing);
    /* a paged cache: its kernels are the per-sequence ones (SEQ), which know each sequence's keys */
    if (p->block_table && !p->seqused_k)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED,
                          "v3 takes a paged KV cache with its sequences' lengths (cache_seqlens)");
    if (!tma_ok(p))
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 needs q, k, v and out 16-byte aligned with every stride a multiple "
                          "of 8 elements (TMA)");
    if (!(p->scale > 0.f)) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 folds a positive scale into one FFMA");
    int idx = 0;
    fattn_status st = v3_choose(p, ov, plan->dev.sm_count, &idx);
    if (st) return st;
    const v3_config *c = &v3_table[idx];
    /* (a paged cache: any page size, a multiple of 16 as the arguments' check demands -- its pieces, at most 8 a key
     * block, one per lane of the producer's warp: v3_fwd_producer.cuh) */
    if (p->block_table && p->page_size % 16)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v3: pages of %lld rows, not a multiple of 16", (long long)p->page_size);
    const int br = 64 * c->consumers;
    int split = 0;
    if ((st = v3_split_tails(p, c, ov->splits, &split))) return st;
    const int64_t blocks = v3_ntiles(p, br);
    /* below 2^31 with room for the dynamic schedule's numbers, which run past the tiles by up to twice the grid */
    if (blocks > 0x7fff0000) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3: %lld tiles are too many", (long long)blocks);
    /* the persistent grid: as many blocks as fit at once */
    const int64_t slots = (int64_t)plan->dev.sm_count * V3_BLOCKS_PER_SM(c->dp, c->bc, c->stages, c->consumers);
    int64_t grid = blocks < slots ? blocks : slots;
    plan->config = idx;
    plan->splits = split ? c->consumers : 1;
    plan->grid_x = (unsigned)(grid > 0 ? grid : 1);
    plan->grid_y = 1;
    plan->threads = (unsigned)(128 * (c->consumers + 1));
    plan->smem = V3_SMEM(c->dp, c->bc, c->stages, c->consumers);
    const int64_t nbh = p->b * p->h < INT32_MAX ? p->b * p->h : INT32_MAX;
    plan->head_group = ov->order == FATTN_ORDER_HEADS    ? 1
                       : ov->order == FATTN_ORDER_BLOCKS ? nbh
                                                         : v3_order(p, br, c->bc, grid, plan->dev.sm_count, split);
    plan->order = plan->head_group == 1 ? FATTN_ORDER_HEADS : FATTN_ORDER_BLOCKS;
    const int tail_rows = (int)(p->sq % br);
    if (c->consumers == 3 && p->mask.left < 0 && p->mask.right < 0 && tail_rows > 0 && (split || tail_rows > 64)) {
        const int64_t nb = (p->sk + c->bc - 1) / c->bc; /* (masked calls: every slot) */
        const int64_t tail = split ? 4 * ((nb + 2) / 3 + 2) : 3 * (nb + 1);
        grid = v3_tail_grid(p, br, plan->head_group, slots, 4 * (nb + 1), tail);
        plan->grid_x = (unsigned)(grid > 0 ? grid : 1);
    }
    /* per-sequence lengths: tiles from a counter, only those that exist (v3_schedule.h: v3_seq_tile) */
    plan->use_counters = p->cu_seqlens_q || p->seqused_k;
    plan->sinks_fused = p->sinks != NULL; /* the epilogue applies them (v3_fwd_kernel.cuh) */
    return FATTN_OK;
}
