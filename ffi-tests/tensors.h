/*
 * Host tensors for the operation tests: buffers with chosen layouts,
 * poisoned with 0xFF bytes (NaN in every float type) so that elements an
 * operation failed to write show, reproducible random values, and the
 * element conversions a float64 reference needs.
 *
 * fp8 values are decoded here independently of the library (OCP E4M3 as
 * torch.float8_e4m3fn, E5M2 as torch.float8_e5m2), so the references check
 * its decoding too.
 *
 * Every value is a pure function of (tag, rank, logical index), so any rank
 * can recompute its peers' inputs for a reference without communicating.
 */
#ifndef SYMM_TEST_TENSORS_H
#define SYMM_TEST_TENSORS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "symm.h"

/* ---- element types --------------------------------------------------------- */
static inline size_t dtype_size(int dt) {
    switch (dt) {
    case SYMM_DTYPE_F32: case SYMM_DTYPE_INT32: return 4;
    case SYMM_DTYPE_BF16: case SYMM_DTYPE_F16: return 2;
    case SYMM_DTYPE_INT64: return 8;
    default: return 1;
    }
}

static inline int is_int_dtype(int dt) {
    return dt == SYMM_DTYPE_INT8 || dt == SYMM_DTYPE_UINT8 || dt == SYMM_DTYPE_INT32 || dt == SYMM_DTYPE_INT64;
}

static inline const char *dtype_name(int dt) {
    switch (dt) {
    case SYMM_DTYPE_F32: return "f32";
    case SYMM_DTYPE_BF16: return "bf16";
    case SYMM_DTYPE_F16: return "f16";
    case SYMM_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case SYMM_DTYPE_INT8: return "int8";
    case SYMM_DTYPE_UINT8: return "uint8";
    case SYMM_DTYPE_INT32: return "int32";
    case SYMM_DTYPE_INT64: return "int64";
    default: return "fp8_e5m2";
    }
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    int exp = (h >> 10) & 0x1f;
    float man = (float)(h & 0x3ff), f;
    if (exp == 0) f = ldexpf(man, -24);
    else if (exp == 31) f = man != 0.0f ? NAN : INFINITY;
    else f = ldexpf(man + 1024.0f, exp - 25);
    return (h & 0x8000) ? -f : f;
}

/* For finite |f| < 65504; rounds to nearest even (nearbyint's default mode). */
static inline uint16_t f32_to_f16(float f) {
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (a < ldexp(1.0, -14)) return sign | (uint16_t)nearbyint(ldexp(a, 24)); /* subnormal */
    int e;
    double fr = frexp(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    long m = lrint((2.0 * fr - 1.0) * 1024.0);
    if (m == 1024) { m = 0; e++; }
    return sign | (uint16_t)(((e - 1 + 15) << 10) | m);
}

/* E4M3 (fn): exponent bias 7, 3 mantissa bits, no infinities, NaN = S.1111.111.
 * E5M2: exponent bias 15, 2 mantissa bits, IEEE-like top exponent. */
static inline double fp8_to_f64(int dt, uint8_t b) {
    int e4m3 = dt == SYMM_DTYPE_FP8_E4M3, mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    int exp = (b & 0x7f) >> mbits, man = b & ((1 << mbits) - 1), top = e4m3 ? 15 : 31;
    double v;
    if (e4m3 && (b & 0x7f) == 0x7f) return NAN;
    if (!e4m3 && exp == top) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexp(man, 1 - bias - mbits);
    else v = ldexp(man + (1 << mbits), exp - bias - mbits);
    return (b & 0x80) ? -v : v;
}

/* An integer element, exactly (uint8 and int8 through int64 all fit). */
static inline int64_t load_int(int dt, const void *p) {
    int32_t i32;
    int64_t i64;
    switch (dt) {
    case SYMM_DTYPE_INT8: return *(const int8_t *)p;
    case SYMM_DTYPE_UINT8: return *(const uint8_t *)p;
    case SYMM_DTYPE_INT32: memcpy(&i32, p, 4); return i32;
    default: memcpy(&i64, p, 8); return i64;
    }
}

/* `v` truncated to the integer type (two's complement wrap). */
static inline int64_t wrap_int(int dt, uint64_t v) {
    switch (dt) {
    case SYMM_DTYPE_INT8: return (int8_t)(uint8_t)v;
    case SYMM_DTYPE_UINT8: return (uint8_t)v;
    case SYMM_DTYPE_INT32: return (int32_t)(uint32_t)v;
    default: return (int64_t)v;
    }
}

static inline double load_elem(int dt, const void *p) {
    uint16_t h;
    float f;
    if (is_int_dtype(dt)) return (double)load_int(dt, p);
    switch (dt) {
    case SYMM_DTYPE_F32: memcpy(&f, p, 4); return f;
    case SYMM_DTYPE_BF16: memcpy(&h, p, 2); return bf16_to_f32(h);
    case SYMM_DTYPE_F16: memcpy(&h, p, 2); return f16_to_f32(h);
    default: return fp8_to_f64(dt, *(const uint8_t *)p);
    }
}

/* ---- reproducible values ------------------------------------------------- */
static inline uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes of element `i` of rank `rank`'s tensor `tag`: uniform in
 * [-1, 1) rounded to the type, or for fp8 a random finite value of
 * magnitude 1/8 to 15 (random sign and mantissa, exponent within 3 of 1,
 * so products and sums stay far from fp8's and bf16's limits). Integers
 * take values f32 (and, summed, f64) cannot hold: int64 +-(2^60 + up to
 * 2^20) or within 2^20 of its limits (sums wrap), int32 likewise around
 * 2^25 + 1 and its limits, int8 and uint8 any value. */
static inline void value_bytes(int dt, uint64_t tag, int rank, int64_t i, void *out) {
    uint64_t h = mix64(mix64(tag * 1000003u + (uint64_t)rank) ^ (uint64_t)i);
    float v = (float)((double)(h >> 11) * ldexp(1.0, -52) - 1.0);
    uint16_t b;
    int64_t small = (int64_t)(h >> 44), sign = (h & 1) ? -1 : 1, x64;
    int32_t x32;
    int near_limit = (h >> 1) % 4 == 0;
    switch (dt) {
    case SYMM_DTYPE_INT64:
        x64 = sign * (near_limit ? INT64_MAX - small : (INT64_C(1) << 60) + small);
        memcpy(out, &x64, 8);
        break;
    case SYMM_DTYPE_INT32:
        x32 = (int32_t)(sign * (near_limit ? INT32_MAX - small : (INT64_C(1) << 25) + 1 + small));
        memcpy(out, &x32, 4);
        break;
    case SYMM_DTYPE_INT8:
    case SYMM_DTYPE_UINT8: *(uint8_t *)out = (uint8_t)(h >> 56); break;
    case SYMM_DTYPE_F32: memcpy(out, &v, 4); break;
    case SYMM_DTYPE_BF16: b = f32_to_bf16(v); memcpy(out, &b, 2); break;
    case SYMM_DTYPE_F16: b = f32_to_f16(v); memcpy(out, &b, 2); break;
    default: {
        int mbits = dt == SYMM_DTYPE_FP8_E4M3 ? 3 : 2, bias = dt == SYMM_DTYPE_FP8_E4M3 ? 7 : 15;
        int exp = bias - 3 + (int)((h >> 8) % 7);
        *(uint8_t *)out = (uint8_t)((h & 0x80) | (exp << mbits) | ((h >> 16) & ((1u << mbits) - 1)));
        break;
    }
    }
}

static inline double value(int dt, uint64_t tag, int rank, int64_t i) {
    unsigned char b[8];
    value_bytes(dt, tag, rank, i, b);
    return load_elem(dt, b);
}

/* An integer tensor's element, exactly. */
static inline int64_t int_value(int dt, uint64_t tag, int rank, int64_t i) {
    unsigned char b[8];
    value_bytes(dt, tag, rank, i, b);
    return load_int(dt, b);
}

/* ---- buffers with layouts ----------------------------------------------- */
enum layout {
    CONTIGUOUS,
    PADDED,     /* row-major, every dimension padded by one: strided, leading dims do not collapse */
    TRANSPOSED, /* dimension 0 fastest, padded: column-major for matrices */
    COLUMN_MAJOR, /* dimension 0 fastest, unpadded (fp8 B operands: K-major) */
};

#define GUARD 16 /* poisoned elements before the view */

typedef struct {
    symm_tensor_t t;
    unsigned char *base;
    size_t bytes;
} tbuf_t;

static inline int64_t numel(const symm_tensor_t *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* Element offset (in elements from data) of logical row-major index i. */
static inline int64_t offset_of(const symm_tensor_t *t, int64_t i) {
    int64_t off = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (i % t->shape[d]) * t->strides[d];
        i /= t->shape[d];
    }
    return off;
}

static inline void *elem_ptr(const symm_tensor_t *t, int64_t i) {
    return (unsigned char *)t->data + offset_of(t, i) * (int64_t)dtype_size(t->dtype);
}

static inline tbuf_t tb_make(int dt, int ndim, const int64_t *shape, int layout) {
    tbuf_t b;
    int64_t extent = 1;
    memset(&b, 0, sizeof b);
    b.t = symm_tensor_contiguous(NULL, dt, ndim, shape);
    if (layout == PADDED) {
        int64_t s = 1;
        for (int d = ndim - 1; d >= 0; d--) { b.t.strides[d] = s; s *= shape[d] + 1; }
    } else if (layout == TRANSPOSED || layout == COLUMN_MAJOR) {
        int64_t s = 1;
        for (int d = 0; d < ndim; d++) { b.t.strides[d] = s; s *= shape[d] + (d == 0 && layout == TRANSPOSED); }
    }
    for (int d = 0; d < ndim; d++) extent += (shape[d] - 1) * b.t.strides[d];
    b.bytes = (size_t)(extent + 2 * GUARD) * dtype_size(dt);
    b.base = (unsigned char *)malloc(b.bytes);
    memset(b.base, 0xff, b.bytes);
    b.t.data = b.base + GUARD * dtype_size(dt);
    return b;
}

static inline void tb_free(tbuf_t *b) { free(b->base); }

/* Fills every element with rank `rank`'s values of tensor `tag`. */
static inline void tb_fill(tbuf_t *b, uint64_t tag, int rank) {
    for (int64_t i = 0; i < numel(&b->t); i++) value_bytes(b->t.dtype, tag, rank, i, elem_ptr(&b->t, i));
}

static inline double tb_get(const tbuf_t *b, int64_t i) { return load_elem(b->t.dtype, elem_ptr(&b->t, i)); }

/* Every byte is still the poison. */
static inline int tb_untouched(const tbuf_t *b) {
    for (size_t i = 0; i < b->bytes; i++)
        if (b->base[i] != 0xff) return 0;
    return 1;
}

/* Every byte outside the view's elements is still the poison. */
static inline int tb_outside_untouched(const tbuf_t *b) {
    size_t es = dtype_size(b->t.dtype), ok = 1;
    unsigned char *in_view = (unsigned char *)calloc(b->bytes, 1);
    for (int64_t i = 0; i < numel(&b->t); i++) {
        size_t at = (size_t)((unsigned char *)elem_ptr(&b->t, i) - b->base);
        memset(in_view + at, 1, es);
    }
    for (size_t i = 0; i < b->bytes; i++)
        if (!in_view[i] && b->base[i] != 0xff) ok = 0;
    free(in_view);
    return (int)ok;
}

/* Multi-index of logical row-major index i, and back. */
static inline void unravel(int ndim, const int64_t *shape, int64_t i, int64_t *idx) {
    for (int d = ndim - 1; d >= 0; d--) { idx[d] = i % shape[d]; i /= shape[d]; }
}

static inline int64_t ravel(int ndim, const int64_t *shape, const int64_t *idx) {
    int64_t i = 0;
    for (int d = 0; d < ndim; d++) i = i * shape[d] + idx[d];
    return i;
}

/* Relative Frobenius error of `got` against `ref`, accumulated by the caller. */
typedef struct { double diff2, ref2; } err_acc_t;

static inline void err_add(err_acc_t *e, double got, double ref) {
    e->diff2 += (got - ref) * (got - ref);
    e->ref2 += ref * ref;
}

static inline double err_rel(const err_acc_t *e) { return sqrt(e->diff2 / e->ref2); }

static inline double tolerance(int dt) {
    return dt == SYMM_DTYPE_F32 ? 1e-5 : dt == SYMM_DTYPE_BF16 ? 2e-2 : 5e-3;
}

#endif
