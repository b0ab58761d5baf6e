"""The scheduler decides, it does not compute: importing it (and running a step) loads no torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig
s = Scheduler(SchedulerConfig(max_model_len=16), KVCacheManager(8, 4))
s.add_request(Request("a", [1, 2, 3], max_tokens=2))
out = s.schedule()
s.update(out, {"a": [5]})
assert "torch" not in sys.modules, "the scheduler imported torch"
"""


def test_scheduler_runs_without_importing_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
