#!/usr/bin/env bash
# Runs the C pjdfstest suite (pjd/pjdfstest) once against a fresh layerfs view, with `prove`,
# and prints prove's summary. See tests/suites/README.md.
#
#   PJDFSTEST_C=/path/to/pjdfstest    the pjdfstest source dir, built (holds tests/ and the
#                                     pjdfstest binary) (required)
#   TRANSPORT=dev|uring               /dev/fuse, or FUSE over io_uring (-o io_uring; turns the
#                                     fuse module's enable_uring on for the run)
#   PASSTHROUGH=on|off                -o passthrough / -o nopassthrough
#   AREA=root|shared                  a new directory at the view's root, or inside a ready
#                                     remote layer's diff dir, run through a short bind mount
#                                     (socket paths are capped at 108 bytes)
#   TESTS="open rename"               only these subdirectories of tests/ (default: all)
#   MATRIX=1                          every TRANSPORT x PASSTHROUGH x AREA, and a table
#   OUT=dir                           where prove's output goes (default: a new temp dir, printed)
#   LAYERFS=path                      binary under test (default target/release/layerfs)
#   WORKDIR=/var/tmp                  where the remote/local trees are made (not tmpfs)
#   LAYER=<id>                        the ready layer for AREA=shared (default: the first one)
set -euo pipefail
. "$(dirname "$0")/lib.sh"

need_root
ensure_fusectl
require_env PJDFSTEST_C "the built C pjdfstest source dir, e.g. PJDFSTEST_C=/path/to/pjdfstest"
PJDFSTEST_C=$(cd "$PJDFSTEST_C" && pwd)
[ -d "$PJDFSTEST_C/tests" ] || die "PJDFSTEST_C=$PJDFSTEST_C has no tests/"
[ -x "$PJDFSTEST_C/pjdfstest" ] ||
    die "PJDFSTEST_C=$PJDFSTEST_C has no pjdfstest binary (autoreconf -ifs && ./configure && make pjdfstest)"
command -v prove >/dev/null || die "prove (perl) is missing"
TESTS=${TESTS:-}

out_dir layerfs-pjdfstest-c-out

# ---- MATRIX=1: this script once per configuration, then a table ----
if [ "${MATRIX:-0}" = 1 ]; then
    run_matrix $'transport\tpassthrough\tarea\tfiles\ttests\tfailed\tresult\tsecs' $'-\t-\t-\tERROR\t-'
    echo
    echo "pjdfstest (C) matrix${TESTS:+: TESTS=$TESTS}"
    column -t -s $'\t' "$MATRIX_TABLE"
    exit $MATRIX_STATUS
fi

# ---- one configuration ----
TRANSPORT=${TRANSPORT:-dev}
PASSTHROUGH=${PASSTHROUGH:-on}
AREA=${AREA:-root}
check_knobs
name=$TRANSPORT-pt$PASSTHROUGH-$AREA

dirs=()
if [ -n "$TESTS" ]; then
    for t in $TESTS; do
        [ -d "$PJDFSTEST_C/tests/$t" ] || die "no tests/$t in $PJDFSTEST_C"
        dirs+=("$PJDFSTEST_C/tests/$t")
    done
else
    dirs=("$PJDFSTEST_C/tests")
fi

workdir W layerfs-pjdfstest-c
stage_layerfs "$W"
make_trees "$W"
mnt=$W/mnt
at_exit stop_daemons
at_exit "force_unmount '$mnt'"
[ "$TRANSPORT" = uring ] && enable_uring
opts=$(view_options allow_other,suid,dev)
mount_view "$W" "$opts"
dir=$(area_base "$mnt")/pjdfstest-c
mkdir -m 0755 "$dir"
if [ "$AREA" = shared ]; then
    bind_short "$dir"
    log "$name: layerfs -o $opts; tests in $dir, through its bind mount $SHORT"
    dir=$SHORT
else
    log "$name: layerfs -o $opts; tests in $dir"
fi

log_file=$OUT/prove-$name.log
rc=0
run_in "$dir" prove -r "${dirs[@]}" >"$log_file" 2>&1 || rc=$?

files_line=$(grep -E '^Files=' "$log_file" | tail -1 || true)
result=$(sed -nE 's/^Result: (.*)$/\1/p' "$log_file" | tail -1)
files=$(sed -nE 's/^Files=([0-9]+),.*/\1/p' <<<"$files_line")
tests=$(sed -nE 's/^Files=[0-9]+, Tests=([0-9]+),.*/\1/p' <<<"$files_line")
secs=$(sed -nE 's/.* ([0-9]+) wallclock secs.*/\1/p' <<<"$files_line")
# Subtests that failed, from the "Test Summary Report" (one line per failing file).
failed=$(sed -nE 's/.*\(Wstat: [0-9]+ .*Failed: ([0-9]+)\)$/\1/p' "$log_file" | awk '{ s += $1 } END { print s + 0 }')
bad_files=$(sed -nE 's/^(.*\.t) +\(Wstat: .*/\1/p' "$log_file" | sed "s|^$PJDFSTEST_C/tests/||" | tr '\n' ' ')

echo "pjdfstest-c $name: ${files_line:-no summary (prove exit $rc)}"
echo "pjdfstest-c $name: Result: ${result:-none}; failed subtests: $failed${bad_files:+ in ${bad_files% }} (log: $log_file)"
if [ -n "${SUMMARY_TSV:-}" ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$TRANSPORT" "$PASSTHROUGH" "$AREA" "${files:--}" \
        "${tests:--}" "$failed" "${result:-none}" "${secs:--}" >"$SUMMARY_TSV"
fi
[ "$rc" = 0 ] && [ "$result" = PASS ]
