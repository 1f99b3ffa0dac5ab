"""Post-hoc report of a run: `python -m steadylm.diagnose RUN_DIR` -> `RUN_DIR/report.md` + PNG plots.

It reads only what a run leaves on disk (TensorBoard event files, `stability/events.jsonl`, the run
config) and works on whatever part of them exists, so a run that crashed mid-way still gets a
report. It names the onset step of a divergence and the most likely cause, from the stability
events first and the curves second. It must never modify the run: it only adds the report files.
"""

from steadylm.diagnose.cli import main
from steadylm.diagnose.findings import Diagnosis, analyse
from steadylm.diagnose.report import write_report
from steadylm.diagnose.runlog import RunLog, load_run

__all__ = ["Diagnosis", "RunLog", "analyse", "load_run", "main", "write_report"]
