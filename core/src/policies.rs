//! The policy slots of a pool: one eviction, one admission and (optionally) one placement policy,
//! each a native SDK policy or a host-provided wrapper (the server's guarded Wasm modules).

use kvpool_policy_sdk::{
    AdmissionPolicy, Admit, AdmitBatch, Events, EvictionPolicy, IndexView, NodeSet, PlaceBatch, PlacementPolicy,
    Placements, Tier,
};
use std::any::Any;

/// An eviction policy as the core drives it: it may consult the index to validate its answers.
pub trait Evictor: Send {
    fn on_events(&mut self, events: &Events);
    fn victims(&mut self, view: &dyn IndexView, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64>;
    /// For the host to recover its own wrapper type (module info for an admin `list`).
    fn as_any(&self) -> &dyn Any;
}

/// An admission policy as the core drives it.
pub trait Admitter: Send {
    fn on_events(&mut self, events: &Events);
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit>;
    fn as_any(&self) -> &dyn Any;
}

/// A placement policy as the core drives it.
pub trait Placer: Send {
    fn on_events(&mut self, events: &Events);
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements;
    fn as_any(&self) -> &dyn Any;
}

/// A native SDK policy in a slot.
pub struct Native<P>(pub P);

impl<P: EvictionPolicy + Send + 'static> Evictor for Native<P> {
    fn on_events(&mut self, events: &Events) {
        self.0.on_events(events)
    }
    fn victims(&mut self, _: &dyn IndexView, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.0.victims(tier, bytes, exclude)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl<P: AdmissionPolicy + Send + 'static> Admitter for Native<P> {
    fn on_events(&mut self, events: &Events) {
        self.0.on_events(events)
    }
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        self.0.admit(batch)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl<P: PlacementPolicy + Send + 'static> Placer for Native<P> {
    fn on_events(&mut self, events: &Events) {
        self.0.on_events(events)
    }
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        self.0.place(blocks, nodes)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

// Policies built by name (the registry) come boxed.
impl Evictor for Box<dyn EvictionPolicy + Send> {
    fn on_events(&mut self, events: &Events) {
        (**self).on_events(events)
    }
    fn victims(&mut self, _: &dyn IndexView, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        (**self).victims(tier, bytes, exclude)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Admitter for Box<dyn AdmissionPolicy + Send> {
    fn on_events(&mut self, events: &Events) {
        (**self).on_events(events)
    }
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        (**self).admit(batch)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Placer for Box<dyn PlacementPolicy + Send> {
    fn on_events(&mut self, events: &Events) {
        (**self).on_events(events)
    }
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        (**self).place(blocks, nodes)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A slot being replaced: the new occupant, built off the request path.
pub enum NewSlot {
    Eviction(Box<dyn Evictor>),
    Admission(Box<dyn Admitter>),
    /// `None` restores the built-in choice (the core's default tier).
    Placement(Option<Box<dyn Placer>>),
}

/// The three slots, and the tap that records events for a policy being swapped in.
pub struct Policies {
    pub eviction: Box<dyn Evictor>,
    pub admission: Box<dyn Admitter>,
    /// With no placement policy, new blocks go to the tier admission chose.
    pub placement: Option<Box<dyn Placer>>,
    tap: Option<Events>,
}

impl Policies {
    pub fn new(eviction: Box<dyn Evictor>, admission: Box<dyn Admitter>) -> Policies {
        Policies { eviction, admission, placement: None, tap: None }
    }

    /// Feed a batch of events to every slot (and to the tap of a swap in progress).
    pub fn feed(&mut self, events: &Events) {
        if events.is_empty() {
            return;
        }
        if let Some(t) = &mut self.tap {
            for e in events.iter() {
                t.push(e);
            }
        }
        self.eviction.on_events(events);
        self.admission.on_events(events);
        if let Some(p) = &mut self.placement {
            p.on_events(events);
        }
    }

    /// Start recording events for a policy that is being built from a snapshot taken now.
    pub fn start_tap(&mut self) {
        self.tap = Some(Events::new());
    }

    pub fn abort_tap(&mut self) {
        self.tap = None;
    }

    /// Feed the new occupant everything since its snapshot, then switch: no decision is ever
    /// taken by a policy that missed an event. Returns the previous occupant (drop it unlocked).
    pub fn swap(&mut self, slot: NewSlot) -> NewSlot {
        let tap = self.tap.take().unwrap_or_default();
        match slot {
            NewSlot::Eviction(mut e) => {
                e.on_events(&tap);
                NewSlot::Eviction(std::mem::replace(&mut self.eviction, e))
            }
            NewSlot::Admission(mut a) => {
                a.on_events(&tap);
                NewSlot::Admission(std::mem::replace(&mut self.admission, a))
            }
            NewSlot::Placement(mut p) => {
                if let Some(p) = &mut p {
                    p.on_events(&tap);
                }
                NewSlot::Placement(std::mem::replace(&mut self.placement, p))
            }
        }
    }
}
