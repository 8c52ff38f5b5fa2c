"""What operators run: ``celery zk status``, the Prometheus exporter, the
tree export."""
