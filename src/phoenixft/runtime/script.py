"""A worker that runs a user's training script: forked by the node agent, the script run as `__main__`.

The script is run as `python train.py ARGS` would run it (`sys.argv`, `sys.path[0]` its folder,
`__name__ == "__main__"`), in the agent's forked image (torch already imported), with the job's
coordinates in its environment: `phoenixft.init()` reads them (api/launched.py). Exit codes are the
built-in worker's: 0 done (or left: drained, a spare the run did not need), 2 the script cannot run
as a job (it never called `phoenixft.init()`, or ended before its `job.steps` loop did), 3 the run
ended for it, 4 an error in the script stopped the run; anything else (a crash) is restarted in place
by the agent.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

__all__ = ["script_main"]


def script_main(script: tuple[str, list[str]], store: str, node: str, local_rank: int, run_id: str, threads: int,
                incarnation: int) -> int:
    from phoenixft.api import launched

    path, args = script
    os.environ.update(launched.launch_env(store, node, local_rank, run_id, threads, incarnation))
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    wid = f"{node}.{local_rank}"
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0 or launched.finished():
            return code
    except Exception as e:  # noqa: BLE001 - the script's own error, outside a step
        started = launched.current()
        if started is not None and started.trained:  # (it trained: a failure outside a step's body, e.g. a
            traceback.print_exc()                   # collective of its own: restarted in place, it rejoins)
            return 1
        if started is not None:  # (it joined: the same error on every node before any step, no restart heals it)
            started.stop_for(e, "before its first step")
            return 4
        from phoenixft.errors import user_traceback
        from phoenixft.runtime.worker import record_start_failure

        trace = user_traceback(e)
        if trace is not None:
            print(trace[1], flush=True)
        where = f" (at {trace[0]})" if trace is not None else ""
        why = f"{path} raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}{where}"
        print(f"phoenixft worker {wid}: {why}", flush=True)
        record_start_failure(None, store, wid, why)
        return 2
    job = launched.current()
    if job is None:
        why = (f"{path} ended without calling phoenixft.init(): nothing of it ran as a job (docs/script.md shows "
               "the lines a script adds)")
        print(f"phoenixft worker {wid}: {why}", flush=True)
        from phoenixft.runtime.worker import record_start_failure

        record_start_failure(None, store, wid, why)  # (every node alike: the coordinator ends the run saying so)
        return 2
    if not launched.finished():
        print(f"phoenixft worker {wid}: {path} ended before its `for step in job.steps(n)` loop did (a `break`, or "
              "no loop): the run has no final state", flush=True)
        job.m.close()
        return 2
    job.m.close()
    return 0
