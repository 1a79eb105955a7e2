//! Threshold admission (vLLM/Mooncake `store_threshold`): a block enters the pool only when the
//! prefix it completes is at least `store_threshold` tokens long; 0 admits everything.

use kvpool_policy_sdk::{AdmissionPolicy, Admit, AdmitBatch, Events, ParamError, Params};

#[derive(Debug, Clone, Default)]
pub struct ThresholdAdmission {
    pub store_threshold: u64,
}

impl ThresholdAdmission {
    pub fn new(store_threshold: u64) -> ThresholdAdmission {
        ThresholdAdmission { store_threshold }
    }

    pub fn with_params(params: &Params) -> Result<ThresholdAdmission, ParamError> {
        Ok(ThresholdAdmission::new(params.get_u64("store_threshold", 0)?))
    }
}

impl AdmissionPolicy for ThresholdAdmission {
    fn on_events(&mut self, _events: &Events) {}

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        batch
            .iter()
            .map(|r| if r.seq_tokens >= self.store_threshold { Admit::Into(r.tier) } else { Admit::Reject })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{AdmitRequest, Tier, NO_PARENT};

    #[test]
    fn admits_at_or_above_threshold() {
        let mut p = ThresholdAdmission::with_params(&Params::from_pairs([("store_threshold", "1024")])).unwrap();
        let req = |seq| AdmitRequest::new(1, 1, 512, seq, Tier::Dram, NO_PARENT);
        let b: AdmitBatch = [req(512), req(1024), req(4096)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Reject, Admit::Into(Tier::Dram), Admit::Into(Tier::Dram)]);
        assert_eq!(ThresholdAdmission::new(0).admit(&b).len(), 3);
        assert!(ThresholdAdmission::with_params(&Params::from_pairs([("store_threshold", "x")])).is_err());
    }
}
