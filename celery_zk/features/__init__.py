"""Beyond Redis and RabbitMQ: singleton tasks, durable revokes,
data-affinity scheduling."""
