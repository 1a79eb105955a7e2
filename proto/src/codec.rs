//! The one place that knows the body encoding: bincode 2 (serde path), fixed-width little-endian
//! integers, u64 length prefixes, u32 enum tags. Decoding is bounded so that a claimed length can
//! never make the decoder allocate more than the frame it came in.

use crate::ProtoError;
use bincode::config::{Configuration, Fixint, Limit, LittleEndian};
use serde::{de::DeserializeOwned, Serialize};

/// Hard ceiling for any single decoded body, whatever a server's configured frame limit.
pub const DECODE_LIMIT: usize = 64 << 20;

type Cfg = Configuration<LittleEndian, Fixint, Limit<DECODE_LIMIT>>;

fn cfg() -> Cfg {
    bincode::config::standard().with_little_endian().with_fixed_int_encoding().with_limit::<DECODE_LIMIT>()
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, ProtoError> {
    bincode::serde::encode_to_vec(value, cfg()).map_err(|e| ProtoError::Encode(e.to_string()))
}

/// Decode a whole body; trailing bytes are an error (a frame holds exactly one message).
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, ProtoError> {
    let (v, used) = bincode::serde::decode_from_slice(body, cfg()).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(ProtoError::Malformed(format!("{} trailing bytes after the message", body.len() - used)));
    }
    Ok(v)
}
