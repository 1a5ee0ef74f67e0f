"""`diffattn study` (`compare --data`, its older spelling): the budgeted, resumable, paired study on a user's text.

The experiment is a grid of *cells*, arm × learning rate × seed (and, with ``--sizes``, a ladder of model
sizes per arm at its best learning rate). A cell is an ordinary run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/``,
trained through the run driver (:func:`diffattn.train.driver.drive`); every arm with the same seed sees the same
batches (a paired design). Any number of workers, on any machines, pull the cells from one Optuna study; a killed
one never blocks the grid (Optuna's heartbeats).

Modules, bottom to top: :mod:`.defaults` (the command's defaults, light), :mod:`.spec` (StudySpec: arms, head
groups, configs; ``study.json``), :mod:`.worker_signals` (a worker's SIGINT/SIGTERM), :mod:`.cell` (one cell,
the data), :mod:`.progress` (what the finished cells say: LR sweeps and brackets, cells done), :mod:`.budget`
(timing probe, budget, ``make_plan``), :mod:`.grid` (the Optuna storage and grids) and :mod:`.workers` (the
grids in order, the worker processes); :mod:`.analysis`, :mod:`.stats` and :mod:`.early` are pure functions on
numbers; :mod:`.collect` gathers the results, :mod:`.study_report` renders them (with :mod:`.verdict_text` and
:mod:`.study_plots`); :mod:`.launch` is the command's work (the folder held, the plan, the grid, the report, how it
ended).

Files in OUT: ``study.json`` (the spec and the plan; re-runs and workers read it), ``tokenizer.json`` (fitted
once), ``optuna.db`` (without ``--storage``), ``events.log`` (one line per cell start/finish), ``cells/``,
``results.json``/``report.md``/``report.html`` and plots.
"""
