"""What runs the attempts: the current connection and its request slots (``_link``), the one
call-with-retry (``_requests``), the handler threads (``_pool``), the shell that performs each
machine's actions (``_shell``), lease renewals and timers (``_watchdog``), the capacity reported
(``_window``), the handler table (``_handlers``) and the bounded shutdown (``_shutdown``)."""
