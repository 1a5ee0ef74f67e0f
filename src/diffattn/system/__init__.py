"""The hardening layer, below everything else: where diffattn meets the operating system and files from elsewhere.

* :mod:`~diffattn.system.untrusted`: the rules for reading folders and files from elsewhere (no link followed out,
  sizes and depths bounded, names and text printable, no unpickling).
* :mod:`~diffattn.system.atomic_files`: files that survive faults (atomic writes, a killed writer's temp files).
* :mod:`~diffattn.system.run_lock`: one process per run folder.
* :mod:`~diffattn.system.io_errors`: an ``OSError`` as one line naming the path, what was kept and what to do.
* :mod:`~diffattn.system.child_process`: processes that end with the command that started them.
"""
