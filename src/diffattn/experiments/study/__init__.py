"""`diffattn study`: the budgeted, resumable, paired study on a user's text.

A grid of *cells*, arm × learning rate × seed (with ``--sizes``, a ladder of model sizes per arm at its best LR),
each an ordinary run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/`` trained through the run driver; arms with the same
seed see the same batches. Workers on any machines pull the cells from one Optuna study. Its modules are on
ARCHITECTURE.md's map (``experiments/study``). OUT holds ``study.json`` (spec and plan), ``tokenizer.json``,
``optuna.db`` (without ``--storage``), ``events.log``, ``cells/``, ``results.json``, ``report.md/html`` and plots."""
