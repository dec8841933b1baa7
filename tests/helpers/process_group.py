"""The one way the tests start a command that may start others (fairseq-train and its
ranks, DomainBed sweeps, the demo, bash scripts, torchrun): in its own session, so that
a timeout, a failure or an interrupted test kills the whole process group, by its id,
and no test leaves work running behind it.

``run`` is ``subprocess.run`` (same keywords, same result and exceptions) with that
guarantee; ``popen`` starts one in its own session for tests that run several at once,
and ``kill_group`` ends it.
"""

import os
import signal
import subprocess


def kill_group(proc):
    """SIGKILL to the process group of ``proc`` (started by ``popen`` or ``run``): the
    command and whatever it started that is still in its group. Returns at once."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def popen(args, **kwargs):
    """``subprocess.Popen`` in a new session (its own process group, id ``proc.pid``)."""
    return subprocess.Popen(args, start_new_session=True, **kwargs)


def run(args, *, timeout=None, check=False, input=None, capture_output=False, **kwargs):
    """``subprocess.run`` in a new session. On a timeout (``TimeoutExpired``, as
    subprocess.run raises it), an exception or an interrupt while waiting, and after a
    command that failed, the whole group is killed; after a success, what the command left
    running in its group too."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc)
            exc.output, exc.stderr = proc.communicate()
            raise
        except BaseException:
            kill_group(proc)
            raise
        finally:
            kill_group(proc)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result
