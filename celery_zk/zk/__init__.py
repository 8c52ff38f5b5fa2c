"""ZooKeeper plumbing the broker and the result backend share: the client,
the URL and options, the znode layout, one session per process, watches."""
