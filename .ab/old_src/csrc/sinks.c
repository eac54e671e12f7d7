/* sinks.c -- attention sinks on the CPU (sinks.h). */
#include "sinks.h"

#include <math.h>

#include "cpu_kernel.h" /* load_elem, store_elem */

void fattn_cpu_sinks_forward(const fattn_sink_params *p) {
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->h; h++)
            for (int64_t i = 0; i < p->s; i++) {
                float *l = p->lse + b * p->lse_sb + h * p->lse_sh + i;
                const float lse2 = fattn_sink_lse(*l, p->sinks[h]);
                const float f = fattn_sink_factor(*l, p->sinks[h]);
                const int64_t row = b * p->o_sb + h * p->o_sh + i * p->o_ss;
                for (int64_t e = 0; e < p->d; e++)
                    store_elem(p->o, row + e, load_elem(p->o, row + e, p->dtype) * f, p->dtype);
                *l = lse2;
            }
}

void fattn_cpu_sinks_backward(const fattn_sink_params *p) {
    for (int64_t h = 0; h < p->h; h++) {
        double acc = 0.0;
        for (int64_t b = 0; b < p->b; b++)
            for (int64_t i = 0; i < p->s; i++) {
                const int64_t row = b * p->o_sb + h * p->o_sh + i * p->o_ss;
                const int64_t grow = b * p->do_sb + h * p->do_sh + i * p->do_ss;
                float dd = 0.f;
                for (int64_t e = 0; e < p->d; e++)
                    dd += load_elem(p->dout, grow + e, p->dtype) * load_elem(p->o, row + e, p->dtype);
                acc += (double)expf(p->sinks[h] - p->lse[b * p->lse_sb + h * p->lse_sh + i]) * dd;
            }
        p->dsinks[h] = (float)-acc;
    }
}
