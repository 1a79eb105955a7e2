//! API keys. Only SHA-256 hashes are kept; a hello is checked by hashing the presented key and
//! comparing in constant time.

use crate::config::ApiKeyEntry;
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    pub tenant_id: u32,
    pub admin: bool,
}

struct KeyEntry {
    hash: [u8; 32],
    principal: Principal,
}

pub struct Auth {
    keys: Vec<KeyEntry>,
    /// Tenant names by id (KV events name the tenant of each block).
    names: std::collections::HashMap<u32, String>,
}

pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    /// `tenant_id` maps a tenant name to its stable id (kept in sled).
    pub fn new(entries: &[ApiKeyEntry], mut tenant_id: impl FnMut(&str) -> u32) -> Auth {
        let keys = entries
            .iter()
            .filter_map(|e| {
                let mut hash = [0u8; 32];
                hex::decode_to_slice(&e.sha256, &mut hash).ok()?;
                Some(KeyEntry {
                    hash,
                    principal: Principal { tenant: e.tenant.clone(), tenant_id: tenant_id(&e.tenant), admin: e.admin },
                })
            })
            .collect::<Vec<KeyEntry>>();
        let names = keys.iter().map(|k| (k.principal.tenant_id, k.principal.tenant.clone())).collect();
        Auth { keys, names }
    }

    /// The longest tenant name a KV event may carry.
    pub fn longest_tenant_name(&self) -> usize {
        self.names.values().map(String::len).max().unwrap_or(0).max("tenant-4294967295".len())
    }

    /// The id of a tenant a configured key names.
    pub fn tenant_id_of(&self, name: &str) -> Option<u32> {
        self.names.iter().find(|(_, n)| n.as_str() == name).map(|(&id, _)| id)
    }

    /// The name of a tenant id (`tenant-<id>` for one no configured key names any more).
    pub fn tenant_name(&self, id: u32) -> String {
        self.names.get(&id).cloned().unwrap_or_else(|| format!("tenant-{id}"))
    }

    pub fn check(&self, presented: &str) -> Option<Principal> {
        let h = hash_key(presented);
        // Compare against every entry so timing does not reveal which one matched.
        let mut found = None;
        for k in &self.keys {
            if ct_eq(&k.hash, &h) && found.is_none() {
                found = Some(k.principal.clone());
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_hashes_only() {
        let e = ApiKeyEntry { tenant: "a".into(), sha256: hex::encode(hash_key("secret")), admin: true };
        let auth = Auth::new(&[e], |_| 7);
        assert_eq!(auth.check("secret").unwrap().tenant_id, 7);
        assert!(auth.check("Secret").is_none());
        assert!(auth.check("").is_none());
    }
}
