"""Peer task queues measured in the same run as our Worker (Dramatiq and Celery on Redis)."""
