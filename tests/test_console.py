"""The console: each silenced third-party message is dropped and nothing else; `train.log` copies the console."""

from __future__ import annotations

import logging
import sys
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from steadylm.console import SILENCED_LOGS, copy_console, quiet


def test_the_silenced_warnings_are_dropped_and_others_still_show():
    from torch.utils._pytree import LeafSpec

    quiet()
    with warnings.catch_warnings(record=True) as seen:
        LeafSpec()  # what Lightning's pytree helper does on every fit
        warnings.warn(
            "Precision bf16-mixed is not supported by the model summary. Estimated ...", UserWarning, stacklevel=2
        )
        warnings.warn("something a user can act on", FutureWarning, stacklevel=2)
    assert [str(w.message) for w in seen] == ["something a user can act on"]


def test_the_logger_advertisement_is_dropped_and_other_lines_kept():
    quiet()
    quiet()  # twice: still one filter
    name, tip, _ = SILENCED_LOGS[0]
    logger = logging.getLogger(name)
    assert len(logger.filters) == 1
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        rank_zero_info(tip + " try installing [litlogger](...)")
        rank_zero_info("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]


def test_train_log_gets_prints_and_logging_handlers_bound_to_the_console(tmp_path, capsys):
    logger = logging.getLogger("steadylm.test_console")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        with copy_console(tmp_path / "run" / "train.log"):
            print("step 1/2 | loss 5.0")
            logger.warning("stability: step 1 loss_spike -> log {}")
            print("error: a user's mistake", file=sys.stderr)
        print("after the run: not copied")
    finally:
        logger.removeHandler(handler)
    text = (tmp_path / "run" / "train.log").read_text()
    assert text == "step 1/2 | loss 5.0\nstability: step 1 loss_spike -> log {}\nerror: a user's mistake\n"
    out, err = capsys.readouterr()
    assert "step 1/2" in out and "after the run" in out and "error: a user's mistake" in err
