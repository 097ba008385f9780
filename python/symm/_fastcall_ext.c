/* The hit path of symm._fastcall in C: an eager call whose kind of call is
 * kept costs the key of its arguments, one dictionary lookup, the
 * arrays' addresses written into the kept descriptors and the library
 * call, with no Python bytecode and no ctypes conversions in between. At
 * small sizes the host's time is the call's time, and Python's share of it
 * (its interpreter loop, cold after a wait) was most of that.
 *
 * It computes exactly the key that _fastcall.key_of computes (that module's
 * docstring says what a key holds), so the two agree on every kept call;
 * everything else (a miss, a call the key does not describe, a kept call in
 * use by another thread) goes back to _fastcall.slow_call. A kept call runs
 * here when _fastcall made a `Native` for it: the operation's C function
 * (one of the five whose prototypes are below, checked against symm.h at
 * compile time) and its arguments as machine words.
 *
 * Built against the stable ABI (CPython 3.10 and newer, one binary); the
 * package works without it (_fastcall's Python path). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "symm.h"

/* How deeply lists nest in what the key describes (_fastcall.MAX_DEPTH). */
#define MAX_DEPTH 8
/* Arrays of a call held without allocating (more: on the heap). */
#define INLINE_ARRAYS 16
/* Devices per call whose current stream is looked up once. */
#define MAX_DEVICES 16

/* The types and functions the key reads: set by set_torch() once torch is
 * imported (until then the key describes no tensor)... */
static PyObject *tensor_type;   /* torch.Tensor */
static PyObject *strided;       /* torch.strided */
static PyObject *torch_dtype;   /* torch.dtype */
static PyObject *stream_of;     /* device -> its current stream (int) */
/* ...and by configure(), at _fastcall's import. */
static PyObject *ndarray_type;  /* numpy.ndarray */
static PyObject *np_dtype;      /* numpy.dtype */
static PyObject *slow_call;     /* _fastcall.slow_call */
static PyObject *torch_probe;   /* _fastcall._ext_torch_probe: calls set_torch once torch is imported */

/* Interned attribute names. */
static PyObject *s_requires_grad, *s_layout, *s_is_conj, *s_is_neg, *s_get_device, *s_is_cpu, *s_is_cuda,
    *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_strides, *s_flags, *s_writeable, *s_array_interface, *s_data,
    *s_calls, *s_native, *s_raw, *s_check;

typedef struct {
    PyObject *objs;  /* list: the arrays, in order */
    uint64_t *ptrs;  /* their addresses: `inline_ptrs`, or a heap block of `cap` */
    uint64_t inline_ptrs[INLINE_ARRAYS];
    Py_ssize_t n, cap;
    long devices[MAX_DEVICES];
    PyObject *streams[MAX_DEVICES];
    int ndevices;
} Found;

static void found_clear(Found *f) {
    Py_CLEAR(f->objs);
    if (f->ptrs != f->inline_ptrs) PyMem_Free(f->ptrs);
    f->ptrs = f->inline_ptrs;
    for (int i = 0; i < f->ndevices; i++) Py_CLEAR(f->streams[i]);
    f->ndevices = 0;
}

/* A bool attribute (or method result when `call`); -1 on error. */
static int truth(PyObject *x, PyObject *name, int call) {
    PyObject *v = PyObject_GetAttr(x, name);
    if (v == NULL) return -1;
    if (call) {
        PyObject *r = PyObject_CallNoArgs(v);
        Py_DECREF(v);
        if (r == NULL) return -1;
        v = r;
    }
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static PyObject *call_method(PyObject *x, PyObject *name) {
    PyObject *m = PyObject_GetAttr(x, name);
    if (m == NULL) return NULL;
    PyObject *r = PyObject_CallNoArgs(m);
    Py_DECREF(m);
    return r;
}

/* Appends array `x` at address `ptr`: 0, or -1 on error. */
static int add_array(Found *f, PyObject *x, PyObject *ptr) {
    uint64_t p = PyLong_AsUnsignedLongLongMask(ptr);
    if (p == (uint64_t)-1 && PyErr_Occurred()) return -1;
    if (f->n == f->cap) {
        uint64_t *grown = PyMem_Malloc(2 * f->cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(grown, f->ptrs, f->n * sizeof *grown);
        if (f->ptrs != f->inline_ptrs) PyMem_Free(f->ptrs);
        f->ptrs = grown;
        f->cap *= 2;
    }
    if (PyList_Append(f->objs, x) < 0) return -1;
    f->ptrs[f->n++] = p;
    return 0;
}

/* The current stream of CUDA device `dev`, looked up once per call. */
static PyObject *stream_for(Found *f, long dev) {
    for (int i = 0; i < f->ndevices; i++)
        if (f->devices[i] == dev) return Py_NewRef(f->streams[i]);
    PyObject *d = PyLong_FromLong(dev);
    if (d == NULL) return NULL;
    PyObject *s = PyObject_CallFunctionObjArgs(stream_of, d, NULL);
    Py_DECREF(d);
    if (s == NULL || f->ndevices == MAX_DEVICES) return s;
    f->devices[f->ndevices] = dev;
    f->streams[f->ndevices++] = Py_NewRef(s);
    return s;
}

#define NOT_DESCRIBED ((PyObject *)1) /* part(): the key does not describe it */

/* _fastcall._part: a new reference, NOT_DESCRIBED, or NULL on error. */
static PyObject *part(PyObject *x, Found *f, int depth);

static PyObject *tensor_part(PyObject *x, Found *f) {
    int t;
    if ((t = truth(x, s_requires_grad, 0)) != 0) return t < 0 ? NULL : NOT_DESCRIBED;
    PyObject *layout = PyObject_GetAttr(x, s_layout);
    if (layout == NULL) return NULL;
    int is_strided = layout == strided;
    Py_DECREF(layout);
    if (!is_strided) return NOT_DESCRIBED;
    if ((t = truth(x, s_is_conj, 1)) != 0) return t < 0 ? NULL : NOT_DESCRIBED;
    if ((t = truth(x, s_is_neg, 1)) != 0) return t < 0 ? NULL : NOT_DESCRIBED;
    PyObject *dev_obj = call_method(x, s_get_device); /* -1: CPU (or no device at all) */
    if (dev_obj == NULL) return NULL;
    long dev = PyLong_AsLong(dev_obj);
    if (dev == -1 && PyErr_Occurred()) {
        Py_DECREF(dev_obj);
        return NULL;
    }
    PyObject *device;
    if (dev < 0) {
        if ((t = truth(x, s_is_cpu, 0)) != 1) {
            Py_DECREF(dev_obj);
            return t < 0 ? NULL : NOT_DESCRIBED;
        }
        device = dev_obj;
    } else {
        if ((t = truth(x, s_is_cuda, 0)) != 1) {
            Py_DECREF(dev_obj);
            return t < 0 ? NULL : NOT_DESCRIBED;
        }
        PyObject *stream = stream_for(f, dev);
        if (stream == NULL) {
            Py_DECREF(dev_obj);
            return NULL;
        }
        device = PyTuple_Pack(2, dev_obj, stream);
        Py_DECREF(dev_obj);
        Py_DECREF(stream);
        if (device == NULL) return NULL;
    }
    PyObject *ptr = NULL, *shape = NULL, *stride = NULL, *dtype = NULL, *key = NULL;
    if ((ptr = call_method(x, s_data_ptr)) == NULL || add_array(f, x, ptr) < 0) goto done;
    if ((shape = PyObject_GetAttr(x, s_shape)) == NULL || (stride = call_method(x, s_stride)) == NULL ||
        (dtype = PyObject_GetAttr(x, s_dtype)) == NULL)
        goto done;
    key = PyTuple_Pack(4, shape, stride, dtype, device);
done:
    Py_XDECREF(ptr);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_DECREF(device);
    return key;
}

static PyObject *ndarray_part(PyObject *x, Found *f) {
    PyObject *iface = PyObject_GetAttr(x, s_array_interface);
    if (iface == NULL) return NULL;
    PyObject *data = PyObject_GetItem(iface, s_data);
    Py_DECREF(iface);
    if (data == NULL) return NULL;
    PyObject *ptr = PyTuple_Check(data) && PyTuple_Size(data) > 0 ? PyTuple_GetItem(data, 0) : NULL;
    int added = ptr ? add_array(f, x, ptr) : -1;
    Py_DECREF(data);
    if (added < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "an array's __array_interface__ has no data address");
        return NULL;
    }
    PyObject *shape = NULL, *strides = NULL, *dtype = NULL, *flags = NULL, *writeable = NULL, *key = NULL;
    if ((shape = PyObject_GetAttr(x, s_shape)) && (strides = PyObject_GetAttr(x, s_strides)) &&
        (dtype = PyObject_GetAttr(x, s_dtype)) && (flags = PyObject_GetAttr(x, s_flags)) &&
        (writeable = PyObject_GetAttr(flags, s_writeable)))
        key = PyTuple_Pack(4, shape, strides, dtype, writeable);
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(flags);
    Py_XDECREF(writeable);
    return key;
}

static PyObject *sequence_part(PyObject *x, Found *f, int depth) {
    if (depth == MAX_DEPTH) return NOT_DESCRIBED;
    /* A snapshot: the key reads each item once, even if a list changes. */
    PyObject *items = PyList_Check(x) ? PyList_AsTuple(x) : Py_NewRef(x);
    if (items == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(items);
    PyObject *key = PyTuple_New(n + 1);
    if (key == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    PyTuple_SetItem(key, 0, Py_NewRef((PyObject *)Py_TYPE(x)));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = part(PyTuple_GetItem(items, i), f, depth + 1);
        if (p == NULL || p == NOT_DESCRIBED) {
            Py_DECREF(key);
            Py_DECREF(items);
            return p;
        }
        PyTuple_SetItem(key, i + 1, p);
    }
    Py_DECREF(items);
    return key;
}

static PyObject *part(PyObject *x, Found *f, int depth) {
    PyTypeObject *t = Py_TYPE(x);
    if (tensor_type != NULL && (PyObject *)t == tensor_type) return tensor_part(x, f);
    if (x == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyUnicode_Type)
        return PyTuple_Pack(2, (PyObject *)t, x);
    if ((PyObject *)t == ndarray_type) return ndarray_part(x, f);
    if (t == &PyFloat_Type) { /* -0.0 == 0.0 as keys, not as arguments */
        PyObject *sign = PyFloat_FromDouble(copysign(1.0, PyFloat_AsDouble(x)));
        if (sign == NULL) return NULL;
        PyObject *key = PyTuple_Pack(3, (PyObject *)t, x, sign);
        Py_DECREF(sign);
        return key;
    }
    if (t == &PyList_Type || t == &PyTuple_Type) return sequence_part(x, f, depth);
    /* out_dtype: torch.bfloat16, np.float16, np.dtype("f2"), ... */
    int dtype = (torch_dtype != NULL && (PyObject *)t == torch_dtype) || PyType_Check(x);
    if (!dtype && np_dtype != NULL) {
        dtype = PyObject_IsInstance(x, np_dtype);
        if (dtype < 0) return NULL;
    }
    return dtype ? PyTuple_Pack(2, (PyObject *)t, x) : NOT_DESCRIBED;
}

/* _fastcall.key_of: the key (a new reference), NOT_DESCRIBED, or NULL on
 * error; `f` receives the arrays and their addresses. */
static void found_init(Found *f) {
    memset(f, 0, sizeof *f);
    f->ptrs = f->inline_ptrs;
    f->cap = INLINE_ARRAYS;
}

static PyObject *key_of(PyObject *args, PyObject *kwargs, Found *f) {
    found_init(f);
    if (tensor_type == NULL && torch_probe != NULL) { /* torch imported since the last call? */
        PyObject *r = PyObject_CallNoArgs(torch_probe);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    if ((f->objs = PyList_New(0)) == NULL) return NULL;
    PyObject *key = PyList_New(0);
    if (key == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = part(PyTuple_GetItem(args, i), f, 0);
        if (p == NULL || p == NOT_DESCRIBED) goto fail_with;
        int r = PyList_Append(key, p);
        Py_DECREF(p);
        if (r < 0) goto fail;
    }
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *name, *value;
        while (PyDict_Next(kwargs, &pos, &name, &value)) { /* a name is a str, a positional part never */
            PyObject *p = part(value, f, 0);
            if (p == NULL || p == NOT_DESCRIBED) {
                Py_DECREF(key);
                return p;
            }
            int r = PyList_Append(key, name) < 0 ? -1 : PyList_Append(key, p);
            Py_DECREF(p);
            if (r < 0) goto fail;
        }
    }
    if (f->n > 1) { /* an array given twice: which positions alias */
        Py_ssize_t n_objs = f->n;
        int aliased = 0;
        for (Py_ssize_t i = 1; i < n_objs && !aliased; i++)
            for (Py_ssize_t j = 0; j < i && !aliased; j++)
                aliased = PyList_GetItem(f->objs, i) == PyList_GetItem(f->objs, j);
        if (aliased) {
            PyObject *first = PyTuple_New(n_objs);
            if (first == NULL) goto fail;
            for (Py_ssize_t i = 0; i < n_objs; i++) {
                Py_ssize_t j = 0;
                while (PyList_GetItem(f->objs, j) != PyList_GetItem(f->objs, i)) j++;
                PyTuple_SetItem(first, i, PyLong_FromSsize_t(j));
            }
            int r = PyList_Append(key, first);
            Py_DECREF(first);
            if (r < 0) goto fail;
        }
    }
    PyObject *tuple = PyList_AsTuple(key);
    Py_DECREF(key);
    return tuple;
fail_with : {
    PyObject *p = PyErr_Occurred() ? NULL : NOT_DESCRIBED;
    Py_DECREF(key);
    return p;
}
fail:
    Py_DECREF(key);
    return NULL;
}

/* (key, objs, ptrs) as _fastcall.key_of returns it. */
static PyObject *found_tuple(PyObject *key, Found *f) {
    PyObject *ptrs = PyList_New(f->n);
    if (ptrs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        PyObject *p = PyLong_FromUnsignedLongLong(f->ptrs[i]);
        if (p == NULL) {
            Py_DECREF(ptrs);
            return NULL;
        }
        PyList_SetItem(ptrs, i, p);
    }
    PyObject *t = PyTuple_Pack(3, key, f->objs, ptrs);
    Py_DECREF(ptrs);
    return t;
}

static PyObject *py_key_of(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 2 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "key_of(args: tuple, kwargs: dict)");
        return NULL;
    }
    Found f;
    PyObject *key = key_of(argv[0], argv[1], &f);
    PyObject *r = key == NOT_DESCRIBED ? Py_NewRef(Py_None) : key ? found_tuple(key, &f) : NULL;
    if (key != NOT_DESCRIBED) Py_XDECREF(key);
    found_clear(&f);
    return r;
}

/* --- a kept call, run from C ------------------------------------------- */

enum Op { AG_MM, MM_RS, LC_ALLGATHER, ALL_REDUCE, ALL_REDUCE_RMSNORM, OPS };

/* Words after the group each operation takes. */
static const int OP_WORDS[OPS] = {8, 7, 3, 5, 8};

/* A float argument's word: its bits in the low 32. */
static float float_of(uint64_t w) {
    uint32_t bits = (uint32_t)w;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef struct {
    PyObject_HEAD
    int op;
    void *fn;
    uint64_t words[8];
    Py_ssize_t nwrites;
    Py_ssize_t *write_index; /* which array's address goes... */
    uint64_t **write_at;     /* ...into which descriptor's data field */
    PyObject *makers;        /* tuple of functions making allocated outputs: () -> (array, address) */
    PyObject *result;        /* the result's spec (an index, or (type, [specs])) */
    PyObject *keep;          /* what the descriptors and words point into */
    int busy;                /* a call is using the descriptors (read and written with the GIL held) */
} Native;

static symm_status_t invoke(const Native *n, uint64_t group) {
    const uint64_t *w = n->words;
#define P(i, T) ((T)(uintptr_t)w[i])
#define I(i, T) ((T)(int64_t)w[i])
    switch (n->op) {
    case AG_MM:
        return ((__typeof__(symm_fused_ag_mm) *)n->fn)((symm_group_t)(uintptr_t)group, P(0, const symm_tensor_t *),
                                                       P(1, const symm_tensor_t *), I(2, int), I(3, int),
                                                       P(4, const symm_tensor_t *), P(5, const symm_tensor_t *),
                                                       P(6, const symm_ag_mm_options_t *), P(7, void *));
    case MM_RS:
        return ((__typeof__(symm_mm_rs) *)n->fn)((symm_group_t)(uintptr_t)group, P(0, const symm_tensor_t *),
                                                 P(1, const symm_tensor_t *), I(2, int), I(3, symm_reduce_op_t),
                                                 P(4, const symm_tensor_t *), P(5, const symm_mm_rs_options_t *),
                                                 P(6, void *));
    case LC_ALLGATHER:
        return ((__typeof__(symm_lc_allgather) *)n->fn)((symm_group_t)(uintptr_t)group,
                                                        P(0, const symm_tensor_t *), P(1, const symm_tensor_t *),
                                                        P(2, void *));
    case ALL_REDUCE:
        return ((__typeof__(symm_all_reduce) *)n->fn)((symm_group_t)(uintptr_t)group, P(0, const symm_tensor_t *),
                                                      P(1, const symm_tensor_t *), I(2, symm_reduce_op_t),
                                                      P(3, const symm_all_reduce_options_t *), P(4, void *));
    default: /* ALL_REDUCE_RMSNORM */
        return ((__typeof__(symm_all_reduce_rmsnorm) *)n->fn)(
            (symm_group_t)(uintptr_t)group, P(0, const symm_tensor_t *), P(1, const symm_tensor_t *),
            P(2, const symm_tensor_t *), float_of(w[3]), P(4, const symm_tensor_t *), P(5, const symm_tensor_t *),
            P(6, const symm_all_reduce_options_t *), P(7, void *));
    }
#undef P
#undef I
}

static uint64_t word_of(PyObject *o, int *ok) {
    uint64_t v = PyLong_AsUnsignedLongLongMask(o);
    *ok = !(v == (uint64_t)-1 && PyErr_Occurred());
    return v;
}

/* Native(op, fn, words, writes, makers, result, keep): `op` an index of
 * enum Op, `fn` the C function's address, `words` its arguments after the
 * group (ints: addresses, integer arguments as two's complement, a float's
 * bits),
 * `writes` ((array index, address of a descriptor's data), ...). */
static PyObject *native_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int op;
    PyObject *fn, *words, *writes, *makers, *result, *keep;
    if (kw != NULL && PyDict_Size(kw) > 0) {
        PyErr_SetString(PyExc_TypeError, "Native takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iOO!O!O!OO", &op, &fn, &PyTuple_Type, &words, &PyTuple_Type, &writes,
                          &PyTuple_Type, &makers, &result, &keep))
        return NULL;
    if (op < 0 || op >= OPS || PyTuple_Size(words) != OP_WORDS[op]) {
        PyErr_SetString(PyExc_ValueError, "Native: unknown operation, or the wrong number of words for it");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Native *n = (Native *)alloc(type, 0);
    if (n == NULL) return NULL;
    int ok = 1;
    n->op = op;
    n->fn = (void *)(uintptr_t)word_of(fn, &ok);
    for (Py_ssize_t i = 0; ok && i < PyTuple_Size(words); i++) n->words[i] = word_of(PyTuple_GetItem(words, i), &ok);
    n->nwrites = PyTuple_Size(writes);
    n->write_index = PyMem_Calloc(n->nwrites + 1, sizeof *n->write_index);
    n->write_at = PyMem_Calloc(n->nwrites + 1, sizeof *n->write_at);
    if (n->write_index == NULL || n->write_at == NULL) ok = 0;
    for (Py_ssize_t i = 0; ok && i < n->nwrites; i++) {
        PyObject *w = PyTuple_GetItem(writes, i);
        if (!PyTuple_Check(w) || PyTuple_Size(w) != 2) {
            PyErr_SetString(PyExc_TypeError, "Native: a write is (array index, address)");
            ok = 0;
            break;
        }
        n->write_index[i] = (Py_ssize_t)word_of(PyTuple_GetItem(w, 0), &ok);
        if (ok) n->write_at[i] = (uint64_t *)(uintptr_t)word_of(PyTuple_GetItem(w, 1), &ok);
    }
    n->makers = Py_NewRef(makers);
    n->result = Py_NewRef(result);
    n->keep = Py_NewRef(keep);
    if (!ok || n->fn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_MemoryError, "Native");
        Py_DECREF(n);
        return NULL;
    }
    return (PyObject *)n;
}

static void native_dealloc(Native *n) {
    PyTypeObject *type = Py_TYPE(n);
    PyMem_Free(n->write_index);
    PyMem_Free(n->write_at);
    Py_XDECREF(n->makers);
    Py_XDECREF(n->result);
    Py_XDECREF(n->keep);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(n);
    Py_DECREF(type);
}

static PyObject *native_get_busy(Native *n, void *closure) {
    (void)closure;
    return PyBool_FromLong(n->busy);
}

/* Tests hold a kept call as another thread's call would. */
static int native_set_busy(Native *n, PyObject *value, void *closure) {
    (void)closure;
    int t = value ? PyObject_IsTrue(value) : -1;
    if (t < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "busy cannot be deleted");
        return -1;
    }
    n->busy = t;
    return 0;
}

static PyGetSetDef native_getset[] = {
    {"busy", (getter)native_get_busy, (setter)native_set_busy, "Whether a call is using the descriptors.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot native_slots[] = {
    {Py_tp_new, native_new},
    {Py_tp_dealloc, native_dealloc},
    {Py_tp_getset, native_getset},
    {Py_tp_doc, "A kept call that _fastcall_ext.call runs from C."},
    {0, NULL},
};

static PyType_Spec native_spec = {"symm._fastcall_ext.Native", sizeof(Native), 0, Py_TPFLAGS_DEFAULT, native_slots};

static PyObject *native_type;

/* The result from its spec: objs[spec], or spec[0](results of spec[1]). */
static PyObject *built(PyObject *spec, PyObject *objs) {
    if (PyLong_Check(spec)) {
        PyObject *o = PyList_GetItem(objs, PyLong_AsSsize_t(spec));
        return o ? Py_NewRef(o) : NULL;
    }
    PyObject *kind = PyTuple_GetItem(spec, 0), *items = PyTuple_GetItem(spec, 1);
    if (kind == NULL || items == NULL) return NULL;
    Py_ssize_t n = PyList_Size(items);
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = built(PyList_GetItem(items, i), objs);
        if (b == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SetItem(list, i, b);
    }
    if (kind == (PyObject *)&PyList_Type) return list;
    PyObject *r = PyObject_CallFunctionObjArgs(kind, list, NULL);
    Py_DECREF(list);
    return r;
}

/* group._check(status) for a failed call: raises, with the library's
 * message (-1), as the Python path does. */
static int checked(PyObject *group, symm_status_t status) {
    PyObject *code = PyLong_FromLong(status);
    PyObject *r = code ? PyObject_CallMethodObjArgs(group, s_check, code, NULL) : NULL;
    Py_XDECREF(code);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Makes the call of `n` (its descriptors written) on `group`, the GIL
 * released meanwhile as ctypes releases it (the call may wait for peers
 * that need it); -1 with the error raised. */
static int make_call(Native *n, PyObject *group) {
    PyObject *raw = PyObject_GetAttr(group, s_raw); /* raises once the group is closed */
    if (raw == NULL) return -1;
    int ok;
    uint64_t g = word_of(raw, &ok);
    Py_DECREF(raw);
    if (!ok) return -1;
    symm_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = invoke(n, g);
    Py_END_ALLOW_THREADS
    return status == SYMM_SUCCESS ? 0 : checked(group, status);
}

/* Runs the kept call `n` on the arrays of `f` (plus its allocated outputs);
 * the caller holds `n` busy: its makers may run Python code, during which
 * another thread may take the GIL and must not write the same descriptors. */
static PyObject *run(Native *n, PyObject *group, Found *f) {
    Py_ssize_t makers = PyTuple_Size(n->makers);
    for (Py_ssize_t i = 0; i < makers; i++) {
        PyObject *made = PyObject_CallNoArgs(PyTuple_GetItem(n->makers, i));
        if (made == NULL) return NULL;
        int r = PyTuple_Check(made) && PyTuple_Size(made) == 2
                    ? add_array(f, PyTuple_GetItem(made, 0), PyTuple_GetItem(made, 1))
                    : -1;
        Py_DECREF(made);
        if (r < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a kept call's output could not be made");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n->nwrites; i++) {
        if (n->write_index[i] >= f->n) {
            PyErr_SetString(PyExc_RuntimeError, "a kept call writes an array it was not given");
            return NULL;
        }
        *n->write_at[i] = f->ptrs[n->write_index[i]];
    }
    if (make_call(n, group) < 0) return NULL;
    return built(n->result, f->objs);
}

/* call_bound(native, group): a bound call (symm.bind), its descriptors
 * written once when it was bound. Calls may overlap: nothing is written. */
static PyObject *py_call_bound(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 2 || Py_TYPE(argv[0]) != (PyTypeObject *)native_type) {
        PyErr_SetString(PyExc_TypeError, "call_bound(native: Native, group)");
        return NULL;
    }
    Native *n = (Native *)argv[0];
    PyObject *group = argv[1];
    if (n->nwrites != 0 || PyTuple_Size(n->makers) != 0) {
        PyErr_SetString(PyExc_ValueError, "call_bound: a bound call writes no descriptor and makes no output");
        return NULL;
    }
    if (make_call(n, group) < 0) return NULL;
    Py_RETURN_NONE;
}

/* call(group, prepare_call, args, kwargs): _fastcall.call. */
static PyObject *py_call(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 4 || !PyTuple_Check(argv[2]) || !PyDict_Check(argv[3])) {
        PyErr_SetString(PyExc_TypeError, "call(group, prepare_call, args: tuple, kwargs: dict)");
        return NULL;
    }
    PyObject *group = argv[0], *prepare_call = argv[1], *args = argv[2], *kwargs = argv[3];
    if (slow_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "symm._fastcall_ext: used before symm._fastcall configured it");
        return NULL;
    }
    Found f;
    found_init(&f);
    PyObject *key = NULL, *found = NULL, *result = NULL;
    PyObject *caches = PyObject_GetAttr(group, s_calls);
    if (caches == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else if (PyDict_CheckExact(caches)) { /* else no call is kept */
        key = key_of(args, kwargs, &f);
        if (key == NULL) goto done;
        if (key != NOT_DESCRIBED) {
            PyObject *cache = PyDict_GetItemWithError(caches, prepare_call); /* borrowed */
            PyObject *template = cache && PyDict_Check(cache) ? PyDict_GetItemWithError(cache, key) : NULL;
            if (PyErr_Occurred()) goto done;
            if (template != NULL) {
                PyObject *native = PyObject_GetAttr(template, s_native);
                if (native == NULL) goto done;
                if (Py_TYPE(native) == (PyTypeObject *)native_type && !((Native *)native)->busy) {
                    ((Native *)native)->busy = 1;
                    result = run((Native *)native, group, &f);
                    ((Native *)native)->busy = 0;
                    Py_DECREF(native);
                    goto done;
                }
                Py_DECREF(native);
            }
            if ((found = found_tuple(key, &f)) == NULL) goto done;
        }
    }
    result = PyObject_CallFunctionObjArgs(slow_call, group, prepare_call, args, kwargs, found ? found : Py_None, NULL);
done:
    Py_XDECREF(caches);
    if (key != NOT_DESCRIBED) Py_XDECREF(key);
    Py_XDECREF(found);
    found_clear(&f);
    return result;
}

static void replace(PyObject **at, PyObject *value) {
    PyObject *old = *at;
    *at = Py_NewRef(value);
    Py_XDECREF(old);
}

/* configure(ndarray, dtype, slow_call, torch_probe): once, at import. */
static PyObject *py_configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *nd, *dt, *slow, *probe;
    if (!PyArg_ParseTuple(args, "OOOO", &nd, &dt, &slow, &probe)) return NULL;
    replace(&ndarray_type, nd);
    replace(&np_dtype, dt);
    replace(&slow_call, slow);
    replace(&torch_probe, probe);
    Py_RETURN_NONE;
}

/* set_torch(torch.Tensor, torch.strided, torch.dtype, stream_of): once torch is imported. */
static PyObject *py_set_torch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *t, *s, *d, *st;
    if (!PyArg_ParseTuple(args, "OOOO", &t, &s, &d, &st)) return NULL;
    replace(&tensor_type, t);
    replace(&strided, s);
    replace(&torch_dtype, d);
    replace(&stream_of, st);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))py_call, METH_FASTCALL, "_fastcall.call, its hit path in C."},
    {"key_of", (PyCFunction)(void (*)(void))py_key_of, METH_FASTCALL, "_fastcall.key_of, in C."},
    {"call_bound", (PyCFunction)(void (*)(void))py_call_bound, METH_FASTCALL, "A bound call (symm.bind), from C."},
    {"configure", py_configure, METH_VARARGS, "configure(ndarray, dtype, slow_call, torch_probe)"},
    {"set_torch", py_set_torch, METH_VARARGS, "set_torch(Tensor, strided, dtype, stream_of)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcall_ext", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastcall_ext(void) {
    struct {
        PyObject **at;
        const char *name;
    } names[] = {
        {&s_requires_grad, "requires_grad"}, {&s_layout, "layout"},     {&s_is_conj, "is_conj"},
        {&s_is_neg, "is_neg"},               {&s_get_device, "get_device"}, {&s_is_cpu, "is_cpu"},
        {&s_is_cuda, "is_cuda"},             {&s_data_ptr, "data_ptr"}, {&s_shape, "shape"},
        {&s_stride, "stride"},               {&s_dtype, "dtype"},       {&s_strides, "strides"},
        {&s_flags, "flags"},                 {&s_writeable, "writeable"}, {&s_array_interface, "__array_interface__"},
        {&s_data, "data"},                   {&s_calls, "_calls"},      {&s_native, "native"},
        {&s_raw, "raw"},                     {&s_check, "_check"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    native_type = PyType_FromSpec(&native_spec);
    if (native_type == NULL || PyModule_AddObject(m, "Native", Py_NewRef(native_type)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
