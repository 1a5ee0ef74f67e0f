"""`diffattn study` (`compare --data`, its older spelling): the budgeted, resumable, paired study on a user's text.

The experiment is a grid of *cells*, arm × learning rate × seed (and, with ``--sizes``, a ladder of model
sizes per arm at its best learning rate). A cell is an ordinary run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/``,
trained through the run driver (:func:`diffattn.train.driver.drive`); every arm with the same seed sees the same
batches (a paired design). Any number of workers pull the cells from one Optuna study; a killed one never blocks
the grid.

Modules, bottom to top: :mod:`.defaults` (the command's defaults, light), :mod:`.spec` (StudySpec: arms, head
groups, configs; ``study.json``), :mod:`.worker_signals`
(a worker's SIGINT/SIGTERM), :mod:`.cell` (one cell, the data), :mod:`.progress` (what the finished cells say:
LR sweeps and brackets, cells done), :mod:`.budget` (timing probe, budget, ``make_plan``), :mod:`.journal` (a
torn Optuna record set aside), :mod:`.grid_worker` and :mod:`.scheduler` (the Optuna grid, the workers);
:mod:`.analysis`, :mod:`.stats` and :mod:`.early` are pure functions on numbers; :mod:`.collect` gathers the
results and :mod:`.study_report` renders them; :mod:`.launch` is the command's work (the folder held, the plan,
the grid, the report, how it ended).

Files in OUT: ``study.json`` (the spec and the plan; re-runs and workers read it), ``tokenizer.json`` (fitted
once), ``optuna.journal``, ``events.log`` (one line per cell start/finish), ``cells/``,
``results.json``/``report.md``/``report.html`` and plots.
"""
