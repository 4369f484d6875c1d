#!/usr/bin/env bash
# The README's test command (make test): lint, notebooks and package in sync, every chapter notebook
# executed by nbdev-test with Triton's interpreter, then pytest. Last line: "N passed, N failed".
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
# Every temporary file of the run (the chapters' scratch folders, torchrun's, pytest's, the compile caches) goes under
# one folder that is removed at exit, pass or fail, so repeated runs do not fill the disk.
SCRATCH=$(mktemp -d -t rtrainer-tests-XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
export TMPDIR="$SCRATCH"
LOGS="$SCRATCH/logs"; mkdir -p "$LOGS"
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
passed=0; failed=0

snapshot() { find nbs rtrainer -type f \( -name '*.ipynb' -o -name '*.py' \) -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 md5sum | md5sum; }

echo "== lint (ruff check: notebooks, package, tests, experiments; rules in pyproject.toml)"
if "$BIN/ruff" check --quiet --output-format concise >"$LOGS/ruff.log" 2>&1; then
  echo "ok"; passed=$((passed+1))
else
  echo "FAIL: ruff found:"; cat "$LOGS/ruff.log"; failed=$((failed+1))
fi

echo "== notebooks and package in sync (nbdev-clean, nbdev-export leave no diff)"
before=$(snapshot)
"$BIN/nbdev-clean" >"$LOGS/clean.log" 2>&1 && "$BIN/nbdev-export" >"$LOGS/export.log" 2>&1
status=$?
after=$(snapshot)
if [ $status -ne 0 ] || [ "$before" != "$after" ]; then
  echo "FAIL: nbdev-clean/nbdev-export changed files or failed (run them and commit):"
  git status --short -- nbs rtrainer; cat "$LOGS/clean.log" "$LOGS/export.log"
  failed=$((failed+1))
else
  echo "ok"; passed=$((passed+1))
fi

echo "== notebooks (nbdev-test, TRITON_INTERPRET=1)"
notebooks=$(ls nbs/*.ipynb | grep -v '/_' )
count=$(echo "$notebooks" | grep -c . )
if [ "$count" -eq 0 ]; then echo "FAIL: no notebooks found"; failed=$((failed+1)); fi
start=$SECONDS
"$BIN/nbdev-test" --n-workers 2 --timing >"$LOGS/nbdev-test.log" 2>&1
nb_status=$?
cat "$LOGS/nbdev-test.log" | grep -v '^\s*$' | tail -n $([ $nb_status -eq 0 ] && echo 40 || echo 400)   # a failure shows more: a child process's last words come before the traceback
nb_failed=$(sed -n '/Failed On The Following Notebooks/,$p' "$LOGS/nbdev-test.log" | grep -c '\.ipynb')
if grep -q "No files were eligible" "$LOGS/nbdev-test.log"; then echo "FAIL: nbdev-test ran no notebook"; nb_failed=$count; fi
if [ $nb_status -ne 0 ] && [ "$nb_failed" -eq 0 ]; then nb_failed=$count; fi
echo "notebooks: $((count-nb_failed)) passed, $nb_failed failed in $((SECONDS-start)) s"
passed=$((passed+count-nb_failed)); failed=$((failed+nb_failed))

echo "== pytest"
start=$SECONDS
"$BIN/python" -m pytest -q -rfE -m "not cuda" -p no:cacheprovider --junitxml="$LOGS/pytest.xml" tests > "$LOGS/pytest.log" 2>&1
# the short summary (one FAILED/ERROR line per test) survives a long traceback above it; each failure's last
# traceback lines come first, so that a failed run's log says why (the scratch folder is removed at exit)
if grep -q '^=* FAILURES =*$\|^=* ERRORS =*$' "$LOGS/pytest.log"; then
  sed -n '/^=* \(FAILURES\|ERRORS\) =*$/,/short test summary info/p' "$LOGS/pytest.log" | grep -E '^(_{3,} .* _{3,}|E  |[^ ].*:[0-9]+: )' | tail -n 80
fi
grep -v '^WARNING' "$LOGS/pytest.log" | sed -n '/short test summary info/,$p' | tail -n 40
grep -q 'short test summary info' "$LOGS/pytest.log" || tail -n 30 "$LOGS/pytest.log"
read -r t_total t_fail < <("$BIN/python" - "$LOGS/pytest.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try: root = ET.parse(sys.argv[1]).getroot()
except Exception: print(0, 1); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
tot = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
print(tot, bad if tot else max(bad, 1))
PY
)
echo "pytest: $((t_total-t_fail)) passed, $t_fail failed in $((SECONDS-start)) s"
passed=$((passed+t_total-t_fail)); failed=$((failed+t_fail))
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
