//! Host bindings of the `kvpool:policy` worlds. The eviction world owns the shared `types` and
//! `host` interfaces; the other two reuse them so one `Host` impl serves all three.

pub mod eviction {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "eviction",
    });
}

pub mod admission {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "admission",
        with: {
            "kvpool:policy/types": crate::bindings::eviction::kvpool::policy::types,
            "kvpool:policy/host": crate::bindings::eviction::kvpool::policy::host,
        },
    });
}

pub mod placement {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "placement",
        with: {
            "kvpool:policy/types": crate::bindings::eviction::kvpool::policy::types,
            "kvpool:policy/host": crate::bindings::eviction::kvpool::policy::host,
        },
    });
}

pub use eviction::kvpool::policy::host::{Host as HostImports, LogLevel};
pub use eviction::kvpool::policy::types as wit;
