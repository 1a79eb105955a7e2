//! Frames: a little-endian u32 body length, then the body. Raw block bytes are never framed:
//! they follow their header frame on the same stream, in the sizes the header declares.

use crate::{codec, ProtoError};
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Read one frame body. `Ok(None)` when the stream ended cleanly before a frame began.
/// The length is checked against `max_len` before anything is allocated.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max_len: u32) -> Result<Option<Vec<u8>>, ProtoError> {
    let mut len_buf = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len_buf[got..]).await?;
        if n == 0 {
            return if got == 0 { Ok(None) } else { Err(ProtoError::Truncated) };
        }
        got += n;
    }
    let len = u32::from_le_bytes(len_buf);
    if len > max_len {
        return Err(ProtoError::FrameTooLarge { len: len as u64, max: max_len as u64 });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Read and decode one message frame; a clean end of stream is `Truncated` here.
pub async fn read_message<R: AsyncRead + Unpin, T: DeserializeOwned>(r: &mut R, max_len: u32) -> Result<T, ProtoError> {
    let body = read_frame(r, max_len).await?.ok_or(ProtoError::Truncated)?;
    codec::decode(&body)
}

/// Encode `msg` into a frame (length prefix included).
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtoError> {
    let body = codec::encode(msg)?;
    let len = u32::try_from(body.len())
        .map_err(|_| ProtoError::FrameTooLarge { len: body.len() as u64, max: u32::MAX as u64 })?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

pub async fn write_message<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> Result<(), ProtoError> {
    let frame = encode_frame(msg)?;
    w.write_all(&frame).await.map_err(ProtoError::from)
}
