#!/usr/bin/env bash
# Check the upstream patch series on torch 2.15.0: each patch on exactly its
# declared dependencies, then the whole series.
#
#   bash tools/upstream/check.sh              # the full check (FAIL -> PASS table)
#   bash tools/upstream/check.sh --quick      # each patch applies on its dependencies
#                                             # and its test passes there (CI)
#   bash tools/upstream/check.sh 0003 0011    # the full check of these patches only
#
# For each patch P (the "Depends on:" line of its PR.md names its dependencies;
# their dependencies count too):
#   before = stock torch 2.15.0 + P's dependencies, after = before + P.
#   Kind "change" (the default): P's test must fail on "before" -- and fail on
#     behaviour: an assertion or an error the code raises, not an ImportError,
#     AttributeError or NameError; "Kind: new module" allows an import failure
#     (the module P adds is what the test tests) -- and pass on "after".
#   Kind "refactor": tools/upstream/stock_vs_patched.py trains every
#     multi-stage schedule class on "before" and "after"; the results must be
#     equal bitwise (and UPSTREAM_TORCH_TESTS, if set, must give the same
#     outcomes on both).
# A fix's test is the tests its test hunks (test.diff) add to upstream's own
# test files (tools/upstream/pytorch_tests, unchanged copies, each at its
# upstream path: make_series.torch_test_path), applied with the test hunks of
# its dependencies; only those tests run (-k).  A proposal's test is the
# test_*.py of its directory, a new upstream test file of its own.
# Then every test again on the whole series, applied in order; the full check
# also runs upstream's whole test_schedule.py and test_utils.py's TestCheckpoint
# on stock torch and on the whole series: every test the hunks do not add must
# have the same outcome.
#
# Environment:
#   UPSTREAM_TORCH_PYTHON  a python with torch 2.15.0, expecttest and numpy
#                          (used read-only); default: a scratch venv under
#                          $UPSTREAM_CHECK_DIR, created on first use (~3 GB)
#   UPSTREAM_CHECK_DIR     scratch directory (default: ~/.cache/torch-upstream-check)
#   UPSTREAM_TEST_TIMEOUT  seconds per test run (default: 900)
#   UPSTREAM_TORCH_TESTS   another directory of pytorch's own test files of
#                          test/distributed/pipelining (test_schedule.py and the
#                          modules it imports) for refactor patches (default:
#                          tools/upstream/pytorch_tests; full check only)
#
# Exit status: 0 when every patch applies without fuzz and every check above
# holds; 1 otherwise.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_VERSION="2.15.0"
CHECK_DIR="${UPSTREAM_CHECK_DIR:-${HOME}/.cache/torch-upstream-check}"
TEST_TIMEOUT="${UPSTREAM_TEST_TIMEOUT:-900}"
LOG_DIR="${CHECK_DIR}/logs"
QUICK=0
SELECTED=()
for arg in "$@"; do
    case "${arg}" in
        --quick) QUICK=1 ;;
        -h|--help) sed -n '2,42p' "$0"; exit 0 ;;
        *) SELECTED+=("${arg}") ;;
    esac
done

die() { echo "check.sh: $*" >&2; exit 1; }

command -v patch >/dev/null || die "needs the patch tool (e.g. apt-get install patch)"

# --- 1. a python with torch 2.15.0 ----------------------------------------------
mkdir -p "${CHECK_DIR}" "${LOG_DIR}" || die "cannot create ${CHECK_DIR}"
if [[ -n "${UPSTREAM_TORCH_PYTHON:-}" ]]; then
    PY="${UPSTREAM_TORCH_PYTHON}"
else
    VENV="${CHECK_DIR}/venv-torch-${TORCH_VERSION}"
    PY="${VENV}/bin/python"
    if ! "${PY}" -c "import torch, expecttest, numpy, pytest" >/dev/null 2>&1; then
        echo "Installing torch ${TORCH_VERSION} into ${VENV} (about 3 GB) ..."
        python3 -m venv "${VENV}" || die "python3 -m venv failed"
        # PIP_CONFIG_FILE=/dev/null: ignore site-wide pip settings (version caps).
        PIP_CONFIG_FILE=/dev/null "${PY}" -m pip install --quiet \
            "torch==${TORCH_VERSION}" expecttest numpy pytest || die "pip install failed"
    fi
fi
SITE="$("${PY}" - "${TORCH_VERSION}" <<'PYEOF'
import os, sys
import torch
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"{sys.executable} has torch {torch.__version__}, need {sys.argv[1]}")
print(os.path.dirname(os.path.dirname(torch.__file__)))
PYEOF
)" || die "no torch ${TORCH_VERSION} in ${PY}"
"${PY}" -c "import expecttest, numpy, pytest" 2>/dev/null || die "${PY} lacks expecttest/numpy/pytest"

# The committed patches must be what the package generates now, and keep the rules.
status=0
"${PY}" "${HERE}/make_series.py" --check --torch-dir "${SITE}" || {
    echo "check.sh: the series is stale or breaks a rule (above)" >&2
    status=1
}

mapfile -t ALL < <(cd "${HERE}" && ls -d [0-9][0-9][0-9][0-9]-*/ | sed 's:/$::' | sort)
[[ ${#ALL[@]} -gt 0 ]] || die "no patches under ${HERE}"

# name -> its dependencies and theirs, in series order (from make_series.closure)
# name -> its test hunks' file and the tests they add ("FILE:TEST,TEST FILE:...")
declare -A CLOSURE KIND DECLARED HUNKS ADDED
while IFS='|' read -r name kind declared deps hunks added; do
    CLOSURE["${name}"]="${deps}"
    DECLARED["${name}"]="${declared}"
    KIND["${name}"]="${kind}"
    HUNKS["${name}"]="${hunks}"
    ADDED["${name}"]="${added}"
done < <("${PY}" - "${HERE}" <<'PYEOF'
import re, sys
sys.path.insert(0, sys.argv[1])
import make_series as m
for p in m.SERIES:
    kind = re.search(r"(?m)^Kind: (.+)$", (p.dir / "PR.md").read_text())
    declared = ",".join(d[:4] for d in m.dependencies(p)) or "none"
    added = " ".join(f"{f}:{','.join(t)}" for f, t in m.added_tests(p).items()) if p.tests else ""
    print(f"{p.name}|{kind.group(1).strip() if kind else 'change'}|{declared}|{' '.join(m.closure(p))}|{p.tests or ''}|{added}")
PYEOF
)

# upstream's test files: "COPY PATH", the copy in pytorch_tests and its path
# under a tree (test/...)
mapfile -t TORCH_TEST_COPIES < <("${PY}" - "${HERE}" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[1])
import make_series as m
for p in sorted(m.TORCH_TESTS.glob("*.py")):
    print(p.name, m.torch_test_path(p.name))
PYEOF
)
[[ ${#TORCH_TEST_COPIES[@]} -gt 0 ]] || die "no upstream test files in ${HERE}/pytorch_tests"

# --- 2. trees: copies of the installed torch package ------------------------------
# A tree is a directory put first on PYTHONPATH: a link to every entry of the
# installed site-packages except torch/, a directory of links whose files that
# a patch edits (torch/random.py, torch/utils/checkpoint.py,
# torch/distributed/pipelining/) are real copies.
mapfile -t EDITED < <(cat "${HERE}"/[0-9]*/patch.diff | sed -n 's:^+++ b/::p' | sort -u)

# own_parents TREE PATH: every directory above PATH (torch/...) in TREE's site
# becomes a real directory of links, so that PATH can be replaced by a copy
# without writing through a link into the installed package
own_parents() {
    local tree="$1" dir="" part entry parts
    IFS=/ read -r -a parts <<<"$(dirname "$2")"
    for part in "${parts[@]}"; do
        dir="${dir:+${dir}/}${part}"
        [[ -L "${tree}/site/${dir}" ]] || continue
        rm "${tree}/site/${dir}"
        mkdir "${tree}/site/${dir}"
        for entry in "${SITE}/${dir}"/*; do
            [[ "$(basename "${entry}")" == __pycache__ ]] && continue
            ln -s "${entry}" "${tree}/site/${dir}/$(basename "${entry}")"
        done
    done
}
make_tree() {
    local tree="$1" entry
    rm -rf "${tree}"
    mkdir -p "${tree}/site/torch/distributed" "${tree}/test/distributed/pipelining"
    for entry in "${SITE}"/*; do
        [[ "$(basename "${entry}")" == torch ]] && continue
        ln -s "${entry}" "${tree}/site/$(basename "${entry}")"
    done
    for entry in "${SITE}"/torch/*; do
        [[ "$(basename "${entry}")" == distributed ]] && continue
        ln -s "${entry}" "${tree}/site/torch/$(basename "${entry}")"
    done
    for entry in "${SITE}"/torch/distributed/*; do
        [[ "$(basename "${entry}")" == pipelining ]] && continue
        ln -s "${entry}" "${tree}/site/torch/distributed/$(basename "${entry}")"
    done
    cp -r "${SITE}/torch/distributed/pipelining" "${tree}/site/torch/distributed/"
    find "${tree}/site/torch/distributed/pipelining" -name __pycache__ -prune -exec rm -rf {} +
    for entry in "${EDITED[@]}"; do
        [[ "${entry}" == torch/distributed/pipelining/* ]] && continue
        own_parents "${tree}" "${entry}"
        rm -f "${tree}/site/${entry}"
        cp "${SITE}/${entry}" "${tree}/site/${entry}"
    done
    # The tests exercise torch alone: shadow torch_pipelining_ext, should the
    # python used have it installed, with a module that refuses to import.
    mkdir -p "${tree}/site/torch_pipelining_ext"
    echo 'raise ImportError("the upstream tests must not import torch_pipelining_ext")' \
        >"${tree}/site/torch_pipelining_ext/__init__.py"
    # upstream's own test files (the test hunks apply to them), at their paths
    local copy path
    for entry in "${TORCH_TEST_COPIES[@]}"; do
        read -r copy path <<<"${entry}"
        mkdir -p "$(dirname "${tree}/${path}")"
        cp "${HERE}/pytorch_tests/${copy}" "${tree}/${path}"
    done
    cp -r "${HERE}/pytorch_tests/artifacts" "${tree}/test/distributed/pipelining/"
}

# apply_patches TREE NAME...: apply the patches in order; 1 (and a log) if one does not
apply_patches() {
    local tree="$1" name diff
    shift
    for name in "$@"; do
        diff="${HERE}/${name}/patch.diff"
        [[ -s "${diff}" ]] || continue
        if ! patch -p1 --fuzz=0 --no-backup-if-mismatch --batch -d "${tree}/site" \
            <"${diff}" >"${LOG_DIR}/${name}.apply.log" 2>&1; then
            echo "${name} does not apply to $(basename "${tree}") (${LOG_DIR}/${name}.apply.log)"
            return 1
        fi
    done
}

# The test side of NAMES: their test hunks applied to upstream's test files in
# TREE (in order), their own test_*.py and helper modules copied; 1 (and a log)
# if a test hunk does not apply
copy_tests() {
    local tree="$1" name
    shift
    for name in "$@"; do
        cp "${HERE}/${name}"/*.py "${tree}/test/distributed/pipelining/" 2>/dev/null
        [[ -n "${HUNKS[${name}]}" ]] || continue
        if ! patch -p1 --fuzz=0 --no-backup-if-mismatch --batch -d "${tree}" \
            <"${HERE}/${name}/${HUNKS[${name}]}" >"${LOG_DIR}/${name}.tests.apply.log" 2>&1; then
            echo "${name}'s test hunks do not apply to $(basename "${tree}") (${LOG_DIR}/${name}.tests.apply.log)"
            return 1
        fi
    done
}

# The environment of every test run. With $CI set (CI services set it), torch's
# run_tests() writes XML reports through xmlrunner, which a test environment
# need not have: every test would then fail on the import. The tests run as on
# a developer's machine.
TEST_ENV=(-u PYTHONSTARTUP -u CI PYTHONDONTWRITEBYTECODE=1 TORCH_PIPELINING_EXT_DISABLE=1
    OMP_NUM_THREADS=1)

# run_file TREE FILE LOG [ARG...]: run FILE (in TREE's test/distributed/pipelining,
# or test/... under TREE) with TREE first on the path, in FILE's directory
run_file() {
    local tree="$1" file="$2" log="$3" dir="$1/test/distributed/pipelining"
    shift 3
    if [[ "${file}" == test/* ]]; then
        dir="$(dirname "${tree}/${file}")"
        file="$(basename "${file}")"
    fi
    (
        cd "${dir}" || exit 1
        env "${TEST_ENV[@]}" PYTHONPATH="${tree}/site:." \
            timeout "${TEST_TIMEOUT}" "${PY}" - "${tree}" "${file}" "$@" <<'PYEOF'
import os, runpy, sys
tree, target = sys.argv[1], os.path.abspath(sys.argv[2])
import torch.distributed.pipelining as pipelining
if not os.path.realpath(pipelining.__file__).startswith(os.path.realpath(tree)):
    sys.exit(f"torch.distributed.pipelining comes from {pipelining.__file__}, not {tree}")
sys.argv = [target, *sys.argv[3:]]
runpy.run_path(target, run_name="__main__")
PYEOF
    ) >"${log}" 2>&1
}

# outcome LOG RC: PASS, SKIP (every test skipped), FAIL (behaviour) or FAIL (import)
outcome() {
    local log="$1" rc="$2"
    if grep -qE '^Ran 0 tests' "${log}"; then
        echo "FAIL (no test ran)"
        return
    fi
    if [[ "${rc}" -eq 0 ]]; then
        if grep -qE '^OK \(skipped=([0-9]+)\)$' "${log}" \
            && [[ "$(grep -oE '^Ran [0-9]+' "${log}" | grep -oE '[0-9]+')" == \
                  "$(grep -oE 'skipped=[0-9]+' "${log}" | grep -oE '[0-9]+')" ]]; then
            echo "SKIP"
        else
            echo "PASS"
        fi
        return
    fi
    # An assertion, or an error the code raised, is behaviour; a missing name
    # (a module, an attribute, a keyword argument) is not.  The harness's
    # "Exception in worker process" only wraps the rank's own error.
    if grep -E '^([A-Za-z_]+\.)*[A-Za-z_]*(Error|Exception)\b' "${log}" \
        | grep -vE '^RuntimeError: Exception in worker process' \
        | grep -vE '^((ModuleNotFound|Import|Attribute|Name)Error|TypeError: .*unexpected keyword argument)' \
        | grep -q .; then
        echo "FAIL (behaviour)"
    else
        echo "FAIL (import)"
    fi
}

# test_of NAME: what the patch's test is, for the table: its test file, or the
# upstream test file(s) its hunks add to
test_of() {
    if [[ -n "${HUNKS[$1]}" ]]; then
        echo "${ADDED[$1]}" | sed -E 's/:[^ ]*//g'
    else
        basename "$(ls "${HERE}/$1"/test_*.py 2>/dev/null | head -n 1)" 2>/dev/null
    fi
}

# run_tests_of TREE NAME LOG: run NAME's test in TREE (a fix: only the tests its
# hunks add, by name); print the outcome
run_tests_of() {
    local tree="$1" name="$2" log="$3" spec file tests args got="" one rc
    if [[ -z "${HUNKS[${name}]}" ]]; then
        run_file "${tree}" "$(test_of "${name}")" "${log}"
        outcome "${log}" $?
        return
    fi
    : >"${log}"
    for spec in ${ADDED[${name}]}; do
        file="${spec%%:*}"
        IFS=',' read -r -a tests <<<"${spec#*:}"
        args=()
        for one in "${tests[@]}"; do args+=(-k "${one}"); done
        run_file "${tree}" "${file}" "${log}.part" "${args[@]}"
        rc=$?
        cat "${log}.part" >>"${log}"
        one="$(outcome "${log}.part" "${rc}")"
        [[ -z "${got}" || "${got}" == PASS ]] && got="${one}"
    done
    rm -f "${log}.part"
    echo "${got:-FAIL (no test ran)}"
}

# torch_test_outcomes TREE: "OUTCOME test id" of every test of upstream's
# test_schedule.py and of test_utils.py's TestCheckpoint in TREE, sorted; one
# process per test class (a test that needs a GPU fails here without
# destroying its process group, which would fail the next test that creates one)
torch_test_outcomes() {
    local dir="$1/test/distributed/pipelining" class spec specs=()
    for class in $(sed -nE 's/^class ([A-Za-z_0-9]+)\(TestCase\):.*/\1/p' "${dir}/test_schedule.py"); do
        specs+=("${dir}/test_schedule.py::${class}")
    done
    specs+=("$1/test/test_utils.py::TestCheckpoint")
    for spec in "${specs[@]}"; do
        (cd "$(dirname "${spec%%::*}")" && env "${TEST_ENV[@]}" PYTHONPATH="$1/site:." \
            timeout "${TEST_TIMEOUT}" "${PY}" -m pytest -q -rA --tb=no -p no:cacheprovider \
            "$(basename "${spec}")" | grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' | sed 's/ - .*//')
    done | sort
}

# torch_tests_check STOCK SERIES LOGPREFIX: upstream's test_schedule.py and
# TestCheckpoint, with every test hunk applied, on stock torch and on the whole series: the tests the
# hunks do not add must have the same outcomes, the ones they add must pass on
# the series
torch_tests_check() {
    local stock="$1" series="$2" log="$3" added=() spec one
    copy_tests "${stock}" "${ALL[@]}" >/dev/null || { echo "test hunks do not apply"; return; }
    torch_test_outcomes "${stock}" >"${log}.stock"
    torch_test_outcomes "${series}" >"${log}.series"
    for spec in "${ADDED[@]}"; do
        for one in ${spec}; do
            IFS=',' read -r -a tests <<<"${one#*:}"
            added+=("${tests[@]}")
        done
    done
    local pattern
    pattern="::($(IFS='|'; echo "${added[*]}"))(_|$)"
    if ! cmp -s <(grep -vE "${pattern}" "${log}.stock") <(grep -vE "${pattern}" "${log}.series"); then
        echo "outcomes differ (${log}.stock, ${log}.series)"
        return
    fi
    if grep -E "${pattern}" "${log}.series" | grep -qv '^PASSED'; then
        echo "a test the hunks add does not pass on the series (${log}.series)"
        return
    fi
    echo "the same outcomes ($(grep -cvE "${pattern}" "${log}.series") tests; the" \
        "$(grep -cE "${pattern}" "${log}.series") the fixes add pass)"
}

# refactor_check BEFORE AFTER LOGPREFIX: "bitwise equal ..." or what differs
refactor_check() {
    local before="$1" after="$2" log="$3" tree side
    for side in before after; do
        tree="${before}"
        [[ "${side}" == after ]] && tree="${after}"
        cp "${HERE}/stock_vs_patched.py" "${tree}/test/distributed/pipelining/"
        run_file "${tree}" stock_vs_patched.py "${log}.${side}.log" \
            --out "${log}.${side}.pt" || { echo "stock_vs_patched.py failed (${log}.${side}.log)"; return; }
    done
    local same
    same="$("${PY}" "${HERE}/stock_vs_patched.py" --compare "${log}.before.pt" "${log}.after.pt")" \
        || { echo "not bitwise equal: ${same}"; return; }
    if [[ ${QUICK} -eq 0 ]]; then
        for side in before after; do
            tree="${before}"
            [[ "${side}" == after ]] && tree="${after}"
            [[ -z "${UPSTREAM_TORCH_TESTS:-}" ]] \
                || cp "${UPSTREAM_TORCH_TESTS}"/*.py "${tree}/test/distributed/pipelining/"
            torch_test_outcomes "${tree}" >"${log}.torch_tests.${side}"
        done
        cmp -s "${log}.torch_tests.before" "${log}.torch_tests.after" \
            || { echo "pytorch's test_schedule.py / TestCheckpoint outcomes differ"; return; }
        same="${same}; pytorch's test_schedule.py and TestCheckpoint: the same outcomes"
    fi
    echo "bitwise equal (${same})"
}

selected() {
    [[ ${#SELECTED[@]} -eq 0 ]] && return 0
    local s
    for s in "${SELECTED[@]}"; do [[ "$1" == "${s}"* ]] && return 0; done
    return 1
}

# --- 3. each patch on its dependencies ------------------------------------------
STOCK="${CHECK_DIR}/stock"
make_tree "${STOCK}"
echo "torch ${TORCH_VERSION} from ${SITE}"
declare -a ROWS FAILED_LOGS=()
for name in "${ALL[@]}"; do
    selected "${name}" || continue
    kind="${KIND[${name}]}"
    read -r -a deps <<<"${CLOSURE[${name}]}"
    diff="${HERE}/${name}/patch.diff"
    added=$(grep -v '^+++ ' "${diff}" | grep -c '^+')
    removed=$(grep -v '^--- ' "${diff}" | grep -c '^-')
    lines="+${added} -${removed}"
    depends="${DECLARED[${name}]}"
    before="${CHECK_DIR}/before"
    after="${CHECK_DIR}/after"
    make_tree "${after}"
    if ! apply_patches "${after}" "${deps[@]}" "${name}"; then
        ROWS+=("${name}|${lines}|${depends}|does not apply|-")
        status=1
        continue
    fi
    copy_tests "${after}" "${deps[@]}" "${name}" \
        || { ROWS+=("${name}|${lines}|${depends}|test hunks do not apply|-"); status=1; continue; }
    if [[ "${kind}" == refactor ]]; then
        make_tree "${before}"
        apply_patches "${before}" "${deps[@]}" || { status=1; continue; }
        copy_tests "${before}" "${deps[@]}" || { status=1; continue; }
        echo "${name}: stock_vs_patched.py on its dependencies, without and with it ..."
        verdict="$(refactor_check "${before}" "${after}" "${LOG_DIR}/${name}")"
        ROWS+=("${name}|${lines}|${depends}|${verdict}|-")
        [[ "${verdict}" == "bitwise equal"* ]] || status=1
        continue
    fi
    test_name="$(test_of "${name}")"
    [[ -n "${test_name}" ]] || { ROWS+=("${name}|${lines}|${depends}|no test|-"); status=1; continue; }
    if [[ ${QUICK} -eq 1 ]]; then
        echo "${name}: ${test_name} with the patch ..."
        got="$(run_tests_of "${after}" "${name}" "${LOG_DIR}/${name}.patched.log")"
        ROWS+=("${name}|${lines}|${depends}|${got}|-")
        [[ "${got}" == PASS ]] || { status=1; FAILED_LOGS+=("${LOG_DIR}/${name}.patched.log"); }
        continue
    fi
    make_tree "${before}"
    apply_patches "${before}" "${deps[@]}" || { status=1; continue; }
    copy_tests "${before}" "${deps[@]}" "${name}" || { status=1; continue; }
    echo "${name}: ${test_name} without and with the patch ..."
    was="$(run_tests_of "${before}" "${name}" "${LOG_DIR}/${name}.before.log")"
    got="$(run_tests_of "${after}" "${name}" "${LOG_DIR}/${name}.patched.log")"
    ROWS+=("${name}|${lines}|${depends}|${was} -> ${got}|")
    [[ "${got}" == PASS ]] || FAILED_LOGS+=("${LOG_DIR}/${name}.patched.log")
    case "${kind}" in
        "new module"|"new api") [[ "${was}" == FAIL* && "${got}" == PASS ]] || status=1 ;;
        *) [[ "${was}" == "FAIL (behaviour)" && "${got}" == PASS ]] || status=1 ;;
    esac
done

# --- 4. the whole series ----------------------------------------------------------
declare -A SERIES_RESULT
if [[ ${QUICK} -eq 0 ]]; then
    series="${CHECK_DIR}/series"
    make_tree "${series}"
    if apply_patches "${series}" "${ALL[@]}"; then
        copy_tests "${series}" "${ALL[@]}" || status=1
        for name in "${ALL[@]}"; do
            selected "${name}" || continue
            [[ -n "$(test_of "${name}")" ]] || continue
            echo "${name}: $(test_of "${name}") on the whole series ..."
            SERIES_RESULT["${name}"]="$(run_tests_of "${series}" "${name}" "${LOG_DIR}/${name}.series.log")"
            [[ "${SERIES_RESULT[${name}]}" == PASS ]] \
                || { status=1; FAILED_LOGS+=("${LOG_DIR}/${name}.series.log"); }
        done
        if [[ ${#SELECTED[@]} -eq 0 ]]; then
            echo "upstream's test_schedule.py and TestCheckpoint on stock torch and on the whole series ..."
            UPSTREAM_RESULT="$(torch_tests_check "${STOCK}" "${series}" "${LOG_DIR}/torch_tests")"
            [[ "${UPSTREAM_RESULT}" == "the same outcomes"* ]] || status=1
        fi
    else
        status=1
    fi
fi

echo
header="before -> after"
[[ ${QUICK} -eq 1 ]] && header="with the patch"
printf '%-34s %-11s %-16s %-37s %s\n' "patch (torch ${TORCH_VERSION})" lines "depends on" "test: ${header}" series
printf '%-34s %-11s %-16s %-37s %s\n' "$(printf -- '-%.0s' {1..34})" "-----------" \
    "----------------" "$(printf -- '-%.0s' {1..37})" "------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r name lines depends result _ <<<"${row}"
    printf '%-34s %-11s %-16s %-37s %s\n' "${name}" "${lines}" "${depends}" "${result}" \
        "${SERIES_RESULT[${name}]:--}"
done
[[ -z "${UPSTREAM_RESULT:-}" ]] \
    || echo "upstream's test_schedule.py and TestCheckpoint, stock torch vs the whole series: ${UPSTREAM_RESULT}"
echo
echo "logs: ${LOG_DIR}"
# the logs of the failed test runs, last lines (CI removes the scratch directory)
for log in "${FAILED_LOGS[@]}"; do
    echo "--- the last 30 lines of ${log}"
    tail -n 30 "${log}"
done
[[ ${status} -eq 0 ]] || echo "MISMATCH: see the rules at the top of check.sh"
exit ${status}
