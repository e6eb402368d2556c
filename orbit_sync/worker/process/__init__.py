"""The process executor of ``executor="process"`` handlers: the pool of child processes
(``_process``, parent side), one child's side (``_process_child``) and their limits
(``_process_limits``)."""
