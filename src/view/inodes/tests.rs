//! The inode table on its own: numbers, identities, counts and the crowd mark.

use super::*;
use crate::view::node::Layer;

const LOCAL: u64 = 10;
const REMOTE: u64 = 20;

fn table() -> InodeTable {
    let root = Node::new(
        ROOT_INO,
        Kind::Dir,
        Zone::Root,
        NodeState::new(Layer::Local),
    );
    InodeTable::new(
        root,
        vec![Identity::Local { dev: LOCAL, ino: 2 }],
        LOCAL,
        REMOTE,
    )
}

fn file(ids: Vec<Identity>) -> NewNode {
    NewNode {
        kind: Kind::File,
        zone: Zone::Private,
        state: NodeState::new(Layer::Local),
        identities: ids,
        generation: 7,
    }
}

fn local(ino: u64) -> Identity {
    Identity::Local { dev: LOCAL, ino }
}

#[test]
fn only_a_node_numbered_after_its_local_inode_keeps_its_generation() {
    let t = table();
    assert_eq!(t.hand_out(file(vec![local(12)])).generation, 7);
    let remote = Identity::Remote {
        dev: REMOTE,
        ino: 12,
    };
    assert_eq!(t.hand_out(file(vec![remote])).generation, 0);
    let t2 = table();
    let first = t2.hand_out(file(vec![local(40)]));
    // Another object whose number is taken gets a counter number.
    let other = t2.hand_out(file(vec![Identity::Local { dev: 99, ino: 40 }]));
    assert_eq!((first.generation, other.generation), (7, 0));
    assert_eq!(
        t2.hand_out_number(first.ino).map(|n| n.ino),
        Some(first.ino)
    );
}

#[test]
fn numbers_derive_from_the_object_and_keep_layers_apart() {
    let t = table();
    let a = t.hand_out(file(vec![local(10)]));
    let b = t.hand_out(file(vec![Identity::Remote {
        dev: REMOTE,
        ino: 10,
    }]));
    assert_eq!(a.ino, 10);
    assert_eq!(b.ino, 10 | REMOTE_BIT);
    let other_fs = t.hand_out(file(vec![Identity::Local { dev: 99, ino: 10 }]));
    assert_ne!(other_fs.ino & COUNTER_BIT, 0);
}

#[test]
fn a_live_identity_is_handed_out_again_and_counted() {
    let t = table();
    let a = t.hand_out(file(vec![local(5)]));
    let again = t.hand_out_known(&local(5)).unwrap();
    assert!(Arc::ptr_eq(&a, &again));
    t.forget(5, 1);
    assert!(t.get(5).is_some());
    t.forget(5, 1);
    assert!(t.get(5).is_none());
    assert!(t.hand_out_known(&local(5)).is_none());
    // Forgetting more than was handed out, or an unknown node, is harmless.
    t.forget(5, 3);
    t.forget(12345, 1);
}

#[test]
fn a_forgotten_node_leaves_no_trace() {
    let t = table();
    for ino in 100..1100 {
        t.hand_out(file(vec![local(ino)]));
        t.forget(ino, 1);
    }
    assert_eq!(t.len(), 1);
    assert_eq!(t.identities(), 1);
}

#[test]
fn a_number_in_use_is_never_given_to_another_object() {
    let t = table();
    // A copied-up file keeps its remote number; a local object whose own number is
    // taken by a live node of another object gets a counter number.
    let first = t.hand_out(file(vec![local(7)]));
    t.detach(&first);
    let second = t.hand_out(file(vec![local(7)]));
    assert!(!Arc::ptr_eq(&first, &second));
    assert_ne!(second.ino, first.ino);
    assert_ne!(second.ino & COUNTER_BIT, 0);
}

#[test]
fn identities_added_later_find_the_same_node() {
    let t = table();
    let remote = Identity::Remote {
        dev: REMOTE,
        ino: 3,
    };
    let n = t.hand_out(file(vec![remote.clone()]));
    t.add_identity(&n, local(33));
    t.remove_identity(&n, &remote);
    assert!(Arc::ptr_eq(&t.hand_out_known(&local(33)).unwrap(), &n));
    assert!(t.hand_out_known(&remote).is_none());
    assert_eq!(t.listed_number(&local(33)), n.ino);
    t.forget(n.ino, 2);
    assert_eq!(t.identities(), 1);
    assert_eq!(t.listed_number(&local(33)), 33);
}

#[test]
fn synthesized_numbers_last_until_unbound() {
    let t = table();
    let name = OsString::from("abc");
    let id = Identity::Virtual {
        parent: 1,
        name: name.clone(),
    };
    let n = t.hand_out(file(vec![id.clone()]));
    t.forget(n.ino, 1);
    assert_eq!(t.listed_number(&id), n.ino);
    let again = t.hand_out(file(vec![id.clone()]));
    assert_eq!(again.ino, n.ino);
    t.unbind_virtual(1, &name);
    assert!(t.hand_out_known(&id).is_none());
    assert_ne!(t.hand_out(file(vec![id])).ino, n.ino);
}

#[test]
fn a_copy_keeps_its_original_number_until_deleted() {
    let t = table();
    let remote = Identity::Remote {
        dev: REMOTE,
        ino: 8,
    };
    let n = t.hand_out(file(vec![remote]));
    t.set_origin(LOCAL, 80, n.ino);
    t.forget(n.ino, 1);
    assert_eq!(t.listed_number(&local(80)), 8 | REMOTE_BIT);
    assert_eq!(t.hand_out(file(vec![local(80)])).ino, 8 | REMOTE_BIT);
    t.forget(8 | REMOTE_BIT, 1);
    t.forget_origin(LOCAL, 80);
    assert_eq!(t.hand_out(file(vec![local(80)])).ino, 80);
}

#[test]
fn the_least_recently_handed_out_come_first() {
    let t = table();
    for ino in 10..20 {
        t.hand_out(file(vec![local(ino)]));
    }
    t.hand_out_known(&local(10));
    let mut old: Vec<u64> = t.least_recent(3, false).iter().map(|n| n.ino).collect();
    old.sort();
    assert_eq!(old, vec![11, 12, 13]);
    assert_eq!(t.least_recent(100, false).len(), 10);
    assert!(t.least_recent(100, true).is_empty(), "never the root");
}

/// Trimming starts on the descriptors the nodes may hold, not on their number: a file's
/// node holds one, a directory's up to two. The table is crowded from the high mark until
/// it is down to the low one.
#[test]
fn the_crowd_mark_counts_a_directory_twice_and_a_file_once() {
    let t = table();
    assert_eq!(t.held(), 2, "the root is a directory");
    let (tell, told) = crossbeam_channel::bounded(1);
    t.watch(6, 4, tell);
    let files: Vec<_> = (0..3)
        .map(|i| t.hand_out(file(vec![local(100 + i)])))
        .collect();
    assert_eq!((t.len(), t.held()), (4, 5));
    assert!(!t.crowded() && told.try_recv().is_err());
    let mut dir = file(vec![local(200)]);
    dir.kind = Kind::Dir;
    let dir = t.hand_out(dir);
    assert_eq!((t.len(), t.held()), (5, 7));
    assert!(t.crowded() && told.try_recv().is_ok());
    t.forget(files[0].ino, 1);
    assert!(t.crowded(), "5 may still be held, above the low mark");
    t.forget(dir.ino, 1);
    assert_eq!(t.held(), 4);
    assert!(!t.crowded());
}

#[test]
fn the_root_is_never_forgotten() {
    let t = table();
    t.forget(ROOT_INO, 100);
    assert!(t.get(ROOT_INO).is_some());
}

/// Keeps the records a table appends, as the keeper's state does.
#[derive(Debug, Default)]
struct Records(Mutex<Vec<Vec<u8>>>);

impl Journal for Records {
    fn append(&self, record: &[u8]) {
        self.0.lock().push(record.to_vec());
    }
}

#[test]
fn a_table_restored_from_the_journal_numbers_as_the_one_that_kept_it() {
    let records = Arc::new(Records::default());
    let first = table();
    // Given before the journal: kept when the journal is set.
    let early = first.named_number(ROOT_INO, &"overlay".into());
    first.keep_in(records.clone());
    let link = first.named_number(early, &"l".into());
    let gone = first.named_number(early, &"old".into());
    first.unbind_virtual(early, &"old".into());
    first.set_origin(LOCAL, 40, REMOTE_BIT | 9);
    first.set_origin(LOCAL, 41, REMOTE_BIT | 10);
    first.forget_origin(LOCAL, 41);
    let remote = first.hand_out(file(vec![Identity::Remote {
        dev: REMOTE,
        ino: 77,
    }]));
    first.placed(&remote, link, std::ffi::OsStr::new("f"));

    let second = table();
    second.restore(
        records
            .0
            .lock()
            .iter()
            .map(|r| Fact::decode(r).expect("a whole record")),
    );
    assert_eq!(second.named_number(ROOT_INO, &"overlay".into()), early);
    assert_eq!(second.named_number(early, &"l".into()), link);
    assert_eq!(second.named_as(remote.ino), Some((link, "f".into())));
    assert_eq!(
        second.origins.lock().get(&(LOCAL, 40)),
        Some(&(REMOTE_BIT | 9))
    );
    assert_eq!(second.origins.lock().get(&(LOCAL, 41)), None);
    let fresh = second.named_number(early, &"new".into());
    assert!(
        ![early, link, gone].contains(&fresh),
        "a number the first table gave is never given again"
    );
}
