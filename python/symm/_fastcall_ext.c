/* The hit path of symm._fastcall in C: an eager call whose kind of call is
 * kept costs the key of its arguments, one dictionary lookup, the
 * arrays' addresses written into the kept descriptors and the library
 * call, with no Python bytecode and no ctypes conversions in between. At
 * small sizes the host's time is the call's time, and Python's share of it
 * (its interpreter loop, cold after a wait) was most of that.
 *
 * Its key describes what _fastcall.key_of's describes (that module's
 * docstring says what), and two calls' keys are equal exactly where
 * Python's are; but it is one bytes object of words, not nested tuples:
 * built, hashed and compared without a Python object per part. A torch
 * tensor is read through DLPack's exchange API where torch offers it
 * (pointer, shape and strides in one C call), else through its
 * attributes. Everything else (a miss, a call the key does not describe, a
 * kept call in use by another thread) goes back to _fastcall.slow_call,
 * with this key, under which the call is then kept. A kept call runs
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
/* Arrays of a call, and words of its key, held without allocating (more:
 * on the heap). */
#define INLINE_ARRAYS 16
#define INLINE_WORDS 192
/* Devices per call whose current stream is looked up once. */
#define MAX_DEVICES 16

/* DLPack's exchange API (dlpack.h, 1.2 and newer): C functions a framework
 * publishes on its tensor type as `__dlpack_c_exchange_api__` (a capsule),
 * so that a library reads a tensor's pointer, shape and strides, and the
 * current stream, without a Python call. Laid out as the standard does;
 * only the two functions read here are typed. */
typedef struct {
    int32_t device_type, device_id;
} DLDevice;
typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct ExchangeHeader {
    struct {
        uint32_t major, minor;
    } version;
    struct ExchangeHeader *prev_api;
} ExchangeHeader;
typedef struct {
    ExchangeHeader header;
    void *managed_tensor_allocator, *managed_tensor_from_py_object_no_sync, *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int device_type, int32_t device_id, void **out_stream);
} ExchangeAPI;
enum { KDL_CPU = 1, KDL_CUDA = 2 };

/* The types and functions the key reads: set by set_torch() once torch is
 * imported (until then the key describes no tensor)... */
static PyObject *tensor_type;   /* torch.Tensor */
static PyObject *strided;       /* torch.strided */
static PyObject *torch_dtype;   /* torch.dtype */
static PyObject *stream_of;     /* device -> its current stream (int) */
static PyObject *dtype_ids;     /* torch.dtype -> its number in keys, times 2, plus 1 where complex */
static const ExchangeAPI *exchange; /* torch's, or NULL (older torch; or turned off) */
static const ExchangeAPI *exchange_found;
/* DLPack's dtypes of torch's, as the exchange reports them, with their
 * numbers in keys (dtype_ids'): learned from torch at set_torch. */
#define MAX_DL_DTYPES 32
static struct {
    uint32_t dl; /* code | bits << 8 | lanes << 16 */
    long id;
} dl_dtypes[MAX_DL_DTYPES];
static int n_dl_dtypes;
/* ...and by configure(), at _fastcall's import. */
static PyObject *ndarray_type;  /* numpy.ndarray */
static PyObject *np_dtype;      /* numpy.dtype */
static PyObject *slow_call;     /* _fastcall.slow_call */
static PyObject *torch_probe;   /* _fastcall._ext_torch_probe: calls set_torch once torch is imported */
static PyObject *bump_fn;       /* _fastcall.bump: a written torch tensor's version, as torch's in-place ops */

/* What the key reads of a torch tensor, each through torch.Tensor's own
 * descriptor (the attribute lookup and the bound method skipped). */
enum Attr { A_REQUIRES_GRAD, A_LAYOUT, A_DTYPE, A_IS_NEG, A_GET_DEVICE, A_IS_CPU, A_IS_CUDA, A_DATA_PTR, A_SHAPE,
            A_STRIDE, ATTRS };
static const struct {
    const char *name;
    int method;
} ATTR[ATTRS] = {{"requires_grad", 0}, {"layout", 0},     {"dtype", 0},    {"is_neg", 1},   {"get_device", 1},
                 {"is_cpu", 0},        {"is_cuda", 0},    {"data_ptr", 1}, {"shape", 0},    {"stride", 1}};
static PyObject *attr_descr[ATTRS];
static descrgetfunc attr_get[ATTRS]; /* an attribute's __get__; NULL for a method */

/* Interned attribute names. */
static PyObject *s_strides, *s_dtype, *s_shape, *s_flags, *s_writeable, *s_array_interface, *s_data, *s_calls,
    *s_native, *s_raw, *s_owned, *s_check, *s_is_complex, *s_exchange_api;

/* Tags of the key's words: what the words after each describe. */
enum Tag { T_NONE = 1, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_STR, T_LIST, T_TUPLE, T_TENSOR, T_NDARRAY, T_TORCH_DTYPE,
           T_OBJECT, T_NAME, T_ALIAS };

/* A call's key as it is built: words, and the objects words cannot hold
 * (compared with ==; each after a T_OBJECT word). */
typedef struct {
    uint64_t *w;
    Py_ssize_t n, cap;
    uint64_t inline_w[INLINE_WORDS];
    PyObject *side; /* list, or NULL while empty */
} Key;

/* A call's arrays, in order (strong references), and their addresses. */
typedef struct {
    PyObject **objs;
    uint64_t *ptrs;
    Py_ssize_t n, cap;
    PyObject *inline_objs[INLINE_ARRAYS];
    uint64_t inline_ptrs[INLINE_ARRAYS];
    long devices[MAX_DEVICES];
    uint64_t streams[MAX_DEVICES];
    int ndevices;
} Arrays;

static void key_init(Key *k) {
    k->w = k->inline_w;
    k->n = 0;
    k->cap = INLINE_WORDS;
    k->side = NULL;
}

static void key_clear(Key *k) {
    if (k->w != k->inline_w) PyMem_Free(k->w);
    k->w = k->inline_w;
    Py_CLEAR(k->side);
}

static int put(Key *k, uint64_t v) {
    if (k->n == k->cap) {
        uint64_t *grown = PyMem_Malloc(2 * k->cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(grown, k->w, k->n * sizeof *grown);
        if (k->w != k->inline_w) PyMem_Free(k->w);
        k->w = grown;
        k->cap *= 2;
    }
    k->w[k->n++] = v;
    return 0;
}

/* `x` compared by ==, with its type (as _fastcall's (type(x), x)). */
static int put_object(Key *k, PyObject *x) {
    if (k->side == NULL && (k->side = PyList_New(0)) == NULL) return -1;
    if (put(k, T_OBJECT) < 0 || PyList_Append(k->side, (PyObject *)Py_TYPE(x)) < 0) return -1;
    return PyList_Append(k->side, x);
}

/* A str's UTF-8 bytes, in words; one that has none (lone surrogates) as an object. */
static int put_str(Key *k, PyObject *s, uint64_t tag) {
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &len);
    if (utf8 == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeError)) return -1;
        PyErr_Clear();
        return put(k, tag) < 0 ? -1 : put_object(k, s);
    }
    if (put(k, tag) < 0 || put(k, (uint64_t)len) < 0) return -1;
    for (Py_ssize_t i = 0; i < len; i += 8) {
        uint64_t w = 0;
        memcpy(&w, utf8 + i, len - i < 8 ? (size_t)(len - i) : 8);
        if (put(k, w) < 0) return -1;
    }
    return 0;
}

/* The key: bytes of its words, or (bytes, *objects). */
static PyObject *key_done(Key *k) {
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)k->w, k->n * (Py_ssize_t)sizeof *k->w);
    if (bytes == NULL || k->side == NULL) return bytes;
    Py_ssize_t n = PyList_Size(k->side);
    PyObject *key = PyTuple_New(n + 1);
    if (key == NULL) {
        Py_DECREF(bytes);
        return NULL;
    }
    PyTuple_SetItem(key, 0, bytes);
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SetItem(key, i + 1, Py_NewRef(PyList_GetItem(k->side, i)));
    return key;
}

static void arrays_init(Arrays *f) {
    f->objs = f->inline_objs;
    f->ptrs = f->inline_ptrs;
    f->n = 0;
    f->cap = INLINE_ARRAYS;
    f->ndevices = 0;
}

static void arrays_clear(Arrays *f) {
    for (Py_ssize_t i = 0; i < f->n; i++) Py_DECREF(f->objs[i]);
    if (f->objs != f->inline_objs) PyMem_Free(f->objs);
    if (f->ptrs != f->inline_ptrs) PyMem_Free(f->ptrs);
    arrays_init(f);
}

/* Appends array `x` at address `ptr`: 0, or -1 on error. */
static int add_array(Arrays *f, PyObject *x, uint64_t ptr) {
    if (f->n == f->cap) {
        PyObject **objs = PyMem_Malloc(2 * f->cap * sizeof *objs);
        uint64_t *ptrs = PyMem_Malloc(2 * f->cap * sizeof *ptrs);
        if (objs == NULL || ptrs == NULL) {
            PyMem_Free(objs);
            PyMem_Free(ptrs);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(objs, f->objs, f->n * sizeof *objs);
        memcpy(ptrs, f->ptrs, f->n * sizeof *ptrs);
        if (f->objs != f->inline_objs) PyMem_Free(f->objs);
        if (f->ptrs != f->inline_ptrs) PyMem_Free(f->ptrs);
        f->objs = objs;
        f->ptrs = ptrs;
        f->cap *= 2;
    }
    f->objs[f->n] = Py_NewRef(x);
    f->ptrs[f->n++] = ptr;
    return 0;
}

static int add_array_at(Arrays *f, PyObject *x, PyObject *ptr) {
    uint64_t p = PyLong_AsUnsignedLongLongMask(ptr);
    if (p == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return add_array(f, x, p);
}

/* The current stream of CUDA device `dev`, looked up once per call: 0, or -1 on error. */
static int stream_for(Arrays *f, long dev, uint64_t *stream) {
    for (int i = 0; i < f->ndevices; i++)
        if (f->devices[i] == dev) {
            *stream = f->streams[i];
            return 0;
        }
    if (exchange != NULL) {
        void *s = NULL;
        if (exchange->current_work_stream(KDL_CUDA, (int32_t)dev, &s) != 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torch gave no current stream");
            return -1;
        }
        *stream = (uint64_t)(uintptr_t)s;
    } else {
        PyObject *d = PyLong_FromLong(dev);
        PyObject *s = d ? PyObject_CallFunctionObjArgs(stream_of, d, NULL) : NULL;
        Py_XDECREF(d);
        if (s == NULL) return -1;
        *stream = PyLong_AsUnsignedLongLongMask(s);
        Py_DECREF(s);
        if (*stream == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    if (f->ndevices < MAX_DEVICES) {
        f->devices[f->ndevices] = dev;
        f->streams[f->ndevices++] = *stream;
    }
    return 0;
}

/* Tensor `x`'s attribute `a` (a method: its result): a new reference, or NULL on error. */
static PyObject *torch_attr(PyObject *x, enum Attr a) {
    if (attr_get[a] != NULL) return attr_get[a](attr_descr[a], x, (PyObject *)Py_TYPE(x));
    return PyObject_CallFunctionObjArgs(attr_descr[a], x, NULL);
}

static int torch_truth(PyObject *x, enum Attr a) {
    PyObject *v = torch_attr(x, a);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* A torch.dtype's number in keys (times 2, plus 1 where complex), or -1 on error. */
static long dtype_id(PyObject *dtype) {
    PyObject *id = PyDict_GetItemWithError(dtype_ids, dtype); /* borrowed */
    if (id != NULL) return PyLong_AsLong(id);
    if (PyErr_Occurred()) return -1;
    PyObject *complex = PyObject_GetAttr(dtype, s_is_complex);
    int c = complex ? PyObject_IsTrue(complex) : -1;
    Py_XDECREF(complex);
    if (c < 0) return -1;
    /* torch.dtype cannot be made from Python: the dict stays as small as torch's list. */
    long v = 2 * (long)PyDict_Size(dtype_ids) + c;
    PyObject *value = PyLong_FromLong(v);
    int r = value ? PyDict_SetItem(dtype_ids, dtype, value) : -1;
    Py_XDECREF(value);
    return r < 0 ? -1 : v;
}

/* The part's result: described (words written), not described, or an error raised. */
enum { ERROR = -1, NOT_DESCRIBED = 0, DESCRIBED = 1 };

static int put_device(Key *k, Arrays *f, long dev) {
    uint64_t stream = 0;
    if (dev >= 0 && stream_for(f, dev, &stream) < 0) return ERROR;
    return put(k, (uint64_t)(dev + 1)) < 0 || put(k, stream) < 0 ? ERROR : DESCRIBED;
}

static uint32_t dl_word(DLDataType d) { return d.code | (uint32_t)d.bits << 8 | (uint32_t)d.lanes << 16; }

/* A tensor's words through the exchange API, in one C call; NOT_DESCRIBED
 * (nothing written) where it cannot: the attribute reader decides then.
 * Only a strided tensor has the storage whose pointer the exchange gives
 * (torch's other layouts refuse it), so the layout needs no reading. */
static int tensor_exchanged(PyObject *x, Key *k, Arrays *f) {
    DLTensor t;
    if (exchange->dltensor_from_py_object_no_sync(x, &t) != 0) {
        if (!PyErr_Occurred() || !PyErr_ExceptionMatches(PyExc_Exception)) return PyErr_Occurred() ? ERROR : NOT_DESCRIBED;
        PyErr_Clear();
        return NOT_DESCRIBED;
    }
    long dev = t.device.device_type == KDL_CPU ? -1 : t.device.device_type == KDL_CUDA ? t.device.device_id : -2;
    if (dev == -2 || t.ndim < 0 || (t.ndim > 0 && (t.shape == NULL || t.strides == NULL))) return NOT_DESCRIBED;
    long id = -1;
    uint32_t dl = dl_word(t.dtype);
    for (int i = 0; i < n_dl_dtypes && id < 0; i++)
        if (dl_dtypes[i].dl == dl) id = dl_dtypes[i].id;
    if (id < 0 || (id & 1)) return NOT_DESCRIBED; /* a dtype not learned, or complex */
    if (put(k, T_TENSOR) < 0 || put(k, (uint64_t)id) < 0 || put(k, (uint64_t)t.ndim) < 0) return ERROR;
    for (int i = 0; i < t.ndim; i++)
        if (put(k, (uint64_t)t.shape[i]) < 0) return ERROR;
    for (int i = 0; i < t.ndim; i++)
        if (put(k, (uint64_t)t.strides[i]) < 0) return ERROR;
    if (put_device(k, f, dev) < 0) return ERROR;
    return add_array(f, x, (uint64_t)(uintptr_t)t.data + t.byte_offset) < 0 ? ERROR : DESCRIBED;
}

static int put_ints(Key *k, PyObject *tuple) {
    Py_ssize_t n = PyTuple_Size(tuple);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GetItem(tuple, i));
        if ((v == -1 && PyErr_Occurred()) || put(k, (uint64_t)v) < 0) return -1;
    }
    return 0;
}

/* The same words from the tensor's attributes (torch without the exchange API). */
static int tensor_attributes(PyObject *x, Key *k, Arrays *f) {
    PyObject *layout = torch_attr(x, A_LAYOUT);
    if (layout == NULL) return ERROR;
    int is_strided = layout == strided;
    Py_DECREF(layout);
    if (!is_strided) return NOT_DESCRIBED;
    PyObject *dtype = torch_attr(x, A_DTYPE);
    if (dtype == NULL) return ERROR;
    long id = dtype_id(dtype);
    Py_DECREF(dtype);
    if (id < 0) return ERROR;
    if (id & 1) return NOT_DESCRIBED;
    if (put(k, T_TENSOR) < 0 || put(k, (uint64_t)id) < 0) return ERROR;
    PyObject *dev_obj = torch_attr(x, A_GET_DEVICE); /* -1: CPU (or no device at all) */
    if (dev_obj == NULL) return ERROR;
    long dev = PyLong_AsLong(dev_obj);
    Py_DECREF(dev_obj);
    if (dev == -1 && PyErr_Occurred()) return ERROR;
    int t = torch_truth(x, dev < 0 ? A_IS_CPU : A_IS_CUDA);
    if (t != 1) return t < 0 ? ERROR : NOT_DESCRIBED;
    int r = ERROR;
    PyObject *ptr = NULL, *shape = NULL, *stride = NULL;
    if ((ptr = torch_attr(x, A_DATA_PTR)) == NULL || (shape = torch_attr(x, A_SHAPE)) == NULL ||
        (stride = torch_attr(x, A_STRIDE)) == NULL)
        goto done;
    if (!PyTuple_Check(shape) || !PyTuple_Check(stride) || PyTuple_Size(shape) != PyTuple_Size(stride)) {
        r = NOT_DESCRIBED;
        goto done;
    }
    if (put(k, (uint64_t)PyTuple_Size(shape)) < 0 || put_ints(k, shape) < 0 || put_ints(k, stride) < 0 ||
        put_device(k, f, dev) < 0 || add_array_at(f, x, ptr) < 0)
        goto done;
    r = DESCRIBED;
done:
    Py_XDECREF(ptr);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return r;
}

/* A plain torch tensor: its dtype, geometry, device and stream. Tensors
 * needing DLPack's rules (requiring grad, other layouts, negative views,
 * complex ones, which may be conjugate views) are not described. After a
 * wait every distinct call into torch costs microseconds (its code is
 * cold), so the exchange's one call reads all it can. */
static int tensor_part(PyObject *x, Key *k, Arrays *f) {
    int t;
    if ((t = torch_truth(x, A_REQUIRES_GRAD)) != 0) return t < 0 ? ERROR : NOT_DESCRIBED;
    if ((t = torch_truth(x, A_IS_NEG)) != 0) return t < 0 ? ERROR : NOT_DESCRIBED;
    int r = exchange != NULL ? tensor_exchanged(x, k, f) : NOT_DESCRIBED;
    return r == NOT_DESCRIBED ? tensor_attributes(x, k, f) : r;
}

static int ndarray_part(PyObject *x, Key *k, Arrays *f) {
    PyObject *iface = PyObject_GetAttr(x, s_array_interface);
    if (iface == NULL) return ERROR;
    PyObject *data = PyObject_GetItem(iface, s_data);
    Py_DECREF(iface);
    if (data == NULL) return ERROR;
    PyObject *ptr = PyTuple_Check(data) && PyTuple_Size(data) > 0 ? PyTuple_GetItem(data, 0) : NULL;
    int added = ptr ? add_array_at(f, x, ptr) : -1;
    Py_DECREF(data);
    if (added < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "an array's __array_interface__ has no data address");
        return ERROR;
    }
    int r = ERROR;
    PyObject *shape = NULL, *strides = NULL, *dtype = NULL, *flags = NULL, *writeable = NULL;
    if ((shape = PyObject_GetAttr(x, s_shape)) && (strides = PyObject_GetAttr(x, s_strides)) &&
        (dtype = PyObject_GetAttr(x, s_dtype)) && (flags = PyObject_GetAttr(x, s_flags)) &&
        (writeable = PyObject_GetAttr(flags, s_writeable))) {
        int w = PyObject_IsTrue(writeable);
        if (w >= 0 && PyTuple_Check(shape) && PyTuple_Check(strides) && put(k, T_NDARRAY) == 0 &&
            put(k, (uint64_t)PyTuple_Size(shape)) == 0 && put_ints(k, shape) == 0 &&
            put(k, (uint64_t)PyTuple_Size(strides)) == 0 && put_ints(k, strides) == 0 && put(k, (uint64_t)w) == 0 &&
            put_object(k, dtype) == 0)
            r = DESCRIBED;
        else if (!PyErr_Occurred())
            r = NOT_DESCRIBED;
    }
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(flags);
    Py_XDECREF(writeable);
    return r;
}

static int part(PyObject *x, Key *k, Arrays *f, int depth);

static int sequence_part(PyObject *x, Key *k, Arrays *f, int depth) {
    if (depth == MAX_DEPTH) return NOT_DESCRIBED;
    int list = PyList_Check(x);
    /* A snapshot: the key reads each item once, even if the list changes meanwhile. */
    PyObject *items = list ? PyList_AsTuple(x) : Py_NewRef(x);
    if (items == NULL) return ERROR;
    Py_ssize_t n = PyTuple_Size(items);
    int r = put(k, list ? T_LIST : T_TUPLE) < 0 || put(k, (uint64_t)n) < 0 ? ERROR : DESCRIBED;
    for (Py_ssize_t i = 0; i < n && r == DESCRIBED; i++) r = part(PyTuple_GetItem(items, i), k, f, depth + 1);
    Py_DECREF(items);
    return r;
}

static int part(PyObject *x, Key *k, Arrays *f, int depth) {
    PyTypeObject *t = Py_TYPE(x);
    if (tensor_type != NULL && (PyObject *)t == tensor_type) return tensor_part(x, k, f);
    if (x == Py_None) return put(k, T_NONE) < 0 ? ERROR : DESCRIBED;
    if (t == &PyBool_Type) return put(k, x == Py_True ? T_TRUE : T_FALSE) < 0 ? ERROR : DESCRIBED;
    if (t == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (v == -1 && PyErr_Occurred()) return ERROR;
        if (overflow) return put_object(k, x) < 0 ? ERROR : DESCRIBED;
        return put(k, T_INT) < 0 || put(k, (uint64_t)v) < 0 ? ERROR : DESCRIBED;
    }
    if (t == &PyUnicode_Type) return put_str(k, x, T_STR) < 0 ? ERROR : DESCRIBED;
    if ((PyObject *)t == ndarray_type) return ndarray_part(x, k, f);
    if (t == &PyFloat_Type) { /* its bits: -0.0 and 0.0 differ as arguments */
        double d = PyFloat_AsDouble(x);
        uint64_t bits;
        memcpy(&bits, &d, sizeof bits);
        return put(k, T_FLOAT) < 0 || put(k, bits) < 0 ? ERROR : DESCRIBED;
    }
    if (t == &PyList_Type || t == &PyTuple_Type) return sequence_part(x, k, f, depth);
    /* out_dtype: torch.bfloat16, np.float16, np.dtype("f2"), ... */
    if (torch_dtype != NULL && (PyObject *)t == torch_dtype) {
        long id = dtype_id(x);
        return id < 0 || put(k, T_TORCH_DTYPE) < 0 || put(k, (uint64_t)id) < 0 ? ERROR : DESCRIBED;
    }
    int dtype = PyType_Check(x);
    if (!dtype && np_dtype != NULL) {
        dtype = PyObject_IsInstance(x, np_dtype);
        if (dtype < 0) return ERROR;
    }
    if (!dtype) return NOT_DESCRIBED;
    return put_object(k, x) < 0 ? ERROR : DESCRIBED;
}

/* _fastcall.key_of for args[start:] and kwargs (NULL: none): the key (a
 * new reference), Py_None where it describes not the call, or NULL on
 * error; `f` receives the arrays and their addresses. */
static PyObject *key_of(PyObject *args, Py_ssize_t start, PyObject *kwargs, Arrays *f) {
    if (tensor_type == NULL && torch_probe != NULL) { /* torch imported since the last call? */
        PyObject *r = PyObject_CallNoArgs(torch_probe);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Key k;
    key_init(&k);
    int r = DESCRIBED;
    Py_ssize_t n = PyTuple_Size(args);
    for (Py_ssize_t i = start; i < n && r == DESCRIBED; i++) r = part(PyTuple_GetItem(args, i), &k, f, 0);
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *name, *value;
        while (r == DESCRIBED && PyDict_Next(kwargs, &pos, &name, &value)) { /* a name is a str */
            r = put_str(&k, name, T_NAME) < 0 ? ERROR : part(value, &k, f, 0);
        }
    }
    if (r == DESCRIBED && f->n > 1) { /* an array given twice: which positions alias */
        int aliased = 0;
        for (Py_ssize_t i = 1; i < f->n && !aliased; i++)
            for (Py_ssize_t j = 0; j < i && !aliased; j++) aliased = f->objs[i] == f->objs[j];
        if (aliased && (put(&k, T_ALIAS) < 0 || put(&k, (uint64_t)f->n) < 0)) r = ERROR;
        for (Py_ssize_t i = 0; aliased && i < f->n && r == DESCRIBED; i++) {
            Py_ssize_t j = 0;
            while (f->objs[j] != f->objs[i]) j++;
            if (put(&k, (uint64_t)j) < 0) r = ERROR;
        }
    }
    PyObject *key = r == DESCRIBED ? key_done(&k) : r == NOT_DESCRIBED ? Py_NewRef(Py_None) : NULL;
    key_clear(&k);
    return key;
}

/* (key, objs, ptrs) as _fastcall.key_of returns it. */
static PyObject *found_tuple(PyObject *key, Arrays *f) {
    PyObject *objs = PyList_New(f->n), *ptrs = PyList_New(f->n);
    if (objs == NULL || ptrs == NULL) goto fail;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        PyObject *p = PyLong_FromUnsignedLongLong(f->ptrs[i]);
        if (p == NULL) goto fail;
        PyList_SetItem(ptrs, i, p);
        PyList_SetItem(objs, i, Py_NewRef(f->objs[i]));
    }
    PyObject *t = PyTuple_Pack(3, key, objs, ptrs);
    Py_DECREF(objs);
    Py_DECREF(ptrs);
    return t;
fail:
    Py_XDECREF(objs);
    Py_XDECREF(ptrs);
    return NULL;
}

static PyObject *py_key_of(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 2 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "key_of(args: tuple, kwargs: dict)");
        return NULL;
    }
    Arrays f;
    arrays_init(&f);
    PyObject *key = key_of(argv[0], 0, argv[1], &f);
    PyObject *r = key == Py_None ? Py_NewRef(Py_None) : key ? found_tuple(key, &f) : NULL;
    Py_XDECREF(key);
    arrays_clear(&f);
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
    Py_ssize_t nbumped;
    Py_ssize_t *bumped;      /* the arrays given that are torch tensors the call writes */
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

/* Native(op, fn, words, writes, makers, result, keep, bumped): `op` an
 * index of enum Op, `fn` the C function's address, `words` its arguments
 * after the group (ints: addresses, integer arguments as two's complement,
 * a float's bits), `writes` ((array index, address of a descriptor's
 * data), ...), `bumped` (array index, ...). */
static PyObject *native_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int op;
    PyObject *fn, *words, *writes, *makers, *result, *keep, *bumped;
    if (kw != NULL && PyDict_Size(kw) > 0) {
        PyErr_SetString(PyExc_TypeError, "Native takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iOO!O!O!OOO!", &op, &fn, &PyTuple_Type, &words, &PyTuple_Type, &writes,
                          &PyTuple_Type, &makers, &result, &keep, &PyTuple_Type, &bumped))
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
    n->nbumped = PyTuple_Size(bumped);
    n->bumped = PyMem_Calloc(n->nbumped + 1, sizeof *n->bumped);
    if (n->bumped == NULL) ok = 0;
    for (Py_ssize_t i = 0; ok && i < n->nbumped; i++)
        n->bumped[i] = (Py_ssize_t)word_of(PyTuple_GetItem(bumped, i), &ok);
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
    PyMem_Free(n->bumped);
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
static PyObject *built(PyObject *spec, const Arrays *f) {
    if (PyLong_Check(spec)) {
        Py_ssize_t i = PyLong_AsSsize_t(spec);
        if (i < 0 || i >= f->n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a kept call returns an array it was not given");
            return NULL;
        }
        return Py_NewRef(f->objs[i]);
    }
    PyObject *kind = PyTuple_GetItem(spec, 0), *items = PyTuple_GetItem(spec, 1);
    if (kind == NULL || items == NULL) return NULL;
    Py_ssize_t n = PyList_Size(items);
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = built(PyList_GetItem(items, i), f);
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
    /* group._owned.raw: the handle without the `raw` property's Python
     * frame (after a wait, a cold frame costs microseconds); a closed group
     * (`_owned` None) or one inherited through a fork (`raw` None) goes
     * through the property, which raises. */
    PyObject *owned = PyObject_GetAttr(group, s_owned), *raw = NULL;
    if (owned != NULL && owned != Py_None) raw = PyObject_GetAttr(owned, s_raw);
    Py_XDECREF(owned);
    if (raw == NULL || raw == Py_None) {
        Py_XDECREF(raw);
        PyErr_Clear();
        raw = PyObject_GetAttr(group, s_raw);
    }
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
static PyObject *run(Native *n, PyObject *group, Arrays *f) {
    Py_ssize_t makers = PyTuple_Size(n->makers);
    for (Py_ssize_t i = 0; i < makers; i++) {
        PyObject *made = PyObject_CallNoArgs(PyTuple_GetItem(n->makers, i));
        if (made == NULL) return NULL;
        int r = PyTuple_Check(made) && PyTuple_Size(made) == 2
                    ? add_array_at(f, PyTuple_GetItem(made, 0), PyTuple_GetItem(made, 1))
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
    for (Py_ssize_t i = 0; i < n->nbumped; i++) {
        if (n->bumped[i] >= f->n || bump_fn == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "a kept call bumps an array it was not given");
            return NULL;
        }
        PyObject *r = PyObject_CallFunctionObjArgs(bump_fn, f->objs[n->bumped[i]], NULL);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    return built(n->result, f);
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

/* _fastcall.call of `prepare_call` on `group` with args[start:] and
 * `kwargs` (NULL: none). */
static PyObject *call(PyObject *group, PyObject *prepare_call, PyObject *args, Py_ssize_t start, PyObject *kwargs) {
    if (slow_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "symm._fastcall_ext: used before symm._fastcall configured it");
        return NULL;
    }
    Arrays f;
    arrays_init(&f);
    PyObject *key = NULL, *found = NULL, *result = NULL, *rest = NULL, *kw = NULL;
    PyObject *caches = PyObject_GetAttr(group, s_calls);
    if (caches == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else if (PyDict_CheckExact(caches)) { /* else no call is kept */
        key = key_of(args, start, kwargs, &f);
        if (key == NULL) goto done;
        if (key != Py_None) {
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
    rest = start == 0 ? Py_NewRef(args) : PyTuple_GetSlice(args, start, PyTuple_Size(args));
    kw = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
    if (rest != NULL && kw != NULL)
        result = PyObject_CallFunctionObjArgs(slow_call, group, prepare_call, rest, kw, found ? found : Py_None, NULL);
done:
    Py_XDECREF(caches);
    Py_XDECREF(key);
    Py_XDECREF(found);
    Py_XDECREF(rest);
    Py_XDECREF(kw);
    arrays_clear(&f);
    return result;
}

/* call(group, prepare_call, args, kwargs): _fastcall.call. */
static PyObject *py_call(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 4 || !PyTuple_Check(argv[2]) || !PyDict_Check(argv[3])) {
        PyErr_SetString(PyExc_TypeError, "call(group, prepare_call, args: tuple, kwargs: dict)");
        return NULL;
    }
    return call(argv[0], argv[1], argv[2], 0, argv[3]);
}

/* call_op(prepare_call, args, kwargs): an operation's call as the user made
 * it, the group first in `args` (the operation's wrapper, one frame less). */
static PyObject *py_call_op(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 3 || !PyTuple_Check(argv[1]) || PyTuple_Size(argv[1]) < 1 || !PyDict_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "call_op(prepare_call, args: tuple (group, ...), kwargs: dict)");
        return NULL;
    }
    return call(PyTuple_GetItem(argv[1], 0), argv[0], argv[1], 1, PyDict_Size(argv[2]) ? argv[2] : NULL);
}

static void replace(PyObject **at, PyObject *value) {
    PyObject *old = *at;
    *at = Py_XNewRef(value);
    Py_XDECREF(old);
}

/* configure(ndarray, dtype, slow_call, torch_probe, bump): once, at import. */
static PyObject *py_configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *nd, *dt, *slow, *probe, *bump;
    if (!PyArg_ParseTuple(args, "OOOOO", &nd, &dt, &slow, &probe, &bump)) return NULL;
    replace(&ndarray_type, nd);
    replace(&np_dtype, dt);
    replace(&slow_call, slow);
    replace(&torch_probe, probe == Py_None ? NULL : probe); /* None: torch is not to be asked for */
    replace(&bump_fn, bump);
    Py_RETURN_NONE;
}

/* torch's exchange API, where it publishes one this file can read. */
static const ExchangeAPI *exchange_of(PyObject *tensor) {
    PyObject *capsule = PyObject_GetAttr(tensor, s_exchange_api);
    if (capsule == NULL) {
        PyErr_Clear();
        return NULL;
    }
    const ExchangeHeader *h = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    Py_DECREF(capsule);
    if (h == NULL) {
        PyErr_Clear();
        return NULL;
    }
    while (h != NULL && h->version.major > 1) h = h->prev_api; /* newer majors chain to older ones */
    if (h == NULL || h->version.major != 1 || h->version.minor < 2) return NULL;
    const ExchangeAPI *api = (const ExchangeAPI *)h;
    return api->dltensor_from_py_object_no_sync != NULL && api->current_work_stream != NULL ? api : NULL;
}

/* The exchange's dtypes of `samples` (tensors, one per dtype) with their
 * numbers in keys; those it cannot export are left to the attributes. */
static int learn_dtypes(PyObject *samples) {
    n_dl_dtypes = 0;
    Py_ssize_t n = PyTuple_Size(samples);
    for (Py_ssize_t i = 0; exchange_found != NULL && i < n && n_dl_dtypes < MAX_DL_DTYPES; i++) {
        PyObject *x = PyTuple_GetItem(samples, i);
        DLTensor dl;
        if (Py_TYPE(x) != (PyTypeObject *)tensor_type || exchange_found->dltensor_from_py_object_no_sync(x, &dl) != 0) {
            PyErr_Clear();
            continue;
        }
        PyObject *dtype = torch_attr(x, A_DTYPE);
        long id = dtype ? dtype_id(dtype) : -1;
        Py_XDECREF(dtype);
        if (id < 0) return -1;
        dl_dtypes[n_dl_dtypes].dl = dl_word(dl.dtype);
        dl_dtypes[n_dl_dtypes++].id = id;
    }
    return 0;
}

/* set_torch(torch.Tensor, torch.strided, torch.dtype, stream_of, samples):
 * once torch is imported; `samples`, a tuple of empty tensors, one per
 * dtype the exchange reads without the dtype attribute. */
static PyObject *py_set_torch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *t, *s, *d, *st, *samples;
    if (!PyArg_ParseTuple(args, "OOOOO!", &t, &s, &d, &st, &PyTuple_Type, &samples)) return NULL;
    if (!PyType_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "set_torch: torch.Tensor is a type");
        return NULL;
    }
    PyObject *descr[ATTRS];
    descrgetfunc get[ATTRS];
    for (int i = 0; i < ATTRS; i++) {
        /* On the class, an attribute's descriptor (a getset, or a property)
         * and a method's function, as instance lookups find them. */
        if ((descr[i] = PyObject_GetAttrString(t, ATTR[i].name)) == NULL) {
            while (i--) Py_DECREF(descr[i]);
            return NULL;
        }
        get[i] = ATTR[i].method ? NULL : (descrgetfunc)PyType_GetSlot(Py_TYPE(descr[i]), Py_tp_descr_get);
        if (!ATTR[i].method && get[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "set_torch: torch.Tensor.%s is no descriptor", ATTR[i].name);
            for (int j = 0; j <= i; j++) Py_DECREF(descr[j]);
            return NULL;
        }
    }
    PyObject *ids = PyDict_New();
    if (ids == NULL) {
        for (int i = 0; i < ATTRS; i++) Py_DECREF(descr[i]);
        return NULL;
    }
    for (int i = 0; i < ATTRS; i++) {
        replace(&attr_descr[i], descr[i]);
        Py_DECREF(descr[i]);
        attr_get[i] = get[i];
    }
    replace(&dtype_ids, ids);
    Py_DECREF(ids);
    replace(&tensor_type, t);
    replace(&strided, s);
    replace(&torch_dtype, d);
    replace(&stream_of, st);
    exchange = exchange_found = exchange_of(t);
    if (learn_dtypes(samples) < 0) return NULL;
    Py_RETURN_NONE;
}

/* use_exchange(on) -> whether torch's exchange API reads tensors now
 * (tests compare it with the attribute reader). */
static PyObject *py_use_exchange(PyObject *self, PyObject *on) {
    (void)self;
    int t = PyObject_IsTrue(on);
    if (t < 0) return NULL;
    exchange = t ? exchange_found : NULL;
    return PyBool_FromLong(exchange != NULL);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))py_call, METH_FASTCALL, "_fastcall.call, its hit path in C."},
    {"call_op", (PyCFunction)(void (*)(void))py_call_op, METH_FASTCALL, "call_op(prepare_call, (group, *args), kwargs)"},
    {"key_of", (PyCFunction)(void (*)(void))py_key_of, METH_FASTCALL, "_fastcall.key_of, in C."},
    {"call_bound", (PyCFunction)(void (*)(void))py_call_bound, METH_FASTCALL, "A bound call (symm.bind), from C."},
    {"configure", py_configure, METH_VARARGS, "configure(ndarray, dtype, slow_call, torch_probe)"},
    {"set_torch", py_set_torch, METH_VARARGS, "set_torch(Tensor, strided, dtype, stream_of, samples)"},
    {"use_exchange", py_use_exchange, METH_O, "use_exchange(on) -> whether DLPack's exchange API reads tensors"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcall_ext", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastcall_ext(void) {
    struct {
        PyObject **at;
        const char *name;
    } names[] = {
        {&s_strides, "strides"},   {&s_dtype, "dtype"},           {&s_shape, "shape"},
        {&s_flags, "flags"},       {&s_writeable, "writeable"},   {&s_array_interface, "__array_interface__"},
        {&s_data, "data"},         {&s_calls, "_calls"},          {&s_native, "native"},
        {&s_raw, "raw"},           {&s_owned, "_owned"},          {&s_check, "_check"},          {&s_is_complex, "is_complex"},
        {&s_exchange_api, "__dlpack_c_exchange_api__"},
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
