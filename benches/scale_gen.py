#!/usr/bin/env python3
"""Generates (or changes) a remote tree in iSulad's remote-layer layout, for benches/scale.sh.

    scale_gen.py create ROOT --chains N --depth D   N images, each on its own chain of D layers
    scale_gen.py add ROOT --first K --count C --depth D   C more chains+images, numbered from K
    scale_gen.py remove ROOT --first K --count C --depth D   removes chains+images K..K+C-1

Every object is ready by DESIGN §4.3: link, diff/, lower matching the chain, layer.json with a
diff-digest and a complete tar-split, images.json, manifest and config.
"""

import argparse
import base64
import gzip
import hashlib
import json
import os
import shutil

TAR_SPLIT = gzip.compress(b'{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}\n')


def hexid(kind, chain, n=0):
    return hashlib.sha256(f"{kind}-{chain}-{n}".encode()).hexdigest()


def write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def make_chain(root, chain, depth):
    lower = []
    parent = None
    for n in range(depth):
        lid = hexid("layer", chain, n)
        short = hexid("short", chain, n)[:26]
        ov = os.path.join(root, "overlay/RO", lid)
        os.makedirs(os.path.join(ov, "diff"), exist_ok=True)
        write(os.path.join(ov, "diff", "file"), f"{chain}/{n}\n")
        write(os.path.join(ov, "link"), short)
        if parent is None:
            os.makedirs(os.path.join(ov, "empty"), exist_ok=True)
        else:
            write(os.path.join(ov, "lower"), ":".join(f"l/{s}" for s in lower))
        meta = os.path.join(root, "overlay-layers/RO", lid)
        os.makedirs(meta, exist_ok=True)
        doc = {"id": lid, "diff-digest": f"sha256:{lid}", "diff-size": 13}
        if parent:
            doc["parent"] = parent
        write(os.path.join(meta, "layer.json"), json.dumps(doc))
        write(os.path.join(meta, f"{lid}.tar-split.gz"), TAR_SPLIT)
        lower.insert(0, short)
        parent = lid
    iid = hexid("image", chain)
    img = os.path.join(root, "overlay-images", iid)
    os.makedirs(img, exist_ok=True)
    write(
        os.path.join(img, "images.json"),
        json.dumps({"id": iid, "names": [f"bench/{chain}:latest"], "layer": parent}),
    )
    write(os.path.join(img, "manifest"), '{"schemaVersion":2}')
    config = "=" + base64.b64encode(f"sha256:{iid}".encode()).decode()
    write(os.path.join(img, config), '{"architecture":"amd64"}')


def remove_chain(root, chain, depth):
    shutil.rmtree(os.path.join(root, "overlay-images", hexid("image", chain)))
    for n in range(depth):
        lid = hexid("layer", chain, n)
        shutil.rmtree(os.path.join(root, "overlay/RO", lid))
        shutil.rmtree(os.path.join(root, "overlay-layers/RO", lid))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["create", "add", "remove"])
    p.add_argument("root")
    p.add_argument("--chains", type=int, default=1000)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--depth", type=int, default=10)
    a = p.parse_args()
    for area in ("overlay/RO", "overlay-layers/RO", "overlay-images"):
        os.makedirs(os.path.join(a.root, area), exist_ok=True)
    if a.action == "create":
        for c in range(a.chains):
            make_chain(a.root, c, a.depth)
    elif a.action == "add":
        for c in range(a.first, a.first + a.count):
            make_chain(a.root, c, a.depth)
    else:
        for c in range(a.first, a.first + a.count):
            remove_chain(a.root, c, a.depth)


if __name__ == "__main__":
    main()
