"""Run every GPU test (`-m cuda`) and record the run in data/results/gpu_tests.json, pass or fail.

    python tests/gpu_tests.py [--workers N] [--name gpu_tests] [-k EXPR]

Two phases: the tests marked `serial` (they time the GPU, so nothing else may share it) run alone, then the rest run in
parallel under pytest-xdist (`--workers`, when it is installed): the cold compile of every kernel is CPU work, and the
GPU machine has 16 cores. The record holds the commit (RTRAINER_COMMIT overrides a stale copy's git metadata), the date,
the GPU, the versions, the counts, the failures' names and the duration. Exit status 0 only when nothing failed.
"""
import argparse, os, signal, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_junit(path):
    "Per-test outcomes of a junit XML file: [(nodeid, outcome, seconds, message)]; [] when pytest wrote none."
    try: root = ET.parse(path).getroot()
    except (OSError, ET.ParseError): return []
    out = []
    for case in root.iter("testcase"):
        module, test = case.get("classname") or "", case.get("name") or ""
        name = f"{module.replace('.', '/')}.py::{test}" if module else test   # a module skipped whole has no class name
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error"}.get(tag, "skipped")
                message = (el.get("message") or "")[:300]
                break
        out.append((name, outcome, float(case.get("time") or 0), message))
    return out


def green(record):
    "Whether a record vouches for its commit: tests ran, none failed, and no phase stopped before its end."
    return record["failed"] == 0 and not record["incomplete_phases"] and record["passed"] > 0


def summarize(cases, phases, seconds, command):
    "The record: counts, the failures' names and messages, the slowest tests."
    count = lambda o: sum(1 for c in cases if c[1] == o)
    failures = [dict(test=n, outcome=o, message=m) for n, o, _, m in cases if o in ("failed", "error")]
    incomplete = [p["phase"] for p in phases if p["returncode"] not in (0, 1, 5)]   # 5: no test selected
    return dict(passed=count("passed"), failed=count("failed") + count("error"), skipped=count("skipped"),
                failures=failures, incomplete_phases=incomplete, duration_s=round(seconds, 1), phases=phases,
                command=command, slowest=[dict(test=n, s=round(t, 1)) for n, _, t, _ in sorted(cases, key=lambda c: -c[2])[:15]])


def run_phase(name, marker, workers, extra, logdir, limit_s):
    "One pytest run; returns (cases, phase record)."
    xml = logdir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfE",
           f"--junitxml={xml}", *(["--timeout", "300"] if have_plugin("pytest_timeout") else []), *(["-n", str(workers), "--dist", "load"] if workers else []), *extra, "tests"]
    # Inductor compiles in-process: its pool of compile workers, shut down at exit with a 300 s wait, once held every
    # xdist worker past the last test until the phase's time limit, and the phase's record was lost.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)   # its own process group: xdist's workers go with it
    try: rc = proc.wait(timeout=limit_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:   # the time limit or SIGINT: pytest writes the XML of what finished
        rc = "timed out" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        try: proc.wait(timeout=30)
        except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    cases = parse_junit(xml)
    return cases, dict(phase=name, marker=marker, workers=workers, returncode=rc, tests=len(cases),
                       seconds=round(time.perf_counter() - t0, 1))


def have_plugin(module):
    "Whether a pytest plugin is importable (the GPU machine has pytest-xdist and pytest-timeout; a plain install may not)."
    import importlib.util
    return importlib.util.find_spec(module) is not None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=min(6, (os.cpu_count() or 2) // 2), help="xdist workers for the parallel phase (0: one process)")
    p.add_argument("--name", default="gpu_tests", help="the record's name under data/results/")
    p.add_argument("--limit", type=float, default=560, help="seconds allowed for both phases together")
    p.add_argument("-k", default=None, help="only the tests matching this pytest -k expression")
    args = p.parse_args(argv)
    from rtrainer.kernels import save_results
    workers = args.workers if have_plugin("xdist") else 0
    extra = ["-k", args.k] if args.k else []
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"rtrainer-gpu-tests-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    t0, cases, phases = time.perf_counter(), [], []
    try:
        for name, marker, n in (("serial", "cuda and serial", 0), ("parallel", "cuda and not serial", workers)):
            c, ph = run_phase(name, marker, n, extra, logdir, max(10, args.limit - (time.perf_counter() - t0)))
            cases += c; phases.append(ph)
            if ph["returncode"] == "interrupted": break   # recorded below as incomplete; the next phase does not start
    finally:   # written even when a phase failed, timed out or was interrupted
        seen = {}
        for case in cases:   # a module skipped at collection shows in both phases: keep one line per test
            if case[0] not in seen or seen[case[0]][1] == "skipped": seen[case[0]] = case
        cases = list(seen.values())
        record = summarize(cases, phases, time.perf_counter() - t0, " ".join(sys.argv))
        rows = [dict(test=n, outcome=o, s=round(t, 2)) for n, o, t, _ in cases]
        path = save_results(args.name, rows, **record)
        print(f"\nGPU tests: {record['passed']} passed, {record['failed']} failed, {record['skipped']} skipped in "
              f"{record['duration_s']:.0f} s; recorded in {path}")
        for f in record["failures"]: print(f"  {f['outcome'].upper()} {f['test']}: {f['message'][:160]}")
    return 0 if green(record) else 1


if __name__ == "__main__":
    sys.exit(main())
