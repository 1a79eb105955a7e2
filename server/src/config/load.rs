//! The effective config: the embedded defaults, then the files the operator named, in order.
//! Beside the types (`mod.rs`) and the foreign formats (`foreign.rs`), so that neither imports
//! the other's user.

use super::foreign::{apply_hixl, apply_mooncake, is_hixl_toml};
use super::{Config, ConfigError, LoadedConfig};
use std::path::Path;

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })
}

/// Load the effective config: defaults, then `kvpool_config` (kvpool TOML, or a Mooncake JSON /
/// HIXL TOML recognised by content), then `MOONCAKE_CONFIG_PATH` and `HIXL_CONFIG_PATH` if given.
pub fn load(
    kvpool_config: Option<&Path>,
    mooncake: Option<&Path>,
    hixl: Option<&Path>,
) -> Result<LoadedConfig, ConfigError> {
    let mut out =
        LoadedConfig { config: Config::default(), sources: vec!["embedded defaults".into()], warnings: vec![] };
    if let Some(p) = kvpool_config {
        let text = read(p)?;
        let is_json = p.extension().is_some_and(|e| e == "json") || text.trim_start().starts_with('{');
        if is_json {
            apply_mooncake(&mut out, p, &text)?;
        } else if is_hixl_toml(&text) {
            apply_hixl(&mut out, p, &text)?;
        } else {
            let mut unknown = Vec::new();
            let de = toml::Deserializer::new(&text);
            out.config = serde_ignored::deserialize(de, |path| unknown.push(path.to_string()))
                .map_err(|e| ConfigError::Parse { path: p.to_owned(), message: e.to_string() })?;
            for u in unknown {
                out.warnings.push(format!("{}: unknown field `{u}` ignored", p.display()));
            }
            out.sources.push(format!("kvpool config {}", p.display()));
        }
    }
    if let Some(p) = mooncake {
        let text = read(p)?;
        apply_mooncake(&mut out, p, &text)?;
    }
    if let Some(p) = hixl {
        let text = read(p)?;
        apply_hixl(&mut out, p, &text)?;
    }
    out.config.validate()?;
    Ok(out)
}
