#!/usr/bin/env bash
# Checks the systemd units in deploy/systemd with `systemd-analyze verify`, their
# Exec*= commands pointed at this tree's binaries (verify requires every command to exist).
# Any complaint fails the check, not only errors: systemd merely warns about a key it does
# not know, and then ignores the setting.
#   tests/systemd_units.sh            # debug build; PROFILE=release for the release one
# Skipped (exit 0) only where systemd-analyze is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v systemd-analyze >/dev/null; then
    echo "tests/systemd_units.sh: skipped, systemd-analyze is not installed"
    exit 0
fi

profile=${PROFILE:-debug}
build=(cargo build --quiet -p layerfs --bin layerfs -p layerfs-snapshotter --bin layerfs-snapshotter)
[ "$profile" = release ] && build+=(--release)
"${build[@]}"
bin=$(cd "${CARGO_TARGET_DIR:-target}/$profile" && pwd)

units=$(mktemp -d)
trap 'rm -rf "$units"' EXIT
for unit in deploy/systemd/*.service; do
    grep -q '^ExecStart=/usr/local/bin/' "$unit" || {
        echo "$unit: ExecStart= does not run a binary from /usr/local/bin" >&2
        exit 1
    }
    sed -E "s|^(Exec[A-Za-z]+)=/usr/local/bin/|\1=$bin/|" "$unit" >"$units/$(basename "$unit")"
done

# verify exits 0 on warnings, so its output is the verdict.
out=$(cd "$units" && systemd-analyze verify ./*.service 2>&1) && rc=0 || rc=$?
if [ "$rc" != 0 ] || [ -n "$out" ]; then
    echo "$out" >&2
    echo "tests/systemd_units.sh: systemd-analyze verify failed (exit $rc)" >&2
    exit 1
fi
echo "tests/systemd_units.sh: $(ls "$units" | tr '\n' ' ')verified"
