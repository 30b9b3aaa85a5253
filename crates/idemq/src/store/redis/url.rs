//! The Redis store's URL: `redis://host:port[/db]` or
//! `redis+unix:///path.sock`, with idemq's own query parameters taken out
//! before the rest goes to the driver.

use crate::error::{Error, Result};

/// The key prefix of an installation that names none.
pub const DEFAULT_PREFIX: &str = "idemq:";

/// Longest key prefix.
const MAX_PREFIX_BYTES: usize = 64;

/// A Redis URL read: the driver's part, and idemq's parameters.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// What the driver connects to (idemq's parameters removed).
    pub driver: String,
    /// The prefix of every key of this installation.
    pub prefix: String,
    /// `?durability=relaxed`: run on a server without the durable settings.
    pub relaxed: bool,
}

impl std::fmt::Debug for RedisUrl {
    /// Never prints the driver's URL: it may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisUrl")
            .field("prefix", &self.prefix)
            .field("relaxed", &self.relaxed)
            .finish_non_exhaustive()
    }
}

fn bad(reason: impl Into<String>) -> Error {
    Error::validation("database", reason)
}

impl RedisUrl {
    /// Reads `url`. Refuses another scheme, a bad prefix and an unknown
    /// `durability`.
    pub fn parse(url: &str) -> Result<Self> {
        if !(url.starts_with("redis://") || url.starts_with("redis+unix://")) {
            return Err(bad(
                "a Redis URL is redis://host:port[/db] or redis+unix:///path.sock",
            ));
        }
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut prefix = DEFAULT_PREFIX.to_owned();
        let mut relaxed = false;
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "prefix" => prefix = check_prefix(value)?,
                "durability" => {
                    relaxed = match value {
                        "relaxed" => true,
                        "strict" => false,
                        _ => {
                            return Err(bad("durability is `strict` (the default) or `relaxed`"));
                        }
                    }
                }
                _ => rest.push(pair),
            }
        }
        let driver = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        Ok(Self {
            driver,
            prefix,
            relaxed,
        })
    }
}

/// A prefix is 1–64 bytes of `[A-Za-z0-9._{}-]` (braces for a hash tag)
/// ending in `:`, its only colon. So no valid prefix starts another (the
/// shorter one's colon would sit inside the longer one), and two
/// installations under different prefixes never share a key: every key is
/// the prefix followed by a name, and two different prefixes differ before
/// either ends. Before this rule any of `[A-Za-z0-9._:{}-]` was taken, so
/// `app` and `app:jobs:` (or `a:` and `a:job:`) could overlap.
fn check_prefix(value: &str) -> Result<String> {
    let chars = !value.is_empty()
        && value.len() <= MAX_PREFIX_BYTES
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:{}-".contains(&b));
    if !chars {
        return Err(bad(format!(
            "prefix must be 1–{MAX_PREFIX_BYTES} bytes of [A-Za-z0-9._{{}}-] ending in `:`, its \
             only colon (e.g. `app1:`)"
        )));
    }
    if value.find(':') != Some(value.len() - 1) {
        return Err(bad(format!(
            "prefix {value:?} must end in `:` and have no other colon (e.g. `app1:`), so that no \
             installation's prefix starts another's and two installations never share a key. \
             An installation stored under this prefix (an earlier idemq took it) opens again \
             once its keys are renamed to a prefix of that form, with every idemq process \
             stopped: see \"Key prefixes\" in docs/operating.md"
        )));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_out_idemq_parameters_and_keeps_the_driver_s() {
        let u = RedisUrl::parse("redis://h:6380/2?prefix=app1:&durability=relaxed&protocol=resp3")
            .expect("url");
        assert_eq!(u.driver, "redis://h:6380/2?protocol=resp3");
        assert_eq!(u.prefix, "app1:");
        assert!(u.relaxed);
        let u = RedisUrl::parse("redis+unix:///tmp/r.sock").expect("url");
        assert_eq!(u.driver, "redis+unix:///tmp/r.sock");
        assert_eq!(u.prefix, DEFAULT_PREFIX);
        assert!(!u.relaxed);
    }

    #[test]
    fn refuses_other_schemes_bad_prefixes_and_durabilities() {
        assert!(RedisUrl::parse("postgres://x").is_err());
        assert!(RedisUrl::parse("redis://h?prefix=").is_err());
        assert!(RedisUrl::parse("redis://h?prefix=a b").is_err());
        assert!(RedisUrl::parse("redis://h?durability=maybe").is_err());
    }

    /// Two installations under different prefixes never share a key: a
    /// prefix ends in its only colon, so no prefix starts another. One that
    /// could (taken before) is refused saying how to move its keys.
    #[test]
    fn no_prefix_starts_another() {
        let taken = [
            "idemq:",
            "app1:",
            "a:",
            "{app1}:",
            "my-app.prod_2:",
            &format!("{}:", "x".repeat(63)),
        ];
        for p in taken {
            let url = format!("redis://h?prefix={p}");
            assert_eq!(RedisUrl::parse(&url).expect(p).prefix, p);
        }
        for p in ["idemq", "app1", "a:b:", "a:job:", "idemq:a", "app:1", "a::"] {
            let err = RedisUrl::parse(&format!("redis://h?prefix={p}")).expect_err(p);
            let text = err.to_string();
            assert!(matches!(err, Error::Validation { .. }), "{err:?}");
            assert!(text.contains("no other colon"), "{text}");
            assert!(text.contains("renamed"), "{text}");
            assert!(text.contains("docs/operating.md"), "{text}");
        }
        assert!(RedisUrl::parse(&format!("redis://h?prefix={}:", "x".repeat(64))).is_err());
        // Every pair of distinct valid prefixes over a small alphabet:
        // neither starts the other.
        let alphabet = ["a", ":", "{", "-"];
        let mut words = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = words
                .iter()
                .flat_map(|w| alphabet.iter().map(move |c| format!("{w}{c}")))
                .collect();
            words.extend(longer);
        }
        words.sort();
        words.dedup();
        let valid: Vec<&String> = words.iter().filter(|w| check_prefix(w).is_ok()).collect();
        assert!(valid.len() > 10, "{valid:?}");
        for a in &valid {
            for b in &valid {
                assert!(a == b || !b.starts_with(a.as_str()), "{a:?} starts {b:?}");
            }
        }
    }
}
