"""The Worker's pure rules: no threads, no sockets, no clock of its own. One attempt's state
machine and its table (``_machine``), the outcome rules (``_outcomes``), the classification of
errors (``_errors``), handler time limits (``_time_limits``) and the reconnect delay
(``_redial``). Everything else in :mod:`orbit_sync.worker` builds on these; they import nothing
of it."""
