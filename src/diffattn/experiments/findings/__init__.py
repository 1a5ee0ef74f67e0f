"""What a ``diffattn study``'s finished cells say: statistics over seeds (``stats``), LR bracketing, the gap over
training, token efficiency and the size ladder (``analysis``), how far training got (``depth``), the early
diagnostics (``early``), the verdict in words (``report_text``), the report and its figures (``report``,
``figures``) and the verdict tables across texts (``verdicts``). Pure functions on result dicts (and the cells'
diagnostics files); the study's machinery (:mod:`diffattn.experiments.study`) collects the results and calls them."""
