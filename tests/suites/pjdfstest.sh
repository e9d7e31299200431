#!/usr/bin/env bash
# Runs the Rust pjdfstest suite (saidsay-so/pjdfstest) RUNS times against a fresh layerfs view
# and counts the failures of every run: one green run proves little (a rare race shows up in
# a few runs out of a hundred). See tests/suites/README.md.
#
#   PJDFSTEST_RS=/path/to/pjdfstest   the pjdfstest binary (required)
#   RUNS=10                           runs per configuration
#   TRANSPORT=dev|uring               /dev/fuse, or FUSE over io_uring (-o io_uring; turns the
#                                     fuse module's enable_uring on for the run)
#   PASSTHROUGH=on|off                -o passthrough / -o nopassthrough
#   AREA=root|shared                  a new directory at the view's root, or inside a ready
#                                     remote layer's diff dir (copy-up, whiteouts, merges)
#   FILTER=open::                     pjdfstest's test filter (substring); all tests if unset
#   REMOUNT_EACH=1                    unmount and mount again before every run
#   MATRIX=1                          every TRANSPORT x PASSTHROUGH x AREA, and a table
#   OUT=dir                           where results go (default: a new temp dir, printed)
#   PJD_CONFIG=file                   pjdfstest config (default: Linux features, naptime 0.01)
#   LAYERFS=path                      binary under test (default target/release/layerfs)
#   WORKDIR=/var/tmp                  where the remote/local trees are made (not tmpfs)
#   LAYER=<id>                        the ready layer for AREA=shared (default: the first one)
#   SHORT_PATH=0                      AREA=shared: run at the long path, not through a short
#                                     bind mount (socket paths are capped at 108 bytes)
set -euo pipefail
. "$(dirname "$0")/lib.sh"

need_root
ensure_fusectl
require_env PJDFSTEST_RS "the Rust pjdfstest binary, e.g. PJDFSTEST_RS=/path/to/pjdfstest/target/release/pjdfstest"
[ -x "$PJDFSTEST_RS" ] || die "PJDFSTEST_RS=$PJDFSTEST_RS is not an executable"
RUNS=${RUNS:-10}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "RUNS must be a positive number, not '$RUNS'"
FILTER=${FILTER:-}

out_dir layerfs-pjdfstest-out

# ---- MATRIX=1: this script once per configuration, then a table ----
if [ "${MATRIX:-0}" = 1 ]; then
    run_matrix $'transport\tpassthrough\tarea\truns\tfailures\tfailing tests' "$RUNS"$'\tERROR\t(setup failed; see above)'
    echo
    echo "pjdfstest matrix: RUNS=$RUNS${FILTER:+ FILTER=$FILTER}"
    column -t -s $'\t' "$MATRIX_TABLE"
    exit $MATRIX_STATUS
fi

# ---- one configuration ----
TRANSPORT=${TRANSPORT:-dev}
PASSTHROUGH=${PASSTHROUGH:-on}
AREA=${AREA:-root}
check_knobs
name=$TRANSPORT-pt$PASSTHROUGH-$AREA

workdir W layerfs-pjdfstest
stage_layerfs "$W"
make_trees "$W"
mnt=$W/mnt
at_exit stop_daemons
at_exit "force_unmount '$mnt'"
[ "$TRANSPORT" = uring ] && enable_uring
opts=$(view_options allow_other,suid,dev)

config=${PJD_CONFIG:-}
if [ -z "$config" ]; then
    config=$W/pjd.toml
    cat >"$config" <<'TOML'
[features]
posix_fallocate = {}
utimensat = {}
utime_now = {}
rename_ctime = {}

[settings]
naptime = 0.01
allow_remount = false

[dummy_auth]
entries = [["nobody", "nogroup"], ["daemon", "daemon"]]
TOML
fi

# In the shared area, the tests run in a short bind mount of the area (socket paths are
# capped at 108 bytes); SHORT_PATH=0 runs them at the long path.
setup_area() {
    base=$(area_base "$mnt")
    if [ "$AREA" = shared ] && [ "${SHORT_PATH:-1}" = 1 ]; then
        bind_short "$base"
        log "$name: tests under $base, through its bind mount $SHORT"
        base=$SHORT
    else
        log "$name: tests under $base"
    fi
}

mount_view "$W" "$opts"
log "$name: layerfs -o $opts"
setup_area

failures=0
declare -A failed_tests=()
last_summary=
for ((run = 1; run <= RUNS; run++)); do
    if [ "${REMOUNT_EACH:-0}" = 1 ] && [ $run -gt 1 ]; then
        unbind_short
        force_unmount "$mnt"
        mount_view "$W" "$opts"
        setup_area
    fi
    dir=$base/pjd-$run
    mkdir "$dir"
    chmod 0755 "$dir"
    log_file=$W/run-$run.log
    rc=0
    run_in "$dir" env RUST_BACKTRACE=0 "$PJDFSTEST_RS" -c "$config" -p "$dir" ${FILTER:+"$FILTER"} \
        >"$log_file" 2>&1 || rc=$?
    names=$(sed -nE 's/^([^ ]+) +(FAILED|PASSED UNEXPECTEDLY)$/\1/p' "$log_file")
    n=0
    [ -z "$names" ] || n=$(wc -l <<<"$names")
    summary=$(grep -E '^Summary: ' "$log_file" | tail -1 || true)
    if [ -z "$summary" ]; then
        # No summary: pjdfstest died or could not start. That is a failure of the run.
        names+=${names:+$'\n'}"(no summary, exit $rc)"
        n=$((n + 1))
    fi
    last_summary=$summary
    if [ $n -gt 0 ]; then
        failures=$((failures + n))
        while IFS= read -r t; do
            failed_tests[$t]=$((${failed_tests[$t]:-0} + 1))
        done <<<"$names"
        mkdir -p "$OUT/$name"
        cp "$log_file" "$OUT/$name/run-$run.log"
        log "$name run $run/$RUNS: $n failed (log: $OUT/$name/run-$run.log)"
    else
        log "$name run $run/$RUNS: ok (${summary#Summary: })"
    fi
done

list=
if [ ${#failed_tests[@]} -gt 0 ]; then
    while IFS= read -r t; do
        list+="${list:+, }$t x${failed_tests[$t]}"
    done < <(printf '%s\n' "${!failed_tests[@]}" | sort)
fi

echo "pjdfstest $name: runs=$RUNS${FILTER:+ filter=$FILTER} failures=$failures${list:+ failing: $list} (last run: ${last_summary#Summary: })"
if [ -n "${SUMMARY_TSV:-}" ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$TRANSPORT" "$PASSTHROUGH" "$AREA" "$RUNS" "$failures" \
        "${list:--}" >"$SUMMARY_TSV"
fi
[ $failures -eq 0 ]
