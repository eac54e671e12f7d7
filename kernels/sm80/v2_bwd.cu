/* v2_bwd.cu -- PLACEHOLDER (being written): v2's backward kernels and launcher. */
#include "../mma.cuh"
#include "../../csrc/variants.h"

extern "C" fattn_status fattn_prepare_bwd_v2(int device) { (void)device; return FATTN_OK; }
extern "C" fattn_status fattn_launch_bwd_v2(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    (void)p; (void)plan; (void)stream;
    return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "the v2 backward is not written yet");
}
