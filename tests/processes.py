"""Commands that tests start, and every process they start ended when the test is done with them.

torchrun's launcher starts each rank in a session of its own, so neither killing the launcher (what
`subprocess.run(timeout=...)` and `Popen.kill` do) nor killing its process group reaches the ranks: they went on
loading a 2-core CI machine after their test had timed out, and pushed the next runs past their own time limits, one
failed run becoming many. Here a command's whole process tree is found (through /proc) and ended with it."""
import os, signal, subprocess, time


def start(cmd, **kwargs):
    "Popen of `cmd` (stdout and stderr captured together, as text)."
    kwargs.setdefault("stdout", subprocess.PIPE); kwargs.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen(cmd, text=True, **kwargs)


def descendants(pid):
    "Pids of every living process below `pid` in the process tree (children, their children, ...)."
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit(): continue
        try: stat = open(f"/proc/{entry}/stat").read()
        except OSError: continue
        fields = stat[stat.rindex(")") + 2:].split()     # after "pid (comm) ": state, ppid, ...
        if fields[0] != "Z": children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []): found.append(child); todo.append(child)
    return found


def running(pid):
    "Whether process `pid` exists and is not a zombie."
    try: stat = open(f"/proc/{pid}/stat").read()
    except OSError: return False
    return stat[stat.rindex(")") + 2] != "Z"


def end_tree(proc, grace_s=10):
    """End `proc` and everything it started: SIGTERM to the launcher (torchrun passes it on to its ranks), then SIGKILL
    to whatever is still alive after `grace_s` seconds."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try: proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired: pass
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        try: os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError): pass
    try: proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError): pass


def finish(proc, timeout):
    "(returncode, output) of a started command; on a timeout its whole tree is ended and the test fails with its output."
    deadline = time.monotonic() + timeout
    try: out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_tree(proc, grace_s=min(10, max(1, deadline - time.monotonic() + 10)))
        raise AssertionError(f"{' '.join(map(str, proc.args))[:200]} did not finish in {timeout} s") from None
    return proc.returncode, out


def run(cmd, timeout, **kwargs):
    "subprocess.run's CompletedProcess (stdout and stderr apart), with the whole process tree ended on a timeout."
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try: out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_tree(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
