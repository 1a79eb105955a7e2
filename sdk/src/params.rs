//! Module parameters (`--param k=v`), with typed getters.

use std::collections::BTreeMap;

/// Module parameters (`--param k=v` at load time), with typed getters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Params(pub BTreeMap<String, String>);

/// A parameter that is present but does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError(pub String);

impl std::fmt::Display for ParamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParamError {}

impl Params {
    pub fn new() -> Params {
        Params::default()
    }

    pub fn from_pairs<K: Into<String>, V: Into<String>>(pairs: impl IntoIterator<Item = (K, V)>) -> Params {
        Params(pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn get_u64(&self, key: &str, default: u64) -> Result<u64, ParamError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.trim().parse().map_err(|_| ParamError(format!("parameter {key}={v:?} is not an unsigned integer")))
            }
        }
    }

    pub fn get_f64(&self, key: &str, default: f64) -> Result<f64, ParamError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(x),
                _ => Err(ParamError(format!("parameter {key}={v:?} is not a finite number"))),
            },
        }
    }

    pub fn get_bool(&self, key: &str, default: bool) -> Result<bool, ParamError> {
        match self.get(key).map(str::trim) {
            None => Ok(default),
            Some("true" | "1" | "yes" | "on") => Ok(true),
            Some("false" | "0" | "no" | "off") => Ok(false),
            Some(v) => Err(ParamError(format!("parameter {key}={v:?} is not a boolean"))),
        }
    }
}
