//! The two 8-bit float formats, decoded to f32: the host backend's fp8
//! matmuls read them through here, and the CUDA tests build references
//! with it. Layouts follow the OCP 8-bit float spec (and `torch.float8_*`):
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

    #[test]
    fn decoding_is_monotonic_over_positive_codes() {
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            let vals: Vec<f32> = (0..0x7cu8).map(|b| fmt.decode(b)).collect();
            assert!(vals.windows(2).all(|w| w[0] < w[1]), "{fmt:?}");
        }
    }
}
