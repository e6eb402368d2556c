"""The connection thread's sessions: dial, resume, report, serve, reconnect (``_session_loop``),
the assignments fed to new attempts (``_admission``), and the outbox replay's own sessions
(``_replay``)."""
