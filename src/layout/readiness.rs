//! The cross-object rules: joining a layer's two directories, walking parent chains, and
//! tying images to their top layer.
//!
//! A layer is ready when both of its directories passed their own checks, they agree with each
//! other, and its parent is ready. The walk up a chain is iterative and memoized, so a long or
//! hostile chain costs linear time and no stack, and a cycle is detected rather than followed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::scan::{Area, Facts, ImageFacts, LayerFacts, OverlayFacts, Probed};
use super::{Image, Layer, LayoutIndex, NotReady, ObjectKind, Ready, MAX_LOWER_DEPTH};

/// One area's facts, borrowed: the rules read the per-object facts where they are kept (in
/// a scanner's cache) and copy out only what the index keeps of ready objects.
pub(crate) struct AreaRef<'a, T> {
    pub path: &'a str,
    pub objects: BTreeMap<&'a str, Result<&'a T, &'a str>>,
    pub problem: Option<&'a str>,
}

impl<'a, T> AreaRef<'a, T> {
    pub fn of(area: &'a Area<T>) -> AreaRef<'a, T> {
        AreaRef {
            path: &area.path,
            objects: area
                .objects
                .iter()
                .map(|(id, probed)| (id.as_str(), probed.as_ref().map_err(String::as_str)))
                .collect(),
            problem: area.problem.as_deref(),
        }
    }
}

/// Everything one scan found, borrowed.
pub(crate) struct FactsRef<'a> {
    pub overlay: AreaRef<'a, OverlayFacts>,
    pub layers: AreaRef<'a, LayerFacts>,
    pub images: AreaRef<'a, ImageFacts>,
}

impl<'a> FactsRef<'a> {
    pub fn of(facts: &'a Facts) -> FactsRef<'a> {
        FactsRef {
            overlay: AreaRef::of(&facts.overlay),
            layers: AreaRef::of(&facts.layers),
            images: AreaRef::of(&facts.images),
        }
    }
}

/// Verdicts by layer id. Lookups dominate the chain walks, and a hash lookup of a 64-char
/// id is much cheaper than a dozen string comparisons down a tree.
type Verdicts<'a> = HashMap<&'a str, Verdict>;

/// Candidates by layer id, for the chain walks.
type Lookup<'a, 'b> = HashMap<&'a str, &'b Probed<Candidate<'a>>>;

/// A layer whose own directories are fine; whether its chain is remains to be seen.
#[derive(Clone, Copy)]
pub(crate) struct Candidate<'a> {
    pub overlay: &'a OverlayFacts,
    pub meta: &'a LayerFacts,
}

/// The outcome for one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// `depth` counts ancestors, which is also the number of `lower` entries.
    Ready { depth: usize },
    NotReady {
        reason: String,
        /// The layer whose own problem sank this one, and that problem: what a child names
        /// in its own reason so an operator goes straight to the broken layer.
        root: String,
        root_reason: String,
    },
}

impl Verdict {
    fn own_failure(id: &str, reason: String) -> Verdict {
        Verdict::NotReady {
            root: id.to_owned(),
            root_reason: reason.clone(),
            reason,
        }
    }

    /// Stands for a layer that is referenced but present in neither area.
    fn missing(id: &str) -> Verdict {
        Verdict::own_failure(id, "missing".to_owned())
    }

    /// The verdict of an object that needs the layer `id` (its `relation`: "parent", "top
    /// layer"), when that layer has this verdict; `None` when the layer is ready.
    fn for_dependent(&self, relation: &str, id: &str) -> Option<Verdict> {
        let Verdict::NotReady {
            root, root_reason, ..
        } = self
        else {
            return None;
        };
        let cause = if root == id {
            root_reason.clone()
        } else {
            format!("ancestor {root}: {root_reason}")
        };
        Some(Verdict::NotReady {
            reason: format!("{relation} {id}: not ready ({cause})"),
            root: root.clone(),
            root_reason: root_reason.clone(),
        })
    }

    pub fn reason(&self) -> Option<&str> {
        match self {
            Verdict::Ready { .. } => None,
            Verdict::NotReady { reason, .. } => Some(reason),
        }
    }
}

/// Turns the scanned facts into the index of ready objects.
pub(crate) fn resolve(facts: FactsRef<'_>, driver: &str) -> LayoutIndex {
    resolve_keeping(facts, driver).0
}

/// A layer in either area as [`resolve_keeping`] decided it: what a caller that keeps
/// verdicts from one scan to the next needs to know of it.
pub(crate) struct Decided<'a> {
    pub id: &'a str,
    /// The parent its joined candidate names, and the short id it claims (before the check
    /// for shared short ids); `None` when its two directories do not make a candidate.
    pub parent: Option<&'a str>,
    pub short: Option<&'a str>,
    pub verdict: Verdict,
}

/// [`resolve`], also returning what it decided of every layer, in id order.
pub(crate) fn resolve_keeping<'a>(
    facts: FactsRef<'a>,
    driver: &str,
) -> (LayoutIndex, Vec<Decided<'a>>) {
    let mut not_ready = Vec::new();
    area_problem(&facts.overlay, ObjectKind::Layer, &mut not_ready);
    area_problem(&facts.layers, ObjectKind::Layer, &mut not_ready);
    area_problem(&facts.images, ObjectKind::Image, &mut not_ready);

    let candidates = join_layer_areas(&facts.overlay, &facts.layers);
    let links: Vec<_> = candidates
        .iter()
        .map(|(id, candidate)| match candidate {
            Ok(c) => (
                *id,
                c.meta.parent.as_deref(),
                Some(c.overlay.short.as_str()),
            ),
            Err(_) => (*id, None, None),
        })
        .collect();
    let candidates = reject_shared_shorts(candidates);
    let mut verdicts = judge_chains(&candidates);

    let mut index = LayoutIndex {
        driver: driver.to_owned(),
        ..LayoutIndex::default()
    };
    add_layers(&mut index, candidates, &verdicts, &mut not_ready);
    add_images(&mut index, facts.images, &verdicts, &mut not_ready);
    not_ready.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
    index.not_ready = Arc::new(not_ready);
    let decided = links
        .into_iter()
        .map(|(id, parent, short)| Decided {
            id,
            parent,
            short,
            // Every candidate has a verdict.
            verdict: verdicts.remove(id).unwrap_or_else(|| {
                Verdict::own_failure(id, "internal inconsistency in the chain walk".to_owned())
            }),
        })
        .collect();
    (index, decided)
}

fn add_layers(
    index: &mut LayoutIndex,
    candidates: BTreeMap<&str, Probed<Candidate<'_>>>,
    verdicts: &Verdicts<'_>,
    not_ready: &mut Vec<NotReady>,
) {
    // Collected in id order, so the maps are built in one pass rather than by insertion.
    let mut ready = Vec::with_capacity(candidates.len());
    for (id, candidate) in candidates {
        match (verdicts.get(id), candidate) {
            (Some(Verdict::Ready { .. }), Ok(c)) => {
                ready.push((Arc::<str>::from(id), ready_layer(id, c)))
            }
            (verdict, _) => not_ready.push(NotReady {
                kind: ObjectKind::Layer,
                // Every candidate has a verdict, and a failed one is never `Ready`.
                reason: verdict
                    .and_then(Verdict::reason)
                    .unwrap_or("internal inconsistency in the readiness check")
                    .to_owned(),
                name: id.to_owned(),
            }),
        }
    }
    index.by_short = ready
        .iter()
        .map(|(id, r)| (Arc::from(r.value.short.as_str()), id.clone()))
        .collect();
    index.layers = ready.into_iter().map(|(id, r)| (id, Arc::new(r))).collect();
}

pub(crate) fn ready_layer(id: &str, c: Candidate<'_>) -> Ready<Layer> {
    let mut fingerprint = c.overlay.fingerprint.clone();
    fingerprint.extend(c.meta.fingerprint.clone());
    let value = Layer {
        id: id.to_owned(),
        short: c.overlay.short.clone(),
        parent: c.meta.parent.clone(),
        mtime: c.overlay.mtime,
    };
    Ready { value, fingerprint }
}

fn add_images(
    index: &mut LayoutIndex,
    images: AreaRef<'_, ImageFacts>,
    verdicts: &Verdicts<'_>,
    not_ready: &mut Vec<NotReady>,
) {
    for (id, probed) in images.objects {
        let top = probed.ok().and_then(|f| verdicts.get(f.top_layer.as_str()));
        match judge_image(id, probed, top) {
            Ok(ready) => {
                index.images.insert(Arc::from(id), Arc::new(ready));
            }
            Err(reason) => not_ready.push(NotReady {
                kind: ObjectKind::Image,
                name: id.to_owned(),
                reason,
            }),
        }
    }
}

fn area_problem<T>(area: &AreaRef<'_, T>, kind: ObjectKind, not_ready: &mut Vec<NotReady>) {
    if let Some(problem) = area.problem {
        not_ready.push(NotReady {
            kind,
            name: area.path.to_owned(),
            reason: problem.to_owned(),
        });
    }
}

/// Pairs each layer's `<driver>/RO/<id>` facts with its `<driver>-layers/RO/<id>` facts.
/// Every id seen in either area gets an entry, so a half-created layer is reported, not
/// silently dropped.
fn join_layer_areas<'a>(
    overlay: &AreaRef<'a, OverlayFacts>,
    layers: &AreaRef<'a, LayerFacts>,
) -> BTreeMap<&'a str, Probed<Candidate<'a>>> {
    // Both areas are in id order: one merging walk pairs them.
    let mut overlay_objects = overlay.objects.iter().peekable();
    let mut meta_objects = layers.objects.iter().peekable();
    let mut joined = Vec::with_capacity(overlay.objects.len().max(layers.objects.len()));
    loop {
        let id: &'a str = match (overlay_objects.peek(), meta_objects.peek()) {
            (None, None) => break,
            (Some((a, _)), None) => a,
            (None, Some((b, _))) => b,
            (Some((a, _)), Some((b, _))) => (**a).min(**b),
        };
        let overlay_facts = overlay_objects.next_if(|(k, _)| **k == id).map(|(_, v)| *v);
        let meta = meta_objects.next_if(|(k, _)| **k == id).map(|(_, v)| *v);
        let sides = Sides {
            overlay_path: overlay.path,
            layers_path: layers.path,
            overlay: overlay_facts,
            meta,
        };
        joined.push((id, join(id, sides)));
    }
    joined.into_iter().collect()
}

/// What the two layer areas hold for one id: `None` where the area has no such object.
pub(crate) struct Sides<'a, 'p> {
    pub overlay_path: &'p str,
    pub layers_path: &'p str,
    pub overlay: Option<Result<&'a OverlayFacts, &'a str>>,
    pub meta: Option<Result<&'a LayerFacts, &'a str>>,
}

/// Joins one layer's two directories into a candidate, or the reason it cannot be one.
pub(crate) fn join<'a>(id: &str, sides: Sides<'a, '_>) -> Probed<Candidate<'a>> {
    let overlay = sides
        .overlay
        .ok_or_else(|| format!("{}/{id}: missing", sides.overlay_path));
    let meta = sides
        .meta
        .ok_or_else(|| format!("{}/{id}: missing", sides.layers_path));
    match (overlay, meta) {
        (Ok(Ok(overlay)), Ok(Ok(meta))) => agree(overlay, meta),
        (Ok(Err(a)), Ok(Err(b))) => Err(format!("{a}; {b}")),
        (Err(a), Ok(Err(b))) => Err(format!("{a}; {b}")),
        (Ok(Err(a)), Err(b)) => Err(format!("{a}; {b}")),
        (Err(a), Err(b)) => Err(format!("{a}; {b}")),
        (Ok(Err(e)), Ok(Ok(_))) | (Ok(Ok(_)), Ok(Err(e))) => Err(e.to_owned()),
        (Err(e), Ok(Ok(_))) | (Ok(Ok(_)), Err(e)) => Err(e),
    }
}

/// The metadata's files must be usable, and the overlay dir must stack a lower chain exactly
/// when the metadata names a parent.
fn agree<'a>(overlay: &'a OverlayFacts, meta: &'a LayerFacts) -> Probed<Candidate<'a>> {
    if let Some(broken) = &meta.broken {
        return Err(broken.clone());
    }
    match (&meta.parent, &overlay.lower) {
        (Some(parent), None) => Err(format!(
            "lower: missing although layer.json names parent {parent}"
        )),
        (None, Some(_)) => Err("lower: present although layer.json names no parent".to_owned()),
        _ => Ok(Candidate { overlay, meta }),
    }
}

/// Two layers claiming the same short id would make `l/<short>` ambiguous: neither is ready.
fn reject_shared_shorts<'a>(
    candidates: BTreeMap<&'a str, Probed<Candidate<'a>>>,
) -> BTreeMap<&'a str, Probed<Candidate<'a>>> {
    let mut owners: HashMap<&'a str, Vec<&'a str>> = HashMap::new();
    for (id, candidate) in &candidates {
        if let Ok(c) = candidate {
            owners.entry(c.overlay.short.as_str()).or_default().push(id);
        }
    }
    candidates
        .into_iter()
        .map(|(id, candidate)| {
            let candidate = candidate.and_then(|c| {
                let owners = owners.get(c.overlay.short.as_str()).into_iter().flatten();
                shared_short(id, c, owners.copied())
            });
            (id, candidate)
        })
        .collect()
}

/// The candidate `id`, unless another layer also claims its short id. `owners` are all the
/// joined candidates claiming it (`id` among them), in id order.
pub(crate) fn shared_short<'a, 'o>(
    id: &str,
    candidate: Candidate<'a>,
    owners: impl Iterator<Item = &'o str>,
) -> Probed<Candidate<'a>> {
    let others: Vec<&str> = owners.filter(|other| *other != id).collect();
    if others.is_empty() {
        Ok(candidate)
    } else {
        Err(format!(
            "link: short id {} also used by {}",
            candidate.overlay.short,
            others.join(", ")
        ))
    }
}

/// Decides every layer, walking each chain upwards only as far as the first layer already
/// decided.
fn judge_chains<'a>(candidates: &BTreeMap<&'a str, Probed<Candidate<'a>>>) -> Verdicts<'a> {
    let mut chains = AllChains {
        candidates: candidates.iter().map(|(id, c)| (*id, c)).collect(),
        verdicts: Verdicts::with_capacity(candidates.len()),
    };
    for &id in candidates.keys() {
        if chains.verdict(id).is_none() {
            judge_chain(id, &mut chains);
        }
    }
    chains.verdicts
}

/// Every layer's candidate at hand, and the verdicts decided so far.
struct AllChains<'a, 'b> {
    candidates: Lookup<'a, 'b>,
    verdicts: Verdicts<'a>,
}

impl<'a> Chains<'a> for AllChains<'a, '_> {
    fn candidate(&self, id: &str) -> Option<Probed<Candidate<'a>>> {
        self.candidates.get(id).map(|c| (*c).clone())
    }

    fn verdict(&self, id: &str) -> Option<&Verdict> {
        self.verdicts.get(id)
    }

    fn decide(&mut self, id: &'a str, verdict: Verdict) {
        self.verdicts.insert(id, verdict);
    }
}

/// What a chain walk needs: each layer's candidate (after the shared-short check) and a
/// place for verdicts. A layer with a verdict is not walked through again.
pub(crate) trait Chains<'a> {
    /// The candidate `id`, or `None` for a layer present in neither area.
    fn candidate(&self, id: &str) -> Option<Probed<Candidate<'a>>>;
    fn verdict(&self, id: &str) -> Option<&Verdict>;
    fn decide(&mut self, id: &'a str, verdict: Verdict);
}

/// Walks from `start` towards its base until reaching a layer that is decided or decidable on
/// its own (missing, failing its own checks, a base layer, or closing a cycle); then decides
/// the walked path from that end back down to `start`.
///
/// Every verdict depends only on the layer and its ancestors, never on where a walk
/// started: a layer on a cycle names the cycle's smallest id, whichever member a walk
/// entered it by. So a verdict stays valid as long as nothing in its chain changes, which is
/// what lets a later scan re-judge only the layers below a change.
pub(crate) fn judge_chain<'a>(start: &'a str, chains: &mut impl Chains<'a>) {
    // Undecided layers, each the child of the next; the last one's parent is `current`.
    let mut path: Vec<&'a str> = Vec::new();
    let mut on_path: HashSet<&'a str> = HashSet::new();
    let mut current: &'a str = start;
    let end = loop {
        if let Some(verdict) = chains.verdict(current) {
            break verdict.clone();
        }
        let Some(candidate) = chains.candidate(current) else {
            break Verdict::missing(current);
        };
        if on_path.contains(current) {
            let at = path.iter().position(|id| *id == current).unwrap_or(0);
            let cycle = path.split_off(at);
            let smallest = cycle.iter().copied().min().unwrap_or(current);
            for &id in &cycle {
                let reason = format!("parent chain loops back to {smallest}");
                chains.decide(id, Verdict::own_failure(id, reason));
            }
            break chains
                .verdict(current)
                .cloned()
                .unwrap_or_else(|| Verdict::missing(current));
        }
        let verdict = match candidate {
            Err(reason) => Verdict::own_failure(current, reason),
            Ok(c) => match c.meta.parent.as_deref() {
                // `agree` made sure a base layer has no `lower`.
                None => Verdict::Ready { depth: 0 },
                Some(parent) => {
                    path.push(current);
                    on_path.insert(current);
                    current = parent;
                    continue;
                }
            },
        };
        chains.decide(current, verdict.clone());
        break verdict;
    };

    let mut parent_id = current;
    let mut parent_verdict = end;
    for &id in path.iter().rev() {
        let verdict = match chains.candidate(id) {
            Some(Ok(c)) => {
                let parent = chains.candidate(parent_id);
                judge_link(id, &c, parent_id, &parent_verdict, parent)
            }
            _ => Verdict::own_failure(id, "internal inconsistency in the chain walk".to_owned()),
        };
        chains.decide(id, verdict.clone());
        parent_id = id;
        parent_verdict = verdict;
    }
}

/// Decides a layer whose own checks passed, given its parent's verdict and candidate.
fn judge_link(
    id: &str,
    candidate: &Candidate<'_>,
    parent_id: &str,
    parent_verdict: &Verdict,
    parent: Option<Probed<Candidate<'_>>>,
) -> Verdict {
    let depth = match parent_verdict {
        Verdict::Ready { depth } => depth + 1,
        not_ready => {
            return not_ready
                .for_dependent("parent", parent_id)
                .unwrap_or_else(|| Verdict::missing(parent_id))
        }
    };
    if depth > MAX_LOWER_DEPTH {
        return Verdict::own_failure(
            id,
            format!("parent chain deeper than {MAX_LOWER_DEPTH} layers"),
        );
    }
    let parent = match parent {
        Some(Ok(parent)) => parent,
        _ => return Verdict::missing(parent_id),
    };
    match check_lower(candidate, &parent) {
        Ok(()) => Verdict::Ready { depth },
        Err(reason) => Verdict::own_failure(id, reason),
    }
}

/// `lower` must be exactly what the writer derives from the chain: the parent's short id,
/// then the parent's own `lower`. Anything else would make a mount stack layers that the
/// metadata does not describe, so it is stricter than "every entry resolves".
fn check_lower(child: &Candidate<'_>, parent: &Candidate<'_>) -> Result<(), String> {
    let lower = child.overlay.lower.as_deref().unwrap_or_default();
    let expected =
        std::iter::once(&parent.overlay.short).chain(parent.overlay.lower.iter().flatten());
    let mut expected = expected.peekable();
    for (i, short) in lower.iter().enumerate() {
        match expected.next() {
            Some(want) if want == short => {}
            Some(want) if i == 0 => {
                return Err(format!(
                    "lower: first entry l/{short} is not the parent's short id {want}"
                ))
            }
            Some(want) => {
                return Err(format!(
                    "lower: entry {} is l/{short}, expected l/{want} from the parent chain",
                    i + 1
                ))
            }
            None => {
                return Err(format!(
                    "lower: entry {} (l/{short}) is beyond the parent chain",
                    i + 1
                ))
            }
        }
    }
    match expected.peek() {
        Some(want) => Err(format!(
            "lower: ends before the parent chain does (l/{want} missing)"
        )),
        None => Ok(()),
    }
}

/// Decides an image from its own facts and its top layer's verdict.
/// `top` is the verdict of the image's top layer, `None` when that layer is in neither area.
pub(crate) fn judge_image(
    id: &str,
    probed: Result<&ImageFacts, &str>,
    top: Option<&Verdict>,
) -> Result<Ready<Image>, String> {
    let facts = probed.map_err(str::to_owned)?;
    let missing = Verdict::missing(&facts.top_layer);
    let verdict = top.unwrap_or(&missing);
    if let Some(dependent) = verdict.for_dependent("top layer", &facts.top_layer) {
        return Err(dependent.reason().unwrap_or_default().to_owned());
    }
    let image = Image {
        id: id.to_owned(),
        top_layer: facts.top_layer.clone(),
        names: facts.names.clone(),
        mtime: facts.mtime,
    };
    Ok(Ready {
        value: image,
        fingerprint: facts.fingerprint.clone(),
    })
}
