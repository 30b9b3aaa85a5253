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
