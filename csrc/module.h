/* module.h -- fattn._C's module state and the pieces its binding files share. */
#ifndef FATTN_MODULE_H
#define FATTN_MODULE_H

#include "args.h"
#include "plan.h"
#include "sinks.h"
#include "tuned.h"
#include "views.h"

/* The forward call's argument names (bind.c), interned so that keywords match by pointer. */
#define FATTN_FORWARD_ARGS 28
extern const char *const fattn_forward_arg_names[FATTN_FORWARD_ARGS];
/* The backward call's (bind_bwd.c). */
#define FATTN_BACKWARD_ARGS 27
extern const char *const fattn_backward_arg_names[FATTN_BACKWARD_ARGS];

typedef struct {
    fattn_names names;                            /* interned strings, torch's types once seen */
    PyObject *forward_args[FATTN_FORWARD_ARGS];   /* interned fattn_forward_arg_names */
    PyObject *backward_args[FATTN_BACKWARD_ARGS]; /* interned fattn_backward_arg_names */
    fattn_tuned tuned;                            /* the tuned-config table (fattn/_tuned.py registers it) */
} module_state;

static inline module_state *fattn_state(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* Raises RuntimeError("fattn: <last C error>") and returns NULL. */
PyObject *fattn_raise_status(void);
/* Raises RuntimeError for a GPU call in a build without CUDA and returns NULL. */
PyObject *fattn_not_built(void);

/* Shared by the forward's and the backward's bindings (bind.c): the variant argument (a str or None), the named
 * variant checked against the table and a dtype, the overrides (config, splits, order), and a planner's status
 * raised in the caller's words.  Each returns 0, or -1 with an exception set. */
int fattn_arg_variant(PyObject *obj, const char **variant);
int fattn_check_variant(const char *name, fattn_dtype dtype);
int fattn_parse_overrides(PyObject *config, PyObject *splits, PyObject *order, fattn_overrides *ov);
int fattn_raise_plan_status(fattn_status s, const char *variant, const fattn_overrides *ov);
/* softcap: None or a float (0: none; range checked with the params). */
int fattn_arg_softcap(PyObject *obj, double *softcap);
/* check_indices: None / absent (check) or a truth value; *trust = 1 when false (index arrays' values not read). */
int fattn_arg_check_indices(PyObject *obj, int *trust);
/* The variable-length arguments (cu_seqlens_q, cu_seqlens_k, seqused_k at objs[0..3), max_seqlen_q / _k) taken
 * into ts[0..3) and o. */
int fattn_take_varlen_args(const fattn_names *names, PyObject **objs, PyObject *max_q, PyObject *max_k,
                           PyObject *stream, fattn_tensor *ts, fattn_call_opts *o);

/* The bindings of each file, for the method tables in module.c. */
PyObject *fattn_py_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
/* The same arguments checked, nothing run; fake and meta torch tensors are described, not read. */
PyObject *fattn_py_check_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_py_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_py_check_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_plan_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_py_backward_workspace_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *fattn_py_sinks(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
/* The sinks pass's arrays (bind_sinks.c, csrc/sinks.h), for the forward's binding too: out's rows (layout 0 / 1,
 * packed 3-D as b = 1), lse (B, H, S) or (H, total) and sinks float32 (H,), checked into p.  0, or -1 with an
 * exception set. */
int fattn_take_sink_rows(const fattn_tensor *out, const fattn_tensor *lse, const fattn_tensor *sinks, int layout,
                         bhsd_view *o, fattn_sink_params *p);
/* ... and the backward's: dout (out's shape and dtype, its rows o) and dsinks (writable float32 (H,)) into p. */
int fattn_take_sink_grads(const fattn_tensor *dout, const fattn_tensor *dsinks, const fattn_tensor *out, int layout,
                          const bhsd_view *o, fattn_sink_params *p);
extern PyMethodDef fattn_dev_methods[];

#endif
