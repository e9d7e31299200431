//! Keeping the readiness verdicts of a [`Scanner`](super::Scanner) up to date, judging again
//! only what a scan changed.
//!
//! A layer's verdict depends on its own two directories, on the layers claiming the same
//! short id, and on its ancestors (their directories and verdicts); an image's on its own
//! directory and its top layer's verdict. When a scan changes a few objects, only these are
//! judged again:
//!
//! 1. the layers whose directories changed (added, gone, or probed with another outcome);
//! 2. the layers claiming the same short id as one of those, before or after the change;
//! 3. every descendant of the layers above, found through a parent → children map;
//! 4. the images whose directory changed, and those whose top layer is among the layers
//!    above, found through a layer → images map.
//!
//! Every other verdict stands, because a verdict depends on nothing outside the layer's own
//! chain (see [`judge_chain`]), and every other object of the index is kept as it was: the
//! new index is the last one with the judged objects replaced, sharing everything else with
//! it. The result is the index [`resolve`](super::readiness::resolve) computes from scratch
//! over the same facts; a test applies random changes and compares the two after each.
//!
//! Chains are walked iteratively, as in a full resolve, and so is the search for
//! descendants: no remote content controls the depth of any recursion.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::isulad;
use super::readiness::{
    self, join, judge_chain, judge_image, ready_layer, shared_short, Candidate, Chains, FactsRef,
    Sides, Verdict,
};
use super::scan::{ImageFacts, LayerFacts, OverlayFacts, Probed};
use super::{LayoutIndex, NotReady, ObjectKind};

/// One area's facts as a scanner keeps them, looked up by id.
pub(crate) trait AreaFacts<T> {
    /// The area's path relative to the remote root, as written in reasons.
    fn path(&self) -> &str;
    /// Why the area itself could not be read, if it could not.
    fn problem(&self) -> Option<&str>;
    /// The object `id` under the name the area keeps it by, with its facts or the reason
    /// it cannot be ready; `None` when the area has no such object.
    fn get(&self, id: &str) -> Option<(&str, Result<&T, &str>)>;
    /// Every object of the area.
    fn ids(&self) -> Vec<&str>;
}

/// The three areas' facts.
pub(crate) struct Sources<'a> {
    pub overlay: &'a dyn AreaFacts<OverlayFacts>,
    pub layers: &'a dyn AreaFacts<LayerFacts>,
    pub images: &'a dyn AreaFacts<ImageFacts>,
}

impl<'a> Sources<'a> {
    /// The layer `id` as the two areas have it, under the name an area keeps it by;
    /// `None` when it is in neither.
    fn joined(&self, id: &str) -> Option<(&'a str, Probed<Candidate<'a>>)> {
        let overlay = self.overlay.get(id);
        let meta = self.layers.get(id);
        let name = overlay
            .map(|(name, _)| name)
            .or(meta.map(|(name, _)| name))?;
        let sides = Sides {
            overlay_path: self.overlay.path(),
            layers_path: self.layers.path(),
            overlay: overlay.map(|(_, facts)| facts),
            meta: meta.map(|(_, facts)| facts),
        };
        Some((name, join(id, sides)))
    }
}

/// What changed since the last update: ids of layers (either area) and images whose facts
/// were added, removed or replaced; `all` when the areas changed as a whole (an area became
/// unreadable, vanished or came back), which rebuilds everything.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    pub layers: BTreeSet<String>,
    pub images: BTreeSet<String>,
    pub all: bool,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        !self.all && self.layers.is_empty() && self.images.is_empty()
    }
}

/// A layer id known to the rules: a layer in either area, or one that a layer names as its
/// parent or an image as its top layer.
///
/// Ids are interned: the key of a node is the one allocation of its id, shared by the edges
/// that point at it.
#[derive(Debug, Default)]
struct Node {
    /// In either layer area.
    candidate: bool,
    /// Every candidate has one, except while it is being judged again.
    verdict: Option<Verdict>,
    /// The parent named by the layer's joined candidate.
    parent: Option<Arc<str>>,
    /// The short id claimed by the layer's joined candidate.
    short: Option<Arc<str>>,
    /// Layers whose joined candidate names this one as parent (a vector: most layers have
    /// one child or none).
    children: Vec<Arc<str>>,
    /// Images whose facts name this layer as top layer.
    images: Vec<Arc<str>>,
}

impl Node {
    fn unused(&self) -> bool {
        !self.candidate && self.children.is_empty() && self.images.is_empty()
    }
}

/// The verdicts of the last update and what they were derived from, kept for the next.
#[derive(Debug, Default)]
pub(crate) struct Judged {
    layers: HashMap<Arc<str>, Node>,
    /// Joined candidates by the short id they claim, in id order (for [`shared_short`]).
    shorts: HashMap<Arc<str>, Vec<Arc<str>>>,
    /// The top layer each image is registered under (in that layer's `images`).
    tops: HashMap<Arc<str>, Arc<str>>,
    /// Objects that are not ready, with their reasons.
    not_ready: BTreeMap<(ObjectKind, Arc<str>), String>,
    index: LayoutIndex,
    built: bool,
}

impl Judged {
    /// Whether [`update`](Self::update) can follow from what is kept: there was a
    /// [`rebuild`](Self::rebuild) for this driver.
    pub fn can_update(&self, driver: &str) -> bool {
        self.built && self.index.driver == driver
    }

    /// Judges everything from scratch (a full [`resolve`](super::readiness::resolve) over
    /// `facts`, the same facts as `src`) and keeps what the next update needs.
    pub fn rebuild(&mut self, facts: FactsRef<'_>, src: &Sources<'_>, driver: &str) -> LayoutIndex {
        let (index, decided) = readiness::resolve_keeping(facts, driver);
        *self = Judged {
            layers: HashMap::with_capacity(decided.len()),
            built: true,
            ..Judged::default()
        };
        let mut shorts = HashSet::new();
        for layer in decided {
            let key = self.intern(layer.id);
            self.set_parent(&key, layer.parent);
            self.set_short(&key, layer.short, &mut shorts);
            let node = self.node(&key);
            node.candidate = true;
            node.verdict = Some(layer.verdict);
        }
        let images: BTreeSet<String> = src.images.ids().into_iter().map(str::to_owned).collect();
        self.relink_images(src, &images);
        for nr in index.not_ready().iter() {
            // Area problems are named by the area's path, objects by their id.
            if isulad::is_object_id(&nr.name) {
                let key = (nr.kind, Arc::from(nr.name.as_str()));
                self.not_ready.insert(key, nr.reason.clone());
            }
        }
        self.index = index;
        self.index.clone()
    }

    /// Brings the verdicts up to date with `src`, given what changed since the last call,
    /// and returns the index. Only after a [`rebuild`](Self::rebuild) for the same driver.
    pub fn update(&mut self, src: &Sources<'_>, changes: Changes) -> LayoutIndex {
        let (layer_ids, image_ids) = (changes.layers, changes.images);
        let dirty = self.relink_layers(src, &layer_ids);
        self.relink_images(src, &image_ids);
        let affected = self.descendants(dirty);
        self.judge_layers(src, &affected);

        let mut images: BTreeSet<Arc<str>> = image_ids.iter().map(|id| Arc::from(&**id)).collect();
        for id in &affected {
            if let Some(node) = self.layers.get(id) {
                images.extend(node.images.iter().cloned());
            }
        }
        self.judge_images(src, &images);

        for id in layer_ids
            .iter()
            .map(String::as_str)
            .chain(affected.iter().map(|a| &**a))
        {
            self.collect(id);
        }
        self.index.not_ready = Arc::new(self.not_ready_list(src));
        self.index.clone()
    }

    /// Records the parent and short id of each changed layer as its facts now say; returns
    /// the layers to judge again before their descendants: those, and every layer claiming
    /// a short id one of them claimed or claims.
    fn relink_layers(&mut self, src: &Sources<'_>, ids: &BTreeSet<String>) -> Vec<Arc<str>> {
        let mut dirty = Vec::with_capacity(ids.len());
        let mut shorts: HashSet<Arc<str>> = HashSet::new();
        for id in ids {
            let joined = src.joined(id);
            let (parent, short) = match &joined {
                Some((_, Ok(c))) => (c.meta.parent.as_deref(), Some(c.overlay.short.as_str())),
                _ => (None, None),
            };
            let key = self.intern(id);
            self.set_parent(&key, parent);
            self.set_short(&key, short, &mut shorts);
            self.node(&key).candidate = joined.is_some();
            dirty.push(key);
        }
        for short in shorts {
            dirty.extend(self.shorts.get(&short).into_iter().flatten().cloned());
        }
        dirty
    }

    /// Records the top layer of each changed image as its facts now say.
    fn relink_images(&mut self, src: &Sources<'_>, ids: &BTreeSet<String>) {
        for id in ids {
            let top = match src.images.get(id) {
                Some((_, Ok(facts))) => Some(facts.top_layer.as_str()),
                _ => None,
            };
            if self.tops.get(&**id).map(|t| &**t) == top {
                continue;
            }
            let image: Arc<str> = Arc::from(&**id);
            if let Some(old) = self.tops.remove(&image) {
                if let Some(node) = self.layers.get_mut(&old) {
                    remove_from(&mut node.images, &image);
                }
                self.collect(&old);
            }
            if let Some(top) = top {
                let top = self.intern(top);
                self.node(&top).images.push(image.clone());
                self.tops.insert(image, top);
            }
        }
    }

    /// `dirty` and all their descendants, by an iterative walk down the children map.
    fn descendants(&self, dirty: Vec<Arc<str>>) -> HashSet<Arc<str>> {
        let mut affected = HashSet::with_capacity(dirty.len());
        let mut stack = dirty;
        while let Some(id) = stack.pop() {
            if affected.contains(&id) {
                continue;
            }
            if let Some(node) = self.layers.get(&id) {
                stack.extend(node.children.iter().cloned());
            }
            affected.insert(id);
        }
        affected
    }

    /// Judges the `affected` layers again (every other verdict stands), and puts them in the
    /// index or the not-ready list.
    fn judge_layers(&mut self, src: &Sources<'_>, affected: &HashSet<Arc<str>>) {
        for id in affected {
            if let Some(node) = self.layers.get_mut(id) {
                node.verdict = None;
            }
            if let Some(old) = self.index.layers.remove(id) {
                let short = old.value.short.as_str();
                if self.index.by_short.get(short) == Some(id) {
                    self.index.by_short.remove(short);
                }
            }
            self.not_ready.remove(&(ObjectKind::Layer, id.clone()));
        }
        let mut chains = LiveChains {
            src,
            shorts: &self.shorts,
            layers: &mut self.layers,
        };
        for id in affected {
            let undecided = chains
                .layers
                .get(id)
                .is_some_and(|n| n.candidate && n.verdict.is_none());
            if let Some((name, _)) = src.joined(id).filter(|_| undecided) {
                judge_chain(name, &mut chains);
            }
        }
        for id in affected {
            let Some(node) = chains.layers.get(id).filter(|n| n.candidate) else {
                continue;
            };
            match (&node.verdict, chains.candidate(id)) {
                (Some(Verdict::Ready { .. }), Some(Ok(c))) => {
                    let ready = ready_layer(id, c);
                    let short = Arc::from(ready.value.short.as_str());
                    self.index.by_short.insert(short, id.clone());
                    self.index.layers.insert(id.clone(), Arc::new(ready));
                }
                (verdict, _) => {
                    // Every candidate has a verdict, and a failed one is never `Ready`.
                    let reason = verdict
                        .as_ref()
                        .and_then(Verdict::reason)
                        .unwrap_or("internal inconsistency in the readiness check");
                    self.not_ready
                        .insert((ObjectKind::Layer, id.clone()), reason.to_owned());
                }
            }
        }
    }

    /// Judges the images `ids` again against their top layers' verdicts.
    fn judge_images(&mut self, src: &Sources<'_>, ids: &BTreeSet<Arc<str>>) {
        for id in ids {
            self.index.images.remove(id);
            let key = (ObjectKind::Image, id.clone());
            self.not_ready.remove(&key);
            let Some((name, probed)) = src.images.get(id) else {
                continue;
            };
            let top = probed.ok().and_then(|facts| {
                let node = self.layers.get(facts.top_layer.as_str())?;
                node.verdict.as_ref()
            });
            match judge_image(name, probed, top) {
                Ok(ready) => {
                    self.index.images.insert(id.clone(), Arc::new(ready));
                }
                Err(reason) => {
                    self.not_ready.insert(key, reason);
                }
            }
        }
    }

    /// The not-ready list of the index: area problems and objects, by kind then name.
    fn not_ready_list(&self, src: &Sources<'_>) -> Vec<NotReady> {
        let mut list = Vec::with_capacity(self.not_ready.len());
        let areas = [
            (ObjectKind::Layer, src.overlay.path(), src.overlay.problem()),
            (ObjectKind::Layer, src.layers.path(), src.layers.problem()),
            (ObjectKind::Image, src.images.path(), src.images.problem()),
        ];
        for (kind, path, problem) in areas {
            if let Some(problem) = problem {
                list.push(NotReady {
                    kind,
                    name: path.to_owned(),
                    reason: problem.to_owned(),
                });
            }
        }
        for ((kind, name), reason) in &self.not_ready {
            list.push(NotReady {
                kind: *kind,
                name: name.to_string(),
                reason: reason.clone(),
            });
        }
        list.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
        list
    }

    /// The shared key of layer `id`, adding a node for it if there is none.
    fn intern(&mut self, id: &str) -> Arc<str> {
        if let Some((key, _)) = self.layers.get_key_value(id) {
            return key.clone();
        }
        let key: Arc<str> = Arc::from(id);
        self.layers.insert(key.clone(), Node::default());
        key
    }

    /// The node of an interned id.
    fn node(&mut self, key: &Arc<str>) -> &mut Node {
        self.layers.entry(key.clone()).or_default()
    }

    /// Registers `key` as a child of `parent` (and no longer of the parent it had).
    fn set_parent(&mut self, key: &Arc<str>, parent: Option<&str>) {
        if self.node(key).parent.as_deref() == parent {
            return;
        }
        if let Some(old) = self.node(key).parent.take() {
            if let Some(node) = self.layers.get_mut(&old) {
                remove_from(&mut node.children, key);
            }
            self.collect(&old);
        }
        if let Some(parent) = parent {
            let parent = self.intern(parent);
            self.node(&parent).children.push(key.clone());
            self.node(key).parent = Some(parent);
        }
    }

    /// Registers `key` as claiming `short` (and no longer the short id it claimed); adds
    /// both short ids to `touched` when they differ.
    fn set_short(&mut self, key: &Arc<str>, short: Option<&str>, touched: &mut HashSet<Arc<str>>) {
        if self.node(key).short.as_deref() == short {
            return;
        }
        if let Some(old) = self.node(key).short.take() {
            if let Some(owners) = self.shorts.get_mut(&old) {
                remove_from(owners, key);
                if owners.is_empty() {
                    self.shorts.remove(&old);
                }
            }
            touched.insert(old);
        }
        if let Some(short) = short {
            let short = match self.shorts.get_key_value(short) {
                Some((short, _)) => short.clone(),
                None => Arc::from(short),
            };
            let owners = self.shorts.entry(short.clone()).or_default();
            // Kept in id order, as a full resolve lists them.
            if let Err(at) = owners.binary_search(key) {
                owners.insert(at, key.clone());
            }
            self.node(key).short = Some(short.clone());
            touched.insert(short);
        }
    }

    /// Forgets the node of `id` once nothing refers to it any more.
    fn collect(&mut self, id: &str) {
        if self.layers.get(id).is_some_and(Node::unused) {
            self.layers.remove(id);
        }
    }
}

/// Removes `id` from a list of ids.
fn remove_from(ids: &mut Vec<Arc<str>>, id: &str) {
    if let Some(at) = ids.iter().position(|x| **x == *id) {
        ids.swap_remove(at);
    }
}

/// The chain walk's view of the kept verdicts: candidates are joined from the facts on
/// demand, verdicts live in the nodes.
struct LiveChains<'a, 'j> {
    src: &'j Sources<'a>,
    shorts: &'j HashMap<Arc<str>, Vec<Arc<str>>>,
    layers: &'j mut HashMap<Arc<str>, Node>,
}

impl<'a> Chains<'a> for LiveChains<'a, '_> {
    fn candidate(&self, id: &str) -> Option<Probed<Candidate<'a>>> {
        let (_, joined) = self.src.joined(id)?;
        Some(joined.and_then(|c| {
            let owners = self.shorts.get(c.overlay.short.as_str());
            shared_short(id, c, owners.into_iter().flatten().map(|o| &**o))
        }))
    }

    fn verdict(&self, id: &str) -> Option<&Verdict> {
        self.layers.get(id)?.verdict.as_ref()
    }

    fn decide(&mut self, id: &'a str, verdict: Verdict) {
        if let Some(node) = self.layers.get_mut(id) {
            node.verdict = Some(verdict);
        }
    }
}
