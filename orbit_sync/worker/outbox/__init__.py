"""The durable outbox: the SQLite file of launches and finishes (``_outbox``) and its lock file
(``_outbox_lock``). Storage only: the replay that delivers it is a session
(:mod:`orbit_sync.worker.session`)."""
