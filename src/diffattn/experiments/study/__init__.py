"""`diffattn study` (`compare --data`, its older spelling): the budgeted, resumable, paired study on a user's text.

The experiment is a grid of *cells*, arm × learning rate × seed (and, with ``--sizes``, a ladder of model
sizes per arm at its best learning rate). A cell is an ordinary run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/``,
trained through the run driver (:func:`diffattn.train.driver.drive`); every arm with the same seed sees the same
batches (a paired design). Any number of workers, on any machines, pull the cells from one Optuna study; a killed
one never blocks the grid (Optuna's heartbeats).

Its modules, bottom to top, are on ARCHITECTURE.md's map (``experiments/study``).

Files in OUT: ``study.json`` (the spec and the plan; re-runs and workers read it), ``tokenizer.json`` (fitted
once), ``optuna.db`` (without ``--storage``), ``events.log`` (one line per cell start/finish), ``cells/``,
``results.json``/``report.md``/``report.html`` and plots.
"""
