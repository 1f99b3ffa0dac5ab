"""Downstream evaluation: multiple-choice tasks from local files, scored as lm-eval scores them.

`tasks` reads task files, `score` computes acc / acc_norm through the model's own loss path, `callback` runs them
at validation time, `fetch` downloads the standard sets, `harness` (`python -m steadylm.eval`) runs lm-eval itself
on a checkpoint. Training never imports lm-eval.
"""
