//! Helpers of the wire form shared by the library's request types and the
//! HTTP server: `null` for an optional member means the same as leaving it
//! out (docs/http-api.md, "Requests").

use serde::{Deserialize, Deserializer};

/// Reads an optional member whose omission means `T::default()`, accepting
/// `null` as an omission too. Use with `#[serde(default, deserialize_with = …)]`.
pub fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// An integer member: a JSON number with no fraction part, `10` or `10.0`
/// (JSON Schema's `integer`), in the range of `T`.
struct IntVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: TryFrom<i128>> serde::de::Visitor<'de> for IntVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an integer")
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<T, E> {
        T::try_from(v.into()).map_err(|_| E::custom(format!("integer {v} is out of range")))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
        T::try_from(v.into()).map_err(|_| E::custom(format!("integer {v} is out of range")))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<T, E> {
        // 2^100 is far beyond every bound and exactly representable.
        if v.is_finite() && v.fract() == 0.0 && v.abs() < 2f64.powi(100) {
            T::try_from(v as i128).map_err(|_| E::custom(format!("integer {v} is out of range")))
        } else {
            Err(E::invalid_type(serde::de::Unexpected::Float(v), &self))
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        let text = number_text(map)?;
        match text.parse::<i128>() {
            Ok(v) => T::try_from(v)
                .map_err(|_| serde::de::Error::custom(format!("integer {text} is out of range"))),
            Err(_) => self.visit_f64(text.parse::<f64>().unwrap_or(f64::INFINITY)),
        }
    }
}

/// The text of a JSON number that serde_json (which keeps every number's
/// digits: its `arbitrary_precision` feature) hands to a visitor as a map:
/// one with a fraction or an exponent, or an integer beyond 64 bits. That
/// is how such a number reaches a member read through serde's buffering
/// (an internally tagged enum such as the retry policy), and how a
/// `deserialize_any` sees it.
fn number_text<'de, A: serde::de::MapAccess<'de>>(map: A) -> Result<String, A::Error> {
    serde_json::Number::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        .map(|n| n.to_string())
}

/// A float member: any JSON number, as the nearest `f64`.
struct FloatVisitor;

impl<'de> serde::de::Visitor<'de> for FloatVisitor {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a number or null")
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Option<f64>, E> {
        Ok(Some(v as f64))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Option<f64>, E> {
        Ok(Some(v as f64))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Option<f64>, E> {
        Ok(Some(v))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Option<f64>, A::Error> {
        let text = number_text(map)?;
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(Some(v)),
            _ => Err(serde::de::Error::custom(format!(
                "number {text} is out of range"
            ))),
        }
    }
}

/// Reads an optional float member: `null` or any JSON number.
pub fn opt_float<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_option(FloatVisitor)
}

/// Reads a required integer member (see [`opt_int`]).
pub fn int<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128>,
{
    d.deserialize_any(IntVisitor(std::marker::PhantomData))
}

/// Reads an optional integer member: `null` or a JSON number with no
/// fraction part (`10` and `10.0` alike; `10.5` is refused). Use with
/// `#[serde(default, deserialize_with = …)]`.
pub fn opt_int<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128>,
{
    struct Opt<T>(std::marker::PhantomData<T>);
    impl<'de, T: TryFrom<i128>> serde::de::Visitor<'de> for Opt<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an integer or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Option<T>, D2::Error> {
            int(d).map(Some)
        }
    }
    d.deserialize_option(Opt(std::marker::PhantomData))
}

/// Reads a member that must be a JSON object: serde's derived structs take
/// an array of their members too, which the API refuses (a `400` naming the
/// member). Errors inside the object still name their member's path.
pub fn object<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_map(ObjectVisitor(std::marker::PhantomData))
}

/// [`object`] for an optional member (`null` means omitted).
pub fn opt_object<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<Obj<T>>::deserialize(d).map(|o| o.map(|o| o.0))
}

/// [`object`] for an optional list of objects (`null` means empty).
pub fn opt_objects<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<Vec<Obj<T>>>::deserialize(d).map(|o| o.map(|v| v.into_iter().map(|o| o.0).collect()))
}

/// [`object`] for a required list of objects.
pub fn objects<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Vec::<Obj<T>>::deserialize(d).map(|v| v.into_iter().map(|o| o.0).collect())
}

/// A value read by [`object`].
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        object(d).map(Obj)
    }
}

struct ObjectVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for ObjectVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Inner {
        a: i64,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Outer {
        #[serde(default, deserialize_with = "opt_int")]
        n: Option<u32>,
        #[serde(default, deserialize_with = "opt_object")]
        inner: Option<Inner>,
    }

    fn read(s: &str) -> Result<Outer, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn integers_may_be_written_with_a_zero_fraction() {
        assert_eq!(read(r#"{"n": 10}"#).unwrap().n, Some(10));
        assert_eq!(read(r#"{"n": 10.0}"#).unwrap().n, Some(10));
        assert_eq!(read(r#"{"n": 1e3}"#).unwrap().n, Some(1000));
        assert_eq!(read(r#"{"n": null}"#).unwrap().n, None);
        assert!(read(r#"{"n": 10.5}"#).is_err());
        assert!(read(r#"{"n": -1}"#).is_err());
        assert!(read(r#"{"n": 1e300}"#).is_err());
        assert!(read(r#"{"n": "10"}"#).is_err());
    }

    #[test]
    fn objects_must_be_objects() {
        assert_eq!(
            read(r#"{"inner": {"a": 1}}"#).unwrap().inner,
            Some(Inner { a: 1 })
        );
        assert_eq!(read(r#"{"inner": null}"#).unwrap().inner, None);
        assert!(read(r#"{"inner": [1]}"#).is_err());
        // Without the helper serde takes the array form.
        assert!(serde_json::from_str::<Inner>("[1]").is_ok());
    }
}

/// The members of each kind of retry policy as they are read, the `kind`
/// member aside: [`crate::RetryPolicy`] is read through them, and the HTTP
/// server reads a policy that did not parse through them again, to name
/// the member at fault (serde's path stops at an internally tagged enum).
pub mod retry {
    use serde::{Deserialize, Deserializer};

    use crate::request::{d_factor, d_initial, d_jitter, d_max};

    /// `null` for an exponential policy's member is its default, as when omitted.
    macro_rules! null_is {
        ($($name:ident: $ty:ty = $default:ident via $read:path),* $(,)?) => {$(
            fn $name<'de, D: Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                Ok($read(d)?.unwrap_or_else($default))
            }
        )*};
    }
    null_is!(
        null_initial: i64 = d_initial via super::opt_int,
        null_factor: f64 = d_factor via super::opt_float,
        null_max: i64 = d_max via super::opt_int,
        null_jitter: bool = d_jitter via Option::<bool>::deserialize,
    );

    /// `{"kind": "exponential", …}`: every member optional.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Exponential {
        /// First delay in milliseconds.
        #[serde(default = "d_initial", deserialize_with = "null_initial")]
        pub initial_ms: i64,
        /// Growth factor.
        #[serde(default = "d_factor", deserialize_with = "null_factor")]
        pub factor: f64,
        /// Largest delay in milliseconds.
        #[serde(default = "d_max", deserialize_with = "null_max")]
        pub max_ms: i64,
        /// Full jitter.
        #[serde(default = "d_jitter", deserialize_with = "null_jitter")]
        pub jitter: bool,
    }

    /// `{"kind": "fixed", "delay_ms": N}`.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Fixed {
        /// The delay in milliseconds.
        #[serde(deserialize_with = "super::int")]
        pub delay_ms: i64,
    }

    /// `{"kind": "none"}`: no other member.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct NoRetries {}
}
