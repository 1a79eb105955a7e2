//! `EventSubscription`: a KV event subscription, its batches as dicts.

use super::error::{Error, Res};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A KV event subscription (from `Client.subscribe`).
#[pyclass(module = "kvpool._native", frozen)]
pub(super) struct EventSubscription {
    pub(super) inner: Mutex<Option<kvpool_client::blocking::Subscription>>,
    pub(super) closed: AtomicBool,
}

/// How long `next` waits at a time before it checks for a close or a signal (Ctrl-C).
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(100);

pub(super) fn event_dict<'py>(py: Python<'py>, b: kvpool_client::proto::EventBatch) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("log_id", b.log_id)?;
    d.set_item("lagged", b.lagged)?;
    d.set_item("next", b.next)?;
    let events = PyList::empty(py);
    for e in b.events {
        let x = PyDict::new(py);
        x.set_item("seq", e.seq)?;
        x.set_item("kind", format!("{:?}", e.kind).to_lowercase())?;
        x.set_item(
            "tier",
            match e.tier {
                0 => "device",
                1 => "dram",
                2 => "ssd",
                _ => "unknown",
            },
        )?;
        x.set_item("node", e.node)?;
        x.set_item("tenant", e.tenant)?;
        x.set_item("key", PyBytes::new(py, &e.key))?;
        x.set_item("parent", e.parent.map(|p| PyBytes::new(py, &p)))?;
        x.set_item("size", e.size)?;
        x.set_item("time_ms", e.time_ms)?;
        events.append(x)?;
    }
    d.set_item("events", events)?;
    Ok(d)
}

#[pymethods]
impl EventSubscription {
    /// The next batch as a dict (`log_id`, `lagged`: events lost before it, `next`: the
    /// sequence number to resume from, `events`: dicts with `seq`, `kind` (`stored`, `removed`,
    /// `evicted`), `tier` (`device`, `dram`, `ssd`), `node`, `tenant`, `key` and `parent`
    /// (bytes), `size`, `time_ms`); `None` when nothing came within `timeout` seconds (`None`:
    /// wait until something comes). Another thread may `close()` it meanwhile, and Ctrl-C
    /// interrupts the wait.
    #[pyo3(signature = (timeout=None))]
    fn next<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let deadline = match timeout {
            None => None,
            Some(t) if t >= 0.0 => Duration::try_from_secs_f64(t).ok().and_then(|d| Instant::now().checked_add(d)),
            Some(t) => return Err(Error::Argument(format!("timeout {t} s")).into()),
        };
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed.into());
            }
            let slice = deadline.map_or(WAIT_SLICE, |d| d.saturating_duration_since(Instant::now()).min(WAIT_SLICE));
            let got = py.detach(|| -> Res<_> {
                let mut g = self.inner.lock();
                let sub = g.as_mut().ok_or(Error::Closed)?;
                Ok(sub.next_within(slice)?)
            })?;
            if let Some(b) = got {
                return Ok(Some(event_dict(py, b)?));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            py.check_signals()?;
        }
    }

    /// The sequence number to subscribe `from_seq` to resume after the last batch returned.
    #[getter]
    fn resume_from(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(py.detach(|| -> Res<u64> { Ok(self.inner.lock().as_ref().ok_or(Error::Closed)?.resume_from()) })?)
    }

    /// The server log the sequence numbers belong to (pass it as `log_id` when resuming).
    #[getter]
    fn log_id(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(py.detach(|| -> Res<u64> { Ok(self.inner.lock().as_ref().ok_or(Error::Closed)?.log_id()) })?)
    }

    /// End the subscription (also done when it is garbage-collected). A `next` waiting in
    /// another thread returns with a `closed` error.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        py.detach(|| drop(self.inner.lock().take()));
    }
}
