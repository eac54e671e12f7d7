/* v2_bwd_plan.c -- PLACEHOLDER (being written): v2's backward planner. */
#include "../../csrc/variants.h"

fattn_status fattn_plan_bwd_v2(const attn_bwd_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                               fattn_plan *plan) {
    (void)p; (void)tuned; (void)ov; (void)plan;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the v2 backward is not written yet");
}
