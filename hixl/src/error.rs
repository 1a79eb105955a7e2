//! HIXL's status codes and kvpool's errors for them, each naming the causes users actually hit
//! (vllm-ascend and Mooncake reports, HIXL's documentation).

use kvpool_transport::TransportError;
use std::time::Duration;

/// A `hixl::Status` (include/hixl/hixl_types.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HixlCode {
    ParamInvalid,
    Timeout,
    NotConnected,
    AlreadyConnected,
    NotifyFailed,
    Unsupported,
    ResourceExhausted,
    Failed,
    Other(u32),
}

impl HixlCode {
    pub const SUCCESS: u32 = 0;

    /// `None` for SUCCESS.
    pub fn from_status(s: u32) -> Option<HixlCode> {
        Some(match s {
            0 => return None,
            103900 => HixlCode::ParamInvalid,
            103901 => HixlCode::Timeout,
            103902 => HixlCode::NotConnected,
            103903 => HixlCode::AlreadyConnected,
            103904 => HixlCode::NotifyFailed,
            103905 => HixlCode::Unsupported,
            203900 => HixlCode::ResourceExhausted,
            503900 => HixlCode::Failed,
            other => HixlCode::Other(other),
        })
    }

    pub fn status(self) -> u32 {
        match self {
            HixlCode::ParamInvalid => 103900,
            HixlCode::Timeout => 103901,
            HixlCode::NotConnected => 103902,
            HixlCode::AlreadyConnected => 103903,
            HixlCode::NotifyFailed => 103904,
            HixlCode::Unsupported => 103905,
            HixlCode::ResourceExhausted => 203900,
            HixlCode::Failed => 503900,
            HixlCode::Other(s) => s,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HixlCode::ParamInvalid => "PARAM_INVALID",
            HixlCode::Timeout => "TIMEOUT",
            HixlCode::NotConnected => "NOT_CONNECTED",
            HixlCode::AlreadyConnected => "ALREADY_CONNECTED",
            HixlCode::NotifyFailed => "NOTIFY_FAILED",
            HixlCode::Unsupported => "UNSUPPORTED",
            HixlCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            HixlCode::Failed => "FAILED",
            HixlCode::Other(_) => "unknown status",
        }
    }

    /// Whether resubmitting (after reconnecting) can help: the link went down or timed out, or
    /// resources were short for a moment. Bad parameters and generic failures repeat.
    pub fn retryable(self) -> bool {
        matches!(self, HixlCode::Timeout | HixlCode::NotConnected | HixlCode::ResourceExhausted)
    }
}

/// The HIXL call that failed; the likely causes depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Create,
    BindThread,
    Malloc,
    Free,
    Register,
    Deregister,
    Connect,
    Disconnect,
    Transfer,
    TransferStatus,
}

impl Call {
    pub fn name(self) -> &'static str {
        match self {
            Call::Create => "Initialize",
            Call::BindThread => "aclrtSetCurrentContext",
            Call::Malloc => "aclrtMalloc/aclrtMallocHost",
            Call::Free => "aclrtFree",
            Call::Register => "RegisterMem",
            Call::Deregister => "DeregisterMem",
            Call::Connect => "Connect",
            Call::Disconnect => "Disconnect",
            Call::Transfer => "Transfer",
            Call::TransferStatus => "GetTransferStatus",
        }
    }
}

/// What usually produces `code` from `call`.
pub fn likely_causes(call: Call, code: HixlCode) -> &'static str {
    use Call as C;
    use HixlCode as H;
    match (code, call) {
        (H::ParamInvalid, C::Register) => {
            "memory not allocated by aclrtMalloc/aclrtMallocHost, or not aligned (device memory for HCCS: 2 MiB, \
             from aclrtMalloc with ACL_MEM_MALLOC_HUGE_ONLY; host memory: 64 KiB, from aclrtMallocHost); \
             more than about 4K registrations; a length of 0"
        }
        (H::ParamInvalid, C::Create) => {
            "a malformed engine name (expected \"ip\", \"ip:port\" or \"[v6]:port\"); an option this CANN does not \
             know or a malformed GlobalResourceConfig JSON (older CANN rejects protocol_desc: upgrade CANN or drop \
             link_type); BufferPool together with EnableUseFabricMem"
        }
        (H::ParamInvalid, C::Connect) => {
            "CANN older than the peer's or than the options used (a known 103900 on connect with old CANN); a \
             malformed remote engine name"
        }
        (H::ParamInvalid, C::Transfer) => {
            "an address outside memory registered on this side or the peer's (memory the peer registered after \
             we connected is only reachable after a reconnect); descriptors mixing host and device directions in \
             buffer-pool mode"
        }
        (H::ParamInvalid, C::TransferStatus) => {
            "a request queried after it was reported or after its link was \
             disconnected (a kvpool bug)"
        }
        (H::ParamInvalid, _) => "an invalid argument (see the detail)",
        (H::Timeout, C::Connect) => {
            "the peer is not listening on that ip:port (not started, wrong address, port blocked); /etc/hccn.conf \
             missing or not mapped into the container, or hccn_tool not on PATH; device NICs down (check \
             `hccn_tool -i <dev> -link -g`); HCCS across pods with separate IPs (use link_type = \"roce\"); \
             timeout_ms too short (HIXL recommends at least 200 ms)"
        }
        (H::Timeout, _) => {
            "the link stalled or the peer went away mid-transfer; a transfer too large for timeout_ms (raise \
             timeout_ms or ASCEND_TRANSFER_TIMEOUT)"
        }
        (H::NotConnected, _) => {
            "no link to the peer: it was never connected, a timeout or failure tore it down, or the peer \
             restarted; when Connect itself timed out first (often after 10 s), check /etc/hccn.conf, the \
             network between the device NICs, and the peer's listen port"
        }
        (H::AlreadyConnected, _) => "a second Connect to the same engine (harmless)",
        (H::NotifyFailed, _) => "a notify could not be delivered (reserved by HIXL)",
        (H::Unsupported, _) => {
            "an option or feature this CANN or device does not support (EnableUseFabricMem is A3 only; async \
             transfers cannot stage host memory through the BufferPool: set enable_async = false)"
        }
        (H::ResourceExhausted, C::Malloc) => "device or pinned host memory exhausted",
        (H::ResourceExhausted, _) => {
            "stream resources exhausted: too many transfers in flight (lower num_workers or max_batch_size); \
             kvpool retries after a pause"
        }
        (H::Failed, C::Create) => {
            "aclrtSetDevice failed (wrong device_id, device busy or not visible: ASCEND_RT_VISIBLE_DEVICES); the \
             listen port is taken; the driver is not installed or its version does not match CANN"
        }
        (H::Failed, C::BindThread) => "the engine's ACL context is gone",
        (H::Failed, _) => {
            "a generic HIXL failure: see the host and device logs ($HOME/ascend/log, plog); a call from a thread \
             without the engine's ACL context; a device memory fault; /etc/hccn.conf missing (it makes HCCL \
             return garbage)"
        }
        (H::Other(_), _) => "a status this kvpool does not know (newer CANN?): see the detail and the CANN logs",
    }
}

/// Errors of the HIXL backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HixlError {
    #[error(
        "the HIXL backend (protocol = \"ascend\") cannot load its shim library {library}: {reason}. Point \
         `transport.hixl.shim_path` (or the KVPOOL_HIXL_SHIM environment variable) at kvpool's \
         libkvpool_hixl_shim.so. kvpool-hixl builds it only where CANN is installed (ASCEND_HOME_PATH or \
         ASCEND_TOOLKIT_HOME with include/hixl/hixl.h), and it needs CANN's HIXL library libcann_hixl.so (CANN's \
         hixl component, in $ASCEND_HOME_PATH/lib64) and the ACL runtime on the library path (source CANN's \
         set_env.sh)"
    )]
    LibraryMissing { library: String, reason: String },
    #[error("{library} is not a kvpool HIXL shim: it has no symbol `{symbol}`")]
    MissingSymbol { library: String, symbol: String },
    #[error(
        "{library} implements kvpool HIXL shim ABI version {found}, this kvpool needs version {expected}: rebuild the \
         shim from this kvpool's hixl/shim sources"
    )]
    AbiMismatch { library: String, found: u32, expected: u32 },
    #[error("HIXL {} failed: {} ({}){}{}. Likely causes: {}", .call.name(), .code.name(), .code.status(),
        if .detail.is_empty() { "" } else { ": " }, .detail, likely_causes(*.call, *.code))]
    Status { call: Call, code: HixlCode, detail: String },
    #[error("transfer did not complete within {0:?}; the link was disconnected, as HIXL requires after a timeout")]
    TransferTimeout(Duration),
    #[error("HIXL configuration: {0}")]
    Config(String),
    #[error("the HIXL engine thread has stopped")]
    EngineGone,
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl HixlError {
    pub fn status(call: Call, code: HixlCode, detail: impl Into<String>) -> HixlError {
        HixlError::Status { call, code, detail: detail.into() }
    }

    /// The HIXL status code, when this came from one.
    pub fn code(&self) -> Option<HixlCode> {
        match self {
            HixlError::Status { code, .. } => Some(*code),
            HixlError::TransferTimeout(_) => Some(HixlCode::Timeout),
            _ => None,
        }
    }
}

impl From<HixlError> for TransportError {
    /// The trait's error has no backend-specific variant: HIXL failures travel as their full
    /// message (code, detail and likely causes); timeouts and kvpool-side errors keep their type.
    fn from(e: HixlError) -> TransportError {
        match e {
            HixlError::Transport(t) => t,
            HixlError::TransferTimeout(d) => TransportError::Timeout(d),
            other => TransportError::Io(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_and_names_causes() {
        for s in [103900, 103901, 103902, 103903, 103904, 103905, 203900, 503900, 42] {
            let c = HixlCode::from_status(s).unwrap();
            assert_eq!(c.status(), s);
        }
        assert_eq!(HixlCode::from_status(0), None);
        let e = HixlError::status(Call::Connect, HixlCode::Timeout, "connect to 10.0.0.2:16000: no answer");
        let m = e.to_string();
        assert!(m.contains("Connect failed: TIMEOUT (103901)"), "{m}");
        assert!(m.contains("/etc/hccn.conf") && m.contains("no answer"), "{m}");
        let m = HixlError::status(Call::Register, HixlCode::ParamInvalid, "").to_string();
        assert!(m.contains("2 MiB") && m.contains("64 KiB") && !m.contains("(103900): "), "{m}");
        let m = HixlError::status(Call::Transfer, HixlCode::NotConnected, "x").to_string();
        assert!(m.contains("NOT_CONNECTED (103902)") && m.contains("hccn.conf"), "{m}");
        let m = HixlError::status(Call::Transfer, HixlCode::ResourceExhausted, "x").to_string();
        assert!(m.contains("203900") && m.contains("num_workers"), "{m}");
        let m = HixlError::status(Call::Transfer, HixlCode::Failed, "x").to_string();
        assert!(m.contains("503900") && m.contains("ACL context"), "{m}");
        assert!(HixlCode::NotConnected.retryable() && !HixlCode::ParamInvalid.retryable());
    }

    #[test]
    fn conversion_to_the_trait_error_keeps_what_it_can() {
        let d = Duration::from_millis(30);
        assert_eq!(TransportError::from(HixlError::TransferTimeout(d)), TransportError::Timeout(d));
        assert_eq!(TransportError::from(HixlError::Transport(TransportError::Cancelled)), TransportError::Cancelled);
        match TransportError::from(HixlError::status(Call::Transfer, HixlCode::Failed, "boom")) {
            TransportError::Io(m) => assert!(m.contains("503900") && m.contains("boom")),
            other => panic!("{other:?}"),
        }
    }
}
