//! Admission answering one decision whatever the batch size.
use kvpool_policy_sdk::*;

pub struct BadCount;

impl FromParams for BadCount {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(BadCount)
    }
}

impl AdmissionPolicy for BadCount {
    fn on_events(&mut self, _: &Events) {}
    fn admit(&mut self, _: &AdmitBatch) -> Vec<Admit> {
        vec![Admit::Reject]
    }
}

export_admission!(BadCount);
