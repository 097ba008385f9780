//! The two 8-bit float formats, decoded to f32 and encoded from it: the
//! host backend's fp8 matmuls read them through here and write fp8 outputs
//! with [`Fp8::encode`] (which `kernels/quantize.cu` mirrors bit for bit),
//! and the CUDA tests build references with it. Layouts follow the OCP 8-bit float spec (and `torch.float8_*`):
//!
//! * E4M3 "fn" (`torch.float8_e4m3fn`): 1 sign, 4 exponent bits with bias 7,
//!   3 mantissa bits; no infinities, and the one NaN pattern per sign is
//!   exponent and mantissa all ones (0x7f, 0xff), so the top exponent still
//!   holds finite values up to 448.
//! * E5M2 (`torch.float8_e5m2`): 1 sign, 5 exponent bits with bias 15, 2
//!   mantissa bits: IEEE-like, with infinities and NaNs at the top exponent,
//!   largest finite 57344.
//!
//! Both have subnormals at exponent 0. Decoding is exact (every value is an
//! f32), so a 256-entry table per format does it.
//!
//! Encoding is what cuBLASLt does to an fp8 output (and PTX's
//! `cvt.rn.satfinite`): round to nearest, ties to even, subnormals kept;
//! saturating, so a magnitude beyond the largest finite value (infinity
//! too) becomes that value with its sign (E4M3 448, E5M2 57344); NaN
//! becomes the NaN 0x7f.

use once_cell::sync::Lazy;

/// Which 8-bit format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    E4M3,
    E5M2,
}

impl Fp8 {
    /// The value of `byte`.
    pub fn decode(self, byte: u8) -> f32 {
        match self {
            Fp8::E4M3 => E4M3_TABLE[byte as usize],
            Fp8::E5M2 => E5M2_TABLE[byte as usize],
        }
    }

    /// Mantissa bits, exponent bias and the code of the largest finite
    /// magnitude.
    const fn layout(self) -> (u32, i32, u8) {
        match self {
            Fp8::E4M3 => (3, 7, 0x7e),
            Fp8::E5M2 => (2, 15, 0x7b),
        }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        self.decode(self.layout().2)
    }

    /// `v` rounded to this format, saturating (see the module documentation).
    pub fn encode(self, v: f32) -> u8 {
        if v.is_nan() {
            return 0x7f;
        }
        let (mbits, bias, max_code) = self.layout();
        let sign = ((v.to_bits() >> 31) as u8) << 7;
        let a = v.abs();
        if a >= self.max() {
            return sign | max_code;
        }
        // The exponent of `a`'s binade, no lower than the normal minimum
        // (below it the spacing stays that of the subnormals).
        let e = (((a.to_bits() >> 23) & 0xff) as i32 - 127).max(1 - bias);
        // `a` in units of the spacing at that exponent: scaling by a power
        // of two is exact, so this rounds once.
        let units = (a * 2f32.powi(mbits as i32 - e)).round_ties_even() as u32;
        // Below the maximum, so at most one binade up: `units` 2^(mbits+1)
        // is the next binade's first value, which the code's arithmetic
        // below carries into the exponent.
        let code = if e == 1 - bias && units < 1 << mbits {
            units
        } else {
            (((e + bias) as u32) << mbits) + units - (1 << mbits)
        };
        sign | code as u8
    }
}

static E4M3_TABLE: Lazy<[f32; 256]> = Lazy::new(|| std::array::from_fn(|b| decode_e4m3fn(b as u8)));
static E5M2_TABLE: Lazy<[f32; 256]> = Lazy::new(|| std::array::from_fn(|b| decode_e5m2(b as u8)));

/// Sign, then `mantissa / 2^mbits` scaled like an IEEE float of the given
/// exponent width (subnormal at exponent 0).
fn ieee_like(byte: u8, ebits: u32, mbits: u32) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> mbits) & ((1 << ebits) - 1)) as i32;
    let man = (byte & ((1 << mbits) - 1)) as f32 / (1 << mbits) as f32;
    let bias = (1 << (ebits - 1)) - 1;
    let magnitude = if exp == 0 { man * 2f32.powi(1 - bias) } else { (1.0 + man) * 2f32.powi(exp - bias) };
    sign * magnitude
}

fn decode_e4m3fn(byte: u8) -> f32 {
    if byte & 0x7f == 0x7f {
        return f32::NAN;
    }
    ieee_like(byte, 4, 3)
}

fn decode_e5m2(byte: u8) -> f32 {
    if (byte >> 2) & 0x1f == 0x1f {
        return match byte & 0x3 {
            0 if byte & 0x80 != 0 => f32::NEG_INFINITY,
            0 => f32::INFINITY,
            _ => f32::NAN,
        };
    }
    ieee_like(byte, 5, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_known_values() {
        let d = |b| Fp8::E4M3.decode(b);
        assert_eq!(d(0x00), 0.0);
        assert!(d(0x80) == 0.0 && d(0x80).is_sign_negative());
        assert_eq!(d(0x38), 1.0); // exponent 7 = bias
        assert_eq!(d(0x40), 2.0);
        assert_eq!(d(0x3c), 1.5);
        assert_eq!(d(0xb8), -1.0);
        assert_eq!(d(0x01), 2f32.powi(-9)); // smallest subnormal: 1/8 * 2^-6
        assert_eq!(d(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(d(0x7e), 448.0); // top exponent is finite except mantissa 7
        assert_eq!(d(0x78), 256.0);
        assert!(d(0x7f).is_nan() && d(0xff).is_nan());
        assert_eq!((0..=255u8).filter(|&b| d(b).is_nan()).count(), 2);
        assert!((0..=255u8).all(|b| !d(b).is_infinite()));
    }

    #[test]
    fn e5m2_known_values() {
        let d = |b| Fp8::E5M2.decode(b);
        assert_eq!(d(0x3c), 1.0); // exponent 15 = bias
        assert_eq!(d(0x3e), 1.5);
        assert_eq!(d(0xc0), -2.0);
        assert_eq!(d(0x01), 2f32.powi(-16)); // 1/4 * 2^-14
        assert_eq!(d(0x7b), 57344.0);
        assert_eq!(d(0x7c), f32::INFINITY);
        assert_eq!(d(0xfc), f32::NEG_INFINITY);
        assert!(d(0x7d).is_nan() && d(0x7e).is_nan() && d(0x7f).is_nan() && d(0xff).is_nan());
        // E5M2 is the top byte of an f16: the half crate agrees on every byte.
        for b in 0..=255u8 {
            let h = half::f16::from_bits((b as u16) << 8).to_f32();
            assert!(h == d(b) || (h.is_nan() && d(b).is_nan()), "byte {b:#04x}: {h} vs {}", d(b));
        }
    }

    /// The encoding by another route: the nearest finite code by f64
    /// distance over the decoded table, ties to the even code, magnitudes
    /// past the largest finite value clamped to it.
    fn nearest(fmt: Fp8, v: f64) -> u8 {
        if v.is_nan() {
            return 0x7f;
        }
        let finite: Vec<u8> = (0..0x80u8).filter(|&b| fmt.decode(b).is_finite()).collect();
        let max = finite.iter().map(|&b| fmt.decode(b) as f64).fold(0.0, f64::max);
        let a = v.abs().min(max);
        let mut best = finite[0];
        for &b in &finite {
            let (d, db) = ((fmt.decode(b) as f64 - a).abs(), (fmt.decode(best) as f64 - a).abs());
            if d < db || (d == db && b % 2 == 0) {
                best = b;
            }
        }
        best | if v.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn encoding_round_trips_every_finite_code() {
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            for b in 0..=255u8 {
                let v = fmt.decode(b);
                if v.is_finite() {
                    assert_eq!(fmt.encode(v), b, "{fmt:?} {b:#04x} ({v})");
                }
            }
        }
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        let e4 = |v| Fp8::E4M3.encode(v);
        // 17 lies halfway between 16 (0x58, even) and 18 (0x59): to 16;
        // 19 between 18 and 20 (0x5a): to 20.
        assert_eq!((e4(17.0), e4(19.0), e4(17.01), e4(-16.99)), (0x58, 0x5a, 0x59, 0xd8));
        // Subnormals: 2^-10 is half the smallest (0x01), ties to 0; 3 * 2^-10 to 0x02.
        assert_eq!((e4(2f32.powi(-10)), e4(3.0 * 2f32.powi(-10)), e4(-1e-30)), (0x00, 0x02, 0x80));
        // Past 448 (also where rounding would reach the NaN code) and infinities saturate.
        assert_eq!(
            (e4(460.0), e4(470.0), e4(1e9), e4(f32::INFINITY), e4(-f32::INFINITY)),
            (0x7e, 0x7e, 0x7e, 0x7e, 0xfe)
        );
        let e5 = |v| Fp8::E5M2.encode(v);
        assert_eq!((e5(60000.0), e5(f32::INFINITY), e5(-1e30)), (0x7b, 0x7b, 0xfb));
        assert_eq!((Fp8::E4M3.max(), Fp8::E5M2.max()), (448.0, 57344.0));
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            assert!(fmt.decode(fmt.encode(f32::NAN)).is_nan());
            assert!(fmt.decode(fmt.encode(-f32::NAN)).is_nan());
        }
    }

    /// Every midpoint between neighbouring codes, the values just beside
    /// it, and a sweep of f32s over the whole range, against `nearest`.
    #[test]
    fn encoding_matches_the_nearest_code_table() {
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            let finite: Vec<f32> = (0..0x80u8).map(|b| fmt.decode(b)).filter(|v| v.is_finite()).collect();
            let mut probes: Vec<f32> = Vec::new();
            for w in finite.windows(2) {
                let mid = (w[0] + w[1]) / 2.0; // exact: both have few bits
                probes.extend([mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)]);
            }
            let mut x = 0x1234_5678u32;
            for _ in 0..20000 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // Exponents from 2^-20 to 2^17, any mantissa and sign.
                let exp = 107 + (x >> 8) % 38;
                probes.push(f32::from_bits((x & 0x8000_0000) | (exp << 23) | (x & 0x7f_ffff)));
            }
            for v in probes.iter().flat_map(|&v| [v, -v]) {
                assert_eq!(fmt.encode(v), nearest(fmt, v as f64), "{fmt:?} {v:e}");
            }
        }
    }

    #[test]
    fn decoding_is_monotonic_over_positive_codes() {
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            let vals: Vec<f32> = (0..0x7cu8).map(|b| fmt.decode(b)).collect();
            assert!(vals.windows(2).all(|w| w[0] < w[1]), "{fmt:?}");
        }
    }
}
