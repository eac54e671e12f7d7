/* module.h -- fattn._C's module state and the pieces its binding files share. */
#ifndef FATTN_MODULE_H
#define FATTN_MODULE_H

#include "args.h"
#include "tuned.h"

/* The forward call's argument names (bind.c), interned so that keywords match by pointer. */
#define FATTN_FORWARD_ARGS 14
extern const char *const fattn_forward_arg_names[FATTN_FORWARD_ARGS];

typedef struct {
    fattn_names names;                            /* interned strings, torch's types once seen */
    PyObject *forward_args[FATTN_FORWARD_ARGS];   /* interned fattn_forward_arg_names */
    fattn_tuned tuned;                            /* the tuned-config table (fattn/_tuned.py registers it) */
} module_state;

static inline module_state *fattn_state(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* Raises RuntimeError("fattn: <last C error>") and returns NULL. */
PyObject *fattn_raise_status(void);
/* Raises RuntimeError for a GPU call in a build without CUDA and returns NULL. */
PyObject *fattn_not_built(void);

/* The bindings of each file, for the method tables in module.c. */
PyObject *fattn_py_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fattn_dev_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern PyMethodDef fattn_dev_methods[];

#endif
